"""The fused capture against main's two passes, side by side in one process (docs/speed.md).

Three runs of `train`'s default model take turns in blocks (bench/paired.py paired_runs): no
checkpoints, strict with the fused capture, strict with the two passes (TrainConfig's fused_capture
off for that run). Prints JSON: each run's ms per step, ratio to
the unchecked run (mean, and median over blocks) and per-phase ms per batch from the tables' and
the checkpointer's counters.

    .venv/bin/python tools/fused_paired.py --pooling 20 --blocks 20 --block-steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from cxltrain.bench.paired import paired_runs
from cxltrain.jobs.config import TrainConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pooling", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--block-steps", type=int, default=5)
    p.add_argument("--folder", default="/dev/shm")
    a = p.parse_args()

    def probe(rt):
        s = rt.stats
        out = {"update_ms": sum(t.stats.update_seconds for t in rt.tables.values())}
        if s is not None:
            out.update(layout_or_capture_ms=s.training_capture_seconds, flush_ms=s.training_flush_seconds,
                       boundary_ms=s.training_boundary_seconds, wait_ms=s.wait_seconds)
        return out

    strict = TrainConfig(pooling=a.pooling)
    two_pass = TrainConfig(pooling=a.pooling, fused_capture=False)  # capture, then update
    pools = [os.path.join(a.folder, f"fused-paired-{a.pooling}-{i}.pool") for i in range(3)]
    for path in pools:
        if os.path.exists(path):
            os.unlink(path)
    started = time.time()
    runs = paired_runs([TrainConfig(pooling=a.pooling, checkpoint="off"), strict, two_pass], pools, warmup=a.warmup,
                       blocks=a.blocks, block_steps=a.block_steps, probe=probe)
    steps = a.blocks * a.block_steps
    result = {}
    for name, run in zip(("off", "strict-fused", "strict-2pass"), runs):
        row = {"ms": run.mean_ms, **{k: 1000 * v / steps for k, v in run.probe_totals.items()}}
        if name != "off":
            row["ratio"] = run.mean_ms / runs[0].mean_ms
            row["median_block_ratio"] = statistics.median(
                b / o for o, b in zip(runs[0].block_seconds, run.block_seconds))
        result[name] = row
    print(json.dumps({"pooling": a.pooling, "args": vars(a), "wall_s": time.time() - started,
                      "load": os.getloadavg(), "results": result}, indent=1))
    for path in pools:
        os.unlink(path)


if __name__ == "__main__":
    main()
