"""A user's own model under torchrun (cxltrain/runtime/group.py): the example of docs/distributed.md,
run as written by `python -m torch.distributed.run` on 2 ranks (loopback, a free port found at run
time, a timeout on every collective and on the child). Rank 1 is killed by SIGKILL before its
commit of batch 5 reaches the root (rank 0 commits it: G = 4), torchrun restarts the group, and
every rank's pool must end bit-identical to an uninterrupted run (`-m slow`; the default suite checks
the ranks recover to G and agree); a planted bug makes either fail.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cxltrain.faults import CRASH_ENV, CRASH_RANK_ENV, FAULT_ENV, CrashPoint, PlantedDist
from cxltrain.runtime.runtime import export_state
from helpers import assert_same_export

DOC = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"
STEPS, RANKS, CHILD_TIMEOUT = 8, 2, 120
BETWEEN_COMMITS = {CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:5", CRASH_RANK_ENV: "1"}


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    """The docs' example, as written, in a file of its own."""
    blocks = re.findall(r"```python\n(# my_train\.py.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/distributed.md lost its torchrun example"
    path = tmp_path_factory.mktemp("user") / "my_train.py"
    path.write_text(blocks[0])
    return path


def start(script: Path, run: Path, restarts: int, env=None) -> subprocess.Popen:
    """The script on RANKS ranks under torchrun. Its agent looks at them every 5 s: rank 1 killed
    before its 5th commit's root, rank 0 meets the lost peer by itself with its 4th commit (and 5th)
    done; an agent looking every 0.1 s could SIGTERM it first, its 4th still in flight (G = 3)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               "--max-restarts", str(restarts), "--monitor-interval", "5", str(script), str(run), str(STEPS)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def finish(agent: subprocess.Popen) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a torchrun started by start(), killed whole past the timeout."""
    try:
        out, err = agent.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.communicate()
        raise
    return agent.returncode, out + err


def ends(run: Path) -> list[dict]:
    return [export_state(str(run / f"rank-{r}.pool")) for r in range(RANKS)]


def test_own_model_restarted_by_torchrun_after_a_kill_recovers_every_rank_to_g(script, shm_dir):
    """The default suite's cheaper variant (one torchrun): both ranks restart at G = 4 (rank 0 rolls
    its batch 5 back), finish, and hold the same replicated state (head, the copied table). A planted
    bug (U3b broken) makes the restart refuse, which fails it."""
    run = shm_dir / "run"
    status, out = finish(start(script, run, 1, BETWEEN_COMMITS))
    assert status == 0, out[-3000:]
    assert "rank 0: from batch 4" in out and "rank 1: from batch 4" in out, out[-3000:]
    rank0, rank1 = ends(run)
    assert rank0["batch"] == rank1["batch"] == STEPS
    for key in ("head.weight", "head.bias", "small.weight", "small.optimizer_state"):
        assert torch.equal(rank0["model"][key], rank1["model"][key]), key
    assert repr(rank0["optimizers"]) == repr(rank1["optimizers"])


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, PlantedDist.RECLAIM_ABOVE_AGREED])
def test_own_model_restarted_by_torchrun_after_a_kill_is_bit_identical(script, shm_dir, fault):
    """The uninterrupted run and the killed one side by side (two torchruns at once: their
    processes spend most of their time importing torch)."""
    uninterrupted, run = shm_dir / "uninterrupted", shm_dir / "run"
    kill = {**BETWEEN_COMMITS, **({FAULT_ENV: fault} if fault else {})}
    agents = [start(script, uninterrupted, 0), start(script, run, 1, kill)]
    (status, out), (killed_status, killed_out) = [finish(a) for a in agents]
    assert status == 0, out[-3000:]
    reference = ends(uninterrupted)
    if fault is None:
        assert killed_status == 0, killed_out[-3000:]
        assert "rank 1: from batch 0" in killed_out and "rank 1: from batch 4" in killed_out, killed_out
        for mine, theirs in zip(ends(run), reference):
            assert_same_export(mine, theirs)
        return
    if killed_status != 0:  # the restart refused: a rank's ring no longer reaches G
        assert "cannot reach batch" in killed_out, killed_out[-3000:]
        return
    with pytest.raises(AssertionError):
        for mine, theirs in zip(ends(run), reference):
            assert_same_export(mine, theirs)
