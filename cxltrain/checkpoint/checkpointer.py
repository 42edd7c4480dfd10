"""The checkpointer: every batch durable (docs/architecture.md §4), off the training thread's critical path.

Per batch b, for each table it looks up with gradients:

    forward of b    capture: the table's looked-up rows R(b) are noted
    backward of b   before_update: R(b) as they are now (after b-1's update, U4) go into the undo
                    ring, durably (U1), on the training thread right before the fused optimizer
                    updates R(b) in place in the pool — the rows are then in cache for the update;
                    after_update: where a flush is a cache-line write-back (is_pmem devices), R(b)
                    are flushed right away, from this core's cache (drained at b's end)
    end of b        the dense state is copied as it is at b's boundary; the commit of b (persist
                    the rows updated since the last commit — drain them, or flush them where the
                    device's flush is a system call — and the snapshot (U2), write the root
                    naming b+1 as the recovery target, reclaim the records it covers (U3)) is handed
                    to the worker, which runs it while the training thread goes on with b+1

Modes (docs/architecture.md §4):
    strict    a commit is a dense snapshot plus the rows, every k = dense_every batches; records are
              kept back to the last one, so recovery is exact.
    relaxed   TrainingCXL's ordering: the rows are committed every batch, the dense snapshot only
              every k batches; the root is flagged ROOT_RELAXED so recovery accepts a dense state
              up to k batches older than the embeddings (and reports the lag). Cheaper, not exact.

Why committing b while b+1 updates the same rows in place is still correct:
  * A row flushed by commit(b) may already hold b+1's value (the flush copies whatever is in the
    row). b+1's undo record of that row is durable before that store (U1, before_update waits), and
    its batch is >= b+1, the target of commit(b)'s root: recovery keeps and restores it, so the row
    goes back to its value after b — what commit(b) promised. Restoring newest first, the oldest
    record wins when several batches touched a row.
  * The snapshot of b is the dense state at b's boundary: copied on the training thread, straight
    into the free dense slot (and checksummed as it goes), before b+1's optimizer step can change
    it; the worker only writes the slot's header. The free slot is the one the durable root does
    not name, and commit(b-1) is finished before the copy starts, so no root in flight can name it
    either.
  * Records are reclaimed only after the root that no longer needs them is durable (U3); the ring's
    bookkeeping is one lock's (the worker reclaims while the training thread appends), so the ring
    is never reused under a live record.
  * Records are appended by one thread (the training thread, or the worker), in batch order. A
    commit's ring start is computed under the ring's lock: the first live record of a batch it does
    not cover, or the head, where the next one goes (recovery's scan follows a wrap from there).
  * At most one commit is in flight: end of b+1 waits for commit(b) (the commit lag is at most one
    batch, the wait is counted). A capture of b+2 that finds the ring full (it may need the space
    commit(b+1) reclaims) first waits for that commit (back-pressure, counted).

With the pipeline off (pipeline=False) the commits run inline on the training thread too: undo
logging and commits on the critical path, the baseline `cxltrain bench` compares against.

Where the capture and the row flushes run: on the training thread, inside backward (above), by
default. With background_capture=True the worker takes both (docs/architecture.md §4): the capture
is handed over in b's forward (before_update waits for it, only when it is late) and the rows are
flushed by the commit during b+1 — the overlap that pays off where the worker has a core of its
own. On a 2-core machine it cost more than it hid (`cxltrain bench` measures both): the worker's
Python takes the GIL from the training thread, its gathers miss the cache that the training
thread's update then misses again, and its flushes find the rows no longer in this core's cache.

When the ring has no room for another batch like the largest seen so far, a commit is taken early
rather than letting the next capture fail; the time that costs the training thread is counted.

This module is the coordinator: what happens at each batch boundary (which capture schedule, when
rows are flushed, when a commit is due or taken early, the dense hand-over). The steps a commit
takes on the worker are commit.py's; the orderings both follow are ordering.py's (a planted bug is
another Ordering, never a flag tested here). Each protocol rule is enforced at one line, tagged
`ORDERING U<n>` in a comment: U1a in ring.UndoRing.append, U1b and U1d in Checkpointer._capture, U1c in
tables.py (before_update before the in-place update), U1e and U1g in cache.py (the hot-row cache:
records before admission fills the slots and before re-placement's write-back and refill), U1f in
Checkpointer.before_update (a cached table's slots recorded before its update, where not fused), U1h
in kernels/rows.c and U1i in ordering.Ordering.fused_steps (the fused capture: each chunk's record,
and a cached table's slots' record of it, durable, payload first, before its rows are stored), U1j in
tables/renorm.py (max_norm's renorm in forward: the rows' record before its stores), U2a in
Checkpointer._hand_over_commit, U2b in ordering.Ordering.commit, U2c, U2d (a pool set's capacity pools), U3a and U3c (a stealing set's redo records) in commit.py, U3b
(distributed runs) in ordering.Ordering.keep_from, U3d (a rank's dense slices) in dense.free_slot, U4 in
Checkpointer._capture.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import CheckpointError
from ..faults import CrashPoint, crash_point, planted_faults
from ..kernels import ops as row_ops
from ..modes import RELAXED, STRICT
from ..pool.handle import Pool
from . import codec, dense, fused, ordering
from .commit import CommitPipeline, DirtyRows
from .guard import BatchGuard
from .options import CheckpointOptions
from .ring import RingFull, SlotRecords, UndoRing
from .seam import CachedSlots, LoggedTable
from .stats import CheckpointStats
from .worker import BackgroundWorker, InlineWorker, Ticket


class Checkpointer(BatchGuard):
    """Drives the protocol for the tables and dense state of one run over one pool.

    The pool must be recovered (its ring empty, a fresh generation) before this is built; `tables`
    are PersistentEmbeddingBag modules attached to it. `options` (options.CheckpointOptions): the
    mode, k = dense_every, the pipeline and where the capture runs (see the module docstring).
    Call finish() at the end of a run and detach() always.
    """

    def __init__(self, pool: Pool, tables: list[LoggedTable], state: dense.DenseState,
                 options: CheckpointOptions = CheckpointOptions()) -> None:
        super().__init__(pool, tables)
        root = pool.root
        self.options = options
        dense_every, mode = options.dense_every, options.mode
        self.dense_state, self.dense_every, self.mode = state, dense_every, mode
        self._ordering = ordering.for_planted(planted_faults())  # production's unless a crash test plants a bug
        self.ring = UndoRing(pool, root.ring_generation, root.ring_start, root.ring_start_seq,
                             record_device=self._ordering.undo_device(pool.device))
        self.stats = CheckpointStats()
        # a pool set steals (redo records for cold rows, capacity write-back deferred) where one
        # thread appends every record: not with background captures (the worker appends those)
        self._commits = CommitPipeline(pool, self.ring, self.stats, self._ordering, relaxed=mode == RELAXED,
                                       write_back_every=1 if options.captures_on_worker else options.write_back_every,
                                       write_back_beside=options.pipeline)
        self.committed = root.batches_done      # the batch of the last commit handed over (embeddings)
        self.dense_committed = root.dense_batch  # ... of the last one with a dense snapshot
        self._worker = BackgroundWorker() if options.pipeline else InlineWorker()
        self.background_capture = options.captures_on_worker
        # Where a flush is a cache-line write-back, the updated rows are flushed right after their
        # update, while this core still holds them (cheaper on 2 cores than the worker flushing them
        # during the next batch: docs/benchmarks.md); where it is a system call (msync), and
        # with background_capture (a worker with a core of its own), the worker does it.
        self.flush_at_update = (pool.device.is_pmem and not self.background_capture
                                and self._ordering.flush_at_update)
        self._commit_ticket: Ticket | None = None
        # a distributed run's last agreed recovery target G (runtime/group.py): commits keep the undo
        # records of batches >= G whatever their own target (U3b); None in a single process
        self.agreed: int | None = None
        self._captures: list[tuple[str, Ticket]] = []    # the batch in flight's capture jobs (background)
        # ... its lookups not yet captured (inline): (table, lookups, its hot-row cache or None)
        self._lookups: list[tuple[LoggedTable, torch.Tensor, CachedSlots | None]] = []
        self._dirty: dict[int, DirtyRows] = {}  # batch -> (table, rows) updated, not flushed at update
        self._batch_bytes = 0
        self._largest_batch_bytes = 0
        self._largest_record = 0
        # strict with k > 1: a row gets one undo record per commit window (window.py); with k = 1,
        # and in relaxed mode (a commit every batch), a window is one batch and its rows are unique
        self._window = self._ordering.window_captures() if mode == STRICT and dense_every > 1 else None
        # the dense state keeps its shape from batch to batch: its manifest is reused (cheaper than
        # laying it out again: docs/benchmarks.md)
        self._layouts = codec.LayoutCache(volatile=("batch", "metadata"))
        # Capture inside the update (kernels/undo.c, fused.py), chunk by chunk of a table's
        # unique rows, where the kernels and the device can persist the records without Python and
        # the capture runs on this thread; else the whole record first, then the update.
        self.fused = (options.fused_capture and not self.background_capture and row_ops.fused_available()
                      and self._ordering.fused_capture and self.ring.streams())
        if self.fused:
            fused.writer()  # refuses a native undo writer built for another record layout
        self._chunk_rows = options.undo_chunk_rows
        # table (or a cache's slots) -> (its layout, records to land, recorded rows, their ring bytes):
        # laid out, not landed yet (a cache's slots' records land with its table's)
        self._fused_records: dict[str, tuple[fused.FusedUndo, list, torch.Tensor, int]] = {}
        self._late_slots: list[tuple[LoggedTable, torch.Tensor]] = []  # the planted CachedUpdateUnlogged's
        self._late_redo: list[tuple[int, LoggedTable, torch.Tensor]] = []  # the planted RedoAfterCommit's

    @property
    def durable(self) -> int:
        """The batch count the durable root names (the worker moves it on)."""
        return self._commits.durable

    # -- training thread: per batch ---------------------------------------------------------
    def begin_batch(self, batch: int) -> None:
        super().begin_batch(batch)
        self._batch_bytes = 0
        self._captures, self._lookups = [], []

    def capture(self, table: LoggedTable, indices: torch.Tensor, cache: CachedSlots | None = None) -> int:
        """Called by a table's forward, with gradients on, before its backward can update the rows
        `indices` [N] look up (cache: the table's hot-row cache, whose slots hold the rows it maps):
        note them for before_update, or hand their capture to the worker (background_capture).
        Returns the batch, which the table hands back to before_update."""
        batch = self._check_in_batch(table)
        if not self.background_capture:
            self._lookups.append((table, indices, cache))
            return batch
        started = time.perf_counter()
        window = self.committed
        for owner, stored in _stored(table, indices, cache):  # before_update(table) waits for both
            ticket = self._worker.submit_capture(lambda owner=owner, stored=stored:
                                                 self._capture(batch, owner, stored, window))
            self._captures.append((table.name, ticket))
        self.stats.training_lookup_seconds += time.perf_counter() - started
        return batch

    def before_update(self, table: LoggedTable, batch: int | None,
                      fusable: bool = False) -> row_ops.UndoChunks | None:
        """Called by a table's backward before it stores into its rows: captures this table's
        lookups of this batch, or waits until the worker has, so that their records are durable
        first (U1). fusable: the update is kernels/ops.sparse_update over those very lookups; then
        where self.fused, the capture is left to it: returns the records it is to write (U1 per
        chunk, inside the kernel), which after_update takes into the ring."""
        super().before_update(table, batch)
        if not self.background_capture:
            mine = [(indices, cache) for owner, indices, cache in self._lookups if owner is table]
            undo = None
            if mine:
                started = time.perf_counter()
                self._lookups = [entry for entry in self._lookups if entry[0] is not table]
                if fusable and self.fused and len(mine) == 1:
                    undo = self._plan_fused(batch, table, *mine[0], self.committed)
                else:
                    for indices, cache in mine:
                        for owner, stored in _stored(table, indices, cache, self._ordering.logs_slots_first):
                            # ORDERING U1f: a cached table's slots' record (its hits', first) is durable
                            # (_capture returns only then), with its misses', before the update stores
                            # into either; a fused update writes both itself, chunk by chunk (U1h).
                            self._capture(batch, owner, stored, self.committed)
                        if cache is not None and not self._ordering.logs_slots_first:  # a planted bug
                            self._late_slots += [part for part in _stored(table, indices, cache) if part[0] is cache.slots]
                self.stats.training_capture_seconds += time.perf_counter() - started
            return undo
        for name, ticket in self._captures:
            if name == table.name:
                self.stats.capture_wait_seconds += self._worker.wait(ticket)
        return None

    def after_update(self, table: LoggedTable, batch: int | None, rows: torch.Tensor) -> None:
        """Called by a table's backward right after its update stored into `rows` [U] (sorted,
        unique): flush them now when flush_at_update (drained before the commit is handed over)."""
        for entry in [entry for entry in self._late_slots if entry[0] is table]:  # the planted CachedUpdateUnlogged's
            self._capture(batch, *entry, self.committed)
        self._late_slots = [entry for entry in self._late_slots if entry[0] is not table]
        landing = self._fused_records.pop(table.name, None)
        undo = None
        if landing is not None:  # the fused update wrote its records: into the ring's bookkeeping
            undo, records, recorded_rows, size = landing
            self.ring.land(records)
            self._count_capture(batch, table, rows, recorded_rows, size)
        if self._commits.steals and rows.numel() and self._commits.row_device(table) is not self.pool.device:
            if self._ordering.redo_before_commit:
                self._log_redo(batch, table, rows)
            else:  # a planted bug: written at the batch's end, once its commit is durable
                self._late_redo.append((batch, table, rows.clone()))
        if not self.flush_at_update or not rows.numel():
            return
        started = time.perf_counter()
        if undo is not None and undo.row_flush is not None:
            self._commits.rows_flushed(table, rows.numel(), undo.flushed_runs)  # the kernel flushed them
        else:
            self._commits.flush_rows(table, rows.numpy())
        crash_point(CrashPoint.UPDATE_ROWS_FLUSHED)
        self.stats.training_flush_seconds += time.perf_counter() - started

    def _log_redo(self, batch: int, table: LoggedTable, rows: torch.Tensor) -> None:
        """A capacity table's rows `rows` [U] (sorted, unique), as batch `batch` just stored them,
        into a redo record in the ring (docs/tiers.md "Steal, no force")."""
        started = time.perf_counter()
        weights, state = table.storage()
        weight_region = self.pool.region(table.weight_region)
        state_region = self.pool.region(table.state_region) if state is not None else None
        size = self._with_room(batch, lambda: self.ring.append(batch, weight_region, state_region, rows, weights,
                                                               state, redo=True))
        # ORDERING U2f: a cold row's redo record is durable (append returns only then, and the tail
        # mark covers it) before the batch ends, so before the commit naming the batch is handed
        # over: between write-backs it, not the capacity page, makes the row's update durable (U2).
        self.ring.mark_tail()
        self._largest_record = max(self._largest_record, size)
        self._batch_bytes += size
        self.stats.redo_bytes += size
        self.stats.capture_seconds += time.perf_counter() - started

    def log_before_write(self, table: LoggedTable, rows: torch.Tensor) -> int:
        if self._ordering.logs_cache_writes:  # a planted bug skips the record
            return super().log_before_write(table, rows)
        return self._check_in_batch(table)

    def fail_batch(self, table: LoggedTable) -> None:
        super().fail_batch(table)
        self._fused_records.clear()  # laid out, maybe never written: never landed

    def end_batch(self, batch: int) -> None:
        """Batch `batch` is done (its update applied). Hands over its commit when one is due."""
        started = time.perf_counter()
        super().end_batch(batch)
        for _, ticket in self._captures:  # captures of tables that got no backward: done before the commit
            self.stats.capture_wait_seconds += self._worker.wait(ticket)
        # lookups whose backward never ran changed nothing: no record needed
        self._captures, self._lookups = [], []
        self.stats.batches += 1
        self._largest_batch_bytes = max(self._largest_batch_bytes, self._batch_bytes)
        done = batch + 1
        snapshot_due = done - self.dense_committed >= self.dense_every
        due = snapshot_due or self.mode == RELAXED
        # room for two batches like the largest so far, plus what the wrap can waste (< one record)
        room_low = self.ring.free_bytes < 2 * self._largest_batch_bytes + self._largest_record
        ring_short = not due and room_low
        if due or ring_short:  # a stealing set's commit writes back when room is low: only that frees the ring
            self._hand_over_commit(done, snapshot=snapshot_due or ring_short, write_back=room_low)
        if self._late_redo:  # the planted RedoAfterCommit: the rows' values now, after the commit
            self.wait_durable()
            for entry in self._late_redo:
                self._log_redo(*entry)
            self._late_redo = []
        lag = done - self._commits.durable
        self.stats.commit_lag_max = max(self.stats.commit_lag_max, lag)
        self.stats.commit_lag_sum += lag
        spent = time.perf_counter() - started
        if ring_short:
            self.stats.ring_full_commits += 1
            self.stats.ring_wait_seconds += spent
        self.stats.training_boundary_seconds += spent

    def finish(self, done: int) -> None:
        """The run ends at `done` batches: commit there with a dense snapshot (unless that is the
        last commit already) and wait until it is durable."""
        self._check_finish(done)
        started = time.perf_counter()
        self.wait_durable()
        # a stealing set's last commit writes the capacity pools back: the run ends with them current
        if self.committed != done or self.dense_committed != done or self._commits.written_back != done:
            # a snapshot of `done` already durable is not written again: a group rank's pool keeps
            # one slice per batch, and its slots hold no spare for a second one of the same batch
            self._hand_over_commit(done, snapshot=self.dense_committed != done, write_back=True)
        self.wait_durable()
        self.stats.training_boundary_seconds += time.perf_counter() - started

    def wait_durable(self) -> float:
        """Wait for the commit in flight, if any (counted as a commit-lag wait); returns the seconds."""
        waited = self._wait_for_commit()
        self.stats.lag_wait_seconds += waited
        return waited

    def wait_idle(self) -> float:
        """wait_durable, then a stealing set's capacity write-back in flight (counted here, as a
        commit would: with no commit in flight, nothing else counts it meanwhile)."""
        return self.wait_durable() + self._commits.join_write_back()

    def detach(self) -> None:
        """Stop the worker (what it has queued still runs: at most the commit handed over last and
        captures of the batch in flight, which is never committed), then let go of the tables.
        A worker failure not yet reported is dropped here: the caller is already leaving, on an
        exception of its own or after finish() reported it."""
        try:
            self._worker.close()
        except CheckpointError:
            pass
        finally:
            self._commits.close()
            super().detach()

    def _hand_over_commit(self, done: int, snapshot: bool, write_back: bool = False) -> None:
        if self.flush_at_update:
            # ORDERING U2a: rows flushed at their update, on this thread, are drained before the
            # commit that names them is handed to the worker.
            self.pool.device.drain()
        self.wait_durable()  # the lag bound: one commit in flight (its root now names the other dense slot)
        # the rows of every batch before `done` (captured: end_batch waited for the background ones)
        dirty = [entry for batch in sorted(b for b in self._dirty if b < done) for entry in self._dirty.pop(batch)]
        written = None
        if snapshot:
            # The dense state as it is at this boundary, copied once, straight from the live tensors
            # into the slot the durable root does not name, before b+1 can change them, checksummed
            # as it goes; the worker makes the slot valid (seal) after persisting the rows.
            slot = dense.free_slot(self.pool, self.agreed)
            written = slot, *dense.write_payload(self.pool, slot, done,
                                                 self._layouts.lay_out(self.dense_state.capture(done)))
            self.stats.dense_bytes += written[1]
        self._commit_ticket = self._worker.submit_commit(self._commits.steps(done, dirty, written, self.agreed,
                                                                             write_back=write_back))
        self.committed = done
        if snapshot:
            self.dense_committed = done

    def _wait_for_commit(self) -> float:
        """Wait until the commit in flight, if any, is done; returns the seconds waited."""
        if self._commit_ticket is None:
            return 0.0
        waited = self._worker.wait(self._commit_ticket)
        self._commit_ticket = None
        return waited

    def _finish_commit_for_room(self) -> bool:
        """A capture found the ring full: run or await the commit in flight, whose reclaim frees
        it; with none in flight, a stealing set writes back at the last commit (below). False when
        nothing is left that could free it."""
        if self.background_capture:  # on the worker thread, which runs the commit's steps itself
            return self._worker.finish_commit()
        if self._commit_ticket is not None:
            self._wait_for_commit()
            return True
        if self._commits.steals and self._commits.written_back < self.committed:
            # A stealing set's records since its last write-back stay live (U3c): a commit that did
            # not write back freed none of them. Write back at the last commit, mid-batch: the root
            # names the same batch and dense snapshot, the batch in flight keeps its records.
            self._hand_over_commit(self.committed, snapshot=False, write_back=True)
            self._wait_for_commit()
            return True
        return False

    def _plan_fused(self, batch: int, table: LoggedTable, indices: torch.Tensor, cache: CachedSlots | None,
                    window: int) -> row_ops.UndoChunks:
        """Lay out the records the fused update of `table` writes for the rows `indices` [N] look up
        (as _capture would record them, one record per chunk of the unique rows); cache: the table's
        hot-row cache, whose slots hold the rows it maps: the update stores into those slots, and
        each chunk's slots get their own record beside the chunk's table record."""
        started = time.perf_counter()
        # Capture after the previous update (as in _capture): the kernel gathers each chunk from the
        # live rows right before updating them, in b's backward, so after b-1's update.
        weights, state = table.storage()
        # the lookups are sorted by row once, here: the kernel takes this order instead of its own sort
        rows, lookup_order = row_ops.unique_rows_and_order(indices.contiguous(), weights.shape[0])
        if cache is None:  # as in _capture (U1d): rows recorded earlier in the commit window are left out
            slots, recorded = None, (rows if self._window is None else
                                     self._window.first_touches(window, table.name, rows, weights.shape[0]))
        else:
            slots, recorded = self._slot_records(table, rows, cache, window)
        weight_region = self.pool.region(table.weight_region)
        state_region = self.pool.region(table.state_region) if state is not None else None
        undo, laid_out = self._with_room(batch, lambda: self.ring.plan_chunks(
            batch, weight_region, state_region, rows, recorded, self._chunk_rows, self._ordering.fused_steps, slots))
        undo.lookup_order = lookup_order
        # a cached table's kernel stores into slots too, which after_update flushes with the table rows
        undo.row_flush = self._kernel_row_flush(table) if cache is None else None
        if slots is not None:  # counted by after_update(slots); its records land with the table's
            self._fused_records[cache.slots.name] = (undo.slots, [], torch.from_numpy(undo.slots.recorded),
                                                     undo.slots.ring_bytes)
        self._fused_records[table.name] = (undo, laid_out, torch.from_numpy(undo.recorded), undo.ring_bytes)
        self.stats.capture_seconds += time.perf_counter() - started
        return undo

    def _slot_records(self, table: LoggedTable, rows: np.ndarray, cache: CachedSlots,
                      window: int) -> tuple[SlotRecords, np.ndarray | None]:
        """(the slots a fused update of the unique rows `rows` [U] stores into, to record chunk by
        chunk as _capture would record them; the sorted rows it stores into in the table itself to
        record, or None: every one, which the layout (ring.plan_chunks) picks out itself)"""
        slot_of = cache.slot_of.numpy()
        weights_region = self.pool.region(cache.slots.weight_region)
        state_region = self.pool.region(cache.slots.state_region)
        if self._window is None:
            return SlotRecords(weights_region, state_region, slot_of), None
        # U1d, as in _capture: rows and slots recorded earlier in the commit window are left out
        at = slot_of[rows]
        hit = at >= 0
        fresh = np.zeros(weights_region.shape[0], dtype=bool)
        fresh[self._window.first_touches(window, cache.slots.name, np.sort(at[hit]).astype(np.int64), fresh.size)] = True
        recorded = self._window.first_touches(window, table.name, rows[~hit], slot_of.size)
        return SlotRecords(weights_region, state_region, slot_of, fresh), recorded

    def _kernel_row_flush(self, table: LoggedTable):
        """How the fused update of `table` writes its updated rows back itself, chunk by chunk while
        they are still in this core's cache (the device's kernels/native.NativePersistence), or None: after_update flushes
        them. Only where the rows are flushed at update and sit on the device the records go through
        (the kernel holds that device's persist lock, nobody else's)."""
        if not self.flush_at_update:
            return None
        device = self._commits.row_device(table)
        if device is not self.ring.record_device:
            return None
        return self._ordering.kernel_row_flush(device.native_persistence())

    def _with_room(self, batch: int, write):
        """write() (a ring append or layout); when the ring is full, again after each commit that
        may reclaim (back-pressure, counted); CheckpointError when none is left and it is full still."""
        try:
            while True:  # each round finishes a commit or writes back, until none is left to run
                try:
                    return write()
                except RingFull:
                    waited = time.perf_counter()
                    if not self._finish_commit_for_room():
                        raise
                    self.stats.ring_full_waits += 1
                    self.stats.ring_full_seconds += time.perf_counter() - waited
        except RingFull as e:
            raise CheckpointError(f"{e}: batch {batch} needs more undo space than the ring has left; "
                                  "create the pool with a larger ring (Runtime(undo_ring_bytes=...)) or take "
                                  "dense snapshots more often (dense_every)") from None

    def _count_capture(self, batch: int, table: LoggedTable, rows: torch.Tensor, recorded: torch.Tensor,
                       size: int) -> None:
        """A table's records of `batch` are durable: `size` ring bytes of `recorded` [V] of its `rows` [U]."""
        if not self.flush_at_update:  # else after_update flushes them
            self._dirty.setdefault(batch, []).append((table, rows))
        self._largest_record = max(self._largest_record, size)
        self._batch_bytes += size
        self.stats.undo_bytes += size
        self.stats.undo_rows += recorded.numel()
        self.stats.undo_rows_skipped += rows.numel() - recorded.numel()

    # -- the capture: training thread, or worker (background_capture) ------------------------
    def _capture(self, batch: int, table: LoggedTable, indices: torch.Tensor, window: int) -> None:
        """Record the rows `indices` [N] look up, as they are now; `window`: the batch count the
        last commit handed over names (the commit window this batch belongs to)."""
        started = time.perf_counter()
        # ORDERING U4: the record is gathered from the rows as they are now, after b-1's update: this
        # runs in b's backward (inline) or is handed over in b's forward (background), both after
        # b-1's backward stored in place, and b's backward waits for it (before_update).
        weights, state = self._ordering.capture_source(table, table.storage())
        rows = row_ops.unique_rows(indices.contiguous(), weights.shape[0])
        # ORDERING U1d: a row left out of this record has a durable record from earlier in its commit
        # window (batch >= any target that window's records serve), whose value recovery restores
        # last (newest first): all of them with k = 1 and in relaxed mode, else the window's first touches.
        recorded = rows if self._window is None else torch.from_numpy(
            self._window.first_touches(window, table.name, rows.numpy(), weights.shape[0]))
        weight_region = self.pool.region(table.weight_region)
        state_region = self.pool.region(table.state_region) if state is not None else None
        size = self._with_room(batch, lambda: self.ring.append(batch, weight_region, state_region, recorded, weights,
                                                               state))
        # ORDERING U1b: the tail mark covering this record is durable before the table's first
        # in-place store (before_update waits for this), so a record header damaged later is
        # refused instead of being taken for the end of the log.
        self.ring.mark_tail()
        crash_point(CrashPoint.UNDO_BETWEEN_HEADER_AND_UPDATE)
        self._count_capture(batch, table, rows, recorded, size)
        self.stats.capture_seconds += time.perf_counter() - started


def _stored(table: LoggedTable, indices: torch.Tensor, cache: CachedSlots | None,
            slots: bool = True) -> list[tuple[LoggedTable, torch.Tensor]]:
    """What a capture (not fused) records of the lookups `indices` [N] of `table`, in this order:
    for a cached table, its slots' lookups (the hits' slots; with slots) and its misses; else the
    table's lookups. Empty ones are left out."""
    if cache is None:
        return [(table, indices)]
    at = cache.slot_of[indices].to(torch.int64)
    hit = at >= 0
    parts = [(cache.slots, at[hit])] if slots else []
    return [(owner, stored) for owner, stored in (*parts, (table, indices[~hit])) if stored.numel()]
