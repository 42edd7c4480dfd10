"""The batch guards' state machine (checkpoint/guard.py), the no-checkpoint null object, and the
ordering strategies planted bugs select (checkpoint/ordering.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cxltrain
from cxltrain.checkpoint import Checkpointer, GuardState, NoCheckpoint, ordering
from cxltrain.errors import CheckpointError
from cxltrain.faults import DIST_PLANTED, PLANTED, Planted
from cxltrain.tables.bag import PersistentEmbeddingBag


class OneTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = PersistentEmbeddingBag(100, 4, name="t")


@pytest.mark.parametrize("checkpoint,guard_class", [("undo", Checkpointer), ("off", NoCheckpoint)])
def test_a_wrong_transition_is_refused_with_the_state_it_found(shm_dir, checkpoint, guard_class):
    model = OneTable()
    with cxltrain.Runtime(shm_dir / "g.pool", model, checkpoint=checkpoint) as rt:
        guard = rt._guard
        assert type(guard) is guard_class and guard.state is GuardState.IDLE
        with pytest.raises(CheckpointError, match="cannot end batch 0: the checkpoint guard is between batches"):
            guard.end_batch(0)  # nothing in flight
        guard.begin_batch(0)
        assert guard.state is GuardState.IN_BATCH
        with pytest.raises(CheckpointError, match="cannot begin batch 0: the checkpoint guard is in a batch"):
            guard.begin_batch(0)
        with pytest.raises(CheckpointError, match="cannot commit at batch 0"):
            guard.finish(0)
        model.table(torch.tensor([[1, 2]])).sum().backward()
        guard.end_batch(0)
        assert guard.state is GuardState.IDLE and guard.next_batch == 1
    assert guard.state is GuardState.DETACHED and model.table.checkpointer is None
    with pytest.raises(CheckpointError, match="the checkpoint guard is detached from its tables"):
        guard.begin_batch(1)


@pytest.mark.parametrize("checkpoint", ["undo", "off"])
def test_a_failed_update_stops_every_later_commit_even_when_caught(shm_dir, checkpoint, monkeypatch):
    """An update that raises after the guard let it store (here: out of memory in the kernel) may
    have stored rows or marked rows recorded: a caller that catches the error and goes on gets a
    clear refusal at the batch's end, and the pool stays at its last commit."""
    from cxltrain.runtime.runtime import export_state

    path = shm_dir / "f.pool"
    model = OneTable()
    real = PersistentEmbeddingBag.update_from_lookups

    def failing(self, *args, **kwargs):
        if rt.batch == 2:
            raise MemoryError("the kernel's sort buffer")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PersistentEmbeddingBag, "update_from_lookups", failing)
    with pytest.raises(CheckpointError, match="stopped by a failed update"):
        with cxltrain.Runtime(path, model, checkpoint=checkpoint) as rt:
            for b in rt.batches(lambda b: torch.tensor([[b, b + 1]]), stop=4):
                try:
                    model.table(b).sum().backward()
                except MemoryError:
                    pass  # the careless caller goes on
    if checkpoint == "undo":
        assert export_state(str(path))["batch"] == 2  # batches 0 and 1 committed, 2 never


def test_without_checkpoints_the_guard_is_a_null_checkpointer(shm_dir):
    with cxltrain.Runtime(shm_dir / "n.pool", OneTable(), checkpoint="off") as rt:
        assert rt.stats is None and rt.wait_durable() == 0.0
    with cxltrain.Runtime(shm_dir / "c.pool", OneTable()) as rt:
        assert rt.stats is not None and rt.wait_durable() == 0.0


def test_planted_bugs_select_orderings_and_combine():
    assert type(ordering.for_planted(())) is ordering.Ordering
    assert type(ordering.for_planted([Planted.ROOT_BEFORE_ENTRIES])) is ordering.Ordering  # the pool's own
    assert type(ordering.for_planted([Planted.COMMIT_BEFORE_ROWS])) is ordering.CommitBeforeRows
    every = ordering.for_planted(PLANTED + DIST_PLANTED)
    assert all(isinstance(every, cls) for cls in ordering.PLANTED_ORDERINGS.values())
    assert not every.flush_at_update and ordering.Ordering.flush_at_update
    assert not every.logs_cache_writes and ordering.Ordering.logs_cache_writes
