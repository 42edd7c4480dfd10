"""The commit pipeline: the steps one commit takes, on the worker (or inline, without the pipeline).

The commit of batch b (`done` = b + 1 batches), handed over by the checkpointer at b's end:

    persist rows     flush the rows updated in place since the last commit, one table per step,
                     then drain (rows flushed at their update were drained at hand-over)
    seal snapshot    when one is due: its payload is already in the free dense slot (written and
                     persisted on the training thread); the header makes it valid
    write the root   naming `done` as the recovery target, and the ring's new live start
    reclaim          forget the undo records the durable root no longer needs

The order of the first three is the Ordering strategy's (ordering.py: U2); the reclaim comes after
all of them (U3). Steps are yielded so the worker can serve captures of b + 1 between them.

A pool set that steals (write_back_every > 1, docs/tiers.md "Steal, no force"): the cold rows'
redo records are durable in the ring before the commit is handed over, so no commit syncs the
capacity pools for its own batch. Every write_back_every batches a commit starts a write-back
beside the commits (write_back.py), which the first commit after it has returned counts (or
join_write_back, for Runtime.wait_idle); when the ring is half full, or when the caller asks (the
run's last commit, an early one for room), the commit waits for any in flight and writes back
itself. Until a write-back is counted the root keeps the ring's live start at the last one
counted, so every redo record since stays live for recovery.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from ..devices.base import Device
from ..errors import CheckpointError
from ..faults import CrashPoint, crash_point
from ..pool.format import ROOT_RELAXED, Region
from ..pool.handle import Pool
from . import dense
from .ordering import Ordering
from .ring import UndoRing
from .seam import LoggedTable
from .stats import CheckpointStats
from .write_back import BackgroundWriteBack

# (table, rows [U] int64 sorted) updated in place and not yet persisted
DirtyRows = list[tuple[LoggedTable, torch.Tensor]]


class CommitPipeline:
    """Builds the steps of each commit over one pool and ring; `durable` is the batch count the
    last durable root names (read by the training thread, written by whoever runs the steps)."""

    def __init__(self, pool: Pool, ring: UndoRing, stats: CheckpointStats, ordering: Ordering, *,
                 relaxed: bool, write_back_every: int = 1, write_back_beside: bool = True) -> None:
        self.pool, self.ring, self.stats, self.ordering = pool, ring, stats, ordering
        self._root_flags = ROOT_RELAXED if relaxed else 0
        self.durable = pool.root.batches_done
        self._keep_from = 0  # the commit in flight keeps undo records of batches >= this
        # a pool set's cold rows are made durable by redo records between write-backs (steal)
        self.write_back_every = write_back_every if pool.members else 1
        self.written_back = pool.root.batches_done  # batches the capacity pools hold durably (recovered: all)
        self._write_back = True  # whether the commit in flight syncs the capacity pools itself
        self.write_back_started = self.written_back  # batches the last write-back started covers
        self._start_write_back: int | None = None  # the commit in flight starts one covering these batches
        self.background = BackgroundWriteBack(lambda: self._sync_members(forced=False))
        self._beside = write_back_beside  # False: a due write-back runs in its commit (no pipeline)
        if pool.members and all(getattr(m.device, "synced_bytes", None) is not None for m in pool.members):
            stats.capacity_forced_bytes = stats.capacity_written_back_bytes = 0

    @property
    def steals(self) -> bool:
        """Whether cold rows get redo records and the capacity pools are synced only at write-backs."""
        return self.write_back_every > 1

    def steps(self, done: int, dirty: DirtyRows, written: tuple[int, int, int] | None,
              agreed: int | None = None, *, write_back: bool = False) -> Iterator[None]:
        """The commit at `done` batches, timed. dirty: the rows updated since the last commit;
        written: (slot, payload bytes, payload checksum) of the dense state at `done`, already
        durable in that slot (dense.write_payload), or None when no snapshot is due; agreed: a
        distributed run's last agreed target G (Ordering.keep_from), None in a single process;
        write_back: sync the capacity pools at this commit whether or not one is due (stealing sets)."""
        return self._timed(self._steps(done, dirty, written, agreed, write_back))

    def _steps(self, done: int, dirty: DirtyRows, written: tuple[int, int, int] | None,
               agreed: int | None, write_back: bool) -> Iterator[None]:
        self._count_write_back(self.background.finished())
        due = done - self.write_back_started >= self.write_back_every
        self._write_back = (not self.steals or write_back or 2 * self.ring.free_bytes < self.ring.capacity
                            or (due and not self._beside))
        if self._write_back:
            self.join_write_back()
        self._start_write_back = done if due and not self._write_back and not self.background.in_flight else None
        self._keep_from = self.ordering.keep_from(done, agreed)
        if not self._write_back:
            # ORDERING U3c: the redo records of every batch since the last write-back counted stay
            # live (the root's ring start does not pass them) until a write-back has returned from
            # syncing the capacity pools: they are what makes those batches' cold rows durable.
            self._keep_from = min(self._keep_from, self.ordering.written_back(self))
        yield from self.ordering.commit(self, done, dirty, written)
        if self.background.in_flight:
            crash_point(CrashPoint.COMMIT_WHILE_WRITING_BACK)
        # ORDERING U3a: records of batches < done (< G in a distributed run) are forgotten (their
        # ring space reused) only now that a durable root no longer needs them.
        self.ring.reclaim(self._keep_from)
        if self._write_back:
            self.write_back_started = done
            self._count_write_back(done)
        self.durable = done
        self.stats.commits += 1

    def _count_write_back(self, done: int | None) -> None:
        """A write-back covering the batches < done has returned (None: none has)."""
        if done is not None:
            self.written_back = done
            self.stats.write_backs += bool(self.pool.members)
            self.stats.write_back_seconds = self.background.seconds

    def join_write_back(self) -> float:
        """Wait for the write-back in flight, if any, and count it; returns the seconds waited.
        Called by a commit's steps, or with no commit in flight (Runtime.wait_idle): never beside one."""
        started = time.perf_counter()
        self._count_write_back(self.background.join())
        return time.perf_counter() - started

    def close(self) -> None:
        """Wait for the write-back in flight, if any: the pools close after this, and a sync still
        running must not see its descriptor closed (or reused). A failure is dropped here, as the
        worker's are at detach: its commit never counted it. A Ctrl-C while waiting is raised once
        the sync has returned."""
        interrupted = None
        while True:
            try:
                self.background.join()
                break
            except KeyboardInterrupt as e:
                interrupted = e
            except CheckpointError:
                break
        if interrupted is not None:
            raise interrupted

    def seal_and_write_root(self, done: int, written: tuple[int, int, int] | None) -> None:
        """Make the snapshot at `done` valid (when one is due), then write the root naming `done`."""
        crash_point(CrashPoint.COMMIT_BETWEEN_ROWS_AND_SNAPSHOT)
        slot = snapshot_batch = None  # None: the root keeps naming the previous snapshot
        if written is not None:
            dense.seal_snapshot(self.pool, written[0], done, *written[1:])
            self.stats.snapshots += 1
            slot, snapshot_batch = written[0], done
            crash_point(CrashPoint.COMMIT_BEFORE_ROOT)
        start, start_seq = self.ring.start_after_reclaim(self._keep_from)
        roots = self._member_bytes("range_bytes")
        # ORDERING U2c: the dense snapshot of `done`, when one is due (payload persisted at hand-over,
        # header sealed just above), is durable before this root names it.
        self.pool.commit(batches_done=done, flags=self._root_flags, ring_start=start, ring_start_seq=start_seq,
                         dense_slot=slot, dense_batch=snapshot_batch)
        if self.stats.capacity_forced_bytes is not None:  # the members' roots: their pages
            self.stats.capacity_forced_bytes += self._member_bytes("range_bytes") - roots
        crash_point(CrashPoint.COMMIT_AFTER_ROOT)

    def persist_rows(self, dirty: DirtyRows) -> Iterator[None]:
        """Flush the rows `dirty` names, one table's rows per step, then drain."""
        for i, (table, rows) in enumerate(dirty):
            self.flush_rows(table, rows.numpy())
            if i == 0 and len(dirty) > 1:
                crash_point(CrashPoint.COMMIT_MID_ROWS)  # one table's rows flushed, more to go
            yield
        self.pool.device.drain()
        if self.pool.members and self._write_back:
            # ORDERING U2d: the capacity pools' dirty pages (cold rows) are durable (fdatasync)
            # before the root that names `done` is written (U2 across the pool set), at every
            # commit without steal, at a write-back waited for with it (between write-backs,
            # U2f: redo records).
            self._sync_members(forced=True)
        elif self._start_write_back is not None:
            # after this commit's rows are flushed: the write-back covers every batch before it
            self.background.start(self._start_write_back)
            self.write_back_started = self._start_write_back
            if self.background.serial:  # a crash test's fixed order (write_back.py)
                self.join_write_back()

    def _sync_members(self, *, forced: bool) -> None:
        """The capacity pools' pages written back and synced: by a commit, which waits for it
        (forced), or beside the commits (a write-back on its own thread)."""
        crash_point(CrashPoint.COMMIT_BEFORE_CAPACITY_SYNC)
        before = self._member_bytes("synced_bytes")
        self.ordering.sync_capacity(self.pool)
        if self.stats.capacity_forced_bytes is not None:
            synced = self._member_bytes("synced_bytes") - before
            if forced:
                self.stats.capacity_forced_bytes += synced
            else:  # only this thread adds to it, one write-back at a time
                self.stats.capacity_written_back_bytes += synced
        if self.steals:
            crash_point(CrashPoint.COMMIT_AFTER_WRITE_BACK)  # synced; the root still keeps the redo records

    def _member_bytes(self, counter: str) -> int:
        """A byte count summed over the capacity pools' devices (CapacityDevice's counters)."""
        return sum(getattr(member.device, counter, None) or 0 for member in self.pool.members)

    def flush_rows(self, table: LoggedTable, indices: np.ndarray) -> None:
        """Flush a table's rows `indices` (int64 [U], sorted): weights and optimizer state; no drain."""
        regions = self._row_regions(table)
        for device, region in regions:
            device.flush_rows(region.offset, region.row_stride, indices)
        self._count_rows(regions, indices.size)

    def rows_flushed(self, table: LoggedTable, count: int, runs: int) -> None:
        """Count `count` rows of a table (`runs` runs of adjacent ones) that the fused update wrote
        back itself (its device's native_persistence), weights and optimizer state, as flush_rows would."""
        regions = self._row_regions(table)
        for device, region in regions:
            device.rows_flushed(region.offset, region.row_stride, count, runs)
        self._count_rows(regions, count)

    def row_device(self, table: LoggedTable) -> Device:
        """The device that holds a table's rows (weights and optimizer state)."""
        weights = self.pool.region(table.weight_region)
        return self.pool.device_for(weights) if self.pool.members else self.pool.device

    def _row_regions(self, table: LoggedTable) -> list[tuple[Device, Region]]:
        """(device, region) of a table's weights, and of its optimizer state where it has one."""
        device = self.row_device(table)
        regions = [self.pool.region(table.weight_region)]
        if table.optimizer.state_columns:
            regions.append(self.pool.region(table.state_region))
        return [(device, region) for region in regions]

    def _count_rows(self, regions: list[tuple[Device, Region]], count: int) -> None:
        row_bytes = sum(region.row_stride for _, region in regions)
        self.stats.rows_persisted += count
        self.stats.row_bytes += count * row_bytes

    def _timed(self, steps: Iterator[None]) -> Iterator[None]:
        """`steps`, with the time of each step (not of the captures run between them) counted."""
        while True:
            started = time.perf_counter()
            finished = next(steps, StopIteration) is StopIteration
            self.stats.commit_seconds += time.perf_counter() - started
            if finished:
                return
            yield
