"""`cxltrain crashtest`: kill training over and over, and prove every recovery exact.

Each trial runs `cxltrain train` (the same `train` call, in a child process) on a fresh pool and
kills it — SIGKILL, which under the emulated device's power-loss model is a power failure:

  time      at a random moment of the run
  point     at the n-th time it reaches a named step of the persistence protocol (faults.py)
  flush     at its n-th flush of the emulated device: a random moment of the persistence traffic
  recovery  at a named point, then recovery itself is killed half-way, and run again

then recovers and exports the pool in this process, compares the export with an uninterrupted run
of as many batches (every tensor with torch.equal, and its dtype), resumes training to the end and
compares again. Some trials also take dense snapshots every 3 batches, get an undo ring so small
that it wraps and forces early commits, or capture undo records on the worker (background_capture).

A trial is defined by (seed, trial number), so `--seed S --trial K` replays it with the same plan
(a timed kill lands at the same delay, not at the same instruction; named points and flush counts
are exact). A mismatch keeps the pool as it was right after the kill, and prints the commands that
replay it.

Children are forked from a server process that has imported torch and cxltrain already (the
multiprocessing forkserver), so a trial costs its training, not an interpreter start. Every process
runs torch with one thread: results stay reproducible, and the evictor thread does not fight
torch's thread pool for the two cores.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import random
import shlex
import shutil
import tempfile
import time
from typing import Callable

from .. import faults, knobs
from ..emulation.cxl import memory_dir
from ..errors import ConfigError, CxlTrainError
from ..faults import CrashPoint
from ..knobs import KNOBS
from .config import TrainConfig

# The run every trial kills: small enough for ~1 s trials, large enough to have several batches
# in flight during any kill, two tables (records interleave), row-wise Adagrad, Adam, dropout-free.
TRIAL_CONFIG = TrainConfig(steps=10, batch_size=64, num_tables=2, rows=3000, dim=8, seed=3)
SMALL_RING_BYTES = 32 << 10   # ~4 batches of this config's records: the ring wraps, commits come early

KINDS = ("time", "point", "flush", "recovery")
# Named points and how many times a full run reaches each, per batch (tables = per table lookup):
# the registry's, so a point added there is tortured here.
PROTOCOL_POINTS = dict(CrashPoint.REACHED_PER)
RECOVERY_POINTS = CrashPoint.RECOVERY
FLUSH_POINT = CrashPoint.DEVICE_FLUSH


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """What the children's emulated device models (knobs of the same names)."""

    power_loss: bool = False
    domain: str = "adr"
    evict_rate: int = 0
    persist_bandwidth: int = 0

    def cli_args(self) -> list[str]:
        """The `cxltrain crashtest` options that ask for this model."""
        return ((["--power-loss"] if self.power_loss else []) + (["--domain", self.domain] if self.domain != "adr" else [])
                + (["--evict-rate", str(self.evict_rate)] if self.evict_rate else [])
                + (["--persist-bandwidth", str(self.persist_bandwidth)] if self.persist_bandwidth else []))

    def knobs(self, trial_seed: int) -> dict:
        return dict(power_loss=int(self.power_loss), domain=self.domain, evict_rate=self.evict_rate,
                    evict_seed=trial_seed, persist_bandwidth=self.persist_bandwidth)


@dataclasses.dataclass(frozen=True)
class TrialPlan:
    """One trial, drawn from (seed, number)."""

    number: int
    kind: str
    crash_at: str | None      # CXLTRAIN_CRASH_AT of the training child
    delay: float              # kind "time": seconds after training starts
    recover_crash_at: str | None  # kind "recovery": CXLTRAIN_CRASH_AT of the recovering child
    dense_every: int
    small_ring: bool
    knobs: dict
    background_capture: bool = False  # undo captures on the worker, in forward

    def describe(self) -> str:
        what = f"killed {self.delay * 1000:.0f} ms into training" if self.kind == "time" else f"killed at {self.crash_at}"
        if self.recover_crash_at:
            what += f", recovery killed at {self.recover_crash_at}"
        extras = [f"dense every {self.dense_every}"] if self.dense_every > 1 else []
        extras += ["small undo ring"] if self.small_ring else []
        extras += ["capture and flushes on the worker"] if self.background_capture else []
        return what + (f" ({', '.join(extras)})" if extras else "")


@dataclasses.dataclass
class TrialResult:
    plan: TrialPlan
    killed: bool              # False: the run ended before the kill came
    recovered_batch: int | None  # None: killed before the pool existed
    problems: list[str]
    seconds: float

    @property
    def exact(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"trial": self.plan.number, "kind": self.plan.kind, "what": self.plan.describe(),
                "killed": self.killed, "recovered_batch": self.recovered_batch, "exact": self.exact,
                "problems": self.problems[:5], "seconds": round(self.seconds, 3)}


# ---------------------------------------------------------------------------------------------
# Comparing exports
# ---------------------------------------------------------------------------------------------
def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}/{i}")
    else:
        yield prefix, tree


INVOCATION = "/metadata/settings/"  # export paths that record how a run was invoked (TrainConfig.run_settings)


def differences(got: dict, want: dict) -> list[str]:
    """Paths where two exports (runtime.export_state) differ: torch.equal and dtype for tensors, ==
    for everything else. Empty when they are the same, bit for bit. The options a run was started
    with (metadata "settings": its --steps, say) say how it was asked for, not what it computed."""
    import torch

    a, b = ({k: v for k, v in _leaves(tree) if not k.startswith(INVOCATION)} for tree in (got, want))
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(set(a) ^ set(b))[:4]}"]
    out = []
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                out.append(key)
        elif x != y:
            out.append(key)
    return out


class References:
    """Exports of uninterrupted runs of `config` for 0..steps batches, each on a fresh pool, made
    once and kept. Batch 0 is a pool set up for the model with no batch trained: what a run killed
    before its first commit leaves."""

    def __init__(self, config: TrainConfig, folder: str) -> None:
        self.config, self.folder = config, folder

    @functools.lru_cache(maxsize=None)
    def __call__(self, batches: int) -> dict:
        from ..runtime.runtime import Runtime, export_state
        from .train import build_model, train

        path = os.path.join(self.folder, f"reference-{batches}.pool")
        if batches:
            train(dataclasses.replace(self.config, steps=batches), pool_path=path, progress=False)
        else:
            import torch

            model = build_model(self.config)
            optimizer = torch.optim.Adam(model.dense_parameters(), lr=self.config.dense_lr)
            with Runtime(path, model, optimizer, metadata=self.config.run_metadata(),
                         rows_per_batch=self.config.batch_size * self.config.pooling):
                pass
        state = export_state(path)
        os.unlink(path)
        return state


def check_recovery(pool: str, references: References, config: TrainConfig) -> tuple[int | None, list[str]]:
    """Recover and export a killed run's pool and compare it with the reference of its batch; then
    resume to config.steps and compare with that reference. Returns (recovered batch, problems)."""
    from ..runtime.runtime import export_state
    from .train import train

    batch, problems = None, []
    if os.path.exists(pool):  # else the kill came before the pool was published: nothing to recover
        try:
            recovered = export_state(pool)
        except CxlTrainError as e:
            return None, [f"recovery refused: {e}"]
        batch = recovered["batch"]
        problems += [f"after recovery to batch {batch}: {d}" for d in differences(recovered, references(batch))]
    try:
        result = train(config, pool_path=pool, progress=False)
    except CxlTrainError as e:
        return batch, problems + [f"resume refused: {e}"]
    if batch is not None and result.progress.recovered_batch != batch:
        problems.append(f"resume recovered batch {result.progress.recovered_batch}, export said {batch}")
    final = export_state(pool)
    problems += [f"after resuming to {config.steps}: {d}" for d in differences(final, references(config.steps))]
    return batch, problems


# ---------------------------------------------------------------------------------------------
# Children (forked from the forkserver; these run there)
# ---------------------------------------------------------------------------------------------
def _enter_child(log: str, knob_values: dict, crash_at: str | None, plant: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    for name, value in knob_values.items():
        setattr(KNOBS, name, value)
    faults.arm(crash_at, plant)
    # tqdm's default lock is a multiprocessing semaphore registered with the parent's resource
    # tracker; a child killed holding it would leak it (a warning at the parent's exit)
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _train_child(pool: str, config: TrainConfig, knob_values: dict, crash_at: str | None, plant: str, log: str,
                 conn) -> None:
    _enter_child(log, knob_values, crash_at, plant)
    from .train import train

    def ready(rt) -> None:
        conn.send(("ready", time.perf_counter()))

    train(config, pool_path=pool, progress=False, on_ready=ready)
    conn.send(("done", faults.reached()))


def _recover_child(pool: str, knob_values: dict, crash_at: str, log: str) -> None:
    _enter_child(log, knob_values, crash_at, "")
    from ..runtime.runtime import recover_pool

    recover_pool(pool)


# ---------------------------------------------------------------------------------------------
# The torture
# ---------------------------------------------------------------------------------------------
class Torture:
    """Runs trials: `Torture(...).run(progress)`; see the module docstring."""

    def __init__(self, *, trials: int, device: DeviceModel, seed: int, plant: str = "", only: int | None = None,
                 fail_fast: bool = False, keep_dir: str | None = None, config: TrainConfig = TRIAL_CONFIG) -> None:
        if trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {trials}")
        if plant and plant not in faults.PLANTED:
            raise ConfigError(f"unknown planted fault {plant!r}; choose one of {', '.join(faults.PLANTED)}")
        with knobs.override(**device.knobs(0)):
            KNOBS.validate()
        self.trials, self.device, self.seed, self.plant = trials, device, seed, plant
        self.only, self.fail_fast, self.config = only, fail_fast, config
        self.work = tempfile.mkdtemp(prefix="cxltrain-crashtest-", dir=memory_dir())
        self.keep_dir = keep_dir or os.path.join(tempfile.gettempdir(), f"cxltrain-crashtest-{seed}")
        self.references = References(config, self.work)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["cxltrain.jobs.train", "cxltrain.jobs.crashtest"])
        self.run_seconds = 0.0      # an uninterrupted child's training time (calibrated)
        self.flushes = 0            # an uninterrupted child's device flushes (calibrated)

    # -- plans ---------------------------------------------------------------------------------
    def plan(self, number: int) -> TrialPlan:
        rng = random.Random(f"{self.seed}:{number}")
        kind = KINDS[number % len(KINDS)]  # every kind, evenly
        dense_every = 3 if rng.random() < 0.25 else 1
        small_ring = rng.random() < 0.25
        steps, tables = self.config.steps, self.config.num_tables
        per = {"tables": steps * tables, "commits": -(-steps // dense_every) + (steps if small_ring else 0)}
        crash_at, delay, recover_at = None, 0.0, None
        if kind == "time":
            delay = rng.uniform(0.0, self.run_seconds)
        elif kind == "flush":
            crash_at = f"{FLUSH_POINT}:{rng.randint(1, max(1, self.flushes))}"
        else:
            point = rng.choice(sorted(PROTOCOL_POINTS))
            crash_at = f"{point}:{rng.randint(1, max(1, per[PROTOCOL_POINTS[point]]))}"
            if kind == "recovery":
                recover_at = rng.choice(RECOVERY_POINTS)
        trial_knobs = {**self.device.knobs(rng.randrange(1 << 31)), "threads": 1,
                       "undo_ring_bytes": SMALL_RING_BYTES if small_ring else 0}
        background = rng.random() < 0.25
        return TrialPlan(number, kind, crash_at, delay, recover_at, dense_every, small_ring, trial_knobs, background)

    def _config(self, plan: TrialPlan) -> TrainConfig:
        return dataclasses.replace(self.config, dense_every=plan.dense_every, background_capture=plan.background_capture)

    # -- children ------------------------------------------------------------------------------
    def _start_training(self, pool: str, plan: TrialPlan, log: str):
        parent, child = self._context.Pipe(duplex=False)
        proc = self._context.Process(target=_train_child, daemon=True,
                                     args=(pool, self._config(plan), plan.knobs, plan.crash_at, self.plant, log, child))
        proc.start()
        child.close()
        return proc, parent

    def calibrate(self) -> None:
        """Time an uninterrupted child's training and count its device flushes: the ranges that
        random kill times and flush counts are drawn from."""
        pool = os.path.join(self.work, "calibrate.pool")
        # armed at a flush it never reaches, so the child counts its flushes
        plan = TrialPlan(-1, "flush", f"{FLUSH_POINT}:{1 << 62}", 0.0, None, 1, False,
                         {**self.device.knobs(0), "threads": 1, "undo_ring_bytes": 0})
        proc, conn = self._start_training(pool, plan, os.path.join(self.work, "calibrate.log"))
        messages = dict(_receive_all(conn))
        proc.join()
        if proc.exitcode != 0 or "done" not in messages:
            raise CxlTrainError(f"crashtest: the uninterrupted calibration run failed (exit {proc.exitcode}); "
                                f"its log: {_tail(os.path.join(self.work, 'calibrate.log'))}")
        self.run_seconds = time.perf_counter() - messages["ready"]
        self.flushes = messages["done"]
        os.unlink(pool)

    def run_trial(self, number: int) -> TrialResult:
        plan = self.plan(number)
        started = time.perf_counter()
        pool = os.path.join(self.work, "trial.pool")
        log = os.path.join(self.work, "trial.log")
        for leftover in (pool, pool + ".creating", log):
            if os.path.exists(leftover):
                os.unlink(leftover)
        proc, conn = self._start_training(pool, plan, log)
        if plan.kind == "time":
            if conn.poll(60):
                conn.recv()  # ready: the pool is open and the first batch is next
            time.sleep(plan.delay)
            proc.kill()
        proc.join()
        killed = proc.exitcode == -9
        if proc.exitcode not in (0, -9):
            return TrialResult(plan, False, None, [f"the training child failed (exit {proc.exitcode}): {_tail(log)}"],
                               time.perf_counter() - started)
        kept = os.path.join(self.work, "killed.pool")
        if os.path.exists(pool):
            shutil.copyfile(pool, kept)
        if plan.recover_crash_at and os.path.exists(pool):
            rec = self._context.Process(target=_recover_child, args=(pool, plan.knobs, plan.recover_crash_at, log),
                                        daemon=True)
            rec.start()
            rec.join()
        batch, problems = check_recovery(pool, self.references, self._config(plan))
        result = TrialResult(plan, killed, batch, problems, time.perf_counter() - started)
        if problems:
            self._keep(plan, kept if os.path.exists(kept) else None, log)
        return result

    def _keep(self, plan: TrialPlan, killed_pool: str | None, log: str) -> None:
        os.makedirs(self.keep_dir, exist_ok=True)
        if killed_pool:
            shutil.copyfile(killed_pool, os.path.join(self.keep_dir, f"trial-{plan.number}.pool"))
        if os.path.exists(log):
            shutil.copyfile(log, os.path.join(self.keep_dir, f"trial-{plan.number}.log"))

    def replay_commands(self, plan: TrialPlan) -> list[str]:
        """Shell commands that replay a trial: crashtest itself, and the raw `cxltrain train` run."""
        kept = os.path.join(self.keep_dir, f"trial-{plan.number}.pool")
        again = ["cxltrain", "crashtest", "--trials", "1", "--trial", str(plan.number), "--seed", str(self.seed),
                 *self.device.cli_args(), *(["--plant", self.plant] if self.plant else [])]
        env = {f"CXLTRAIN_{k.upper()}": str(v) for k, v in plan.knobs.items()}
        if plan.crash_at:
            env[faults.CRASH_ENV] = plan.crash_at
        if self.plant:
            env[faults.FAULT_ENV] = self.plant
        c = self._config(plan)
        train = ["cxltrain", "train", "--pool", "REPLAY.pool", "--steps", str(c.steps), "--batch-size",
                 str(c.batch_size), "--num-tables", str(c.num_tables), "--rows", str(c.rows), "--dim", str(c.dim),
                 "--seed", str(c.seed), "--dense-every", str(c.dense_every), "--no-progress"]
        train += ["--background-capture"] if c.background_capture else []
        lines = [shlex.join(again)]
        if plan.kind != "time":
            lines.append(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(train)
                         + " ; cxltrain export REPLAY.pool REPLAY.pt")
        if os.path.exists(kept):
            lines.append(f"cxltrain recover {shlex.quote(kept)}   # the pool as the kill left it")
        return lines

    def run(self, on_trial: Callable[[TrialResult], None] = lambda r: None) -> list[TrialResult]:
        """Calibrate, then run the trials (or only --trial K); stops early with fail_fast."""
        self.calibrate()
        numbers = [self.only] if self.only is not None else range(self.trials)
        results = []
        for number in numbers:
            result = self.run_trial(number)
            results.append(result)
            on_trial(result)
            if self.fail_fast and not result.exact:
                break
        return results

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _receive_all(conn) -> list[tuple[str, object]]:
    out = []
    try:
        while True:
            out.append(conn.recv())
    except EOFError:
        return out


def _tail(log: str, lines: int = 3) -> str:
    try:
        with open(log, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(no log)"


def summary(results: list[TrialResult], seconds: float) -> dict:
    exact = sum(r.exact for r in results)
    by_kind: dict[str, list[int]] = {}
    for r in results:
        counts = by_kind.setdefault(r.plan.kind, [0, 0])
        counts[0] += r.exact
        counts[1] += 1
    return {"trials": len(results), "exact": exact, "killed": sum(r.killed for r in results),
            "by_kind": {k: {"exact": v[0], "trials": v[1]} for k, v in sorted(by_kind.items())},
            "recovered_batches": sorted({r.recovered_batch for r in results if r.recovered_batch is not None}),
            "seconds": round(seconds, 1), "failures": [r.to_json() for r in results if not r.exact]}

