"""The process-wide settings: threads, the device backend and the emulated device's model, where
pools go, new pools' alignment, test hooks (docs/architecture.md §9). A job's settings are
TrainConfig's (jobs/config.py), a checkpointer's are CheckpointOptions (checkpoint/options.py).

Each knob has a default, an environment override (`CXLTRAIN_<NAME>`), and can be changed for a
block of code with `override(...)`, which restores the old values even when the block raises:

    with knobs.override(device="msync"):
        pool = Pool.create(path, size)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator

from .errors import ConfigError


@dataclasses.dataclass
class Knobs:
    # Which device backend maps a pool: one of DEVICE_BACKENDS (see cxltrain.devices).
    device: str = "auto"
    # Where `cxltrain train` puts its emulated CXL pool when no --pool is given; "" = /dev/shm,
    # or the temp folder where there is no /dev/shm.
    pool_dir: str = ""
    # Region alignment in bytes: at least a page, so a region can be mapped and msync'ed alone.
    region_align: int = 4096
    # Table rows start on this byte boundary, so flushing a row never splits a cache line with its
    # neighbour (docs/architecture.md §2).
    row_align: int = 64
    # Directory entries reserved when a pool is created (one per region).
    dir_capacity: int = 256
    # Threads torch uses for training; fixed so reductions are reproducible (docs/architecture.md §4).
    threads: int = 2
    # Threads torch uses in each rank of a group of two or more ranks: a host's ranks share its cores
    # (as torchrun's OMP_NUM_THREADS=1 has them), and more threads than cores spin against each other
    # (docs/distributed.md, "Threads"). A group of one rank uses `threads`, as one process does.
    rank_threads: int = 1
    # 1 = the emulated CXL device models power loss: the process stores into a private view and only
    # what it persists reaches the file, so a killed process loses every unpersisted store. 0 = a
    # kill loses nothing (the page cache is the media). Other backends ignore it (cxltrain.emulation).
    power_loss: int = 0
    # With power_loss = 1, the persistence domain the emulated device models: adr (flush needed;
    # unflushed stores are lost), eadr (CPU caches persistent: every store durable at once), none
    # (volatile memory: nothing survives a power loss).
    domain: str = "adr"
    # With power_loss = 1 and the adr domain: unpersisted cache lines written back to the media early,
    # at most this many per second (0 = none), as write-back caches do; evict_seed fixes the picks.
    evict_rate: int = 0
    evict_seed: int = 0
    # The emulated device's cap on persistence traffic, bytes per second (0 = none): flushes sleep
    # so that they average at most this rate, as a slower medium would make them (emulation/bandwidth.py).
    persist_bandwidth: int = 0
    # Undo ring bytes of the pools `train` creates; 0 = room for a few of its largest batches
    # (trainer.undo_ring_bytes). Small rings make the ring wrap and force early commits: for tests.
    undo_ring_bytes: int = 0
    # 1 = the row kernels (gather, sparse update, undo capture, row flush) run the native C code
    # of kernels/rows.c when it is built; 0 = always the torch kernels (for comparisons and tests).
    native_kernels: int = 1
    # 1 = capacity pools (a pool set's members on block storage) use the crash model: writes go to
    # a private view and only flushed pages reach the file, so a kill loses unsynced page writes,
    # as a power loss does (devices/capacity.py). For crash tests.
    capacity_crash: int = 0
    # Threads that read the next batch's cold rows ahead from a capacity pool (0 = no read-ahead).
    prefetch_threads: int = 8
    # Unique rows per chunk of the fused capture, for crash tests that want several chunks per table
    # and batch (0 = the checkpointer's default). Read once, where a Runtime builds its options.
    undo_chunk_rows: int = 0
    # A pool set's capacity pages written back every this many batches, its cold rows durable by
    # redo records in between (docs/tiers.md "Steal, no force"; 1 = synced at every commit). The
    # default steals: measured faster than syncing at every commit (docs/tiers.md, Measured).
    write_back_every: int = 16

    def validate(self) -> None:
        """Raise ConfigError for a knob (or CXLTRAIN_* variable) out of range."""
        if _ENV_ERRORS:
            raise ConfigError(_ENV_ERRORS[0])
        if self.device not in DEVICE_BACKENDS:
            raise ConfigError(f"device {self.device!r} must be one of {', '.join(DEVICE_BACKENDS)}")
        if self.region_align < 4096 or self.region_align & (self.region_align - 1):
            raise ConfigError(f"region_align {self.region_align} must be a power of two >= 4096")
        if not 8 <= self.row_align <= 4096 or self.row_align & (self.row_align - 1):
            raise ConfigError(f"row_align {self.row_align} must be a power of two in [8, 4096]")
        if not 1 <= self.dir_capacity <= 65536:
            raise ConfigError(f"dir_capacity {self.dir_capacity} must be in [1, 65536]")
        if self.threads < 1:
            raise ConfigError(f"threads {self.threads} must be at least 1")
        if self.rank_threads < 1:
            raise ConfigError(f"rank_threads {self.rank_threads} must be at least 1")
        if self.undo_ring_bytes < 0:
            raise ConfigError(f"undo_ring_bytes {self.undo_ring_bytes} must be >= 0")
        if not 0 <= self.undo_chunk_rows <= 1 << 20:
            raise ConfigError(f"undo_chunk_rows {self.undo_chunk_rows} must be in [0, {1 << 20}]")
        if not 1 <= self.write_back_every <= 1 << 20:
            raise ConfigError(f"write_back_every {self.write_back_every} must be in [1, {1 << 20}]")
        if not 0 <= self.prefetch_threads <= 256:
            raise ConfigError(f"prefetch_threads {self.prefetch_threads} must be in [0, 256]")
        if self.capacity_crash not in (0, 1):
            raise ConfigError(f"capacity_crash {self.capacity_crash} must be 0 or 1")
        if self.power_loss not in (0, 1):
            raise ConfigError(f"power_loss {self.power_loss} must be 0 or 1")
        if self.domain not in DOMAINS:
            raise ConfigError(f"persistence domain {self.domain!r} must be one of {', '.join(DOMAINS)}")
        if self.persist_bandwidth < 0:
            raise ConfigError(f"persist_bandwidth {self.persist_bandwidth} must be >= 0 bytes per second")
        if self.evict_rate < 0:
            raise ConfigError(f"evict_rate {self.evict_rate} must be >= 0 lines per second")
        if self.evict_rate and not (self.power_loss and self.domain == "adr"):
            raise ConfigError("early write-back (evict_rate) needs the power-loss model in the adr domain "
                              "(--power-loss, --domain adr): elsewhere no store waits to be written back")
        if self.native_kernels not in (0, 1):
            raise ConfigError(f"native_kernels {self.native_kernels} must be 0 or 1")


def torch_threads(world_size: int) -> int:
    """The torch threads of a process of a group of `world_size` ranks (1: a single process)."""
    return KNOBS.threads if world_size == 1 else KNOBS.rank_threads


# The device backends (knob `device`): "auto" picks one of the others per path. Named here, with the
# knob, so that knobs stay a leaf every layer can read; devices/registry.py says how each one opens.
DEVICE_BACKENDS = ("auto", "pmem", "msync", "emulated")

# Persistence domains the emulated device can model (knob `domain`).
DOMAINS = ("adr", "eadr", "none")

# Malformed CXLTRAIN_* variables: reported by validate(), never as an exception at import time.
_ENV_ERRORS: list[str] = []


def _from_env(defaults: Knobs) -> Knobs:
    values = {}
    for field in dataclasses.fields(Knobs):
        raw = os.environ.get(f"CXLTRAIN_{field.name.upper()}")
        if raw is None:
            continue
        if field.type != "int":
            values[field.name] = raw
            continue
        try:
            values[field.name] = int(raw)
        except ValueError:
            _ENV_ERRORS.append(f"CXLTRAIN_{field.name.upper()}={raw!r} is not an integer")
    return dataclasses.replace(defaults, **values)


KNOBS = _from_env(Knobs())


@contextlib.contextmanager
def override(**changes) -> Iterator[Knobs]:
    """Change knobs for the duration of a `with` block; always restores them."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(Knobs)}
    if unknown:
        raise TypeError(f"unknown knob(s): {', '.join(sorted(unknown))}")
    saved = {name: getattr(KNOBS, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(KNOBS, name, value)
        yield KNOBS
    finally:
        for name, value in saved.items():
            setattr(KNOBS, name, value)


# libgomp's own default spins for milliseconds, which made runs several times slower where other
# processes share the cores; not spinning at all (PASSIVE alone) puts every idle OpenMP thread to
# sleep between two parallel regions, which slows an idle machine's step (docs/benchmarks.md,
# "OpenMP's wait"). This spin count lies between the two.
OPENMP_SPIN_COUNT = "3000"


def set_openmp_wait(environ) -> None:
    """How torch's OpenMP threads wait for work: PASSIVE after a short spin, unless the user set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT. Must run before torch is imported (the commands import it
    lazily): libgomp reads both when it is loaded."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
