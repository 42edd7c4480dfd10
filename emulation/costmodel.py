"""What a run's pool traffic would cost on real PMEM or CXL memory (docs/emulation.md, bandwidth/latency).

The emulated device is ordinary DRAM, so a run on it says nothing about Optane or a CXL expander.
This model takes counters of what the run did to the pool (`AccessCounts`) and the published
latency and bandwidth of a memory (`MemoryPreset`), and estimates the time those accesses take:

    random   = gather_rows × load_latency / MLP
    transfer = gather_bytes / read_bandwidth + media_write_bytes / write_bandwidth
    persist  = (drains + flush_calls / MLP) × persist_latency
    total    = max(random, transfer) + persist

    media_write_bytes = max(write_bytes + log_bytes, persist_bytes)

Why this shape:
  - A row gather is one random access: its first cache line misses, the rest of the row streams.
    A core keeps about MLP misses in flight (memory-level parallelism: `memory_level_parallelism`,
    default 10), so n random rows cost n × latency / MLP when latency bounds them.
  - The same bytes are bandwidth-bound when enough misses are in flight, so random and transfer
    time overlap: the slower of the two is the time (Little's law; the usual roofline bound).
  - Every stored byte reaches the media once, through a flush or an eviction; a flush writes
    whole lines, so the bytes persisted can exceed the bytes stored, never the other way round
    for the lines written. The undo log is appended sequentially: bandwidth, no random latency.
  - A fence stalls the thread until its write-backs are acknowledged — at least one persist
    latency — and the flush calls before it overlap MLP at a time. Nothing of the thread runs
    during a fence, so persist time adds to the rest.
  - Rows written in place (write_rows) are counted but not charged a load: they are the rows the
    same batch gathered, still in cache; their cost is their write-back, charged by bytes.

Not modelled: queueing under load (loaded latency rises well above these idle figures), Optane's
256-byte internal write granularity (small random writes cost up to 4× in bandwidth), and caches
hiding hot rows (a Zipf workload re-reads the same rows; gather counters should count misses).

Example: 9,160 rows of 256 bytes gathered and updated per batch, 2.5 MB of undo log, one fence:

    counts = AccessCounts(gather_bytes=2_344_960, gather_rows=9_160, write_bytes=2_344_960,
                          write_rows=9_160, persist_bytes=4_900_000, flush_calls=9_200, drains=1,
                          log_bytes=2_460_000)
    print(format_estimate(estimate(counts, PRESETS["optane-6dimm"])))
"""

from __future__ import annotations

import dataclasses

from cxltrain.errors import ConfigError

GB = 1e9  # the sources quote GB/s in decimal gigabytes


@dataclasses.dataclass(frozen=True)
class AccessCounts:
    """What a run did to the pool. All counts are totals over the run (or over the batches asked about)."""

    gather_bytes: int = 0     # bytes read by row gathers (lookups, undo capture)
    gather_rows: int = 0      # rows read: each one random access
    write_bytes: int = 0      # bytes stored in place (optimizer updates)
    write_rows: int = 0       # rows written in place
    persist_bytes: int = 0    # bytes made durable (Device.counters.persisted_bytes)
    flush_calls: int = 0      # flush calls, one range each (Device.counters.flushes)
    drains: int = 0           # fences waited for, pmem_drain / SFENCE (Device.counters.drains)
    log_bytes: int = 0        # bytes appended sequentially to the undo log

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"AccessCounts.{field.name} must be a non-negative integer, not {value!r}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MemoryPreset:
    """Idle latency and peak bandwidth of one memory, with where the figures come from."""

    name: str
    load_latency_ns: float        # random 64-byte load, idle system
    persist_latency_ns: float     # store + cache-line write-back + fence, idle system
    read_gb_s: float              # peak read bandwidth, decimal GB/s
    write_gb_s: float             # peak write bandwidth, decimal GB/s
    source: str
    note: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_OPTANE_STUDY = ("Yang et al., An Empirical Guide to the Behavior and Use of Scalable Persistent Memory, FAST 2020, "
                 "Fig. 2 and Fig. 4 (authors' data: github.com/NVSL/OptaneStudy, graphs/02-best_case_latency.csv, "
                 "graphs/04-bandwidth_thcount_dram.csv)")
_OPTANE_BASIC = ("Izraelevitz et al., Basic Performance Measurements of the Intel Optane DC Persistent Memory Module, "
                 "arXiv:1903.05714")

# Each figure below was read in the source named with it; see the README's table.
PRESETS: dict[str, MemoryPreset] = {p.name: p for p in (
    # Cascade Lake, 6 channels of DDR4-2666 on one socket. Latency: Fig. 2 (read random 101.5 ns,
    # write with clwb 57.3 ns). Bandwidth: Fig. 4, the peak over 1-24 threads (read 105.56 GB/s at
    # 19 threads, ntstore write 76.81 GB/s at 24 threads).
    MemoryPreset("dram", 101.5, 57.3, 105.56, 76.81, _OPTANE_STUDY,
                 "local DDR4-2666, 6 channels (the same machine as the Optane figures)"),
    # One Optane DC PMM, not interleaved. Bandwidth: the abstract of arXiv:1903.05714 ("for a single
    # Optane DC PMM, its max read bandwidth is 6.6 GB/s, whereas its max write bandwidth is 2.3 GB/s").
    # Latency: random load 305 ns (arXiv:1903.05714's latency observation, "The read latency of random
    # Optane DC memory loads is 305 ns"; FAST'20 Fig. 2: 305.0 ns) and store + clwb + fence 62.3 ns
    # (FAST'20 Fig. 2: a write is done once it reaches the ADR domain, the memory controller).
    MemoryPreset("optane-1dimm", 305.0, 62.3, 6.6, 2.3, f"{_OPTANE_BASIC}; {_OPTANE_STUDY}",
                 "Intel Optane DC PMEM, one DIMM, App Direct"),
    # Six interleaved PMMs: "maximum read bandwidth is 39.4 GB/sec, and their maximum write
    # bandwidth is 13.9 GB/sec" (arXiv:1903.05714's bandwidth observation); latencies as above.
    MemoryPreset("optane-6dimm", 305.0, 62.3, 39.4, 13.9, f"{_OPTANE_BASIC}; {_OPTANE_STUDY}",
                 "Intel Optane DC PMEM, 6 DIMMs interleaved on one socket, App Direct"),
    # A CXL 2.0 Type-3 memory expander (E3.S, PCIe 5.0 x8, 96 GB), measured by Intel: "All read:
    # 17.8 GB/s", "R:W 1:1 27.2 GB/s", "Latency: 250ns". No write-only figure is given: the write
    # share of the 1:1 mix (27.2 / 2 = 13.6 GB/s) stands in for it. No persist latency is given
    # either: a write-back to the device crosses the link and back like a load, so the load
    # latency stands in. For comparison, Pond emulates CXL at ~150 ns, one NUMA hop (Li et al.,
    # ASPLOS 2023, artifact README at github.com/MoatLab/Pond).
    MemoryPreset("cxl-expander", 250.0, 250.0, 17.8, 13.6,
                 "Intel CacheLib wiki, OCP demo configuration (github.com/intel/CacheLib/wiki/OCP-demo-configuration)",
                 "CXL 2.0 memory expander, DDR5 behind PCIe 5.0 x8; write bandwidth and persist latency derived"),
)}

# Misses one core keeps in flight: a model parameter, not a measured figure. ~10 is the order of an
# x86 core's line-fill buffers; a multi-threaded gather has proportionally more.
DEFAULT_MLP = 10


def preset(name: str) -> MemoryPreset:
    """The preset called `name`, or a ConfigError naming the ones there are."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"no memory preset {name!r}; choose one of {', '.join(PRESETS)}") from None


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The time `counts` would take on `preset`, term by term (seconds)."""

    preset: MemoryPreset
    counts: AccessCounts
    memory_level_parallelism: int
    random_s: float          # latency-bound random row reads
    read_transfer_s: float   # bandwidth-bound reads
    write_transfer_s: float  # bandwidth-bound writes to the media
    persist_s: float         # fences and the flushes they wait for

    @property
    def transfer_s(self) -> float:
        return self.read_transfer_s + self.write_transfer_s

    @property
    def total_s(self) -> float:
        return max(self.random_s, self.transfer_s) + self.persist_s

    def to_json(self) -> dict:
        return {"preset": self.preset.name, "counts": self.counts.to_json(),
                "memory_level_parallelism": self.memory_level_parallelism, "random_s": self.random_s,
                "read_transfer_s": self.read_transfer_s, "write_transfer_s": self.write_transfer_s,
                "persist_s": self.persist_s, "total_s": self.total_s}


def media_write_bytes(counts: AccessCounts) -> int:
    """Bytes written to the media: every stored byte once; flushes round out to whole lines."""
    return max(counts.write_bytes + counts.log_bytes, counts.persist_bytes)


def estimate(counts: AccessCounts, memory: MemoryPreset, *,
             memory_level_parallelism: int = DEFAULT_MLP) -> Estimate:
    """The model of the module docstring, applied to `counts` on `memory`."""
    mlp = memory_level_parallelism
    if not isinstance(mlp, int) or mlp < 1:
        raise ConfigError(f"memory_level_parallelism {mlp!r} must be an integer >= 1")
    ns = 1e-9
    return Estimate(
        preset=memory, counts=counts, memory_level_parallelism=mlp,
        random_s=counts.gather_rows * memory.load_latency_ns * ns / mlp,
        read_transfer_s=counts.gather_bytes / (memory.read_gb_s * GB),
        write_transfer_s=media_write_bytes(counts) / (memory.write_gb_s * GB),
        persist_s=(counts.drains + counts.flush_calls / mlp) * memory.persist_latency_ns * ns,
    )


def format_estimate(e: Estimate) -> str:
    """A few lines for people: the total, then each term with the figures that made it."""
    p, c, mlp = e.preset, e.counts, e.memory_level_parallelism
    bound = "latency" if e.random_s > e.transfer_s else "bandwidth"
    return "\n".join([
        f"{p.name} ({p.note}): {e.total_s * 1e3:.3f} ms, {bound}-bound",
        f"  random reads  {c.gather_rows:,} rows x {p.load_latency_ns:g} ns / {mlp} in flight = {e.random_s * 1e3:.3f} ms",
        f"  transfer      {c.gather_bytes / 1e6:.2f} MB read at {p.read_gb_s:g} GB/s + "
        f"{media_write_bytes(c) / 1e6:.2f} MB written at {p.write_gb_s:g} GB/s = {e.transfer_s * 1e3:.3f} ms",
        f"  persist       ({c.drains:,} fences + {c.flush_calls:,} flushes / {mlp}) x {p.persist_latency_ns:g} ns "
        f"= {e.persist_s * 1e3:.3f} ms",
        "  total = max(random, transfer) + persist",
    ])
