"""Pool metadata survives a process killed anywhere: at named points and at random moments.

A child process creates a pool and then, round after round, adds two regions in one call and
commits. After it is killed (SIGKILL), the pool must open and show a state some prefix of the
rounds produced: regions in whole pairs, and a root that counts only complete entries. The first
test shows the check catches a planted bug (the root written before the entries it counts).

Only the named crash point catches that bug: with it planted, 0 of 30 random kills landed in its
window, which under SIGKILL is the few microseconds between two stores (measured when this test was
written). Random kills are there to find windows nobody named.
"""

from __future__ import annotations

import random
import signal
import sys

import pytest

from cxltrain.errors import NotAPoolError, PoolError
from cxltrain.faults import CRASH_ENV, FAULT_ENV
from cxltrain.pool.handle import Pool
from cxltrain.pool.info import inspect
from helpers import run_and_kill

CHILD = """
import sys
from cxltrain.pool.handle import Pool, RegionSpec
from cxltrain.pool.format import RegionKind
pool = Pool.create(sys.argv[1], 64 << 20, dir_capacity=16384)
print("created", flush=True)
for i in range(int(sys.argv[2])):
    pool.add_regions([RegionSpec(f"r{i}a", RegionKind.BLOB, "uint8", (4096,)),
                      RegionSpec(f"r{i}b", RegionKind.BLOB, "uint8", (4096,))])
    pool.commit(batches_done=i)
pool.close()
print("done", flush=True)
"""


def run_child(path, rounds, env=None, kill_after=None):
    """Run the child; with kill_after, SIGKILL it that many seconds after its pool exists.
    Returns its exit code."""
    cmd = [sys.executable, "-c", CHILD, str(path), str(rounds)]
    return run_and_kill(cmd, env=env, kill_after=kill_after, ready_lines=1, timeout=120).returncode  # "created"


def crashed_pool_problem(path) -> str | None:
    """None if the pool is a state some prefix of the child's rounds produced; else what is wrong."""
    try:
        with Pool.open(str(path), writable=False) as pool:
            names, batch = list(pool.regions), pool.root.batches_done
    except NotAPoolError as e:
        return None if "interrupted" in str(e) else f"refused: {e}"  # killed inside Pool.create
    except PoolError as e:
        return f"refused: {e}"
    pairs = len(names) // 2
    expected = [f"r{i}{half}" for i in range(pairs) for half in "ab"]
    if names != expected:
        return f"regions {names} are not whole pairs in order"
    if batch not in (pairs - 1, pairs - 2) or (pairs == 0 and batch != -1):
        return f"root says batch {batch} with {pairs} pairs"
    if not inspect(str(path)).ok:
        return "pool check disagrees with open"
    return None


def test_check_catches_the_planted_root_before_entries_bug(shm_dir):
    path = shm_dir / "planted.pool"
    env = {FAULT_ENV: "root-before-entries", CRASH_ENV: "add-regions:between:3"}
    assert run_child(path, 10, env) == -signal.SIGKILL
    problem = crashed_pool_problem(path)
    assert problem is not None and "directory entry" in problem, problem


@pytest.mark.parametrize("point,pairs,batch", [
    ("create:before-superblock", None, None),
    ("add-regions:between:1", 0, -1),
    ("add-regions:between:3", 2, 1),
    ("commit:torn-root:1", None, None),    # the very first root, inside create
    ("commit:torn-root:4", 1, 0),          # round 1's add: the slot holding round 0's add is torn
    ("commit:torn-root:5", 2, 0),          # round 1's commit
])
def test_crash_at_named_points(shm_dir, point, pairs, batch):
    path = shm_dir / "named.pool"
    assert run_child(path, 10, {CRASH_ENV: point}) == -signal.SIGKILL
    assert crashed_pool_problem(path) is None
    if pairs is None:
        with pytest.raises(NotAPoolError, match="interrupted"):
            Pool.open(str(path))
        return
    with Pool.open(str(path), writable=False) as pool:
        assert len(pool.regions) == 2 * pairs and pool.root.batches_done == batch
    if point.startswith("commit:torn-root"):
        assert any(s.state == "corrupt" for s in inspect(str(path)).slots)  # the tear was seen, and ignored


def test_uninterrupted_child_completes(shm_dir):
    path = shm_dir / "whole.pool"
    assert run_child(path, 10) == 0
    with Pool.open(str(path), writable=False) as pool:
        assert len(pool.regions) == 20 and pool.root.batches_done == 9


@pytest.mark.parametrize("trial", range(12))
def test_killed_at_a_random_moment(shm_dir, trial):
    seed = random.SystemRandom().randrange(1 << 32)
    delay = random.Random(seed).uniform(0.0, 0.4)  # 6000 rounds take about 1.5 s
    print(f"seed={seed} kill {delay:.3f}s after creation")
    path = shm_dir / "random.pool"
    assert run_child(path, 6000, kill_after=delay) == -signal.SIGKILL, "the child finished before the kill"
    assert crashed_pool_problem(path) is None, f"seed={seed}"
