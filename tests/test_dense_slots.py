"""Dense slots (cxltrain.checkpoint.dense): the slots' size against the dense state, and snapshots
taken every k batches in relaxed mode, with the roots that name them flagged."""

from __future__ import annotations

import pytest

from cxltrain.errors import CheckpointError
from cxltrain.pool import Pool
from cxltrain.pool_format import ROOT_RELAXED
from cxltrain.runtime import recover_pool
from test_runtime import train_steps


def test_relaxed_mode_snapshots_the_dense_state_every_k_and_flags_its_roots(shm_dir):
    rt, _ = train_steps(shm_dir / "p.pool", 7, dense_every=3, mode="relaxed")
    # a commit per batch, snapshots at 3 and 6; leaving commits batch 7 again, with its snapshot
    assert (rt.stats.commits, rt.stats.snapshots) == (8, 3)
    with Pool.open(str(shm_dir / "p.pool"), writable=False) as pool:
        assert pool.root.flags == ROOT_RELAXED and pool.root.dense_batch == 7
    with pytest.raises(KeyboardInterrupt):
        train_steps(shm_dir / "p.pool", 12, fail_at=11, dense_every=3, mode="relaxed")
    report = recover_pool(str(shm_dir / "p.pool"))
    assert (report.batch, report.dense_batch, report.dense_lag) == (11, 10, 1)


def test_dense_slots_too_small_say_how_big_they_are(shm_dir):
    with pytest.raises(CheckpointError, match=r"does not fit the pool's dense slots \(4,032 bytes\)"):
        train_steps(shm_dir / "p.pool", 1, dense_slot_bytes=4096)
    assert not (shm_dir / "p.pool").exists()
