"""Several hosts (issue 34, item 2), simulated: two torchrun agents, one worker each, meeting at a
c10d rendezvous on 127.0.0.1 (cxltrain/jobs/agents.py). A clean run, its ranks' pools in a folder
each as on hosts that share no file system, equals the same run under one agent; a worker SIGKILLed
at a random moment costs exactly one group restart and the run ends bit-exact. The ranks must agree
on their attempt through the store (runtime/attempt.py): the agents' restart counts part after a
kill. tools/multi_agent_kills.py runs the kills many times."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading

import pytest

from cxltrain.jobs.agents import AgentsRun, run_agents
from cxltrain.jobs.reshard import export_dir
from cxltrain.runtime import manifest as run_dir
from cxltrain.runtime.attempt import agree_on_attempt
from helpers import assert_same_export, cxltrain, shm_tempdir

TRAIN = ["--steps", "120", "--batch-size", "96", "--num-tables", "3", "--rows", "2000", "--dim", "16",
         "--sharding", "table-wise,row-wise,data-parallel", "--no-progress", "--dist-timeout", "30"]
GROUP_STARTS = ("rank(s): training from batch", "rank(s): recovered every rank to batch")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def reference():
    """The same run under one agent (`train --nproc-per-node 2`), exported."""
    with shm_tempdir("cxltrain-agents-ref-") as folder:
        run = os.path.join(folder, "run")
        done = cxltrain("train", "--nproc-per-node", "2", "--pool", run, *TRAIN, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        yield export_dir(run)


def gathered(pools: list[str]) -> str:
    """The first folder, holding every rank's pool: copied there as from the other hosts."""
    for rank, pool in enumerate(pools):
        if pool != pools[0]:
            shutil.copy(run_dir.pool_path(pool, rank), run_dir.pool_path(pools[0], rank))
    return pools[0]


def assert_ended_well(run: AgentsRun, attempts: int) -> None:
    said = "\n".join(f"--- agent {i} (exit {code}):\n{out[-3000:]}"
                     for i, (code, out) in enumerate(zip(run.returncodes, run.outputs)))
    assert run.ok, said
    assert run.attempts == attempts, said
    starts = sum(line.count(start) for line in run.outputs for start in GROUP_STARTS)
    assert starts == attempts, said  # rank 0's own record: one line per group it opened and recovered
    assert "forcefully exiting via 9" not in said, said  # a SIGTERMed worker ended within the grace


def test_attempt_numbers_agree_and_never_repeat_whatever_an_earlier_attempt_left():
    """Rank 0 of a later attempt finds an earlier attempt's ask, answer and acknowledgement keys of
    rank 1 in the store, and rank 1 asks only after rank 0 answered the stale key."""
    import torch.distributed as dist

    store = dist.HashStore()
    numbers: dict = {}

    def rank(r: int, attempt: int) -> None:
        numbers[attempt, r] = agree_on_attempt(store, r, 2, timeout_s=30)

    for attempt in range(3):
        zero = threading.Thread(target=rank, args=(0, attempt))
        zero.start()
        threading.Event().wait(0.2)  # rank 1 of this attempt comes late: rank 0 meets the stale keys first
        rank(1, attempt)
        zero.join(timeout=30)
    assert [numbers[a, 0] for a in range(3)] == [numbers[a, 1] for a in range(3)] == [1, 2, 3], numbers


def assert_a_folder_per_host(pools: list[str]) -> None:
    """Each host's folder: its own rank's pool and the same manifest, created."""
    for rank, pool in enumerate(pools):
        assert sorted(os.listdir(pool)) == [run_dir.MANIFEST, f"rank-{rank}.pool"], os.listdir(pool)
    copies = [json.load(open(os.path.join(pool, run_dir.MANIFEST))) for pool in pools]
    assert copies[0] == copies[1] and copies[0]["state"] == run_dir.CREATED


@pytest.mark.slow
def test_two_agents_in_folders_of_their_own_equal_one_agent(reference, shm_dir):
    pools = [str(shm_dir / "host-0"), str(shm_dir / "host-1")]
    run = run_agents(pools, TRAIN, timeout_s=TIMEOUT_S)
    assert_ended_well(run, attempts=1)
    assert_a_folder_per_host(pools)
    assert_same_export(export_dir(gathered(pools)), reference)


@pytest.mark.parametrize("trial", [
    pytest.param((1, False, 0), id="rank1-separate-folders"),
    pytest.param((0, True, 1), id="rank0-shared-folder", marks=pytest.mark.slow),
    pytest.param((1, True, 2), id="rank1-shared-folder", marks=pytest.mark.slow),
])
def test_a_worker_killed_at_a_random_moment_costs_one_restart_and_ends_exact(reference, shm_dir, trial):
    victim, shared, seed = trial
    kill_after = random.Random(seed).uniform(0.0, 2.0)
    print(f"seed {seed}: rank {victim} killed {kill_after:.2f} s into training")
    pools = [str(shm_dir / "run")] * 2 if shared else [str(shm_dir / "host-0"), str(shm_dir / "host-1")]
    run = run_agents(pools, TRAIN, kill_after=kill_after, victim=victim, timeout_s=TIMEOUT_S)
    assert run.killed is not None, run.outputs
    assert_ended_well(run, attempts=2)
    if not shared:
        assert_a_folder_per_host(pools)
    assert_same_export(export_dir(gathered(pools)), reference)
