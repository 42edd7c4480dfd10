"""The first commit of a pool whose tables were just written, by whatever wrote them: a new pool
(Runtime), an import, a re-shard, or a run without the checkpointer making its pool consistent.

    for table in tables: table.persist()          # the caller's part: every table region durable
    first_commit(pool, batch, state.capture(batch))

After it, the pool recovers to `batch` like any committed pool: the dense snapshot sits in the slot
the root names, and the ring starts a new generation, so no undo record written before is live.
"""

from __future__ import annotations

from ..pool.handle import Pool
from . import dense


def first_commit(pool: Pool, batch: int, snapshot: dict) -> None:
    """Write `snapshot` (a DenseState.capture tree of `batch`) into the free dense slot, then the
    root naming it, `batch` and a fresh ring. The tables must be durable already."""
    slot = dense.free_slot(pool)
    dense.write_snapshot(pool, slot, batch, snapshot)
    # ORDERING: tables and the snapshot are durable before the root names them
    pool.commit(batches_done=batch, ring_generation=pool.root.ring_generation + 1, ring_start=0, ring_start_seq=0,
                dense_slot=slot, dense_batch=batch)
