"""`cxltrain bench --dist`: distributed runs on this machine at 1, 2 and 4 ranks.

For each world size: the step time after warm-up with every batch durable (strict) and with
checkpointing off, side by side, and the bytes the ranks sent each other per batch (ids, pooled
embeddings, gradients, DDP's dense gradients not included: they go through torch's own counters).
Then the group's recovery after a kill: rank 1 is SIGKILLed between the ranks' commits, torchrun
restarts the group, and rank 0 reports how long agreeing on G, rolling back and resuming took.
Every run is a `cxltrain train` child; on a machine with fewer cores than ranks the ranks share
cores, so the step times say what the exchange and the commits cost there, not how a cluster scales.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from ..faults import CRASH_ENV, CRASH_RANK_ENV, CrashPoint
from .records import DistRecovery, DistResults, DistRow, DistSteps

RANKS = (1, 2, 4)


def model_options(quick: bool) -> list[str]:
    if quick:
        return ["--steps", "12", "--batch-size", "128", "--num-tables", "4", "--rows", "5000", "--dim", "16"]
    return ["--steps", "30", "--batch-size", "1024", "--num-tables", "8", "--rows", "100000", "--dim", "32"]


def _train(folder: str, ranks: int, options: list[str], env: dict | None = None, restarts: int = 0) -> dict:
    """Rank 0's `train --json` (jobs/train.py TrainResult.to_json) of one run in a child."""
    command = [sys.executable, "-m", "cxltrain", "train", "--nproc-per-node", str(ranks), "--max-restarts",
               str(restarts), "--pool", folder, "--json", "--no-progress", *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})})
    shutil.rmtree(folder, ignore_errors=True)  # memory-backed: keep at most one run's pools
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _steps(summary: dict) -> DistSteps:
    return DistSteps(ms_per_step=summary["split_ms"]["total"],
                     bytes_exchanged_per_batch=summary["group"]["bytes_exchanged_per_batch"])


def run(quick: bool, log) -> DistResults:
    base = os.environ.get("CXLTRAIN_POOL_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    scratch = tempfile.mkdtemp(prefix="cxltrain-dist-bench-", dir=base)
    options = model_options(quick)
    rows = []
    try:
        for ranks in RANKS:
            timed = {}
            for method in ("undo", "off"):
                log(f"{ranks} rank(s), checkpoint {method}")
                timed[method] = _steps(_train(os.path.join(scratch, f"{ranks}-{method}"), ranks,
                                              [*options, "--checkpoint", method]))
            rows.append(DistRow(ranks, timed["undo"], timed["off"],
                                strict_overhead=timed["undo"].ms_per_step / timed["off"].ms_per_step - 1))
        log("2 ranks, rank 1 killed between the ranks' commits, torchrun restarts the group")
        killed = _train(os.path.join(scratch, "killed"), 2, options, restarts=1,
                        env={CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:5", CRASH_RANK_ENV: "1"})
        recovery = DistRecovery(killed["recovered_batch"], killed["recovery_seconds"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return DistResults(options, os.cpu_count(), rows, recovery)


def format_text(results: DistResults) -> str:
    lines = [f"distributed, {' '.join(results.options)}, {results.cores} cores",
             f"{'ranks':>5} {'strict ms/step':>15} {'off ms/step':>12} {'overhead':>9} {'KiB exchanged/batch':>20}"]
    for row in results.runs:
        exchanged = row.undo.bytes_exchanged_per_batch
        lines.append(f"{row.ranks:>5} {row.undo.ms_per_step:>15.1f} {row.off.ms_per_step:>12.1f} "
                     f"{row.strict_overhead:>9.0%} {'-' if exchanged is None else f'{exchanged / 1024:.1f}':>20}")
    r = results.recovery
    lines.append(f"group recovery after a kill (2 ranks): to batch {r.recovered_batch} in {r.seconds * 1000:.0f} ms "
                 "(rank 0, once every rank has started: agreeing on G, rolling back, resuming)")
    return "\n".join(lines)
