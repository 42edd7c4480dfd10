"""The orderings of the persistence protocol (docs/architecture.md §4) as one strategy object the checkpointer
holds, so that a planted bug is a different strategy rather than a flag its hot paths test.

Production runs `Ordering`. Each planted bug (faults.Planted, chosen with CXLTRAIN_FAULT) is a
subclass that breaks one rule, picked once when the checkpointer is built (for_planted):

    SkipUndoPersist      U1  the undo record is stored but never persisted
    CommitBeforeRows     U2  the root is written before the batch's rows are persisted
    CaptureBeforeUpdate  U4  the undo record holds the rows as they were before the previous update
    WindowNeverCleared   U1  (strict, k > 1) a row recorded in one commit window gets no record in later ones
    SkipCapacitySync     U2  (pool sets) the root names cold rows whose pages were never synced
    HeaderBeforePayload  U1  (fused capture) a chunk's header is durable before its payload is stored
    UpdateBeforeHeader   U1  (fused capture) a chunk's rows are updated before its header is written
    KernelSkipsRowFlush  U2  (fused capture) the kernel's row write-back writes nothing
    ReclaimBeforeWriteBack U3c (stealing sets) a write-back is counted when it starts, not when its sync returns
    RedoAfterCommit      U2f (stealing sets) a batch's redo records are written after its commit is durable
    CachedUpdateUnlogged U1f (hot-row cache) the slots' record is taken after the update stored into them

The fused capture's orders are step lists (fused.py), not flags: a planted one is another list.

Several planted at once combine (one class deriving from each).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Iterator, Protocol

import numpy as np
import torch

from ..faults import Planted, PlantedDist
from ..kernels.native import NativePersistence
from .fused import (
    HEADER_STOP,
    PAYLOAD_STOP,
    PERSIST_HEADER,
    PERSIST_PAYLOAD,
    PERSIST_TAIL,
    STORE_HEADER,
    STORE_TAIL,
    UPDATE,
)
from .seam import LoggedTable
from .window import WindowCaptures

if TYPE_CHECKING:
    from ..devices.base import Device


class CommitSteps(Protocol):
    """The two steps of a commit whose order an Ordering decides (commit.CommitPipeline has them);
    named here so this module needs nothing of the pipeline that calls it."""

    def persist_rows(self, dirty: list) -> Iterator[None]: ...

    def seal_and_write_root(self, done: int, written: tuple[int, int, int] | None) -> None: ...

    written_back: int          # batches the capacity pools hold durably: the last write-back returned covers them
    write_back_started: int    # batches the last write-back started covers


class Ordering:
    """The protocol's orderings as production runs them."""

    # Rows may be flushed right after their update, on the training thread (their drain before the
    # commit is handed over keeps U2); a strategy that needs the commit to flush them says False.
    flush_at_update = True
    # The fused capture (fused.py, kernels/undo.c) may write the undo records inside the update,
    # chunk by chunk, in the order of this step list (the crash tests' stops included).
    fused_capture = True
    # ORDERING U1i: a chunk's payload durable before its header, the header before the tail mark
    # that covers it, all three before the chunk's rows are updated (the kernel runs this list).
    fused_steps = (PERSIST_PAYLOAD, PAYLOAD_STOP, PERSIST_HEADER, PERSIST_TAIL, HEADER_STOP, UPDATE)

    # Stores outside a table's update (the hot-row cache's admission and re-placement) are
    # undo-logged first (U1).
    logs_cache_writes = True
    # A cached table's slots are undo-logged before its update stores into them (U1f).
    logs_slots_first = True
    # A stealing set's redo records of a batch are written before its commit is handed over (U2f).
    redo_before_commit = True

    def kernel_row_flush(self, flush: NativePersistence | None) -> NativePersistence | None:
        """How the fused update writes its updated rows back inside the kernel (U2's flush,
        checkpointer._kernel_row_flush): `flush`, the device's own way, or None."""
        return flush

    def undo_device(self, device: Device) -> Device:
        """The device an undo record is stored and persisted through (U1): the pool's."""
        return device

    def capture_source(self, table: LoggedTable,
                       storage: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (rows [R, P], state [R, K] or None) an undo record is gathered from (U4): the
        table's live storage, `storage` itself."""
        return storage

    def window_captures(self) -> WindowCaptures:
        """What tells a capture which rows already have a record in their commit window (U1)."""
        return WindowCaptures()

    def sync_capacity(self, pool) -> None:
        """Make a pool set's capacity pools durable (their pages written back and synced)."""
        pool.drain_members()

    def written_back(self, pipeline: CommitSteps) -> int:
        """The batches a stealing set's capacity pools hold durably, for U3c: those the last
        write-back that has returned covers."""
        return pipeline.written_back

    def commit(self, pipeline: CommitSteps, done: int, dirty: list, written) -> Iterator[None]:
        """A commit's steps up to its durable root: the rows, then the snapshot and the root."""
        yield from pipeline.persist_rows(dirty)
        # ORDERING U2b: the rows updated in place since the last commit are durable (persist_rows
        # ends with a drain) before the root that names `done` is written.
        pipeline.seal_and_write_root(done, written)

    def keep_from(self, done: int, agreed: int | None) -> int:
        """The oldest batch whose undo records the commit at `done` keeps: `done` in a single
        process; in a distributed run (agreed: the last target G all ranks agreed on) never above
        G, since a peer may still need this rank rolled back to G (docs/distributed.md)."""
        # ORDERING U3b: in a distributed run, records of batches at or above the agreed target G
        # are kept whatever this pool's own root says.
        return done if agreed is None else min(done, agreed)


class SkipUndoPersist(Ordering):
    """Planted U1 bug: the record's stores land, its persists are left out."""

    def undo_device(self, device: Device) -> Device:
        return _UnpersistedDevice(device)


class SkipCapacitySync(Ordering):
    """Planted U2 bug across a pool set: the capacity pools' pages are never synced before the root."""

    def sync_capacity(self, pool) -> None:
        pass


class ReclaimBeforeWriteBack(Ordering):
    """Planted U3c bug: a write-back beside the commits counts from its start, so the next commit's
    root moves the ring's live start past the redo records while the sync may still be running."""

    def written_back(self, pipeline: CommitSteps) -> int:
        return pipeline.write_back_started


class RedoAfterCommit(Ordering):
    """Planted U2f bug: a batch's redo records are written once the commit naming it is durable."""

    redo_before_commit = False


class UnloggedAdmission(Ordering):
    """Planted U1 bug for the hot-row cache: slots are filled with no undo record of them first."""

    logs_cache_writes = False


class CachedUpdateUnlogged(Ordering):
    """Planted U1f bug: a cached table's slots are recorded after its update stored into them (the
    record holds the new values)."""

    fused_capture = False  # the fused update records the slots before each chunk's stores
    logs_slots_first = False


class CommitBeforeRows(Ordering):
    """Planted U2 bug: the root names the batch before its rows are durable."""

    flush_at_update = False  # the rows must still be unflushed when the root is written

    def commit(self, pipeline: CommitSteps, done: int, dirty: list, written) -> Iterator[None]:
        pipeline.seal_and_write_root(done, written)
        yield from pipeline.persist_rows(dirty)


class CaptureBeforeUpdate(Ordering):
    """Planted U4 bug: the record is gathered from the rows as they were at the table's previous
    capture, i.e. before the previous batch's update — what capturing too early records."""

    fused_capture = False  # the record's source is not the live rows the fused kernel reads

    def __init__(self) -> None:
        self._stale: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def capture_source(self, table, storage):
        weights, state = storage
        copy = (weights.clone(), None if state is None else state.clone())
        previous = self._stale.get(table.name, copy)
        self._stale[table.name] = copy
        return previous


class WindowNeverCleared(Ordering):
    """Planted U1 bug (strict, k > 1): the rows recorded in a commit window stay marked in the next
    ones, so a row touched again after a commit gets no record there — what a window that is never
    cleared would do."""

    def window_captures(self) -> WindowCaptures:
        return _NeverCleared()


class _NeverCleared(WindowCaptures):
    def _clear(self) -> None:
        pass


class HeaderBeforePayload(Ordering):
    """Planted U1 bug in the fused capture: each chunk's header (and the tail mark covering it) is
    made durable before the chunk's payload is even stored."""

    fused_steps = (PERSIST_HEADER, PERSIST_TAIL, PAYLOAD_STOP, PERSIST_PAYLOAD, HEADER_STOP, UPDATE)


class UpdateBeforeHeader(Ordering):
    """Planted U1 bug in the fused capture: each chunk's payload is durable, but the rows are
    updated in place before the headers that make the records valid are written, and those are
    then only stored, never persisted (a SIGKILL before they are stored, or a power loss after the
    rows' flush, finds updated rows and no valid record)."""

    fused_steps = (PERSIST_PAYLOAD, PAYLOAD_STOP, UPDATE, HEADER_STOP, STORE_HEADER, STORE_TAIL)


class KernelSkipsRowFlush(Ordering):
    """Planted U2 bug in the fused update: the kernel counts its rows' flush and never does it, so
    the root names rows that are still only in the caches (visible under power loss only)."""

    def kernel_row_flush(self, flush: NativePersistence | None) -> NativePersistence | None:
        return None if flush is None else dataclasses.replace(flush, kind=NativePersistence.NONE)


class ReclaimAboveAgreed(Ordering):
    """Planted U3b bug: a rank reclaims up to its own commit, ignoring the agreed target G."""

    def keep_from(self, done: int, agreed: int | None) -> int:
        return done


PLANTED_ORDERINGS: dict[str, type[Ordering]] = {
    Planted.SKIP_UNDO_PERSIST: SkipUndoPersist,
    Planted.COMMIT_BEFORE_ROWS: CommitBeforeRows,
    Planted.CAPTURE_BEFORE_UPDATE: CaptureBeforeUpdate,
    Planted.WINDOW_NEVER_CLEARED: WindowNeverCleared,
    Planted.SKIP_CAPACITY_SYNC: SkipCapacitySync,
    Planted.HEADER_BEFORE_PAYLOAD: HeaderBeforePayload,
    Planted.UPDATE_BEFORE_HEADER: UpdateBeforeHeader,
    Planted.KERNEL_SKIPS_ROW_FLUSH: KernelSkipsRowFlush,
    Planted.UNLOGGED_ADMISSION: UnloggedAdmission,
    Planted.CACHED_UPDATE_UNLOGGED: CachedUpdateUnlogged,
    Planted.RECLAIM_BEFORE_WRITE_BACK: ReclaimBeforeWriteBack,
    Planted.REDO_AFTER_COMMIT: RedoAfterCommit,
    PlantedDist.RECLAIM_ABOVE_AGREED: ReclaimAboveAgreed,
}


def for_planted(planted: Iterable[str]) -> Ordering:
    """The strategy for these planted faults (names from faults.Planted; others are not the
    checkpointer's and are ignored): production's when none of them is one of PLANTED_ORDERINGS."""
    bugs = tuple(PLANTED_ORDERINGS[name] for name in sorted(planted) if name in PLANTED_ORDERINGS)
    if not bugs:
        return Ordering()
    if len(bugs) == 1:
        return bugs[0]()
    return type("PlantedOrdering", bugs, {})()


class _UnpersistedDevice:
    """The planted U1 bug's view of a device: stores go through, persists do nothing."""

    def __init__(self, device: Device) -> None:
        self._device = device

    @property
    def array(self) -> np.ndarray:
        return self._device.array

    def persist(self, offset: int, length: int) -> None:
        pass

    def persist_streamed(self, offset: int, length: int) -> None:
        pass

    def native_persistence(self) -> None:
        return None  # native code would persist around this view

    def copy_persist(self, offset: int, data: bytes) -> None:
        self.array[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
