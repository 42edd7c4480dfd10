"""The checkpointer: every batch durable (DESIGN §4), off the training thread's critical path.

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

Modes (DESIGN §4):
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
default. With background_capture=True the worker takes both, as DESIGN §4 has it: the capture is
handed over in b's forward (before_update waits for it, only when it is late) and the rows are
flushed by the commit during b+1 — the overlap that pays off where the worker has a core of its
own. On a 2-core machine it cost more than it hid (`cxltrain bench` measures both): the worker's
Python takes the GIL from the training thread, its gathers miss the cache that the training
thread's update then misses again, and its flushes find the rows no longer in this core's cache.

When the ring has no room for another batch like the largest seen so far, a commit is taken early
rather than letting the next capture fail; the time that costs the training thread is counted.

The protocol rules are each enforced at one line: U1 in ring.UndoRing.append, U2 and U3 in
Checkpointer._commit_steps (U2 also in _hand_over_commit, for rows flushed at their update), U4 in
Checkpointer._capture.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import torch

from ..errors import CheckpointError
from ..faults import CrashPoint, crash_point, planted
from ..kernels import ops as row_ops
from ..pool import Pool
from ..pool_format import ROOT_RELAXED
from . import codec, dense
from .ring import RingFull, UndoRing
from .worker import BackgroundWorker, InlineWorker, Ticket

MODES = ("strict", "relaxed")


@dataclasses.dataclass
class CheckpointStats:
    """Running totals of the checkpointer's work. Work is counted on whichever thread does it;
    the training thread's share is the *_wait and training_* fields."""

    batches: int = 0                 # batches ended
    commits: int = 0                 # roots written
    snapshots: int = 0               # dense snapshots written (= commits in strict mode)
    capture_seconds: float = 0.0     # U1: gathering old rows into the ring and persisting them
    commit_seconds: float = 0.0      # U2 + commit: persisting rows and the snapshot, writing the root
    undo_bytes: int = 0              # ring bytes written
    dense_bytes: int = 0             # encoded snapshot bytes written
    row_bytes: int = 0               # table bytes (weights and optimizer state) flushed at commits
    rows_persisted: int = 0          # table rows flushed at commits
    ring_full_commits: int = 0       # commits taken early because the ring was nearly full
    ring_wait_seconds: float = 0.0   # training thread: what those early commits cost it
    ring_full_waits: int = 0         # worker: captures that found the ring full and first ran the
    ring_full_seconds: float = 0.0   # in-flight commit (back-pressure; a late capture's wait holds it)
    capture_wait_seconds: float = 0.0  # training thread, in backward: a capture was late (U1)
    lag_wait_seconds: float = 0.0    # training thread, at a batch end: the previous commit ran late
    commit_lag_max: int = 0          # batches the training thread was ahead of the durable root
    commit_lag_sum: int = 0          # (measured at each batch end, after handing its commit over)
    training_lookup_seconds: float = 0.0    # training thread, in forward: handing captures to the worker
    training_capture_seconds: float = 0.0   # training thread, in backward: undo captures (not background)
    training_flush_seconds: float = 0.0     # training thread, in backward: updated rows flushed (is_pmem)
    training_boundary_seconds: float = 0.0  # training thread at batch ends (the commit itself when inline)

    @property
    def wait_seconds(self) -> float:
        """The training thread's waits for the worker: late captures, ring full, commit lag."""
        return self.capture_wait_seconds + self.lag_wait_seconds + self.ring_wait_seconds

    @property
    def training_seconds(self) -> float:
        """All the time the checkpointer took from the training thread."""
        return (self.training_lookup_seconds + self.training_capture_seconds + self.training_flush_seconds
                + self.capture_wait_seconds + self.training_boundary_seconds)

    def to_json(self) -> dict:
        per_batch = max(self.batches, 1)
        return {**dataclasses.asdict(self),
                "wait_ms_per_batch": 1000.0 * self.wait_seconds / per_batch,
                "bytes_persisted_per_batch": (self.row_bytes + self.undo_bytes + self.dense_bytes) / per_batch,
                "commit_lag_mean": self.commit_lag_sum / per_batch}


def summary_line(stats: dict) -> str:
    """One line for `train`, from CheckpointStats.to_json()."""
    return (f"checkpoint: training thread waited {stats['wait_ms_per_batch']:.2f} ms/batch, "
            f"{stats['bytes_persisted_per_batch'] / 2**20:.2f} MiB persisted/batch, commit lag "
            f"{stats['commit_lag_mean']:.2f} batches (max {stats['commit_lag_max']}), {stats['commits']} commits, "
            f"{stats['snapshots']} dense snapshots")


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

    def after_update(self, table, batch: int, rows: torch.Tensor) -> None:
        """Called by a table's backward after it stored into `rows` [U]; nothing to do here."""

    def end_batch(self, batch: int) -> None:
        if batch != self._batch:
            raise CheckpointError(f"end of batch {batch}, but batch {self._batch} is in flight")
        self._batch = None
        self._next = batch + 1


class Checkpointer(BatchGuard):
    """Drives the protocol for the tables and dense state of one run over one pool.

    The pool must be recovered (its ring empty, a fresh generation) before this is built; `tables`
    are PersistentEmbeddingBag modules attached to it. mode: "strict" or "relaxed"; dense_every:
    k (see the module docstring); pipeline: run captures and commits on a background thread.
    Call finish() at the end of a run and close() always (detach() does).
    """

    def __init__(self, pool: Pool, tables: list, state: dense.DenseState, *, dense_every: int = 1,
                 mode: str = "strict", pipeline: bool = True, background_capture: bool = False) -> None:
        if dense_every < 1:
            raise CheckpointError(f"dense_every must be >= 1, got {dense_every}")
        if mode not in MODES:
            raise CheckpointError(f"mode must be one of {MODES}, got {mode!r}")
        super().__init__(pool, tables)
        root = pool.root
        self.state, self.dense_every, self.mode = state, dense_every, mode
        self.ring = UndoRing(pool, root.ring_generation, root.ring_start, root.ring_start_seq)
        self.stats = CheckpointStats()
        self.committed = root.batch          # the batch of the last commit handed over (embeddings)
        self.dense_committed = root.dense_batch  # ... of the last one with a dense snapshot
        self.durable = root.batch            # the batch the durable root names (set by the worker)
        self._worker = BackgroundWorker() if pipeline else InlineWorker()
        self.background_capture = pipeline and background_capture
        # Where a flush is a cache-line write-back, the updated rows are flushed right after their
        # update, while this core still holds them (measured: ~3 ms a batch cheaper on 2 cores than
        # the worker flushing them during the next batch); where it is a system call (msync), and
        # with background_capture (a worker with a core of its own), the worker does it. The
        # planted U2 bug needs the commit to flush the rows (after its root).
        self.flush_at_update = (pool.device.is_pmem and not self.background_capture
                                and not planted("commit-before-rows"))
        self._commit_ticket: Ticket | None = None
        self._captures: list[tuple[str, Ticket]] = []    # the batch in flight's capture jobs (background)
        self._lookups: list[tuple[object, torch.Tensor]] = []  # ... its lookups not yet captured (inline)
        self._dirty: dict[int, list[tuple[object, torch.Tensor]]] = {}  # batch -> (table, rows) updated
        self._batch_bytes = 0
        self._largest_batch_bytes = 0
        self._largest_record = 0
        self._stale: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # planted U4 bug only
        # the dense state keeps its shape from batch to batch: its manifest is reused (measured on
        # the default model: laying it out costs ~0.4 ms a batch, reusing it ~0.13 ms)
        self._layouts = codec.LayoutCache(counters=("batch",))

    @property
    def pipelined(self) -> bool:
        return self._worker.pipelined

    # -- training thread: per batch ---------------------------------------------------------
    def begin_batch(self, batch: int) -> None:
        super().begin_batch(batch)
        self._batch_bytes = 0
        self._captures, self._lookups = [], []

    def capture(self, table, indices: torch.Tensor) -> int:
        """Called by a table's forward, with gradients on, before its backward can update the rows
        `indices` [N] look up: note them for before_update, or hand their capture to the worker
        (background_capture). Returns the batch, which the table hands back to before_update."""
        batch = self._check_in_batch(table)
        if not self.background_capture:
            self._lookups.append((table, indices))
            return batch
        started = time.perf_counter()
        ticket = self._worker.submit_capture(lambda: self._capture(batch, table, indices))
        self._captures.append((table.name, ticket))
        self.stats.training_lookup_seconds += time.perf_counter() - started
        return batch

    def before_update(self, table, batch: int) -> None:
        """Called by a table's backward before it stores into its rows: captures this table's
        lookups of this batch, or waits until the worker has, so that their records are durable
        first (U1 is enforced in ring.UndoRing.append)."""
        super().before_update(table, batch)
        if not self.background_capture:
            mine = [indices for owner, indices in self._lookups if owner is table]
            if mine:
                started = time.perf_counter()
                self._lookups = [entry for entry in self._lookups if entry[0] is not table]
                for indices in mine:
                    self._capture(batch, table, indices)
                self.stats.training_capture_seconds += time.perf_counter() - started
            return
        for name, ticket in self._captures:
            if name == table.name:
                self.stats.capture_wait_seconds += self._worker.wait(ticket)

    def after_update(self, table, batch: int, rows: torch.Tensor) -> None:
        """Called by a table's backward right after its update stored into `rows` [U] (sorted,
        unique): flush them now when flush_at_update (drained before the commit is handed over)."""
        if not self.flush_at_update or not rows.numel():
            return
        started = time.perf_counter()
        self._flush_rows(table, rows.numpy())
        crash_point(CrashPoint.UPDATE_ROWS_FLUSHED)
        self.stats.training_flush_seconds += time.perf_counter() - started

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
        due = snapshot_due or self.mode == "relaxed"
        # room for two batches like the largest so far, plus what the wrap can waste (< one record)
        ring_short = not due and self.ring.free_bytes < 2 * self._largest_batch_bytes + self._largest_record
        if due or ring_short:
            self._hand_over_commit(done, snapshot=snapshot_due or ring_short)
        lag = done - self.durable
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
        if self._batch is not None or done != self._next:
            raise CheckpointError(f"cannot commit at batch {done}: the pool is at batch {self._next}"
                                  + (f", batch {self._batch} in flight" if self._batch is not None else ""))
        started = time.perf_counter()
        if self.committed != done or self.dense_committed != done:
            self._hand_over_commit(done, snapshot=True)
        self.wait_durable()
        self.stats.training_boundary_seconds += time.perf_counter() - started

    def wait_durable(self) -> float:
        """Wait for the commit in flight, if any (counted as a commit-lag wait); returns the seconds."""
        waited = self._wait_for_commit()
        self.stats.lag_wait_seconds += waited
        return waited

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
            super().detach()

    def _hand_over_commit(self, done: int, snapshot: bool) -> None:
        if self.flush_at_update:
            # U2 — rows before commit (rows flushed at their update): their flushes, issued on this
            # thread, are complete before the commit that names them is handed to the worker.
            self.pool.device.drain()
        self.wait_durable()  # the lag bound: one commit in flight (its root now names the other dense slot)
        # the rows of every batch before `done` (captured: end_batch waited for the background ones)
        dirty = [entry for batch in sorted(b for b in self._dirty if b < done) for entry in self._dirty.pop(batch)]
        written = None
        if snapshot:
            # The dense state as it is at this boundary, copied once, straight from the live tensors
            # into the slot the durable root does not name, before b+1 can change them, checksummed
            # as it goes; the worker makes the slot valid (seal) after persisting the rows.
            slot = dense.free_slot(self.pool)
            written = slot, *dense.write_payload(self.pool, slot, done, self._layouts.lay_out(self.state.capture(done)))
            self.stats.dense_bytes += written[1]
        self._commit_ticket = self._worker.submit_commit(self._timed(self._commit_steps(done, dirty, written)))
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
        it. False when there is none."""
        if self.background_capture:  # on the worker thread, which runs the commit's steps itself
            return self._worker.finish_commit()
        if self._commit_ticket is None:
            return False
        self._wait_for_commit()
        return True

    # -- the capture: training thread, or worker (background_capture) ------------------------
    def _capture(self, batch: int, table, indices: torch.Tensor) -> None:
        started = time.perf_counter()
        weights, state = table.storage()
        rows = row_ops.unique_rows(indices.contiguous(), weights.shape[0])
        if planted("capture-before-update"):  # test-only: U4 broken on purpose (see below)
            weights, state = self._stale_copy(table, weights, state)
        weight_region = self.pool.region(table.weight_region)
        state_region = self.pool.region(table.state_region) if state is not None else None
        # U4 — capture after the previous update: this job is handed over in b's forward, after
        # b-1's backward has updated the rows in place, and b's backward waits for it
        # (before_update), so the record holds the values after b-1.
        append = lambda: self.ring.append(batch, weight_region, state_region, rows, weights, state)  # noqa: E731
        try:
            try:
                size = append()
            except RingFull:
                waited = time.perf_counter()
                if not self._finish_commit_for_room():
                    raise
                self.stats.ring_full_waits += 1
                self.stats.ring_full_seconds += time.perf_counter() - waited
                size = append()
        except RingFull as e:
            raise CheckpointError(f"{e}: batch {batch} needs more undo space than the ring has left; "
                                  "create the pool with a larger ring (Runtime(undo_ring_bytes=...)) or take "
                                  "dense snapshots more often (dense_every)") from None
        # U1 — undo before overwrite, for recovery's sake: the tail mark covering this record is
        # durable before the table's first in-place store (before_update waits for this job), so a
        # record header damaged later is refused instead of being taken for the end of the log.
        self.ring.mark_tail()
        if not self.flush_at_update:  # else after_update flushes them
            self._dirty.setdefault(batch, []).append((table, rows))
        self._largest_record = max(self._largest_record, size)
        self._batch_bytes += size
        self.stats.undo_bytes += size
        self.stats.capture_seconds += time.perf_counter() - started

    def _stale_copy(self, table, weights, state):
        """The planted U4 bug: hand capture the rows as they were at the table's previous capture,
        i.e. before the previous batch's update — what capturing too early records."""
        previous = self._stale.get(table.name, (weights.clone(), None if state is None else state.clone()))
        self._stale[table.name] = (weights.clone(), None if state is None else state.clone())
        return previous

    def _timed(self, steps: Iterator[None]) -> Iterator[None]:
        """`steps`, with the time of each step (not of the captures run between them) counted."""
        while True:
            started = time.perf_counter()
            finished = next(steps, StopIteration) is StopIteration
            self.stats.commit_seconds += time.perf_counter() - started
            if finished:
                return
            yield

    def _commit_steps(self, done: int, dirty: list, written: tuple[int, int, int] | None) -> Iterator[None]:
        """The commit at `done` batches, in steps the worker may interleave captures with.
        dirty: [(table, rows)] updated since the last commit; written: (slot, payload bytes, payload
        checksum) of the dense state at `done`, already durable in that slot (write_payload), or
        None when no snapshot is due."""
        rows_late = planted("commit-before-rows")  # test-only: U2 broken on purpose
        if not rows_late:
            yield from self._persist_rows(dirty)
        crash_point(CrashPoint.COMMIT_BETWEEN_ROWS_AND_SNAPSHOT)
        fields = {}
        if written is not None:
            dense.seal_snapshot(self.pool, written[0], done, *written[1:])
            self.stats.snapshots += 1
            fields = dict(dense_slot=written[0], dense_batch=done)
            crash_point(CrashPoint.COMMIT_BEFORE_ROOT)
        start, start_seq = self.ring.start_after_reclaim(done)
        # U2 — rows before commit: every row updated in place since the last commit (flushed just
        # above, or at its update and drained at hand-over), and the dense snapshot of batch `done`
        # when one is due, are durable before this root names `done`.
        self.pool.commit(batch=done, flags=ROOT_RELAXED if self.mode == "relaxed" else 0, ring_start=start,
                         ring_start_seq=start_seq, **fields)
        crash_point(CrashPoint.COMMIT_AFTER_ROOT)
        if rows_late:
            yield from self._persist_rows(dirty)
        # U3 — commit before reclaim: records of batches < done are forgotten (their ring space
        # reused) only now that a durable root no longer needs them.
        self.ring.reclaim(done)
        self.durable = done
        self.stats.commits += 1

    def _persist_rows(self, dirty: list) -> Iterator[None]:
        """Flush the rows `dirty` names, one table's rows per step, then drain."""
        for i, (table, rows) in enumerate(dirty):
            self._flush_rows(table, rows.numpy())
            if i == 0 and len(dirty) > 1:
                crash_point(CrashPoint.COMMIT_MID_ROWS)  # one table's rows flushed, more to go
            yield
        self.pool.device.drain()

    def _flush_rows(self, table, indices) -> None:
        """Flush a table's rows `indices` (int64 [U], sorted): weights and optimizer state; no drain."""
        device = self.pool.device
        weights = self.pool.region(table.weight_region)
        device.flush_rows(weights.offset, weights.row_stride, indices)
        row_bytes = weights.row_stride
        if table.optimizer.state_columns:
            state = self.pool.region(table.state_region)
            device.flush_rows(state.offset, state.row_stride, indices)
            row_bytes += state.row_stride
        self.stats.rows_persisted += indices.size
        self.stats.row_bytes += indices.size * row_bytes
