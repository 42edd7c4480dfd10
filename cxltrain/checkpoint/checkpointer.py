"""The checkpointer: every batch durable (DESIGN §4, strict mode), driven from the training thread.

Per batch b, for each table it looks up with gradients:

    forward of b    capture: the table's rows R(b) as they are now (after b-1's update, U4) go into
                    the undo ring, durable before forward returns (U1)
    backward of b   the fused optimizer updates R(b) in place in the pool
    end of b        when a dense snapshot is due: persist every row updated since the last commit
                    and the snapshot (U2), write the root naming batch b+1 as the recovery target,
                    then reclaim the undo records it covers (U3)

With dense_every = k a snapshot (and so a commit) is due every k batches; records are kept back to
the last one, so recovery is exact either way. When the ring has no room for another batch like the
largest seen so far, the snapshot is taken early rather than letting the next capture fail: the
time that costs is the training thread's wait for the ring, and is counted as such.

The protocol rules are each enforced at one line: U1 in ring.UndoRing.append, U2 and U3 in
Checkpointer._commit, U4 in Checkpointer.capture.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..errors import CheckpointError
from ..faults import crash_point, planted
from ..pool import Pool
from . import codec, dense
from .ring import RingFull, UndoRing


@dataclasses.dataclass
class CheckpointStats:
    """Running totals of the checkpointer's work."""

    batches: int = 0                 # batches ended
    commits: int = 0                 # roots written (one per dense snapshot)
    capture_seconds: float = 0.0     # U1: gathering old rows into the ring and persisting them
    commit_seconds: float = 0.0      # U2 + commit: persisting rows and the snapshot, writing the root
    undo_bytes: int = 0              # ring bytes written
    dense_bytes: int = 0             # encoded snapshot bytes written
    rows_persisted: int = 0          # table rows flushed at commits
    ring_full_commits: int = 0       # snapshots taken early because the ring was nearly full
    ring_wait_seconds: float = 0.0   # time those early snapshots cost the training thread

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class BatchGuard:
    """Keeps in-place table updates inside batches: a table looked up with gradients outside a
    batch, or updated in a batch other than the one that looked it up, is refused before any store.
    With the checkpointer off it is all there is: the first in-place change makes the pool's root
    stop vouching for the tables (batch -1), so a crash before the final commit means starting over.
    """

    def __init__(self, pool: Pool, tables: list) -> None:
        self.pool, self.tables = pool, tables
        self._batch: int | None = None   # the batch in flight
        self._next = pool.root.batch     # the batch expected next
        self.touched = False             # the batch in flight has looked up a table with gradients
        for table in tables:
            table.checkpointer = self

    def detach(self) -> None:
        for table in self.tables:
            table.checkpointer = None

    @property
    def in_flight(self) -> int | None:
        """The batch begun and not yet ended, if any."""
        return self._batch

    @property
    def next_batch(self) -> int:
        """The batch that begins next: batches done so far."""
        return self._next

    def begin_batch(self, batch: int) -> None:
        if batch != self._next:
            raise CheckpointError(f"batch {batch} out of order: the next batch is {self._next}")
        self._batch = batch
        self.touched = False

    def abort_batch(self) -> None:
        """The batch in flight did nothing (no table looked up with gradients): forget it."""
        if self.touched:
            raise CheckpointError(f"batch {self._batch} has already changed the tables")
        self._batch = None

    def _check_in_batch(self, table) -> int:
        if self._batch is None:
            raise CheckpointError(f"table {table.name!r} was looked up with gradients outside a batch of "
                                  "rt.batches(): its update could not be undone after a crash "
                                  "(use torch.no_grad() for evaluation)")
        self.touched = True
        return self._batch

    def capture(self, table, indices: torch.Tensor) -> int:
        batch = self._check_in_batch(table)
        if self.pool.root.batch != -1:
            # ORDERING: nothing can roll the tables back once they change in place: the root stops
            # vouching for them first
            self.pool.commit(batch=-1, dense_slot=0)
        return batch

    def before_update(self, table, batch: int) -> None:
        """Called by a table's backward before it stores into its rows; `batch` is what capture returned."""
        if batch != self._batch:
            raise CheckpointError(f"table {table.name!r}: backward of a lookup made in batch {batch} ran in "
                                  + (f"batch {self._batch}" if self._batch is not None else "no batch")
                                  + ": call backward inside the batch that did the forward")

    def end_batch(self, batch: int) -> None:
        if batch != self._batch:
            raise CheckpointError(f"end of batch {batch}, but batch {self._batch} is in flight")
        self._batch = None
        self._next = batch + 1


class Checkpointer(BatchGuard):
    """Drives the protocol for the tables and dense state of one run over one pool.

    The pool must be recovered (its ring empty, a fresh generation) before this is built; `tables`
    are PersistentEmbeddingBag modules attached to it.
    """

    def __init__(self, pool: Pool, tables: list, state: dense.DenseState, *, dense_every: int = 1) -> None:
        if dense_every < 1:
            raise CheckpointError(f"dense_every must be >= 1, got {dense_every}")
        super().__init__(pool, tables)
        root = pool.root
        self.state, self.dense_every = state, dense_every
        self.ring = UndoRing(pool, root.ring_generation, root.ring_start, root.ring_start_seq)
        self.stats = CheckpointStats()
        self.committed = root.batch      # batches the durable root vouches for
        self._dirty: list[tuple[object, torch.Tensor]] = []   # (table, rows) updated since the last commit
        self._batch_bytes = 0
        self._largest_batch_bytes = 0
        self._largest_record = 0
        self._stale: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # planted U4 bug only

    # -- per batch --------------------------------------------------------------------------
    def begin_batch(self, batch: int) -> None:
        super().begin_batch(batch)
        self._batch_bytes = 0

    def capture(self, table, indices: torch.Tensor) -> int:
        """Called by a table's forward, with gradients on, before its backward can update the rows
        `indices` [N] look up: put their current values in the undo ring, durably. Returns the batch,
        which the table hands back to before_update."""
        batch = self._check_in_batch(table)
        started = time.perf_counter()
        rows = torch.unique(indices, sorted=True)
        weights, state = table.storage()
        if planted("capture-before-update"):  # test-only: U4 broken on purpose (see below)
            weights, state = self._stale_copy(table, weights, state)
        weight_region = self.pool.region(table.weight_region)
        state_region = self.pool.region(table.state_region) if state is not None else None
        # U4 — capture after the previous update: this runs in b's forward, after b-1's backward
        # has updated the rows in place (before_update refuses any other order), so the record holds
        # the values after b-1.
        try:
            size = self.ring.append(batch, weight_region, state_region, rows, weights, state)
        except RingFull as e:
            raise CheckpointError(f"{e}: batch {batch} needs more undo space than the ring has left; "
                                  "create the pool with a larger ring (Runtime(undo_ring_bytes=...)) or take "
                                  "dense snapshots more often (dense_every)") from None
        self._dirty.append((table, rows))
        self._largest_record = max(self._largest_record, size)
        self._batch_bytes += size
        self.stats.undo_bytes += size
        self.stats.capture_seconds += time.perf_counter() - started
        return batch

    def before_update(self, table, batch: int) -> None:
        super().before_update(table, batch)
        # U1 — undo before overwrite, for recovery's sake: the tail mark covering this batch's
        # records is durable before its first in-place store, so a record header damaged later is
        # refused instead of being taken for the end of the log.
        self.ring.mark_tail()

    def _stale_copy(self, table, weights, state):
        """The planted U4 bug: hand capture the rows as they were at the table's previous capture,
        i.e. before the previous batch's update — what capturing too early records."""
        previous = self._stale.get(table.name, (weights.clone(), None if state is None else state.clone()))
        self._stale[table.name] = (weights.clone(), None if state is None else state.clone())
        return previous

    def end_batch(self, batch: int) -> None:
        """Batch `batch` is done (its update applied). Commits when a snapshot is due."""
        super().end_batch(batch)
        self.stats.batches += 1
        self._largest_batch_bytes = max(self._largest_batch_bytes, self._batch_bytes)
        done = batch + 1
        due = done - self.committed >= self.dense_every
        # room for two batches like the largest so far, plus what the wrap can waste (< one record)
        ring_short = not due and self.ring.free_bytes < 2 * self._largest_batch_bytes + self._largest_record

        if not (due or ring_short):
            return
        started = time.perf_counter()
        self._commit(done)
        if ring_short:
            self.stats.ring_full_commits += 1
            self.stats.ring_wait_seconds += time.perf_counter() - started
        self.stats.commit_seconds += time.perf_counter() - started

    def commit_now(self, done: int) -> None:
        """Commit at `done` batches although no snapshot is due (the run is ending)."""
        if self._batch is not None or done != self._next:
            raise CheckpointError(f"cannot commit at batch {done}: the pool is at batch {self._next}"
                                  + (f", batch {self._batch} in flight" if self._batch is not None else ""))
        started = time.perf_counter()
        self._commit(done)
        self.stats.commit_seconds += time.perf_counter() - started

    def _commit(self, done: int) -> None:
        slot = dense.free_slot(self.pool)
        start, start_seq = self.ring.start_after_reclaim(done)
        fields = dict(ring_start=start, ring_start_seq=start_seq, dense_slot=slot, dense_batch=done)
        rows_late = planted("commit-before-rows")  # test-only: U2 broken on purpose
        if not rows_late:
            self._persist_dirty_rows()
        crash_point("commit:between-rows-and-snapshot")
        blob = codec.encode(self.state.capture(done))
        dense.write_snapshot(self.pool, slot, done, blob)
        self.stats.dense_bytes += len(blob)
        crash_point("commit:before-root")
        # U2 — rows before commit: every row updated in place since the last commit, and the dense
        # snapshot of batch `done`, are durable (just above) before this root names `done`.
        self.pool.commit(batch=done, **fields)
        crash_point("commit:after-root")
        if rows_late:
            self._persist_dirty_rows()
        # U3 — commit before reclaim: records of batches < done are forgotten (their ring space
        # reused) only now that a durable root no longer needs them.
        self.ring.reclaim(done)
        self.committed = done
        self._dirty.clear()
        self.stats.commits += 1

    def _persist_dirty_rows(self) -> None:
        device = self.pool.device
        for table, rows in self._dirty:
            indices = rows.numpy()
            weights = self.pool.region(table.weight_region)
            device.flush_rows(weights.offset, weights.row_stride, indices)
            if table.optimizer.state_columns:
                state = self.pool.region(table.state_region)
                device.flush_rows(state.offset, state.row_stride, indices)
            self.stats.rows_persisted += indices.size
        device.drain()
