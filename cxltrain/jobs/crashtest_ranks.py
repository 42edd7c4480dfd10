"""`cxltrain crashtest --mode ranks`: the torture's trial loop on `train --nproc-per-node 2` run
folders (docs/distributed.md).

Each trial launches `cxltrain train --nproc-per-node 2 --max-restarts 0` as the user would (the
launcher, torchrun inside it, two ranks) on a fresh run folder under the power-loss model asked for,
and kills, by kind (even shares):

  one       one rank (chosen at random), SIGKILLed at a random moment of the run
  both      both ranks at that moment
  launcher  the launcher (its ranks must end with it: a rank left running is a failure)
  point     one rank at the n-th time it reaches a named step of the protocol, the distributed
            ones included (CXLTRAIN_CRASH_RANK); a quarter of these then have `cxltrain recover
            DIR` killed inside the group's recovery, and recovered again by the export

then recovers and exports the folder in this process (`export DIR`: every rank rolled back to the
agreed batch G), compares it bit for bit with an uninterrupted 2-rank run of G batches, resumes with
the same command to the end, and compares again. A trial costs three processes starting torch (the
launcher and its ranks), twice: seconds, not the pool modes' fraction of one.
"""

from __future__ import annotations

import functools
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time

from .. import faults
from ..errors import CxlTrainError
from ..faults import CrashPoint
from .config import TrainConfig
from .crashtest import PROTOCOL_POINTS, DeviceModel, Torture, TrialPlan, _copy, _tail, check_recovery
from .processes import alive, children, rank_of

RANK_KINDS = ("one", "both", "launcher", "point")
# the run every trial kills: three tables, one of each sharding, as tests/test_dist.py trains
RANKS_CONFIG = TrainConfig(steps=16, batch_size=96, num_tables=3, rows=2000, dim=16)
SHARDING = "table-wise,row-wise,data-parallel"
RANK_POINTS = {**PROTOCOL_POINTS, CrashPoint.DIST_AFTER_LOCAL_COMMIT: "commits",
               CrashPoint.DIST_BEFORE_AGREEMENT: "commits"}
GROUP_RECOVERY_POINTS = (CrashPoint.DIST_RECOVER_BEFORE_ROOT, *CrashPoint.RECOVERY)
CHILD_TIMEOUT = 300   # seconds any launched command may take
LAUNCHER_GRACE = 10   # seconds the ranks may take to end after their launcher


def _command() -> list[str]:
    return [sys.executable, "-m", "cxltrain"]


def train_args(run: str, config: TrainConfig) -> list[str]:
    """`cxltrain train` arguments of a trial's run of `config` on 2 ranks in folder `run`."""
    return ["train", "--nproc-per-node", "2", "--max-restarts", "0", "--pool", run, "--steps", str(config.steps),
            "--batch-size", str(config.batch_size), "--num-tables", str(config.num_tables), "--rows",
            str(config.rows), "--dim", str(config.dim), "--seed", str(config.seed), "--sharding", SHARDING,
            "--dist-timeout", "30", "--no-progress"]


_LAUNCHED: set[subprocess.Popen] = set()  # commands still running, ended by stop_launched


def _launch(args: list[str], log: str, env: dict) -> subprocess.Popen:
    """`cxltrain ARGS` in a session of its own (so a kill reaches its ranks), output to `log`."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(_command() + args, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)
    _LAUNCHED.add(proc)
    return proc


def stop_launched() -> None:
    """Kill every launched command still running, with its ranks (a torture stopped by Ctrl-C)."""
    for proc in list(_LAUNCHED):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _LAUNCHED.discard(proc)


def _finish(proc: subprocess.Popen, log: str) -> int:
    """Wait for a launched command; a hung one is killed with its whole session and is a failure."""
    try:
        code = proc.wait(timeout=CHILD_TIMEOUT)
        _LAUNCHED.discard(proc)
        return code
    except subprocess.TimeoutExpired:
        stop_launched()
        raise CxlTrainError(f"`{shlex.join(proc.args[2:4])}` did not end within {CHILD_TIMEOUT} s: {_tail(log)}")


def _knob_env(values: dict) -> dict:
    return {f"CXLTRAIN_{k.upper()}": str(v) for k, v in values.items()}


def export_run(path: str) -> dict | None:
    """`export DIR` in this process: None where no rank has committed yet (or the folder was never
    made); the group's first problem as a RecoveryError."""
    from ..runtime import manifest as run_dir
    from ..runtime.run_check import check_run_dir
    from .reshard import export_dir

    if not run_dir.is_run_dir(path):
        return None
    checked = check_run_dir(path)
    if checked.problems:
        from ..errors import RecoveryError

        raise RecoveryError(checked.problems[0])
    return None if checked.batch is None else export_dir(path)


class RankReferences:
    """Exports of uninterrupted 2-rank runs of `config` for 0..steps batches, each launched on a
    fresh folder, made when first asked for and kept. Batch 0 is a folder set up with no batch
    trained (`--steps 0`): what a kill after every rank made its pool and before the first commit leaves."""

    def __init__(self, config: TrainConfig, folder: str) -> None:
        self.config, self.folder = config, folder

    @functools.lru_cache(maxsize=None)
    def __call__(self, batches: int) -> dict:
        import dataclasses

        run, log = os.path.join(self.folder, f"reference-{batches}"), os.path.join(self.folder, "reference.log")
        code = _finish(_launch(train_args(run, dataclasses.replace(self.config, steps=batches)), log, {}), log)
        if code != 0:
            raise CxlTrainError(f"crashtest: the uninterrupted reference run of {batches} batches failed: {_tail(log)}")
        state = export_run(run)
        shutil.rmtree(run)
        return state


class RankTorture(Torture):
    """The torture of 2-rank run folders: Torture's loop with these hooks (module docstring)."""

    mode = "ranks"
    plants = faults.PLANTED + faults.DIST_PLANTED

    def __init__(self, *, trials: int, device: DeviceModel, seed: int, plant: str = "", only: int | None = None,
                 first: int = 0, fail_fast: bool = False, keep_dir: str | None = None,
                 config: TrainConfig = RANKS_CONFIG) -> None:
        self._settle(trials, device, seed, plant, only, first, fail_fast, keep_dir)
        self.config, self.disk_work = config, None
        self.path = os.path.join(self.work, "run")
        self.references = RankReferences(config, self.work)
        self.run_seconds = 0.0

    def plan(self, number: int) -> TrialPlan:
        rng = random.Random(f"{self.seed}:ranks:{number}")
        kind = RANK_KINDS[number % len(RANK_KINDS)]
        crash_at, delay, recover_at, rank = None, 0.0, None, rng.randrange(2)
        if kind == "point":
            point = rng.choice(sorted(RANK_POINTS))
            per = {"tables": self.config.steps * self.config.num_tables, "commits": self.config.steps}
            crash_at = f"{point}:{rng.randint(1, per[RANK_POINTS[point]])}"
            if rng.random() < 0.25:
                recover_at = rng.choice(GROUP_RECOVERY_POINTS)
        else:
            delay = rng.uniform(0.0, self.run_seconds)
        trial_knobs = {**self.device.knobs(rng.randrange(1 << 31)), "threads": 1}
        return TrialPlan(number, kind, crash_at, delay, recover_at, 1, False, trial_knobs, rank=rank)

    def _files(self) -> list[str]:
        return [self.path]

    def _env(self, plan: TrialPlan) -> dict:
        env = _knob_env(plan.knobs)
        if plan.crash_at:
            env.update({faults.CRASH_ENV: plan.crash_at, faults.CRASH_RANK_ENV: str(plan.rank)})
        if self.plant:
            env[faults.FAULT_ENV] = self.plant
        return env

    def calibrate(self) -> None:
        """Time an uninterrupted run from its first batch: the range random kill times come from."""
        log = os.path.join(self.work, "calibrate.log")
        run = os.path.join(self.work, "calibrate")
        proc = _launch(train_args(run, self.config), log, _knob_env(self.device.knobs(0)))
        ready = _wait_for_start(proc, log)
        if _finish(proc, log) != 0:
            raise CxlTrainError(f"crashtest: the uninterrupted calibration run failed: {_tail(log)}")
        self.run_seconds = time.perf_counter() - ready
        shutil.rmtree(run)

    def _run_killed(self, plan: TrialPlan, log: str) -> tuple[bool, str | None]:
        proc = _launch(train_args(self.path, self.config), log, self._env(plan))
        ranks: list[int] = []
        if plan.kind != "point":
            _wait_for_start(proc, log)
            time.sleep(plan.delay)
            ranks = children(proc.pid)
            victims = {"one": [p for p in ranks if rank_of(p) == plan.rank], "both": ranks,
                       "launcher": [proc.pid]}[plan.kind]
            for pid in victims:
                _kill(pid)
        else:
            ranks = children(proc.pid)
        code = _finish(proc, log)
        left = _outliving(ranks)
        if left:
            return True, f"rank process(es) {left} outlived their launcher by {LAUNCHER_GRACE} s"
        return code != 0, None

    def _recover_killed(self, plan: TrialPlan, log: str) -> None:
        env = {**_knob_env(plan.knobs), faults.CRASH_ENV: plan.recover_crash_at}
        _finish(_launch(["recover", self.path], log, env), log)

    def _check(self, plan: TrialPlan) -> tuple[int | None, list[str]]:
        return check_recovery(self.path, self.references, self.config, export=export_run,
                              resume=functools.partial(self._resume, plan))

    def _resume(self, plan: TrialPlan, run: str, config: TrainConfig) -> int | None:
        """The same command again, unkilled: the batch it recovered every rank to (None: a fresh start)."""
        log = os.path.join(self.work, "resume.log")
        if os.path.exists(log):
            os.unlink(log)
        if _finish(_launch(train_args(run, config), log, _knob_env(plan.knobs)), log) != 0:
            raise CxlTrainError(f"the resumed run failed: {_tail(log)}")
        with open(log, errors="replace") as f:
            said = f.read()
        found = said.split("recovered every rank to batch ", 1)
        return int(found[1].split()[0]) if len(found) > 1 else None

    def replay_commands(self, plan: TrialPlan) -> list[str]:
        again = ["cxltrain", "crashtest", "--trials", "1", "--trial", str(plan.number), "--seed", str(self.seed),
                 *self._command_options()]
        lines = [shlex.join(again)]
        if plan.kind == "point":
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self._env(plan).items())
            lines.append(f"{env} {shlex.join(['cxltrain', *train_args('REPLAY', self.config)])} ; "
                         "cxltrain export REPLAY REPLAY.pt")
        kept = os.path.join(self.keep_dir, f"trial-{plan.number}.run")
        if os.path.exists(kept):
            lines.append(f"cxltrain recover {shlex.quote(kept)}   # the run folder as the kill left it")
        return lines

    def close(self) -> None:
        stop_launched()
        super().close()

    def _keep(self, plan: TrialPlan, kept: list[str], log: str) -> None:
        os.makedirs(self.keep_dir, exist_ok=True)
        _copy(kept[0], os.path.join(self.keep_dir, f"trial-{plan.number}.run"))
        _copy(log, os.path.join(self.keep_dir, f"trial-{plan.number}.log"))


def _wait_for_start(proc: subprocess.Popen, log: str) -> float:
    """Wait until rank 0 says training starts (or the launcher ends); returns that moment."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            if "rank(s): training from batch" in f.read():
                break
        time.sleep(0.05)
    return time.perf_counter()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it ended on its own first


def _outliving(ranks: list[int]) -> list[int]:
    """The ranks still alive LAUNCHER_GRACE s after their launcher ended (killed then, if any)."""
    deadline = time.monotonic() + LAUNCHER_GRACE
    while any(map(alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in ranks if alive(pid)]
    for pid in left:
        _kill(pid)
    return left

