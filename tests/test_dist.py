"""Distributed runs (docs/distributed.md): 2 ranks here, 4 behind `-m slow`.

Every run is launched by torchrun (`cxltrain train --nproc-per-node N`, or torch.distributed.run
itself) on loopback, with a port found free at run time (--standalone), a timeout on every
collective (--dist-timeout) and on every child process. A rank is killed by SIGKILL at a named
point between the ranks' commits (rank 1 dies before its root names batch 5, while rank 0 commits
it) or at a random moment; the group restarts (torchrun) or is recovered offline (`cxltrain
recover`/`export DIR`), and must equal an uninterrupted run bit for bit: at the agreed batch G,
and at the end. The planted bugs of faults.PlantedDist make the same check fail.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cxltrain.errors import ConfigError, RecoveryError
from cxltrain.faults import CRASH_ENV, CRASH_RANK_ENV, FAULT_ENV, CrashPoint, PlantedDist
from cxltrain.jobs.processes import children
from cxltrain.jobs.reshard import export_dir
from cxltrain.placement.sharding import DATA_PARALLEL, ROW_WISE, TABLE_WISE, make_plan, parse_kinds
from cxltrain.runtime import manifest as run_dir
from cxltrain.runtime.group_recovery import RankState, agree
from helpers import assert_same_export, cxltrain, shm_tempdir

STEPS, AT_G = 8, 4
# rank 1 dies before its 5th commit's root (batch 5); rank 0 commits batch 5: G = 4, rank 0 rolls back
BETWEEN_COMMITS = {CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:5", CRASH_RANK_ENV: "1"}
CHILD_TIMEOUT = 240


def options(steps: int, *more: str) -> list[str]:
    return ["--steps", str(steps), "--batch-size", "96", "--num-tables", "3", "--rows", "2000", "--dim", "16",
            "--sharding", "table-wise,row-wise,data-parallel", "--no-progress", "--dist-timeout", "30", *more]


def train(run, steps: int, ranks: int = 2, *more: str, env=None) -> subprocess.CompletedProcess:
    return cxltrain("train", "--nproc-per-node", ranks, "--pool", run, *options(steps, *more), env=env,
                    timeout=CHILD_TIMEOUT)


def torchrun(run, steps: int, ranks: int, restarts: int, env=None,
             monitor_s: float = 0.1) -> subprocess.CompletedProcess:
    """`cxltrain train` under torchrun, its agent looking at the ranks every `monitor_s` seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "--max-restarts", str(restarts), "--monitor-interval", str(monitor_s), "-m", "cxltrain", "train",
               "--pool", str(run), *options(steps)]
    return subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT,
                          env={**os.environ, **(env or {})})


def killed_between_commits(run, env=None) -> subprocess.CompletedProcess:
    """A 2-rank run, not restarted, whose rank 1 dies before its 5th commit's root: rank 0 at 5,
    rank 1 at 4. Rank 0 ends on the lost peer at batch 6's exchange, its 5th commit done; an agent
    looking every 0.1 s could SIGTERM it first, still in batch 5, leaving both at 4."""
    return torchrun(run, STEPS, 2, restarts=0, env={**BETWEEN_COMMITS, **(env or {})}, monitor_s=5)


def export(run) -> dict:
    """What `cxltrain export DIR` writes (its command line is tested once, below), in this process."""
    return export_dir(str(run))


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def references():
    """Uninterrupted runs on 2 (or 4) ranks: their exports at G and at the end, made once."""
    made = {}
    with shm_tempdir("cxltrain-dist-ref-") as folder:
        def reference(ranks: int = 2) -> dict:
            if ranks not in made:
                run = Path(folder) / f"run{ranks}"
                ok(train(run, AT_G, ranks))
                at_g = export(run)
                ok(train(run, STEPS, ranks))
                made[ranks] = {"at_g": at_g, "end": export(run)}
            return made[ranks]
        yield reference


@pytest.fixture
def reference(references):
    return references(2)


# ---------------------------------------------------------------------------------------------
# Plans and the manifest: in this process.
# ---------------------------------------------------------------------------------------------
def test_plans_follow_sizes_and_requests():
    plan = make_plan([100_000, 500, 90_000], 2)
    assert [t.kind for t in plan.tables] == [TABLE_WISE, DATA_PARALLEL, TABLE_WISE]
    assert plan.owners(0) == (0,) and plan.owners(2) == (1,) and plan.owners(1) == (0, 1)
    wide = make_plan([10_000, 10_000], 4)  # fewer tables than ranks: split row-wise
    assert {t.kind for t in wide.tables} == {ROW_WISE} and wide.rows_of(1, 3) == (7_500, 10_000)
    given = make_plan([2000] * 3, 2, parse_kinds("table-wise,row-wise,data-parallel", 3))
    assert [t.kind for t in given.tables] == [TABLE_WISE, ROW_WISE, DATA_PARALLEL]
    assert "t1: 2,000 rows, row-wise: rank 0 rows 0-999, rank 1 rows 1,000-1,999" in given.describe()
    with pytest.raises(ConfigError, match="leaves rank"):
        make_plan([100], 2, [TABLE_WISE])
    with pytest.raises(ConfigError, match="--sharding"):
        parse_kinds("table-wise,sideways", 2)


def test_the_manifest_refuses_another_world_size_plan_or_settings(tmp_path):
    plan = make_plan([2000] * 2, 2)
    m = run_dir.new(2, plan, {"seed": 0})
    run_dir.write(str(tmp_path), {**m, "state": run_dir.CREATED})
    for r in range(2):
        Path(run_dir.pool_path(str(tmp_path), r)).touch()
    read = run_dir.read(str(tmp_path))
    run_dir.check(str(tmp_path), read, 2, plan, {"seed": 0})
    with pytest.raises(RecoveryError, match="written by 2 rank"):
        run_dir.check(str(tmp_path), read, 3, None, None)
    with pytest.raises(RecoveryError, match="another sharding plan"):
        run_dir.check(str(tmp_path), read, 2, make_plan([2000] * 2, 2, [TABLE_WISE, ROW_WISE]), None)
    with pytest.raises(RecoveryError, match="other settings"):
        run_dir.check(str(tmp_path), read, 2, plan, {"seed": 1})
    os.unlink(run_dir.pool_path(str(tmp_path), 1))
    with pytest.raises(RecoveryError, match="rank 1's pool is missing"):
        run_dir.check(str(tmp_path), read, 2, plan, None)


def test_the_ranks_agree_on_the_lowest_target_or_all_refuse():
    assert agree([RankState(0, 6, 5), RankState(1, 5, 5)], "D") == 5
    assert agree([RankState(0, None, 0), RankState(1, None, 0)], "D") is None  # a fresh run
    with pytest.raises(RecoveryError, match="rank 0 cannot reach batch 4: its pool is at batch 6 and keeps undo "
                                            "records from batch 6 on"):
        agree([RankState(0, 6, 6), RankState(1, 4, 3)], "D")
    with pytest.raises(RecoveryError, match="rank 1: D/rank-1.pool: is not rank 1's pool"):
        agree([RankState(0, 6, 5), RankState(1, None, 0, "D/rank-1.pool: is not rank 1's pool of this run")], "D")
    with pytest.raises(RecoveryError, match="rank-1.pool: holds no committed checkpoint while rank 0's pool does"):
        agree([RankState(0, 6, 5), RankState(1, None, 0)], "D")


# ---------------------------------------------------------------------------------------------
# Kills, restarts, planted bugs.
# ---------------------------------------------------------------------------------------------
NAMED_POINTS = [f"{CrashPoint.DIST_BEFORE_AGREEMENT}:6", f"{CrashPoint.DIST_AFTER_LOCAL_COMMIT}:3",
                f"{CrashPoint.COMMIT_AFTER_ROOT}:4", f"{CrashPoint.UPDATE_MID}:7"]


@pytest.mark.parametrize("ranks,crash", [(2, None), pytest.param(4, None, marks=pytest.mark.slow),
                                         *(pytest.param(2, c, marks=pytest.mark.slow) for c in NAMED_POINTS)])
def test_torchrun_restart_after_a_kill_between_commits_is_bit_identical(references, shm_dir, ranks, crash):
    """Rank 1 SIGKILLed between the ranks' commits (or, slow, at other named points), under the
    power-loss model; torchrun restarts the group, which agrees on G, rolls rank 0 back past its
    own commit, and finishes."""
    run = shm_dir / "run"
    kill = {**BETWEEN_COMMITS, **({CRASH_ENV: crash} if crash else {})}
    done = ok(torchrun(run, STEPS, ranks, restarts=1, env={**kill, "CXLTRAIN_POWER_LOSS": "1"}))
    assert "recovered every rank to batch" in done.stdout, done.stdout
    if crash is None:
        assert f"recovered every rank to batch {AT_G}" in done.stdout, done.stdout
    out = shm_dir / "out.pt"
    ok(cxltrain("export", run, out, timeout=CHILD_TIMEOUT))
    assert_same_export(torch.load(out, weights_only=True), references(ranks)["end"])
    whole = io.BytesIO()
    torch.save(export_dir(str(run)), whole)
    assert out.read_bytes() == whole.getvalue()  # streamed a chunk at a time, the file of the whole dict


def test_an_error_in_a_rank_ends_the_group_without_a_restart(shm_dir):
    """A rank's own RuntimeError (planted in its step) is no lost peer: it ends the group with one
    line naming it, and torchrun's later attempts refuse with that line before joining, so
    training runs once and the bug is never run into again; a killed rank is restarted (above)."""
    done = torchrun(shm_dir / "run", STEPS, 2, restarts=2, env={FAULT_ENV: PlantedDist.ERROR_IN_STEP})
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert out.count("training from batch 0") == 1, out[-3000:]
    assert "rank 1: RuntimeError: planted error in the step of batch 1\n" in out, out[-3000:]
    # each of the 2 restarts: its ranks refuse with the same line, before joining. Each refuses on its
    # own, so the agent may SIGTERM the slower one before it gets there: one or two lines a restart
    refusals = out.count("planted error in the step of batch 1 (an earlier attempt's error: not retried)")
    assert 2 <= refusals <= 4, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("point", [CrashPoint.DIST_RECOVER_BEFORE_ROOT, CrashPoint.RECOVER_MID,
                                   CrashPoint.RECOVER_AFTER_ROOT])
def test_a_crash_during_the_group_recovery_is_repaired_by_recovering_again(reference, shm_dir, point):
    """`cxltrain recover DIR` killed inside a rank's roll-back to G (between records, before its root,
    after it), then recovered again by the export: exact at G."""
    run = shm_dir / "run"
    assert killed_between_commits(run).returncode != 0
    dying = cxltrain("recover", run, env={CRASH_ENV: point}, timeout=CHILD_TIMEOUT)
    assert dying.returncode == -signal.SIGKILL, dying.stderr
    assert_same_export(export(run), reference["at_g"])


@pytest.mark.parametrize("fault", [None, PlantedDist.RECLAIM_ABOVE_AGREED,
                                   pytest.param(PlantedDist.COMMIT_WITHOUT_AGREEMENT, marks=pytest.mark.slow)])
def test_recovery_to_g_is_exact_and_planted_bugs_are_caught(reference, shm_dir, fault):
    """No restart: `cxltrain export DIR` recovers the killed run offline. Exact at G without a bug;
    with one, it refuses (a rank cannot reach G) or its export differs."""
    run = shm_dir / "run"
    killed = killed_between_commits(run, {FAULT_ENV: fault} if fault else {})
    assert killed.returncode != 0
    if fault is None:
        assert_same_export(export(run), reference["at_g"])
        return
    try:
        state = export(run)
    except RecoveryError as e:
        assert "cannot reach batch" in str(e)
        return
    with pytest.raises(AssertionError):
        assert_same_export(state, reference["at_g"])


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(3))
def test_random_kill_then_torchrun_restart_is_bit_identical(reference, shm_dir, trial):
    seed = random.randrange(1 << 30)
    print(f"random kill seed {seed}")
    rng = random.Random(seed)
    run = shm_dir / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "2", "--monitor-interval", "0.1", "-m", "cxltrain", "train", "--pool", str(run),
               *options(STEPS)]
    env = {**os.environ, "CXLTRAIN_POWER_LOSS": str(trial % 2)}
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        time.sleep(3 + rng.random() * 4)
        ranks = children(agent.pid)
        if ranks:
            os.kill(rng.choice(ranks), signal.SIGKILL)
        out, _ = agent.communicate(timeout=CHILD_TIMEOUT)
    finally:
        agent.kill()
    assert agent.returncode == 0, out[-3000:]
    assert_same_export(export(run), reference["end"])


# ---------------------------------------------------------------------------------------------
# Export and import onto another world size.
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_import_onto_the_same_world_size_continues_bit_identical(reference, shm_dir):
    """Export at G, import into 2 ranks, continue: bit for bit the uninterrupted run (optimizer
    state included, or Adam's and Adagrad's next steps would differ)."""
    exported = shm_dir / "g.pt"
    torch.save(reference["at_g"], exported)
    run = shm_dir / "run"
    ok(cxltrain("import", exported, run, "--nproc-per-node", "2", *_import_options(), timeout=CHILD_TIMEOUT))
    assert_same_export(export(run), reference["at_g"])  # a round trip changes nothing
    ok(train(run, STEPS))
    assert_same_export(export(run), reference["end"])


@pytest.mark.parametrize("ranks", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_import_onto_another_world_size_changes_no_bit(reference, shm_dir, ranks):
    """An export imported into 1 or 3 ranks (re-planned: a table-wise table may move, a row-wise one
    is split anew) and exported again is the same state dict, bit for bit."""
    exported = shm_dir / "g.pt"
    torch.save(reference["at_g"], exported)
    run = shm_dir / "run"
    ok(cxltrain("import", exported, run, "--nproc-per-node", ranks, *_import_options(), timeout=CHILD_TIMEOUT))
    assert_same_export(export(run), reference["at_g"])


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 3])
def test_import_onto_another_world_size_continues_within_tolerance(reference, shm_dir, ranks):
    """Imported into 1 (or 3) ranks and continued, the run differs from the 2-rank one only by
    rounding: a mean over 96 samples is not the mean of two means of 48, nor are the tables'
    gradient sums added in the same order, and Adam and row-wise Adagrad divide by running norms
    that magnify such differences in small gradients."""
    exported = shm_dir / "g.pt"
    torch.save(reference["at_g"], exported)
    run = shm_dir / "run"
    ok(cxltrain("import", exported, run, "--nproc-per-node", ranks, *_import_options(), timeout=CHILD_TIMEOUT))
    ok(train(run, STEPS, ranks))
    continued, uninterrupted = export(run), reference["end"]
    assert continued["batch"] == uninterrupted["batch"] == STEPS
    for key, tensor in uninterrupted["model"].items():
        torch.testing.assert_close(continued["model"][key], tensor, rtol=0.05, atol=0.02, msg=key)


def _import_options() -> list[str]:
    return ["--batch-size", "96", "--num-tables", "3", "--rows", "2000", "--dim", "16", "--steps", str(STEPS),
            "--sharding", "table-wise,row-wise,data-parallel"]


# ---------------------------------------------------------------------------------------------
# Bad input: one line, non-zero, nothing written.
# ---------------------------------------------------------------------------------------------
def test_bad_starts_are_refused_in_one_line_with_nothing_written(shm_dir):
    run = shm_dir / "run"
    plan = make_plan([2000] * 3, 2, parse_kinds("table-wise,row-wise,data-parallel", 3))
    m = {**run_dir.new(2, plan, {}), "state": run_dir.CREATED}
    run_dir.write(str(run), m)
    before = sorted(os.listdir(run)), (run / run_dir.MANIFEST).read_bytes()
    for args, message in ((["--nproc-per-node", "3"], "written by 2 rank(s), this start has 3"),
                          (["--nproc-per-node", "2", "--sharding", "row-wise"], "another sharding plan"),
                          (["--nproc-per-node", "2", "--seed", "7"], "other settings"),
                          (["--nproc-per-node", "2", "--capacity-pool", str(shm_dir / "run.cap")],
                           "--capacity-pool is not supported by distributed runs")):
        done = cxltrain("train", "--pool", run, *_with(options(STEPS), args), timeout=CHILD_TIMEOUT)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert (sorted(os.listdir(run)), (run / run_dir.MANIFEST).read_bytes()) == before
    single = shm_dir / "single.pool"
    single.write_bytes(b"not a directory")
    done = cxltrain("train", "--pool", single, *_with(options(STEPS), ["--nproc-per-node", "2"]), timeout=CHILD_TIMEOUT)
    assert done.returncode != 0 and "is not a distributed run's directory" in done.stderr, done.stderr
    assert single.read_bytes() == b"not a directory"
    done = cxltrain("recover", run, timeout=CHILD_TIMEOUT)  # the rank pools are missing
    assert done.returncode != 0 and "rank 0's pool is missing" in done.stderr, done.stderr
    done = cxltrain("pool", "info", run, "--json", timeout=CHILD_TIMEOUT)
    assert done.returncode != 0 and json.loads(done.stdout)["world_size"] == 2


def _with(base: list[str], extra: list[str]) -> list[str]:
    """`base` options with those of `extra` replacing theirs."""
    out = list(base)
    for i in range(0, len(extra), 2):
        if extra[i] in out:
            out[out.index(extra[i]) + 1] = extra[i + 1]
        else:
            out += extra[i : i + 2]
    return out


def test_one_rank_exports_what_a_single_process_run_exports(shm_dir):
    """`train --nproc-per-node 1` (no launcher: one rank in this process) and plain `train` with the
    same options: the same plain state dict, key for key and bit for bit, which a single-process
    `cxltrain import` then takes as it is."""
    model = ["--steps", "3", "--batch-size", "96", "--num-tables", "2", "--rows", "500", "--dim", "8", "--no-progress"]
    ok(cxltrain("train", "--nproc-per-node", "1", "--pool", shm_dir / "run", *model, "--sharding", "table-wise",
                timeout=CHILD_TIMEOUT))
    ok(cxltrain("train", "--pool", shm_dir / "one.pool", *model, timeout=CHILD_TIMEOUT))
    ok(cxltrain("export", shm_dir / "one.pool", shm_dir / "one.pt", timeout=CHILD_TIMEOUT))
    assert_same_export(export(shm_dir / "run"), torch.load(shm_dir / "one.pt"))


ONE_RANK_THEN_THREADS = r"""
import json, os, sys
from cxltrain.cli.main import main
code = main(["train", "--nproc-per-node", "1", "--pool", sys.argv[1], *sys.argv[2:]])
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps({"code": code, "gloo_threads": [name for name in threads if "gloo" in name]}))
"""


def test_a_rank_leaves_no_gloo_thread_for_the_interpreters_exit(shm_dir):
    """Once a rank has trained, its group is gone with its threads. A group kept alive past
    destroy_process_group (by torch.distributed.nn.functional's `group=group.WORLD` defaults, read
    when torch first imports it, after the group exists) left gloo's threads to meet the
    interpreter's finalization, and now and then a rank aborted at its exit. A fresh interpreter:
    this one may have imported that module long ago."""
    model = ["--steps", "2", "--batch-size", "96", "--num-tables", "2", "--rows", "500", "--dim", "8", "--no-progress"]
    done = ok(subprocess.run([sys.executable, "-c", ONE_RANK_THEN_THREADS, str(shm_dir / "run"), *model],
                             capture_output=True, text=True, timeout=CHILD_TIMEOUT))
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": 0, "gloo_threads": []}
