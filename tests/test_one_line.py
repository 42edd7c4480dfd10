"""A refused `cxltrain train` says why in one line on stderr, with nothing before it: no banner on
stdout (it is printed once the pool is open and recovered), and it writes nothing."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import cxltrain

TEARDOWN = "terminate called without an active exception"
SMALL = ("--steps", "2", "--rows", "500", "--dim", "8", "--num-tables", "2", "--batch-size", "32", "--no-progress")


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A pool that holds a small model, committed at batch 2."""
    folder = tmp_path_factory.mktemp("one-line")
    pool = folder / "done.pool"
    done = cxltrain("train", "--pool", pool, *SMALL)
    assert done.returncode == 0, done.stderr
    return pool


def not_a_pool(folder):
    path = folder / "junk.pool"
    path.write_bytes(os.urandom(1 << 16))
    return path


CASES = {
    "another model in the pool": lambda c, d: ("--pool", c, *SMALL[:-1], "--dim", "16", "--no-progress"),
    "another seed in the pool": lambda c, d: ("--pool", c, *SMALL, "--steps", "4", "--seed", "7"),
    "checkpoint off on committed batches": lambda c, d: ("--pool", c, *SMALL, "--steps", "4", "--checkpoint", "off"),
    "a file that is not a pool": lambda c, d: ("--pool", not_a_pool(d), *SMALL),
    "a folder that does not exist": lambda c, d: ("--pool", d / "no" / "such" / "p.pool", *SMALL),
    "a data file that does not exist": lambda c, d: ("--pool", d / "p.pool", "--data", d / "none.txt", *SMALL),
    "epochs without data": lambda c, d: ("--pool", d / "p.pool", *SMALL, "--epochs", "2"),
    "a device cache on the cpu": lambda c, d: ("--pool", d / "p.pool", *SMALL, "--device-cache-rows", "5"),
    "a host cache without a capacity pool": lambda c, d: ("--pool", d / "p.pool", *SMALL, "--cache-rows", "5"),
    "zero rows": lambda c, d: ("--pool", d / "p.pool", *SMALL, "--rows", "0"),
    "a metrics file in a folder that does not exist":
        lambda c, d: ("--pool", d / "p.pool", *SMALL, "--metrics", d / "no" / "m.jsonl"),
    "a metrics file that is a folder": lambda c, d: ("--pool", d / "p.pool", *SMALL, "--metrics", d),
    "more memory than there is, on 2 ranks":
        lambda c, d: ("--nproc-per-node", "2", "--pool", d / "run", "--batch-size", "100000000", "--no-progress"),
}
if not torch.cuda.is_available():
    CASES["a GPU that is not there"] = lambda c, d: ("--pool", d / "p.pool", *SMALL, "--device", "cuda")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refused_train_is_one_line(committed, tmp_path, case):
    before = committed.read_bytes()
    done = cxltrain("train", *CASES[case](committed, tmp_path), timeout=120)
    assert done.returncode != 0
    assert done.stdout == "", done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cxltrain") and "error: " in lines[0], done.stderr
    assert committed.read_bytes() == before            # the refused run wrote nothing
    assert set(os.listdir(tmp_path)) <= {"junk.pool"}  # no pool, run directory or metrics file


def test_pool_info_refuses_what_pool_check_refuses(committed, tmp_path):
    """A row made NaN: `pool check` finds it; `pool info` must not list the pool as if it were sound."""
    import shutil

    import numpy as np

    from cxltrain.pool.handle import Pool

    path = tmp_path / "nan.pool"
    shutil.copy(committed, path)
    with Pool.open(str(path)) as pool:
        pool.array("t0.weight")[7, 3] = np.nan
        pool.persist_region("t0.weight")
    for command in ("check", "info"):
        done = cxltrain("pool", command, path)
        assert done.returncode == 1 and done.stdout == "", (command, done.stdout)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "row 7 holds a non-finite value" in lines[0], (command, done.stderr)


DIST = ("--nproc-per-node", "2", *SMALL)


@pytest.fixture(scope="module")
def damaged_run(tmp_path_factory):
    """A 2-rank run committed at batch 2, its rank 1 pool's superblock then damaged."""
    folder = tmp_path_factory.mktemp("one-line-run") / "run"
    assert cxltrain("train", "--pool", folder, *DIST).returncode == 0
    with open(folder / "rank-1.pool", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    return folder


def test_a_rank_refusal_under_torchrun_is_one_line(damaged_run):
    """A rank's pool damaged: the ranks refuse, torchrun restarts them, and the user sees one line."""
    folder = damaged_run
    done = cxltrain("train", "--pool", folder, *DIST[:-1], "--steps", "4", "--no-progress")
    assert done.returncode == 1 and done.stdout == "", done.stdout
    # A rank torn down under load may have its C++ runtime print "terminate called without an active
    # exception" (a thread of torch's still joinable at exit): not ours to word, left out here.
    lines = [line for line in done.stderr.strip().splitlines() if line != TEARDOWN]
    assert lines == [f"cxltrain: error: rank 1: {folder / 'rank-1.pool'}: superblock checksum mismatch"], done.stderr


def test_pool_info_refuses_a_damaged_run_directory_in_one_line(damaged_run):
    """`pool info DIR` listed the run and its ranks before the problem; now the problem alone."""
    done = cxltrain("pool", "info", damaged_run)
    assert done.returncode == 1 and done.stdout == "", done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank-1.pool: superblock checksum mismatch" in lines[0], done.stderr


@pytest.mark.parametrize("sent,code,said", [("SIGTERM", 143, "terminated (SIGTERM)"), ("SIGINT", 130, "interrupted")])
def test_a_signal_to_the_launcher_is_one_line_and_the_run_resumes(tmp_path, sent, code, said):
    """SIGTERM (or Ctrl-C) to `train --nproc-per-node 2` once its ranks train: torchrun's agent
    passes it to the ranks and re-raises it, which reached the user as a traceback (SIGTERM) and a
    line from every rank."""
    import signal
    import subprocess

    from helpers import cxltrain_command

    folder = tmp_path / "run"
    steps = ("--nproc-per-node", "2", "--steps", "100000", *SMALL[2:])
    launcher = subprocess.Popen(cxltrain_command() + ["train", "--pool", str(folder), *steps], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in launcher.stdout:
            if "training from batch" in line:
                break
        launcher.send_signal(getattr(signal, sent))
        out, err = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    assert launcher.returncode == code, err
    lines = [line for line in err.strip().splitlines() if line != TEARDOWN]
    assert lines == [f"cxltrain: {said}; the run resumes from its last committed batch"], err
    resumed = cxltrain("train", "--pool", folder, *DIST)
    assert resumed.returncode == 0 and "every rank's pool is committed at batch" in resumed.stdout, resumed.stderr


def test_a_rank_killed_by_a_signal_is_named_not_the_peer_that_lost_it(tmp_path):
    """Rank 1 SIGKILLed (an out-of-memory kill, say), no restart: the line rank 0 wrote says only that
    a collective failed; the launcher names the killed rank first (before: rank 0's line alone)."""
    from cxltrain.faults import CRASH_ENV, CRASH_RANK_ENV, CrashPoint

    folder = tmp_path / "run"
    done = cxltrain("train", "--pool", folder, *DIST, "--max-restarts", "0",
                    env={CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:1", CRASH_RANK_ENV: "1"})
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if line != TEARDOWN]
    assert len(lines) == 1 and lines[0].startswith("cxltrain: error: rank 1 was killed by SIGKILL"), done.stderr
    assert "(--max-restarts 0); the same command resumes" in lines[0], done.stderr


def test_the_launchers_line_for_each_way_a_group_ends():
    from cxltrain.jobs.lifeline import failure_line

    peer = "cxltrain: error: rank 0: a collective failed (...); a peer died or hangs — no restart is left"
    refused = "cxltrain: error: rank 1: /p/rank-1.pool: superblock checksum mismatch"
    # a rank killed: named, whatever its peers wrote; the agent's SIGTERM to the others is no cause
    assert failure_line({0: -15, 1: -9}, [peer], 0).startswith("cxltrain: error: rank 1 was killed by SIGKILL (")
    assert failure_line({0: 143, 1: -11}, [], 2).startswith("cxltrain: error: rank 1 was killed by SIGSEGV, and no "
                                                            "restart was left (--max-restarts 2)")
    # a rank's own error: its line, even where a peer's echo of it was written first
    assert failure_line({0: -15, 1: 1}, [peer, refused, peer], 3) == refused
    assert failure_line({0: 1, 1: 143}, [peer], 3) == peer
    # nothing written, nothing killed: the rank that failed, not one the agent stopped after it
    assert failure_line({1: 3, 0: 143}, [], 1) == ("cxltrain: error: rank 1 exited with status 3 (2 rank(s) "
                                                   "failed, after 1 restart(s) at most)")
    # every rank SIGTERMed, by no agent (it stops ranks only after a failure): from outside
    assert failure_line({0: 143, 1: -15}, [], 0).startswith("cxltrain: error: the ranks were terminated (SIGTERM) "
                                                            "from outside their launcher, and no restart was left")
