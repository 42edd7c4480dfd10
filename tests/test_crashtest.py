"""`cxltrain crashtest`: the torture runs, reports K/N exact, and catches each planted bug.

The torture's trials are real child processes killed with SIGKILL under the emulated device's
power-loss model. Each planted bug (faults.PLANTED) breaks one persistence rule; the torture must
report a mismatch within 50 trials for each — the proof that its comparisons can fail.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from cxltrain import knobs
from cxltrain.faults import PLANTED, Planted
from cxltrain.jobs.crashtest import KINDS, DeviceModel, Torture
from helpers import cxltrain

CLI = ["crashtest", "--no-progress", "--json"]
SEED = 11


def crashtest(*args: str, keep=None) -> tuple[subprocess.CompletedProcess, dict]:
    done = cxltrain(*CLI, *args, *(["--keep", keep] if keep else []), timeout=600)
    assert "Traceback" not in done.stderr, done.stderr
    return done, json.loads(done.stdout.splitlines()[-1])


def test_every_kind_of_kill_recovers_exactly_with_early_write_back(shm_dir):
    done, report = crashtest("--trials", "6", "--seed", str(SEED), "--power-loss", "--evict-rate", "50000")
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["exact"] == report["trials"] == 6 and report["failures"] == []
    assert set(report["by_kind"]) == set(KINDS) and report["killed"] >= 4
    assert "early write-back 50,000 lines/s" in report["device_model"]
    assert "6/6 exact" in done.stdout


def test_a_stealing_set_resumed_before_a_re_placement_finds_room(shm_dir):
    """Set trial 433 of seed 3611 (a 64 KiB ring, a write-back every 3 batches): the run resumed at
    batch 4 met batch 8's re-placement, the largest records it had seen, with the ring full of redo
    records that only a write-back frees; it refused ("undo ring full") until a full ring made a
    stealing set write back (Checkpointer._finish_commit_for_room)."""
    done, report = crashtest("--mode", "set", "--power-loss", "--seed", "3611", "--trials", "1", "--trial", "433")
    assert done.returncode == 0 and report["exact"] == 1, done.stdout + done.stderr


def test_a_torture_without_a_terminal_says_how_far_it_is(shm_dir, monkeypatch, capsys):
    """Under nohup the bar is off, and a torture of hours said nothing until its end."""
    from cxltrain.cli import crashtest as crashtest_cli
    from cxltrain.cli import main

    monkeypatch.setattr(crashtest_cli, "LOG_EVERY_S", 0.0)  # a line after every trial
    assert main(["crashtest", "--trials", "2", "--seed", str(SEED)]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("crashtest: ")]
    assert [line.split(" trials/s")[0].rsplit(", ", 1)[0] for line in said] == [
        "crashtest: 1 of 2 trial(s) done, 1 exact", "crashtest: 2 of 2 trial(s) done, 2 exact"], said


def test_a_plan_runs_in_parts_from_first(shm_dir):
    """--first K runs trials K..N-1 of the seed's plan of N (a long torture split across runs)."""
    done, report = crashtest("--trials", "4", "--first", "3", "--seed", str(SEED))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 trial(s) (trials 3 to 3 of its plan)" in done.stdout
    assert report["trials"] == report["exact"] == report["asked"] == 1 and list(report["by_kind"]) == [KINDS[3]]


def test_a_trial_replays_with_the_same_plan():
    with knobs.override(threads=1):
        a = Torture(trials=20, device=DeviceModel(power_loss=True), seed=SEED)
        b = Torture(trials=1, device=DeviceModel(power_loss=True), seed=SEED, only=13)
        try:
            assert a.plan(13) == b.plan(13) and a.plan(13) != a.plan(14)
        finally:
            a.close()
            b.close()


# Where each planted bug is shown caught. The torture of one pool (below) catches the checkpointer's
# and the fused update's; that of a pool set (--mode set, below) the set's, the hot-row cache's and the
# steal protocol's. The rest need a kill the random plans rarely draw, and their own crash tests make
# it where the bug bites: the pool's root-before-entries is test_pool_crash's; window-never-cleared
# needs dense_every > 1 and a kill inside the window (test_checkpoint_crash); crashtest's DLRM has no
# max_norm (renorm-unlogged: test_max_norm); the set's recovery killed between its capacity writes and
# their sync (recovery-root-before-capacity-sync: test_cache); a commit killed while a held-back
# write-back is still syncing, at least one commit after it started (reclaim-before-write-back:
# test_pool_set).
SET_PLANTED = (Planted.SKIP_CAPACITY_SYNC, Planted.UNLOGGED_ADMISSION, Planted.CACHED_UPDATE_UNLOGGED,
               Planted.REDO_AFTER_COMMIT)
CAUGHT_ELSEWHERE = (Planted.ROOT_BEFORE_ENTRIES, Planted.WINDOW_NEVER_CLEARED, Planted.RENORM_UNLOGGED,
                    Planted.RECOVERY_ROOT_BEFORE_CAPACITY_SYNC, Planted.RECLAIM_BEFORE_WRITE_BACK)
SINGLE_PLANTED = tuple(f for f in PLANTED if f not in SET_PLANTED + CAUGHT_ELSEWHERE)
# in the default suite one planted bug per torture shows that it catches them (the suite's 10
# minutes; each is caught by its own crash test there too); -m slow runs every one
DEFAULT_PLANTED = (Planted.SKIP_UNDO_PERSIST, Planted.REDO_AFTER_COMMIT)


def test_every_planted_bug_has_a_crash_test_that_catches_it():
    """A bug planted for a rule is shown caught somewhere: a new one must be placed in a list above
    (two were once tortured in a mode where they could not bite)."""
    assert sorted(SINGLE_PLANTED + SET_PLANTED + CAUGHT_ELSEWHERE) == sorted(PLANTED)  # each in one list


@pytest.mark.parametrize("mode, fault", [
    pytest.param(mode, f, marks=() if f in DEFAULT_PLANTED else pytest.mark.slow)
    for mode, faults in (("single", SINGLE_PLANTED), ("set", SET_PLANTED)) for f in faults])
def test_planted_bug_is_caught_within_50_trials(mode, fault, tmp_path):
    done, report = crashtest("--mode", mode, "--trials", "50", "--seed", str(SEED), "--power-loss", "--plant", fault,
                             "--fail-fast", keep=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert report["exact"] < report["trials"] <= 50
    failing = report["failures"][0]["trial"]
    assert "differs; replay with:" in done.stdout and f"--trial {failing}" in done.stdout
    assert f"--plant {fault}" in done.stdout
    kept = [name for name in os.listdir(tmp_path) if name.endswith(".log")]
    assert kept == [f"trial-{failing}.log"]


def test_bad_arguments_are_one_line():
    for args in (["--trials", "0"], ["--evict-rate", "10"], ["--plant", "nonsense"], ["--domain", "eadr"],
                 ["--trials", "3", "--first", "3"], ["--first", "1", "--trial", "2"]):
        done = cxltrain(*CLI, *args, timeout=120)
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
