"""A group whose ranks keep their tables in stealing pool sets (docs/distributed.md, docs/tiers.md
"Steal, no force"): tests/dist_set_train.py on 2 ranks under torchrun, every rank's capacity pool
on the disk under the capacity crash model (a page write not synced is lost with the process),
capacity pages written back every 3 batches. Rank 1 is SIGKILLed between the ranks' commits, or
inside a write-back; torchrun restarts the group, which rolls a rank ahead of G back past its own
commits (and its own write-back) by redoing the redo records below G and undoing the batches at or
above it; every rank's pool must end bit-identical to an uninterrupted run's. Seconds per run:
behind `-m slow`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cxltrain.errors import RecoveryError
from cxltrain.faults import CRASH_ENV, CRASH_RANK_ENV, CrashPoint
from cxltrain.runtime.group_recovery import recover_dir
from cxltrain.runtime.runtime import export_state
from helpers import assert_same_export, cxltrain, tier_folders

SCRIPT = Path(__file__).with_name("dist_set_train.py")
STEPS, RANKS, EVERY, CHILD_TIMEOUT = 8, 2, 3, 180
STEALING = {"CXLTRAIN_CAPACITY_CRASH": "1", "CXLTRAIN_WRITE_BACK_EVERY": str(EVERY)}


def torchrun(run: str, disk: str, restarts: int, env=None, status: int = 0, steps: int = STEPS) -> str:
    """stdout + stderr of the group trained to `steps` (its status checked)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(SCRIPT), run, disk, str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT,
                          env={**os.environ, **STEALING, **(env or {})})
    out = done.stdout + done.stderr
    assert (done.returncode == 0) == (status == 0), out[-3000:]
    return out


def made(fast: str, disk: str, name: str) -> tuple[str, str]:
    """(the run directory, the folder of its capacity pools) of a new run called `name`."""
    os.makedirs(os.path.join(disk, name))
    return os.path.join(fast, name), os.path.join(disk, name)


def ends(run: str) -> list[dict]:
    return [export_state(os.path.join(run, f"rank-{r}.pool")) for r in range(RANKS)]


@pytest.fixture(scope="module")
def folders():
    with tier_folders("cxltrain-dist-sets-") as found:
        yield found


@pytest.fixture(scope="module")
def reference(folders):
    run, capacity = made(*folders, "reference")
    out = torchrun(run, capacity, 0)
    assert out.count(f"write-back every {EVERY}") == RANKS, out[-3000:]  # the ranks' sets steal
    return ends(run)


# rank 1 dies before the root of its 5th commit (batch 5), which rank 0 makes durable: G = 4, and
# rank 0 rolls back past its own commit, between its write-backs (at 3 and 6). Rank 1 killed right
# after the sync of its first write-back (batch 3), its root not written: G = 2, and rank 0, which
# wrote back at 3 as well, rolls back past its own write-back.
@pytest.mark.slow
@pytest.mark.parametrize("point, at_g", [(f"{CrashPoint.COMMIT_BEFORE_ROOT}:5", 4),
                                         (f"{CrashPoint.COMMIT_AFTER_WRITE_BACK}:1", 2)])
def test_a_stealing_group_killed_between_commits_ends_bit_identical(folders, reference, point, at_g):
    run, capacity = made(*folders, re.sub(r"\W", "-", point))
    out = torchrun(run, capacity, 1, {CRASH_ENV: point, CRASH_RANK_ENV: "1"})
    assert out.count(f"write-back every {EVERY}") == 2 * RANKS, out[-3000:]  # killed once, restarted once
    assert all(f"rank {r}: from batch {at_g}," in out for r in range(RANKS)), out[-3000:]
    for mine, theirs in zip(ends(run), reference):
        assert_same_export(mine, theirs)


@pytest.mark.slow
def test_a_rank_ahead_of_g_is_never_recovered_alone(folders):
    """Rank 1 killed before its root of batch 5, no restart: rank 0's pool is at 5, with redo
    records to apply (a stealing rank's always are), rank 1's at 4. Exporting rank 0's pool alone
    is refused before anything is written (U3e). Recovered in place to its own batch (a new ring
    generation), its ring would hold nothing to roll back: the group's recovery would then take it
    to G = 4 restoring no record, its rows still at 5. The run directory recovers exactly to G."""
    run, capacity = made(*folders, "alone")
    torchrun(run, capacity, 0, {CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:5", CRASH_RANK_ENV: "1"}, status=1)
    with pytest.raises(RecoveryError, match="rank 1's dense slice is of batch 4, rank 0's of batch 5"):
        export_state(os.path.join(run, "rank-0.pool"))
    refused = cxltrain("recover", os.path.join(run, "rank-0.pool"))
    assert refused.returncode != 0 and "is one rank's pool of the distributed run in" in refused.stderr, refused
    recovered = recover_dir(run)
    assert [(r.target, r.batch) for r in recovered] == [(5, 4), (4, 4)] and recovered[0].records_restored > 0
    at_g, capacity = made(*folders, "at-g")
    torchrun(at_g, capacity, 0, steps=4)
    for mine, theirs in zip(ends(run), ends(at_g)):
        assert_same_export(mine, theirs)
