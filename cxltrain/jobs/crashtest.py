"""`cxltrain crashtest`: kill training over and over, and prove every recovery exact.

Three modes share one trial loop (Torture.run_trial: kill, recover, export, compare bit for bit
with an uninterrupted run, resume, compare again):

  single  one pool on /dev/shm (the emulated device)
  set     a pool set: the primary on /dev/shm, the tables in a capacity pool on the disk under the
          capacity tier's crash model (unsynced page writes lost), a hot-row cache re-placed
          every 4 batches (cache admission and re-placement are killed too)
  ranks   `train --nproc-per-node 2` run folders, killed one rank, both, or the launcher at a time
          (crashtest_ranks.py)

In the pool modes each trial runs `cxltrain train` (the same `train` call, in a child process) on a
fresh pool and kills it — SIGKILL, which under the emulated device's power-loss model is a power failure:

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

Children are forked from a server process that has imported torch, torch._dynamo (which a torch
optimizer imports when first built) and cxltrain already (the multiprocessing forkserver), so a
trial costs its training, not an interpreter start. Every process runs torch with one thread:
results stay reproducible, and the evictor thread does not fight torch's thread pool for the two
cores.
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
from ..devices.capacity import disk_dir
from ..emulation.cxl import memory_dir
from ..errors import ConfigError, CxlTrainError
from ..faults import CrashPoint
from ..knobs import KNOBS
from .config import TrainConfig

# The run every trial kills: small enough for ~1 s trials, large enough to have several batches
# in flight during any kill, two tables (records interleave), row-wise Adagrad, Adam, dropout-free.
TRIAL_CONFIG = TrainConfig(steps=10, batch_size=64, num_tables=2, rows=3000, dim=8, seed=3)
SMALL_RING_BYTES = 32 << 10   # ~4 batches of this config's records: the ring wraps, commits come early
SET_SMALL_RING_BYTES = 64 << 10  # a set's first batch also records its cache admission

KINDS = ("time", "point", "flush", "recovery")
MODES = ("single", "set", "ranks")
# Named points and how many times a full run reaches each, per batch (tables = per table lookup):
# the registry's, so a point added there is tortured here.
PROTOCOL_POINTS = dict(CrashPoint.REACHED_PER)
# a pool set reaches the set's points too, and its cache's: admission fills each table's slots in
# two halves (at the start and at each re-placement), a re-placement writes each table's evicted rows back;
# the capacity write-back's points are reached at most once a commit (every commit when forcing)
SET_POINTS = {**PROTOCOL_POINTS, **CrashPoint.SET_REACHED_PER, CrashPoint.CACHE_MID_ADMISSION: "admissions",
              CrashPoint.CACHE_AFTER_WRITE_BACK: "replacements", CrashPoint.CAPACITY_MID_WRITE_BACK: "commits",
              CrashPoint.CAPACITY_BEFORE_SYNC: "commits", CrashPoint.COMMIT_AFTER_WRITE_BACK: "commits",
              CrashPoint.COMMIT_WHILE_WRITING_BACK: "commits"}
SET_CACHE_ROWS, SET_REPLACE_EVERY = 300, 4  # 10% of each table's rows, re-placed every 4 batches
# A set trial forces (writes the capacity pages back at every commit) or steals with a write-back
# every 3 batches, so that a 10-batch run reaches several write-backs and redo records live between them.
STEAL_EVERY = 3
SET_WRITE_BACK_EVERY = (1, STEAL_EVERY)
# reached only while a write-back runs beside the commits: a trial killed there steals
STEALING_POINTS = (CrashPoint.COMMIT_WHILE_WRITING_BACK,)
RECOVERY_POINTS = CrashPoint.RECOVERY
SET_RECOVERY_POINTS = (*CrashPoint.RECOVERY, CrashPoint.RECOVER_MID_REDO)
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
    rank: int | None = None   # --mode ranks: the rank killed (kind "one") or armed (kind "point")

    def describe(self) -> str:
        after = f"killed {self.delay * 1000:.0f} ms into training"
        what = {"time": after, "one": f"rank {self.rank} {after}", "both": f"both ranks {after}",
                "launcher": f"the launcher {after}"}.get(self.kind, f"killed at {self.crash_at}")
        if self.kind == "point" and self.rank is not None:
            what = f"rank {self.rank} {what}"
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
    before its first commit leaves. A pool set's capacity pools go to `capacity_folder`."""

    def __init__(self, config: TrainConfig, folder: str, capacity_folder: str | None = None) -> None:
        self.config, self.folder, self.capacity_folder = config, folder, capacity_folder or folder

    @functools.lru_cache(maxsize=None)
    def __call__(self, batches: int) -> dict:
        from ..runtime.runtime import export_state
        from .train import train

        path = os.path.join(self.folder, f"reference-{batches}.pool")
        config = self.config
        if config.capacity_pool is not None:
            config = dataclasses.replace(config, capacity_pool=os.path.join(self.capacity_folder,
                                                                            f"reference-{batches}.cap"))
        train(dataclasses.replace(config, steps=batches), pool_path=path, progress=False)  # 0: set up only
        state = export_state(path)
        for made in (path, config.capacity_pool):
            if made is not None:
                os.unlink(made)
        return state


def _resume_in_process(pool: str, config: TrainConfig) -> int | None:
    from .train import train

    return train(config, pool_path=pool, progress=False).progress.recovered_batch


def check_recovery(pool: str, references: References, config: TrainConfig, *,
                   export: Callable[[str], dict | None] | None = None,
                   resume: Callable[[str, TrainConfig], int | None] = _resume_in_process
                   ) -> tuple[int | None, list[str]]:
    """Recover and export a killed run's pool (or run folder: `export`, `resume`) and compare it
    with the reference of its batch; then resume to config.steps (`resume` returns the batch it
    recovered to) and compare with that reference. Returns (recovered batch, problems)."""
    if export is None:
        from ..runtime.runtime import export_state as export

    batch, problems = None, []
    if os.path.exists(pool):  # else the kill came before the pool was published: nothing to recover
        try:
            recovered = export(pool)
        except CxlTrainError as e:
            return None, [f"recovery refused: {e}"]
        if recovered is not None:  # None: a run folder killed before any rank committed
            batch = recovered["batch"]
            problems += [f"after recovery to batch {batch}: {d}" for d in differences(recovered, references(batch))]
    try:
        recovered_batch = resume(pool, config)
    except CxlTrainError as e:
        return batch, problems + [f"resume refused: {e}"]
    if batch is not None and recovered_batch != batch:
        problems.append(f"resume recovered batch {recovered_batch}, export said {batch}")
    final = export(pool)
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
    """Runs trials: `Torture(...).run(progress)`; see the module docstring. The pool modes (single,
    set) are this class; RankTorture (crashtest_ranks.py) replaces the hooks that start, kill,
    export and resume a run, and keeps the loop."""

    mode = "single"
    plants = faults.PLANTED

    def __init__(self, *, trials: int, device: DeviceModel, seed: int, plant: str = "", only: int | None = None,
                 first: int = 0, fail_fast: bool = False, keep_dir: str | None = None,
                 config: TrainConfig = TRIAL_CONFIG, pool_set: bool = False) -> None:
        self.mode = "set" if pool_set else self.mode
        self._settle(trials, device, seed, plant, only, first, fail_fast, keep_dir)
        self.path = os.path.join(self.work, "trial.pool")
        self.disk_work = None
        if pool_set:  # the capacity tier on the real disk, as `train --capacity-pool` is meant to be used
            self.disk_work = tempfile.mkdtemp(prefix="cxltrain-crashtest-", dir=disk_dir())
            config = dataclasses.replace(config, capacity_pool=os.path.join(self.disk_work, "trial.cap"),
                                         cache_rows=SET_CACHE_ROWS, cache_replace_every=SET_REPLACE_EVERY)
        self.config = config
        self.points = SET_POINTS if pool_set else PROTOCOL_POINTS
        self.references = References(config, self.work, self.disk_work)
        self._context = multiprocessing.get_context("forkserver")
        # torch._dynamo too: each child's first torch optimizer would otherwise import it itself
        self._context.set_forkserver_preload(["cxltrain.jobs.train", "cxltrain.jobs.crashtest", "torch._dynamo"])
        self.run_seconds = 0.0      # an uninterrupted child's training time (calibrated)
        self.flushes = 0            # an uninterrupted child's device flushes (calibrated)

    def _settle(self, trials: int, device: DeviceModel, seed: int, plant: str, only: int | None, first: int,
                fail_fast: bool, keep_dir: str | None) -> None:
        """Check and keep what every mode is given; make the work folder. The trials run are
        [only], or first..trials-1 of the seed's plan (a trial's plan is its seed's and number's alone,
        so one plan of many trials may be run in parts, one after another or side by side)."""
        if trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {trials}")
        if not 0 <= first < trials:
            raise ConfigError(f"--first {first}: the plan of --trials {trials} has trials 0 to {trials - 1}")
        if plant and plant not in self.plants:
            raise ConfigError(f"unknown planted fault {plant!r} for --mode {self.mode}; choose one of "
                              f"{', '.join(self.plants)}")
        with knobs.override(**device.knobs(0)):
            KNOBS.validate()
        self.trials, self.device, self.seed, self.plant = trials, device, seed, plant
        self.only, self.first, self.fail_fast = only, first, fail_fast
        self.work = tempfile.mkdtemp(prefix="cxltrain-crashtest-", dir=memory_dir())
        self.keep_dir = keep_dir or os.path.join(tempfile.gettempdir(), f"cxltrain-crashtest-{seed}")

    # -- plans ---------------------------------------------------------------------------------
    def plan(self, number: int) -> TrialPlan:
        rng = random.Random(f"{self.seed}:{number}")
        kind = KINDS[number % len(KINDS)]  # every kind, evenly
        dense_every = 3 if rng.random() < 0.25 else 1
        small_ring = rng.random() < 0.25
        steps, tables = self.config.steps, self.config.num_tables
        replacements = steps // self.config.cache_replace_every if self.config.cache_replace_every else 0
        per = {"tables": steps * tables, "commits": -(-steps // dense_every) + (steps if small_ring else 0),
               "admissions": 2 * tables * (1 + replacements), "replacements": tables * replacements}
        crash_at, point, delay, recover_at = None, None, 0.0, None
        if kind == "time":
            delay = rng.uniform(0.0, self.run_seconds)
        elif kind == "flush":
            crash_at = f"{FLUSH_POINT}:{rng.randint(1, max(1, self.flushes))}"
        else:
            point = rng.choice(sorted(self.points))
            crash_at = f"{point}:{rng.randint(1, max(1, per[self.points[point]]))}"
            if kind == "recovery":
                recover_at = rng.choice(SET_RECOVERY_POINTS if self.disk_work else RECOVERY_POINTS)
        trial_knobs = {**self.device.knobs(rng.randrange(1 << 31)), "threads": 1,
                       "undo_ring_bytes": (SET_SMALL_RING_BYTES if self.disk_work else SMALL_RING_BYTES) if small_ring else 0,
                       **({"capacity_crash": 1} if self.disk_work else {})}
        background = rng.random() < 0.25
        if self.disk_work:  # drawn last: a single pool's plans stay what their seeds gave before
            trial_knobs["write_back_every"] = rng.choice(SET_WRITE_BACK_EVERY)
            if point in STEALING_POINTS:  # forcing never reaches them
                trial_knobs["write_back_every"] = STEAL_EVERY
        return TrialPlan(number, kind, crash_at, delay, recover_at, dense_every, small_ring, trial_knobs, background)

    def _config(self, plan: TrialPlan) -> TrainConfig:
        return dataclasses.replace(self.config, dense_every=plan.dense_every, background_capture=plan.background_capture)

    def _files(self) -> list[str]:
        """The files a trial's run writes: its pool (a set's primary, then its capacity pool)."""
        return [self.path] + ([self.config.capacity_pool] if self.disk_work else [])

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
        config = self.config
        if self.disk_work:
            self.config = dataclasses.replace(config, capacity_pool=os.path.join(self.disk_work, "calibrate.cap"))
        try:
            proc, conn = self._start_training(pool, plan, os.path.join(self.work, "calibrate.log"))
            messages = dict(_receive_all(conn))
            proc.join()
        finally:
            calibrated, self.config = self.config, config
        if proc.exitcode != 0 or "done" not in messages:
            raise CxlTrainError(f"crashtest: the uninterrupted calibration run failed (exit {proc.exitcode}); "
                                f"its log: {_tail(os.path.join(self.work, 'calibrate.log'))}")
        self.run_seconds = time.perf_counter() - messages["ready"]
        self.flushes = messages["done"]
        _unlink(pool, calibrated.capacity_pool)

    def _run_killed(self, plan: TrialPlan, log: str) -> tuple[bool, str | None]:
        """Start the trial's training and kill it as planned: (killed, why the run failed or None)."""
        proc, conn = self._start_training(self.path, plan, log)
        if plan.kind == "time":
            if conn.poll(60):
                conn.recv()  # ready: the pool is open and the first batch is next
            time.sleep(plan.delay)
            proc.kill()
        proc.join()
        if proc.exitcode not in (0, -9):
            return False, f"the training child failed (exit {proc.exitcode}): {_tail(log)}"
        return proc.exitcode == -9, None

    def _recover_killed(self, plan: TrialPlan, log: str) -> None:
        """Recover the killed run in a child that dies at plan.recover_crash_at."""
        rec = self._context.Process(target=_recover_child, args=(self.path, plan.knobs, plan.recover_crash_at, log),
                                    daemon=True)
        rec.start()
        rec.join()

    def _check(self, plan: TrialPlan) -> tuple[int | None, list[str]]:
        return check_recovery(self.path, self.references, self._config(plan))

    def run_trial(self, number: int) -> TrialResult:
        plan = self.plan(number)
        started = time.perf_counter()
        log = os.path.join(self.work, "trial.log")
        kept = [os.path.join(self.work, f"killed-{i}") for i in range(len(self._files()))]
        _unlink(*self._files(), *(p + ".creating" for p in self._files()), log, *kept)
        killed, failure = self._run_killed(plan, log)
        if failure:
            return TrialResult(plan, False, None, [failure], time.perf_counter() - started)
        for path, copy in zip(self._files(), kept):
            _copy(path, copy)
        if plan.recover_crash_at and os.path.exists(self.path):
            self._recover_killed(plan, log)
        batch, problems = self._check(plan)
        result = TrialResult(plan, killed, batch, problems, time.perf_counter() - started)
        if problems:
            self._keep(plan, kept, log)
        return result

    def _keep(self, plan: TrialPlan, kept: list[str], log: str) -> None:
        os.makedirs(self.keep_dir, exist_ok=True)
        for path, copy in zip(self._files(), kept):
            _copy(copy, os.path.join(self.keep_dir, f"trial-{plan.number}.{os.path.basename(path).split('.')[-1]}"))
        _copy(log, os.path.join(self.keep_dir, f"trial-{plan.number}.log"))

    def _command_options(self) -> list[str]:
        """`cxltrain crashtest` options that repeat this torture's mode, device model and plant."""
        return ((["--mode", self.mode] if self.mode != "single" else []) + self.device.cli_args()
                + (["--plant", self.plant] if self.plant else []))

    def replay_commands(self, plan: TrialPlan) -> list[str]:
        """Shell commands that replay a trial: crashtest itself, and the raw `cxltrain train` run."""
        kept = os.path.join(self.keep_dir, f"trial-{plan.number}.pool")
        again = ["cxltrain", "crashtest", "--trials", "1", "--trial", str(plan.number), "--seed", str(self.seed),
                 *self._command_options()]
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
        if self.disk_work:
            train += ["--capacity-pool", "REPLAY.cap", "--cache-rows", str(c.cache_rows),
                      "--cache-replace-every", str(c.cache_replace_every)]
        lines = [shlex.join(again)]
        if plan.kind != "time":
            lines.append(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(train)
                         + " ; cxltrain export REPLAY.pool REPLAY.pt")
        if os.path.exists(kept):
            lines.append(f"cxltrain recover {shlex.quote(kept)}   # the pool as the kill left it"
                         + ("; a set's capacity pool beside it: trial-K.cap" if self.disk_work else ""))
        return lines

    def run(self, on_trial: Callable[[TrialResult], None] = lambda r: None) -> list[TrialResult]:
        """Calibrate, then run the trials (--first K on, or only --trial K); stops early with
        fail_fast, or at Ctrl-C with the trials done so far."""
        self.calibrate()
        numbers = [self.only] if self.only is not None else range(self.first, self.trials)
        results = []
        for number in numbers:
            try:
                result = self.run_trial(number)
            except KeyboardInterrupt:
                break
            results.append(result)
            on_trial(result)
            if self.fail_fast and not result.exact:
                break
        return results

    def close(self) -> None:
        for folder in (self.work, self.disk_work):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)


def _unlink(*paths: str | None) -> None:
    """Remove each file or folder (a run folder) that exists."""
    for path in paths:
        if path and os.path.isdir(path):
            shutil.rmtree(path)
        elif path and os.path.exists(path):
            os.unlink(path)


def _copy(source: str, target: str) -> None:
    """Copy a file or folder, if it exists, in place of what `target` holds (a run of the same seed
    before this one kept its own trial there)."""
    if not os.path.exists(source):
        return
    _unlink(target)
    if os.path.isdir(source):
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)


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

