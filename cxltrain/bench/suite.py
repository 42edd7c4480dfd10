"""`cxltrain bench`: every measurement, one after the other, each in a fresh process.

Jobs that time a process's whole life (recovery: `cxltrain recover`, torch.load, DCP load, and a
process that loads nothing) and the job that crashes on purpose run as new Python processes
(`python -m ...`). The others are forked from a fork server that has imported torch once: each is
still a fresh process (no earlier job's tables, caches or threads), without paying torch's import
each time.

    if __name__ == "__main__":           # the fork server imports the main module again
        results = run_bench(full_plan())  # a results.BenchResults; report.py describes its JSON
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import time
import traceback
from typing import Callable

from ..emulation.cxl import memory_dir
from ..jobs.config import TrainConfig
from ..knobs import KNOBS
from .methods import Method, step_methods
from .records import (
    Bandwidth,
    EmbeddingTiming,
    LoadTime,
    OursSteps,
    PairedTiming,
    PlainSteps,
    RecoveredPool,
    SavedCheckpoint,
    Unmeasured,
)
from .report import machine_info, targets
from .results import BenchResults, EmbeddingRow, PairedRow, Recovery, RecoverySize, StepRow, StepTiming

GB = 1e9


@dataclasses.dataclass(frozen=True)
class BenchPlan:
    """What one `cxltrain bench` run measures, and how long it samples each thing."""

    name: str                                # "full" or "quick"
    config: TrainConfig                      # model, data and batch for every measurement
    step_poolings: tuple[int, ...]           # pooling of the step-time runs; the first gets every method
    ours_timed: int                          # steps timed per ours run (after the trainer's warm-up)
    ours_rounds: int                         # runs of each of ours at the first pooling, interleaved
                                             # (off, strict, ..., off, strict, ...); a row is the median run
    paired: tuple[str, ...]                  # methods also run side by side with ours-off in one process
    paired_blocks: tuple[int, int, int]      # (warm-up steps, blocks each, steps per block)
    periods: tuple[int, int]                 # k of the plain checkpoints every k batches
    plain_timed: dict                        # (save, every) -> (warm-up, timed steps)
    recovery_rows: tuple[int, ...]           # rows per table of the recovery sizes
    embedding_poolings: tuple[int, ...]
    embedding_steps: tuple[int, int]         # (warm-up, timed)
    embedding_rounds: int                    # runs of each contender, interleaved; a row is the median run
    copy_bytes: int
    job_timeout_s: int


def full_plan() -> BenchPlan:
    """The bench's configuration: 8 x 1M x 64 tables, batch 2048, skewed ids, 2 threads."""
    # k = 1: a checkpoint every step (few steps: each costs 1-3 s); k = 100: whole periods, two for
    # DCP so that one save overlaps the steps after it
    timed = {("none", 1): (5, 40), ("torch", 1): (3, 8), ("torch", 100): (5, 100),
             ("dcp", 1): (3, 6), ("dcp", 100): (5, 200)}
    # rows per table for 0.5, 1, 2, 4 GB of tables (8 tables x 64 fp32 = 2,048 bytes per row index)
    # ours: 3 interleaved rounds, because run-to-run noise on a shared 2-core box (~5-10%) is as
    # large as the effect the strict target is about
    return BenchPlan(name="full", config=TrainConfig(), step_poolings=(1, 20), ours_timed=40, ours_rounds=3,
                     paired=("ours-strict", "ours-strict-bgcap"), paired_blocks=(5, 20, 10),
                     periods=(1, 100), plain_timed=timed,
                     recovery_rows=(250_000, 500_000, 1_000_000, 2_000_000), embedding_poolings=(1, 20),
                     embedding_steps=(5, 30), embedding_rounds=3, copy_bytes=1 << 30, job_timeout_s=1200)


def quick_plan() -> BenchPlan:
    """The whole path on a tiny model, in seconds: for tests, not for figures."""
    config = TrainConfig(batch_size=64, num_tables=2, rows=1000, dim=8, bottom_mlp=(16,), top_mlp=(16,))
    timed = {("none", 1): (1, 4), ("torch", 1): (1, 2), ("torch", 4): (1, 4), ("dcp", 1): (1, 2), ("dcp", 4): (1, 4)}
    return BenchPlan(name="quick", config=config, step_poolings=(1,), ours_timed=4, ours_rounds=2,
                     paired=("ours-strict",), paired_blocks=(1, 2, 2), periods=(1, 4),
                     plain_timed=timed, recovery_rows=(1000,),
                     embedding_poolings=(1,), embedding_steps=(1, 3), embedding_rounds=1, copy_bytes=1 << 20, job_timeout_s=120)


def scratch_dir() -> str:
    """Where pools and checkpoint files go: memory-backed, like the tables they stand for."""
    return KNOBS.pool_dir or memory_dir()


# ---------------------------------------------------------------------------------------------
# running jobs
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class JobResult:
    result: dict | None    # the job's record as JSON (worker.run_job), as it crossed the process boundary
    error: str | None      # one line: why there is no result
    wall_seconds: float
    returncode: int | None = None
    cpu_seconds: float = 0.0   # user + system time of the job's process: its cost on an idle machine


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _in_fork(job: dict, conn) -> None:
    from .worker import run_job

    try:
        result = run_job(job).to_json()
        conn.send(("ok", result, _cpu_seconds(resource.RUSAGE_SELF)))
    except BaseException as e:  # the parent reports it as this job's reason, one line
        traceback.print_exc()
        conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0], _cpu_seconds(resource.RUSAGE_SELF)))
    finally:
        conn.close()


class Jobs:
    """Runs jobs one at a time: forked from a fork server, or as new Python processes."""

    def __init__(self, timeout_s: int) -> None:
        self.timeout_s = timeout_s
        self.cpu_seconds = 0.0  # all jobs so far
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["cxltrain.bench.worker", "cxltrain.bench.preload"])

    def forked(self, job: dict) -> JobResult:
        """Run `job` (worker.run_job) in a process forked from the fork server."""
        return self._count(self._forked(job))

    def _forked(self, job: dict) -> JobResult:
        receive, send = self._ctx.Pipe(duplex=False)
        started = time.perf_counter()
        process = self._ctx.Process(target=_in_fork, args=(job, send))
        process.start()
        send.close()
        outcome = None
        try:
            if receive.poll(self.timeout_s):
                try:
                    outcome = receive.recv()
                except EOFError:  # died before it could answer
                    pass
            process.join(5 if outcome is not None else 0.1)
        finally:  # also on Ctrl-C: no job outlives the bench
            if process.is_alive():
                process.kill()
                process.join()
        wall = time.perf_counter() - started
        if outcome is None:
            why = (f"timed out after {self.timeout_s} s" if process.exitcode in (None, -9) and wall >= self.timeout_s
                   else f"its process died (exit {process.exitcode})")
            return JobResult(None, why, wall, process.exitcode)
        status, value, cpu = outcome
        return JobResult(value if status == "ok" else None, None if status == "ok" else value, wall, process.exitcode,
                         cpu)

    def fresh(self, argv: list[str], env: dict | None = None) -> JobResult:
        """`python <argv>` in a new process; its result is the last stdout line (JSON)."""
        return self._count(self._fresh(argv, env))

    def _count(self, outcome: JobResult) -> JobResult:
        self.cpu_seconds += outcome.cpu_seconds
        return outcome

    def _fresh(self, argv: list[str], env: dict | None) -> JobResult:
        started, cpu = time.perf_counter(), _cpu_seconds(resource.RUSAGE_CHILDREN)
        try:
            done = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                                  timeout=self.timeout_s, env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            return JobResult(None, f"timed out after {self.timeout_s} s", time.perf_counter() - started)
        wall, cpu = time.perf_counter() - started, _cpu_seconds(resource.RUSAGE_CHILDREN) - cpu
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            return JobResult(None, last[:200], wall, done.returncode, cpu)
        return JobResult(json.loads(lines[-1]), None, wall, done.returncode, cpu)

    def worker(self, job: dict, env: dict | None = None) -> JobResult:
        return self.fresh(["-m", "cxltrain.bench.worker", json.dumps(job)], env)


# ---------------------------------------------------------------------------------------------
# the sections
# ---------------------------------------------------------------------------------------------
def run_bench(plan: BenchPlan, log: Callable[[str], None] = lambda line: None) -> BenchResults:
    started = time.perf_counter()
    jobs = Jobs(plan.job_timeout_s)
    where = scratch_dir()
    prefix = os.path.join(where, f"cxltrain-bench-{os.getpid()}")
    machine = machine_info(KNOBS.threads)
    results = BenchResults(machine=machine, config=plan.config, quick=plan.name == "quick", scratch_dir=where,
                           steps=_step_times(plan, jobs, prefix, log), paired=_paired(plan, jobs, prefix, log),
                           recovery=_recovery(plan, jobs, prefix, log), embedding=_embedding(plan, jobs, prefix, log),
                           bandwidth=_bandwidth(plan, jobs, log))
    results.seconds = time.perf_counter() - started
    results.job_cpu_seconds = jobs.cpu_seconds
    results.targets = targets(results)
    return results


def _timed(log: Callable[[str], None], what: str, run: Callable[[], JobResult], killed_ok: bool = False) -> JobResult:
    outcome = run()
    said = "killed as planned" if killed_ok and outcome.returncode == -9 else outcome.error or "ok"
    if outcome.result:  # the job's figures, so a run cut short still leaves them in the log
        said += " " + ", ".join(f"{k} {v:.4g}" for k, v in outcome.result.items()
                                if isinstance(v, float) and k not in ("note",))[:120]
    log(f"{what}: {said} ({outcome.wall_seconds:.1f} s, {outcome.cpu_seconds:.1f} s of CPU)")
    return outcome


def _step_times(plan: BenchPlan, jobs: Jobs, prefix: str, log) -> list[StepRow]:
    from .plain import remove
    from .worker import config_to_json

    rows = []
    for pooling in plan.step_poolings:
        config = dataclasses.replace(plan.config, pooling=pooling)
        # beyond the first pooling, only the baselines and strict mode (each run costs a minute there)
        methods = step_methods(plan.periods)
        if pooling != plan.step_poolings[0]:
            methods = [m for m in methods if m.name in ("ours-off", "ours-strict", "plain")]
        rounds = plan.ours_rounds if pooling == plan.step_poolings[0] else 1
        schedule = [m for _ in range(rounds) for m in methods if m.family == "ours"]
        schedule += [m for m in methods if m.family != "ours"]
        runs: dict[str, list[OursSteps | PlainSteps]] = {}
        reasons: dict[str, str] = {}
        for method in schedule:
            if method.name in reasons:
                continue
            job = _step_job(method, config, plan, prefix, config_to_json)
            try:
                outcome = _timed(log, f"steps {method.name} pooling {pooling}", lambda: jobs.forked(job))
            finally:  # a job that died (or was interrupted) leaves its pool or checkpoint
                for path in (job["pool"], job["pool"] + ".creating") if "pool" in job else (job["path"],):
                    remove(path)
            if outcome.error is not None:
                reasons[method.name] = outcome.error
            else:
                steps = OursSteps if method.family == "ours" else PlainSteps
                runs.setdefault(method.name, []).append(steps.from_json(outcome.result))
        measured: dict[str, StepTiming] = {}
        for method in methods:
            row = StepRow(method=method.name, label=method.label, pooling=pooling, baseline=method.baseline)
            if method.name in reasons:
                row.reason = reasons[method.name]
            else:
                done = sorted(runs[method.name], key=lambda result: result.mean_ms)
                row.timing = _step_row(method, done[(len(done) - 1) // 2])  # the median run (lower one if even)
                if len(done) > 1:
                    row.timing.runs_ms = [result.mean_ms for result in runs[method.name]]
                measured[method.name] = row.timing
            rows.append(row)
        for row in rows:
            base = measured.get(row.baseline)
            if row.pooling == pooling and row.timing is not None and base is not None:
                row.timing.ratio = row.timing.mean_ms / base.mean_ms
        if "plain" in measured and "ours-off" in measured:
            measured["ours-off"].plain_over_ours_off = measured["plain"].mean_ms / measured["ours-off"].mean_ms
    return rows


def _paired(plan: BenchPlan, jobs: Jobs, prefix: str, log) -> list[PairedRow]:
    """Each of plan.paired against ours-off in one process, in alternating blocks (paired.py)."""
    from .worker import config_to_json

    warmup, blocks, block_steps = plan.paired_blocks
    rows = []
    for method in (m for m in step_methods(plan.periods) if m.name in plan.paired):
        job = {"job": "ours-paired", "config": config_to_json(plan.config), "overrides": method.overrides,
               "pools": [f"{prefix}-paired-off.pool", f"{prefix}-paired-{method.name}.pool"],
               "warmup": warmup, "blocks": blocks, "block_steps": block_steps}
        outcome = _timed(log, f"paired {method.name} / ours-off", lambda: jobs.forked(job))
        rows.append(PairedRow(method=method.name, label=method.label, reason=outcome.error,
                              timing=None if outcome.error else PairedTiming.from_json(outcome.result)))
    return rows


def _step_job(method: Method, config: TrainConfig, plan: BenchPlan, prefix: str, to_json) -> dict:
    from ..jobs.train import WARMUP_STEPS

    if method.family == "ours":
        config = dataclasses.replace(config, steps=WARMUP_STEPS + plan.ours_timed, **method.overrides)
        return {"job": "ours-steps", "config": to_json(config), "pool": f"{prefix}-{method.name}.pool"}
    warmup, timed = plan.plain_timed[(method.save, method.every)]
    return {"job": "plain-steps", "config": to_json(config), "save": method.save, "every": method.every,
            "path": f"{prefix}-{method.name}.ckpt", "warmup": warmup, "timed": timed}


def _step_row(method: Method, result: OursSteps | PlainSteps) -> StepTiming:
    """Step ms, batches a crash loses, bytes written per batch, for one measured method."""
    if isinstance(result, OursSteps):  # ours times means only: no median
        return StepTiming(mean_ms=result.mean_ms, median_ms=None, batches_lost=method.batches_lost(),
                          bytes_per_batch=result.bytes_written_per_batch())
    return StepTiming(mean_ms=result.mean_ms, median_ms=result.median_ms,
                      batches_lost=method.batches_lost(result.overlap_steps), full_checkpoint_bytes=result.state_bytes,
                      bytes_per_batch=0.0 if method.save == "none" else result.state_bytes / method.every,
                      overlap_steps=result.overlap_steps if method.save == "dcp" else None)


def _recovery(plan: BenchPlan, jobs: Jobs, prefix: str, log) -> Recovery:
    """Ours (a pool killed mid-batch, then `cxltrain recover`) vs torch.load and DCP load of a full
    checkpoint, per table size; all in fresh processes."""
    from .plain import remove
    from .worker import config_to_json

    nothing = _timed(log, "recovery: a process that loads nothing", lambda: jobs.worker({"job": "nothing"}))
    sizes = []
    for rows in plan.recovery_rows:
        config = dataclasses.replace(plan.config, rows=rows, steps=6)
        entry = RecoverySize(rows=rows, table_gb=config.num_tables * rows * config.dim * 4 / GB)
        pool, torch_path, dcp_path = f"{prefix}-recover.pool", f"{prefix}-recover.pt", f"{prefix}-recover.dcp"
        try:
            _recover_ours(entry, config, pool, jobs, log)
            remove(pool)
            saved = _timed(log, f"recovery {rows:,} rows: plain model, torch.save + dcp.save",
                           lambda: jobs.forked({"job": "plain-save", "config": config_to_json(config), "steps": 2,
                                                "torch_path": torch_path, "dcp_path": dcp_path}))
            if saved.error is not None:
                entry.torch_reason = entry.dcp_reason = saved.error
            else:
                entry.full_checkpoint_bytes = SavedCheckpoint.from_json(saved.result).state_bytes
                for name, path in (("torch", torch_path), ("dcp", dcp_path)):
                    loaded = _timed(log, f"recovery {rows:,} rows: {name} load",
                                    lambda: jobs.worker({"job": f"{name}-load", "config": config_to_json(config),
                                                         "path": path}))
                    remove(path)  # before the next load: /dev/shm is memory
                    if loaded.error is not None:
                        setattr(entry, f"{name}_reason", loaded.error)
                    else:
                        setattr(entry, f"{name}_seconds", LoadTime.from_json(loaded.result).seconds)
                        setattr(entry, f"{name}_process_seconds", loaded.wall_seconds)
        finally:
            for path in (pool, pool + ".creating", torch_path, dcp_path):
                remove(path)
        sizes.append(entry)
    return Recovery(nothing_process_seconds=nothing.wall_seconds if nothing.error is None else None,
                    nothing_reason=nothing.error, sizes=sizes)


def _recover_ours(entry: RecoverySize, config: TrainConfig, pool: str, jobs: Jobs, log) -> None:
    """Train a pool and SIGKILL it half-way through updating the tables in batch 3, then time
    `cxltrain recover` on it in a fresh process; into `entry`'s ours_* fields."""
    from .worker import config_to_json

    crash_at = f"update:mid:{config.num_tables * 3 + 1}"  # table 0's update of batch 3 (0-based)
    built = _timed(log, f"recovery {config.rows:,} rows: ours, killed mid-batch",
                   lambda: jobs.worker({"job": "ours-crash", "config": config_to_json(config), "pool": pool},
                                       env={"CXLTRAIN_CRASH_AT": crash_at}), killed_ok=True)
    if built.returncode != -9:
        entry.ours_reason = f"the training run was not killed as planned ({built.error or 'it finished'})"
        return
    recovered = _timed(log, f"recovery {config.rows:,} rows: cxltrain recover",
                       lambda: jobs.fresh(["-m", "cxltrain", "recover", pool, "--json"]))
    if recovered.error is not None:
        entry.ours_reason = recovered.error
        return
    report = RecoveredPool.from_json(recovered.result)
    entry.ours_seconds, entry.ours_process_seconds = report.seconds, recovered.wall_seconds
    entry.ours_rows_restored, entry.ours_batches_rolled_back = report.rows_restored, report.batches_rolled_back


def _embedding(plan: BenchPlan, jobs: Jobs, prefix: str, log) -> list[EmbeddingRow]:
    from .embedding import CONTENDERS, OPTIMIZERS
    from .worker import config_to_json

    rows = []
    for pooling in plan.embedding_poolings:
        config = dataclasses.replace(plan.config, pooling=pooling)
        for optimizer in OPTIMIZERS:
            runs: dict[str, list[EmbeddingTiming | Unmeasured]] = {contender: [] for contender in CONTENDERS}
            for _ in range(plan.embedding_rounds):
                for contender in CONTENDERS:
                    if runs[contender] and isinstance(runs[contender][-1], Unmeasured):
                        continue  # no result the first time (e.g. torchrec missing): not again
                    warmup, timed = plan.embedding_steps
                    outcome = _timed(log, f"embedding {contender} {optimizer} pooling {pooling}",
                                     lambda: jobs.forked({"job": "embedding", "config": config_to_json(config),
                                                          "contender": contender, "optimizer": optimizer,
                                                          "pool": f"{prefix}-emb.pool", "warmup": warmup,
                                                          "timed": timed}))
                    runs[contender].append(_embedding_run(outcome))
            for contender in CONTENDERS:
                row = EmbeddingRow(contender=contender, optimizer=optimizer, pooling=pooling)
                in_order = [r for r in runs[contender] if isinstance(r, EmbeddingTiming)]
                timed_runs = sorted(in_order, key=lambda r: r.ms)
                if timed_runs:
                    row.timing = timed_runs[(len(timed_runs) - 1) // 2]
                else:
                    row.reason = runs[contender][-1].reason
                if len(timed_runs) > 1:
                    row.runs_ms = [r.ms for r in in_order]
                rows.append(row)
    return rows


def _embedding_run(outcome: JobResult) -> EmbeddingTiming | Unmeasured:
    """A run's timing, or why it has none (the job may answer with a reason: torchrec missing)."""
    if not outcome.result:
        return Unmeasured(outcome.error)
    return (Unmeasured if "reason" in outcome.result else EmbeddingTiming).from_json(outcome.result)


def _bandwidth(plan: BenchPlan, jobs: Jobs, log) -> Bandwidth | Unmeasured:
    from .worker import config_to_json

    outcome = _timed(log, "copy bandwidth", lambda: jobs.forked(
        {"job": "bandwidth", "config": config_to_json(plan.config), "nbytes": plan.copy_bytes}))
    return Bandwidth.from_json(outcome.result) if outcome.result else Unmeasured(outcome.error)
