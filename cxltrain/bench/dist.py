"""`cxltrain bench --dist`: distributed runs on this machine at 1, 2 and 4 ranks.

For each world size: the step time with every batch durable (strict) and with checkpointing off,
side by side in one group (dist_paired.py: in each rank's process the two runs take turns in blocks,
so both meet the same load), their ratio with its 95% bootstrap interval over the blocks, and the
bytes the ranks sent each other per batch (ids, pooled embeddings, gradients; DDP's dense gradients
not included: they go through torch's own counters). Beside them, the same model in one process,
side by side the same way (paired.py): the figure a group's durability is held to. Then the group's
recovery after a kill: rank 1 is SIGKILLed between the ranks' commits, torchrun restarts the group,
and rank 0 reports how long agreeing on G, rolling back and resuming took. Every run is a child
process (group: under torchrun); on a machine with fewer cores than ranks the ranks share cores, so
the step times say what the exchange and the commits cost there, not how a cluster scales.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from ..faults import CRASH_ENV, CRASH_RANK_ENV, CrashPoint
from ..knobs import set_openmp_wait
from ..modes import UNDO
from .interval import LEVEL
from .records import DistPaired, DistRecovery, DistResults, DistRow, DistSteps, PairedTiming

RANKS = (1, 2, 4)


def model_options(quick: bool) -> list[str]:
    """The model of every run (the killed run's `train` options; --steps: that run's)."""
    if quick:
        return ["--steps", "12", "--batch-size", "128", "--num-tables", "4", "--rows", "5000", "--dim", "16"]
    return ["--steps", "30", "--batch-size", "1024", "--num-tables", "8", "--rows", "100000", "--dim", "32"]


def turns(quick: bool) -> tuple[int, int, int]:
    """(warm-up steps, blocks of each run, steps a block) of the side-by-side runs: 10 blocks at
    least, the fewest that carry an interval (interval.MIN_BLOCKS)."""
    return (1, 10, 1) if quick else (5, 20, 10)


def _config(quick: bool) -> dict:
    """model_options as the TrainConfig fields of the side-by-side runs (worker.config_to_json)."""
    from ..jobs.config import TrainConfig
    from .worker import config_to_json

    values = dict(zip(model_options(quick)[::2], model_options(quick)[1::2]))
    return config_to_json(TrainConfig(batch_size=int(values["--batch-size"]), num_tables=int(values["--num-tables"]),
                                      rows=int(values["--rows"]), dim=int(values["--dim"])))


def _child(command: list[str], env: dict | None = None) -> str:
    """The last stdout line of a child; a failure raises with its last stderr line."""
    env = {**os.environ, **(env or {})}
    set_openmp_wait(env)  # as `cxltrain` sets it: the child may be torchrun, which imports torch first
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:8])} ... failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip().splitlines()[-1]


def _side_by_side(folder: str, ranks: int, quick: bool) -> DistPaired:
    """dist_paired.run on `ranks` ranks under torchrun, in folder/off and folder/durable."""
    warmup, blocks, block_steps = turns(quick)
    job = {"config": _config(quick), "dirs": [os.path.join(folder, "off"), os.path.join(folder, "durable")],
           "warmup": warmup, "blocks": blocks, "block_steps": block_steps}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "--max-restarts", "0", "-m", "cxltrain.bench.dist_paired", json.dumps(job)]
    try:  # the ranks set their own threads: torchrun need not warn about OMP_NUM_THREADS
        return DistPaired.from_json(json.loads(_child(command, {"OMP_NUM_THREADS": "1"})))
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # memory-backed: keep at most one run's pools


def _one_process(folder: str, quick: bool) -> PairedTiming:
    """The same model in one process, checkpointing off and durable side by side (paired.py)."""
    warmup, blocks, block_steps = turns(quick)
    job = {"job": "ours-paired", "config": _config(quick), "overrides": {"checkpoint": UNDO},
           "pools": [os.path.join(folder, "off.pool"), os.path.join(folder, "durable.pool")],
           "warmup": warmup, "blocks": blocks, "block_steps": block_steps}
    return PairedTiming.from_json(json.loads(_child([sys.executable, "-m", "cxltrain.bench.worker", json.dumps(job)])))


def _row(paired: DistPaired) -> DistRow:
    t = paired.timing
    return DistRow(paired.ranks, DistSteps(t.method_ms, paired.durable_bytes_per_batch),
                   DistSteps(t.base_ms, paired.off_bytes_per_batch), strict_overhead=t.ratio - 1,
                   overhead_low=None if t.ratio_low is None else t.ratio_low - 1,
                   overhead_high=None if t.ratio_high is None else t.ratio_high - 1,
                   blocks=t.blocks, block_steps=t.block_steps, durable_mb=paired.durable_mb, phase_ms=paired.phase_ms)


def _train(folder: str, ranks: int, options: list[str], env: dict | None = None, restarts: int = 0) -> dict:
    """Rank 0's `train --json` (jobs/train.py TrainResult.to_json) of one run in a child."""
    command = [sys.executable, "-m", "cxltrain", "train", "--nproc-per-node", str(ranks), "--max-restarts",
               str(restarts), "--pool", folder, "--json", "--no-progress", *options]
    try:
        return json.loads(_child(command, env))
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # memory-backed: keep at most one run's pools


def _steps(summary: dict) -> DistSteps:
    return DistSteps(ms_per_step=summary["split_ms"]["total"],
                     bytes_exchanged_per_batch=summary["group"]["bytes_exchanged_per_batch"])


def run(quick: bool, log) -> DistResults:
    base = os.environ.get("CXLTRAIN_POOL_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    scratch = tempfile.mkdtemp(prefix="cxltrain-dist-bench-", dir=base)
    options = model_options(quick)
    rows = []
    try:
        log("1 process, checkpoint off and durable side by side")
        single = _one_process(scratch, quick)
        for ranks in RANKS:
            log(f"{ranks} rank(s), checkpoint off and durable side by side")
            rows.append(_row(_side_by_side(os.path.join(scratch, str(ranks)), ranks, quick)))
        log("2 ranks, rank 1 killed between the ranks' commits, torchrun restarts the group")
        killed = _train(os.path.join(scratch, "killed"), 2, options, restarts=1,
                        env={CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:5", CRASH_RANK_ENV: "1"})
        recovery = DistRecovery(killed["recovered_batch"], killed["recovery_seconds"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return DistResults(options, os.cpu_count(), rows, recovery, single)


def format_text(results: DistResults) -> str:
    lines = [f"distributed, {' '.join(results.options)}, {results.cores} cores",
             f"{'ranks':>5} {'strict ms/step':>15} {'off ms/step':>12} {'overhead':>9} {'KiB exchanged/batch':>20} "
             f"{f'overhead {LEVEL:.0%} interval':>24}"]
    for row in results.runs:
        exchanged = row.undo.bytes_exchanged_per_batch
        spread = _spread(None if row.overhead_low is None else row.overhead_low + 1,
                         None if row.overhead_high is None else row.overhead_high + 1)
        crowded = " (more ranks than cores)" if results.cores and row.ranks > results.cores else ""
        lines.append(f"{row.ranks:>5} {row.undo.ms_per_step:>15.1f} {row.off.ms_per_step:>12.1f} "
                     f"{row.strict_overhead:>9.0%} {'-' if exchanged is None else f'{exchanged / 1024:.1f}':>20} "
                     f"{spread:>24}{crowded}")
    for row in results.runs:
        if row.durable_mb:
            lines.append(f"{row.ranks} rank(s), MB made durable a batch by each rank: dense snapshot "
                         f"{' / '.join(f'{d:.2f}' for d, _ in row.durable_mb)}, table rows and undo records "
                         f"{' / '.join(f'{t:.2f}' for _, t in row.durable_mb)}")
        if row.phase_ms:
            lines.append(f"{row.ranks} rank(s), ms a batch on each rank: undo capture "
                         + ", batch end ".join(" / ".join(f"{ms[i]:.2f}" for ms in row.phase_ms) for i in range(2))
                         + ", commit (worker) " + " / ".join(f"{ms[2]:.2f}" for ms in row.phase_ms))
    single = results.single
    if single is not None:
        lines.append(f"one process, the same model: {single.method_ms:.1f} / {single.base_ms:.1f} ms/step, overhead "
                     f"{single.ratio - 1:.0%} ({_spread(single.ratio_low, single.ratio_high)})")
    if results.runs and results.runs[0].blocks is not None:
        lines.append(f"side by side: {results.runs[0].blocks} blocks of {results.runs[0].block_steps} steps each, "
                     "off and durable taking turns in one group")
    r = results.recovery
    lines.append(f"group recovery after a kill (2 ranks): to batch {r.recovered_batch} in {r.seconds * 1000:.0f} ms "
                 "(rank 0, once every rank has started: agreeing on G, rolling back, resuming)")
    return "\n".join(lines)


def _spread(low: float | None, high: float | None) -> str:
    """A ratio's interval as overheads: "+1.0% to +7.0%", or "-" without one."""
    return "-" if low is None or high is None else f"{low - 1:+.1%} to {high - 1:+.1%}"
