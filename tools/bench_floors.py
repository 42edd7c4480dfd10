"""Where the floor is: each checkpointing method side by side with no checkpoints in one process
(cxltrain.bench.paired.paired_runs), next to the bytes it makes durable per batch and the time those bytes take at
this machine's measured copy bandwidth — the physical floor of its overhead.

    .venv/bin/python tools/bench_floors.py --pooling 1 20           # the default model (2 GB pools: 4 at a time)
    .venv/bin/python tools/bench_floors.py --rows 100000 --blocks 6 # smaller pools, fewer blocks

For each pooling, the runs share one process and one data source and take turns in blocks; they
are "off" (no checkpoints: the baseline), "strict" (every batch durable), "relaxed" (dense state
every 100 batches) and "strict-k10" (dense_every=10: a commit every 10 batches, one undo record
per row per window). A method's floor is durable bytes per batch / copy bandwidth: undo records,
dense snapshots and the updated rows' flushes each move their bytes at least once more than an
unchecked step does. Measured figures belong in docs/speed.md, not here.
A lab instrument (tools/README.md): `cxltrain bench` does not run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from typing import TYPE_CHECKING

from cxltrain.bench.interval import LEVEL, interval_text, ratio_interval
from cxltrain.bench.records import Record, optional
from cxltrain.jobs.config import TrainConfig
from cxltrain.modes import OFF, RELAXED, UNDO

if TYPE_CHECKING:
    from cxltrain.bench.paired import SideBySide

METHODS = {
    "off": {"checkpoint": OFF},
    "strict": {"checkpoint": UNDO},
    "relaxed": {"checkpoint": UNDO, "mode": RELAXED, "dense_every": 100},
    "strict-k10": {"checkpoint": UNDO, "dense_every": 10},
}


COPY_BYTES = 256 << 20  # enough to leave the caches behind


@dataclasses.dataclass
class FloorRow(Record):
    """floor_rows: one method side by side with ours-off, next to its physical floor."""

    pooling: int
    method: str
    ms_per_step: float
    ratio: float               # mean step / the off run's mean step
    median_block_ratio: float  # median over blocks of (this block / the off run's block of that round)
    durable_mb_per_batch: float
    undo_mb_per_batch: float
    floor_ms: float            # durable bytes per batch at the copy bandwidth
    floor_ratio: float         # 1 + floor_ms / the off run's ms per step
    ratio_low: float | None = optional()   # ratio_interval of the blocks: how sure the ratio is
    ratio_high: float | None = optional()  # (None: too few blocks for one)


@dataclasses.dataclass
class Floors(Record):
    """measure_floors: one pooling's methods side by side with ours-off in one process, and
    the copy bandwidth (numpy, one thread) measured in that process."""

    pooling: int
    copy_gbps: float
    base_ms: float             # the off run's mean ms per step
    rows: list[FloorRow]

    @classmethod
    def from_json(cls, fields: dict) -> Floors:
        return cls(**{**fields, "rows": [FloorRow.from_json(row) for row in fields["rows"]]})



def floor_rows(config: TrainConfig, methods: list[str], folder: str, *, warmup: int, blocks: int, block_steps: int,
               copy_gbps: float) -> list[FloorRow]:
    """One pooling's methods ("off" first, added when missing) side by side; one row each but off."""
    from cxltrain.bench.paired import paired_runs  # torch: format_rows alone needs none

    names = ["off", *(m for m in methods if m != "off")]
    configs = [dataclasses.replace(config, **METHODS[name]) for name in names]
    pools = [os.path.join(folder, f"{name}.pool") for name in names]
    try:
        runs = paired_runs(configs, pools, warmup=warmup, blocks=blocks, block_steps=block_steps)
    finally:
        for pool in pools:
            if os.path.exists(pool):
                os.unlink(pool)
    base = runs[0]
    return [_row(config.pooling, name, run, base, copy_gbps) for name, run in zip(names[1:], runs[1:])]


def _row(pooling: int, name: str, run: SideBySide, base: SideBySide, copy_gbps: float) -> FloorRow:
    durable = run.durable_bytes_per_batch()
    undo = run.stats["undo_bytes"] / max(run.stats["batches"], 1) if run.stats else 0.0
    floor_ms = 1000.0 * durable / (copy_gbps * 1e9)
    return FloorRow(pooling, name, run.mean_ms, run.mean_ms / base.mean_ms,
                    statistics.median(b / a for a, b in zip(base.block_seconds, run.block_seconds)),
                    durable / 1e6, undo / 1e6, floor_ms, 1.0 + floor_ms / base.mean_ms,
                    *(ratio_interval(base.block_seconds, run.block_seconds) or (None, None)))


def measure_floors(config: TrainConfig, methods: list[str], folder: str, *, warmup: int, blocks: int,
                   block_steps: int, copy_bytes: int) -> Floors:
    """The copy bandwidth of `copy_bytes` (numpy, one thread: the checkpointer's copies run on one),
    then floor_rows at config's pooling, in this process."""
    from cxltrain.bench.bandwidth import copy_bandwidth

    copy_gbps = copy_bandwidth(copy_bytes, 1)[1]
    rows = floor_rows(config, methods, folder, warmup=warmup, blocks=blocks, block_steps=block_steps,
                      copy_gbps=copy_gbps)
    return Floors(pooling=config.pooling, copy_gbps=copy_gbps, base_ms=rows[0].ms_per_step / rows[0].ratio, rows=rows)


def format_rows(rows: list[FloorRow], base_ms: dict[int, float], copy_gbps: float) -> str:
    lines = [f"copy bandwidth {copy_gbps:.1f} GB/s (numpy, one thread); floor = durable bytes / that bandwidth; "
             f"interval: the ratio's {LEVEL:.0%} bootstrap interval over the blocks",
             f"{'pooling':>7} {'method':<11} {'ms/step':>8} {'ratio':>6} {'interval':>11} {'median':>6} {'floor':>6} "
             f"{'durable MB/b':>12} {'undo MB/b':>9} {'floor ms':>8}"]
    for pooling, ms in base_ms.items():
        lines.append(f"{pooling:>7} {'off':<11} {ms:>8.1f}")
        for r in (r for r in rows if r.pooling == pooling):
            lines.append(f"{r.pooling:>7} {r.method:<11} {r.ms_per_step:>8.1f} {r.ratio:>6.3f} "
                         f"{interval_text(r.ratio_low, r.ratio_high):>11} {r.median_block_ratio:>6.3f} "
                         f"{r.floor_ratio:>6.3f} {r.durable_mb_per_batch:>12.2f} {r.undo_mb_per_batch:>9.2f} "
                         f"{r.floor_ms:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/bench_floors.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--pooling", type=int, nargs="+", default=[1, 20])
    p.add_argument("--methods", nargs="+", choices=[m for m in METHODS if m != "off"],
                   default=["strict", "relaxed", "strict-k10"])
    p.add_argument("--rows", type=int, default=TrainConfig().rows)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--block-steps", type=int, default=10)
    p.add_argument("--folder", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    measured = []
    with tempfile.TemporaryDirectory(prefix="cxltrain-floors-", dir=args.folder) as folder:
        for pooling in args.pooling:
            floors = measure_floors(TrainConfig(rows=args.rows, pooling=pooling), args.methods, folder,
                                    warmup=args.warmup, blocks=args.blocks, block_steps=args.block_steps,
                                    copy_bytes=COPY_BYTES)
            measured.append(floors)
            print(format_rows(floors.rows, {pooling: floors.base_ms}, floors.copy_gbps), flush=True)
    if args.json:
        print(json.dumps([floors.to_json() for floors in measured]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
