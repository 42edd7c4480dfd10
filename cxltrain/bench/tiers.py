"""`cxltrain bench --tiers`: the tiers side by side in one process (docs/tiers.md).

    cxltrain bench --tiers [--quick] [--json] [--capacity-dir DIR]

Every configuration trains the same model on the same data in its own pool (or pool set), taking
turns in blocks of a few steps (cxltrain.bench.paired.paired_runs), so the load of a shared machine falls
on all of them alike:

    fast          all tables in the fast tier (one pool: the baseline)
    capacity      every table in the capacity pool on the disk, no cache, every batch durable (written
                  back every STEAL_EVERY batches, as cache-2%)
    capacity-off  the same with checkpoint off: what per-batch durability costs on the tiered set
    cache-2%      every table in the capacity pool, its hottest 2% of rows in the hot-row cache
    cache-10%     the same with 10% of the rows cached (cache.py), every batch durable, the capacity
                  pages synced at every commit
    steal-10%     the same, the capacity pages written back every STEAL_EVERY batches, the cold rows
                  durable by redo records in the fast tier in between (docs/tiers.md "Steal, no force")

A cached setup's hit rate is its caches' hits over their lookups in the timed blocks. Every ratio
comes with its 95% bootstrap interval over the block pairs (interval.py; none below MIN_BLOCKS
blocks, as in --quick): block i of a setup and block i of its baseline ran in the same turn.

The capacity tier's traffic is the process's storage I/O (/proc/self/io: bytes read from and
written to block storage; the fast tier's /dev/shm does none), counted around each timed block;
beside them, the bytes the commits forced (CheckpointStats.capacity_forced_bytes: what the syncs run
in a commit wrote, by the disk's own count, and the member roots' pages).
Every setup trains on the batches after the hot lists' profile (planning.hot_list_batches), which a cache
would hit more often than any later batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import shutil
import tempfile

from ..jobs.config import TrainConfig
from ..jobs.planning import hot_list_batches
from ..jobs.train import storage_io
from ..modes import OFF
from .interval import MIN_BLOCKS, interval_text, ratio_interval
from .records import Record


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    label: str
    capacity: bool                         # the tables in a capacity pool on the disk
    overrides: dict = dataclasses.field(default_factory=dict)   # TrainConfig fields
    cache_share: float | None = None       # rows of each table in the hot-row cache, as a share of its rows


STEAL_EVERY = 16  # the stealing setups' write-back interval (the knob's default)
SETUPS = (
    Setup("fast", "all tables in the fast tier", capacity=False),
    Setup("capacity", f"capacity only, no cache (steal {STEAL_EVERY})", capacity=True,
          overrides={"write_back_every": STEAL_EVERY}),
    Setup("capacity-off", "capacity tier only, checkpoint off", capacity=True, overrides={"checkpoint": OFF}),
    Setup("cache-2%", f"capacity + 2% cached (steal {STEAL_EVERY})", capacity=True, cache_share=0.02,
          overrides={"write_back_every": STEAL_EVERY}),
    Setup("cache-10%", "10% cached, synced every commit", capacity=True, cache_share=0.10,
          overrides={"write_back_every": 1}),
    Setup("steal-10%", f"10% cached, steal, write-back {STEAL_EVERY}", capacity=True, cache_share=0.10,
          overrides={"write_back_every": STEAL_EVERY}),
)
BASELINE, TIERED, TIERED_OFF = "fast", "capacity", "capacity-off"


@dataclasses.dataclass(frozen=True)
class TiersPlan:
    config: TrainConfig
    warmup: int
    blocks: int
    block_steps: int


def default_plan() -> TiersPlan:
    """A few minutes here: 8 tables of 250k rows (0.5 GB of weights per configuration), enough
    blocks for every ratio to have its interval, each block as long as the stealing setups'
    write-back interval: every block of theirs carries one write-back, not one block in three."""
    return TiersPlan(TrainConfig(rows=250_000), warmup=5, blocks=max(20, MIN_BLOCKS), block_steps=STEAL_EVERY)


def quick_plan() -> TiersPlan:
    """Seconds, for tests: the figures mean nothing."""
    return TiersPlan(TrainConfig(batch_size=64, num_tables=2, rows=2000, dim=8, bottom_mlp=(16,), top_mlp=(16,)),
                     warmup=1, blocks=2, block_steps=2)


@dataclasses.dataclass
class TierRow(Record):
    name: str
    label: str
    ms_per_step: float
    ratio: float                           # ms per step / the baseline's
    read_bytes_per_batch: float            # from block storage: the capacity tier
    written_bytes_per_batch: float
    pages_prefetched_per_batch: float      # cold rows' pages the prefetcher saw: read ahead, or held already (0 without a capacity pool)
    forced_bytes_per_batch: float | None   # of those written, synced by the commits (None: the disk's count unknown)
    hit_rate: float | None = None          # the hot-row cache's share of the lookups (None: no cache)
    ratio_low: float | None = None         # the ratio's 95% interval over the block pairs (None: too few blocks)
    ratio_high: float | None = None


@dataclasses.dataclass
class TiersResult(Record):
    rows: list
    checkpoint_ratio: float                # capacity / capacity-off: per-batch durability on the tiered set
    peak_rss_bytes: int                    # of the whole process: every configuration, torch included
    blocks: int
    block_steps: int
    capacity_dir: str
    config: dict
    checkpoint_ratio_low: float | None = None   # its 95% interval (None: too few blocks)
    checkpoint_ratio_high: float | None = None


def io_counters(rt) -> dict[str, float]:
    """A tiered run's counters, read around every timed block (paired_runs' probe): the bytes its
    commits forced, its prefetcher's pages, its caches' hits and lookups, and the process's storage
    I/O (read_bytes, write_bytes: storage_io)."""
    prefetcher = rt.prefetcher
    forced = 0 if rt.stats is None or not rt.tiers.capacity_path else rt.stats.capacity_forced_bytes
    # nan: the disk's count is unknown (a capacity pool on tmpfs), and stays nan through the sums
    counters = {"forced": float("nan") if forced is None else float(forced),
                "pages": float(prefetcher.pages_read + prefetcher.pages_resident) if prefetcher is not None else 0.0,
                "hits": float(sum(s.hits for s in rt.cache_stats.values())),
                "lookups": float(sum(s.lookups for s in rt.cache_stats.values()))}
    counters.update((name, float(value)) for name, value in storage_io().items())
    return counters


def run_tiers(plan: TiersPlan, fast_dir: str, capacity_dir: str) -> TiersResult:
    """Train every setup side by side; their pools are removed afterwards, whatever happens."""
    from .paired import paired_runs

    prefix = f"cxltrain-tiers-{os.getpid()}"
    disk = tempfile.mkdtemp(prefix=prefix, dir=capacity_dir)
    configs, pools = [], []
    for setup in SETUPS:
        capacity = os.path.join(disk, f"{setup.name}.cap") if setup.capacity else None
        cache = {} if setup.cache_share is None else {"cache_rows": max(1, int(plan.config.rows * setup.cache_share))}
        configs.append(dataclasses.replace(plan.config, capacity_pool=capacity, **setup.overrides, **cache))
        pools.append(os.path.join(fast_dir, f"{prefix}-{setup.name}.pool"))
    try:
        # timed on batches past those the hot lists were ranked on, as most of a long run's are: on
        # the ranked ones a cache hits more than it ever will later
        runs = paired_runs(configs, pools, warmup=plan.warmup, blocks=plan.blocks, block_steps=plan.block_steps,
                           probe=io_counters, first_batch=hot_list_batches(plan.config))
        seconds, io = [run.block_seconds for run in runs], [run.probe_totals for run in runs]
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        for pool in pools:
            for path in (pool, pool + ".creating"):
                if os.path.exists(path):
                    os.unlink(path)
    durability = ratio_interval(seconds[_index(TIERED_OFF)], seconds[_index(TIERED)]) or (None, None)
    return TiersResult(tier_rows(seconds, io, plan.block_steps), sum(seconds[_index(TIERED)]) /
                       sum(seconds[_index(TIERED_OFF)]), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                       plan.blocks, plan.block_steps, capacity_dir, dataclasses.asdict(plan.config), *durability)


def _index(name: str) -> int:
    return [setup.name for setup in SETUPS].index(name)


def tier_rows(seconds: list[list[float]], io: list[dict], block_steps: int) -> list[TierRow]:
    """One row per setup (SETUPS' order) from its block times seconds[setup] [blocks] (block i of
    every setup ran in turn i) and its summed probe counters io[setup]; each ratio is against the
    baseline's blocks, with its interval."""
    steps = len(seconds[0]) * block_steps
    base = seconds[_index(BASELINE)]
    rows = []
    for setup, blocks, counters in zip(SETUPS, seconds, io):
        low, high = ratio_interval(base, blocks) or (None, None)
        rows.append(TierRow(setup.name, setup.label, 1000.0 * sum(blocks) / steps, sum(blocks) / sum(base),
                            counters.get("read_bytes", 0.0) / steps, counters.get("write_bytes", 0.0) / steps,
                            counters.get("pages", 0.0) / steps,
                            None if math.isnan(counters.get("forced", 0.0)) else counters.get("forced", 0.0) / steps,
                            counters["hits"] / counters["lookups"] if counters.get("lookups") else None,
                            low, high))
    return rows


def format_tiers(result: TiersResult) -> str:
    c = result.config
    head = (f"{'configuration':<36} {'ms/step':>8} {'vs fast':>8} {'95% interval':>13} {'hit rate':>9} "
            f"{'read B/batch':>13} {'written B/batch':>16} {'forced B/batch':>15} {'pages ahead':>12}")
    lines = [f"tiers: {c['num_tables']} tables x {c['rows']:,} rows x {c['dim']}, batch {c['batch_size']}, "
             f"{result.blocks} blocks of {result.block_steps} steps each, side by side; capacity tier in "
             f"{result.capacity_dir}", head, "-" * len(head)]
    for r in result.rows:
        hits = "-" if r.hit_rate is None else f"{r.hit_rate:.1%}"
        forced = "-" if r.forced_bytes_per_batch is None else f"{r.forced_bytes_per_batch:,.0f}"
        lines.append(f"{r.label:<36} {r.ms_per_step:>8.1f} {r.ratio:>7.2f}x {interval_text(r.ratio_low, r.ratio_high):>13} "
                     f"{hits:>9} {r.read_bytes_per_batch:>13,.0f} {r.written_bytes_per_batch:>16,.0f} {forced:>15} "
                     f"{r.pages_prefetched_per_batch:>12,.0f}")
    durability = interval_text(result.checkpoint_ratio_low, result.checkpoint_ratio_high)
    lines.append(f"per-batch durability on the tiered set: {result.checkpoint_ratio:.2f}x ({durability}) the step "
                 f"time with checkpoint off; peak RSS of the process {result.peak_rss_bytes / 2**20:,.0f} MiB")
    return "\n".join(lines)
