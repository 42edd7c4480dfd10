"""The undo ring: append records of old rows (U1), reclaim them once a durable root allows (U3),
and scan the live ones back for recovery. The byte layout is in layout.py.

Shapes: U rows in a record, R rows in the table, P floats per padded row, K state columns.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CheckpointError, PoolCorruptError
from ..faults import CrashPoint, crash_point
from ..kernels import native
from ..pool.format import Region, RegionKind, checksum_seed
from ..pool.handle import Pool
from . import layout

if TYPE_CHECKING:  # the writer's tensors; the reading side (scan, restore) is recovery's, which needs no torch
    import torch

    from .fused import FusedUndo


@dataclasses.dataclass(frozen=True)
class LiveRecord:
    """A live record, or a run of `count` records of one batch laid back to back (a fused update's
    chunk records: seqs seq .. seq + count - 1), which the ring keeps and reclaims as one."""

    offset: int     # within the ring region
    size: int       # ring bytes, headers and padding included
    seq: int        # the (first) record's
    batch: int
    count: int = 1


class RingFull(CheckpointError):
    """No room for a record until a commit reclaims older ones."""


@dataclasses.dataclass(frozen=True)
class SlotRecords:
    """A hot-row cache's slots a fused update stores into (plan_chunks): slot_of int32 [R], each
    table row's slot (-1: the row is its own copy), of the S slots of the slots' regions; fresh
    bool [S], the slots to record (None: every one the update stores into)."""

    weights_region: Region
    state_region: Region
    slot_of: np.ndarray
    fresh: np.ndarray | None = None


class UndoRing:
    """Writer side of the ring. It starts empty, at (start, start_seq) of the current generation:
    the checkpointer only writes after recovery has begun a fresh generation.

    One thread appends; another may reclaim and ask for the start concurrently: the live-record
    bookkeeping (where records are, head, next seq) changes only under `_lock`."""

    def __init__(self, pool: Pool, generation: int, start: int, start_seq: int, record_device=None) -> None:
        self.pool = pool
        # what records are stored and persisted through: the pool's device (a planted U1 bug's
        # view of it in crash tests: checkpoint/ordering.py)
        self._record_device = pool.device if record_device is None else record_device
        self.region = pool.region(layout.RING_REGION)
        self.capacity = layout.ring_record_bytes(self.region.size)  # the tail mark follows
        self.generation = generation
        self.head = start            # where the next record goes (if it fits there)
        self.next_seq = start_seq
        self.marked = start_seq      # the tail mark covers records [0, marked) of this generation
        self._live: collections.deque[LiveRecord] = collections.deque()
        self._lock = threading.Lock()
        # kept as a running total: the training thread reads it while the worker appends
        self.live_bytes = 0
        self._streaming_fields: dict | None = None  # _streaming()

    @property
    def free_bytes(self) -> int:
        """Bytes a record could still be given, at most (fragmentation at the wrap aside)."""
        return self.capacity - self.live_bytes

    def _place(self, size: int) -> int:
        """Ring offset for a record of `size` bytes; raises RingFull when there is no room."""
        if size > self.capacity:
            raise CheckpointError(f"an undo record of {size:,} bytes cannot fit the {self.region.size:,}-byte undo ring "
                                  f"({self.capacity:,} bytes for records); "
                                  "create the pool with a larger ring (Runtime(undo_ring_bytes=...))")
        if not self._live:
            return self.head if self.head + size <= self.capacity else 0
        first, last = self._live[0], self._live[-1]
        if last.offset >= first.offset:  # live bytes are [first, head): room after head, then before first
            if self.head + size <= self.capacity:
                return self.head
            if size <= first.offset:
                return 0
        elif self.head + size <= first.offset:  # wrapped: live bytes are [first, end) and [0, head)
            return self.head
        raise RingFull(f"undo ring full: {self.live_bytes:,} of {self.capacity:,} bytes live")

    def append(self, batch: int, weights_region: Region, state_region: Region | None, rows: torch.Tensor,
               weights: torch.Tensor, state: torch.Tensor | None, *, redo: bool = False) -> int:
        """Write the record of `batch` for one table and make it durable; returns its ring bytes.

        rows [U] int64 unique; weights [R, P] the table's padded rows; state [R, K] or None.
        The rows' values are gathered straight into the ring (no staging copy, non-temporal stores):
        their old values (an undo record) or, with redo, their new ones (a redo record, layout.py).
        """
        from ..kernels import ops as row_ops  # torch: the writer only (recovery imports this module too)

        count = rows.numel()
        row_bytes = weights_region.row_stride
        state_bytes = state_region.row_stride if state_region is not None else 0
        size = layout.record_bytes(count, row_bytes, state_bytes)
        with self._lock:  # placed against the live records; reclaim can only free more meanwhile
            offset = self._place(size)
        base = self.region.offset + offset
        device = self._record_device
        payload_len = layout.payload_bytes(count, row_bytes, state_bytes)
        payload = device.array[base + layout.UNDO_HEADER.size : base + layout.UNDO_HEADER.size + payload_len]
        streamed = row_ops.capture_undo(*layout.split_payload(payload, count, row_bytes, state_bytes), weights, state,
                                        rows)
        header = layout.UndoHeader(weights_region.index, self.generation, self.next_seq, batch, count, row_bytes,
                                   state_bytes, layout.payload_checksum(payload, self.pool.superblock.uuid,
                                                                        self.generation, self.next_seq),
                                   None if state_region is None else state_region.index, redo)
        if streamed:  # non-temporal stores: no cache lines to write back
            device.persist_streamed(base + layout.UNDO_HEADER.size, payload_len)
        else:
            device.persist(base + layout.UNDO_HEADER.size, payload_len)
        crash_point(CrashPoint.UNDO_BETWEEN_PAYLOAD_AND_HEADER)
        # ORDERING U1a: the payload is durable before the header that makes it valid, and the whole
        # record is durable when append returns (before the batch's first in-place store: U1b, U1c).
        device.copy_persist(base, header.pack(self.pool.superblock.uuid))
        with self._lock:
            self._take(LiveRecord(offset, size, self.next_seq, batch))
        return size

    def _take(self, record: LiveRecord) -> None:
        """Count `record`, placed by _place, as the ring's newest live record (the caller holds _lock)."""
        self._live.append(record)
        self.live_bytes += record.size
        self.head = record.offset + record.size
        self.next_seq += record.count

    @property
    def record_device(self):
        """The device the records are written through (the pool's, or a planted bug's wrapper)."""
        return self._record_device

    def streams(self) -> bool:
        """Whether a native kernel can make records durable itself on this ring's device (plan_chunks);
        a planted bug's view of the device says no (its persists are what it changes)."""
        return self._record_device.native_persistence() is not None

    def plan_chunks(self, batch: int, weights_region: Region, state_region: Region | None, rows: np.ndarray,
                    recorded: np.ndarray | None, chunk_rows: int, steps: tuple[str, ...] | None = None,
                    slots: SlotRecords | None = None) -> tuple[FusedUndo, list[LiveRecord]]:
        """Lay out the records a fused update writes for `batch` and one table (fused.FusedUndo), in
        the order `steps` says (an Ordering's fused_steps; None: production's):
        rows [U] int64, the update's unique rows, taken in chunks of `chunk_rows`; recorded [V], the
        sorted subset that needs a record (capture once per window); one record per chunk that has a
        recorded row, placed one after the other as append would place them. slots: a hot-row
        cache's slots the same update stores into (SlotRecords); each chunk's slots' record goes
        right after the chunk's table record (FusedUndo.slots), and recorded may be None: every row
        the cache leaves in the table. Writes nothing and changes no bookkeeping: land() does, once
        the kernel has written them (table and slots' records: one list, in ring order). Raises
        RingFull when they do not all fit. Only where streams() holds."""
        from . import fused, ordering  # torch: the writer only

        steps = ordering.Ordering.fused_steps if steps is None else steps
        template, row_payload = self._template(batch, weights_region, state_region)
        if slots is None:
            # rec_first [C + 1]: each chunk's recorded rows; sizes [K]: a record per chunk with any
            rec_first, sizes, total = fused.undo_chunk_counts(rows, recorded, chunk_rows, layout.UNDO_HEADER.size,
                                                                row_payload, layout.RECORD_ALIGN)
        else:  # both kinds' records in one pass, their sizes [K + K'] in ring order
            slot_template, slot_payload = self._template(batch, slots.weights_region, slots.state_region)
            counts = fused.undo_cached_counts(rows, recorded, slots.slot_of, slots.fresh,
                                              slots.weights_region.shape[0], chunk_rows, layout.UNDO_HEADER.size,
                                              row_payload, slot_payload, layout.RECORD_ALIGN)
            rec_first, recorded, sizes, total = counts.rec_first, counts.recorded, counts.sizes, counts.total
        with self._lock:  # placed against the live records, tentatively: taken back before the lock goes
            head, live_bytes, seq, live = self.head, self.live_bytes, self.next_seq, len(self._live)
            try:
                placed, offsets = self._place_records(sizes, total, batch)
            finally:
                while len(self._live) > live:
                    self._live.pop()
                self.head, self.live_bytes, self.next_seq = head, live_bytes, seq
        run_start = placed[0].offset if placed else 0
        # every header from one template per kind: seq (in ring order), count and payload bytes differ per record
        laid_out = fused.undo_chunk_headers(template, seq, rec_first, sizes, offsets, run_start, row_payload,
                                            None if slots is None else (slot_template, counts.slot_first,
                                                                        slot_payload))
        shared = self._streaming()
        undo = fused.FusedUndo(rows=rows, recorded=recorded, chunk_rows=chunk_rows, rec_first=rec_first,
                               rec_offset=laid_out[0], headers=laid_out[1], steps=steps,
                               ring_bytes=total - (0 if slots is None else counts.slot_bytes), **shared)
        if slots is not None:
            undo.slots = fused.FusedUndo(rows=rows, recorded=counts.slot_ids, chunk_rows=chunk_rows,
                                         rec_first=counts.slot_first, rec_offset=laid_out[2], headers=laid_out[3],
                                         steps=steps, ring_bytes=counts.slot_bytes, **shared)
        # a chunk's record: payload, header, two tail mark copies
        self._record_device.streamed_persisted(self.region.offset, total, 4 * sizes.size)
        return undo, placed

    def _template(self, batch: int, weights_region: Region, state_region: Region | None) -> tuple[bytes, int]:
        """(the header template of a table's chunk records in `batch`, the payload bytes of one row)."""
        row_bytes = weights_region.row_stride
        state_bytes = state_region.row_stride if state_region is not None else 0
        template = layout.UndoHeader(weights_region.index, self.generation, 0, batch, 0, row_bytes, state_bytes, 0,
                                     None if state_region is None else state_region.index).template()
        return template, layout.payload_bytes(1, row_bytes, state_bytes)

    def _streaming(self) -> dict:
        """What every FusedUndo of this ring shares (the ring's addresses, the generation's seeds
        and tail mark templates, which the kernel only reads), worked out once per mapping."""
        device = self._record_device
        ring = native.address(device.array) + self.region.offset  # raises once the device is closed
        persistence = device.native_persistence()  # an observer set since changes it (on_fence)
        if (self._streaming_fields is None or self._streaming_fields["ring"] != ring
                or self._streaming_fields["persistence"] != persistence):
            uuid = self.pool.superblock.uuid
            tails = np.frombuffer(layout.tail_mark_template(self.generation) * layout.TAIL_COPIES,
                                  dtype=np.uint8).reshape(layout.TAIL_COPIES, -1).copy()
            self._streaming_fields = dict(
                ring=ring, persistence=persistence, payload_seed=layout.payload_checksum_base(uuid, self.generation),
                header_seed=layout.header_checksum_seed(uuid, self.generation), tails=tails,
                tail_seeds=np.array([checksum_seed(uuid, copy) for copy in range(layout.TAIL_COPIES)],
                                    dtype=np.uint32),
                tail_offset=self.capacity)
            for shared in ("tails", "tail_seeds"):  # every layout of this ring hands the kernel these very arrays
                self._streaming_fields[shared].flags.writeable = False
        return self._streaming_fields

    def _place_records(self, sizes: np.ndarray, total: int, batch: int) -> tuple[list[LiveRecord], np.ndarray | None]:
        """Place records of `sizes` [K] bytes (`total` in all) of `batch`, one after the other as
        append would, and take them in (the caller holds _lock): as one run where they all fit at
        the head, else one by one (the first ones at the head, the rest from the ring's start: a run
        moved whole to the start would leave the head's room unused). Returns what was taken, and
        each record's offset [K] where they went one by one (None: one run, back to back); raises
        RingFull when they do not all fit."""
        if total and total <= self.capacity:
            try:
                at = self._place(total)
            except RingFull:
                at = None  # maybe room one by one, across the wrap
            if at == self.head:
                self._take(LiveRecord(at, total, self.next_seq, batch, int(sizes.size)))
                return [self._live[-1]], None
        placed = []
        for size in sizes.tolist():
            placed.append(LiveRecord(self._place(size), size, self.next_seq, batch))
            self._take(placed[-1])
        return placed, np.array([r.offset for r in placed], dtype=np.int64)

    def land(self, records: list[LiveRecord]) -> None:
        """The records plan_chunks laid out are written and durable, and the tail mark covers them
        (the kernel wrote it after each one's header): take them into the bookkeeping."""
        if not records:
            return
        with self._lock:
            for record in records:
                if record.seq != self.next_seq:
                    raise CheckpointError(f"undo record {record.seq} lands out of order (next is {self.next_seq})")
                self._take(record)
            self.marked = self.next_seq

    def mark_tail(self) -> None:
        """Make the tail mark cover every record appended so far, durably. Call before the first
        in-place store a new record undoes. Both copies get the same values, one after the other,
        so a crash tears at most one and media damage to one leaves the other."""
        if self.marked == self.next_seq:
            return
        uuid = self.pool.superblock.uuid
        for copy in range(layout.TAIL_COPIES):
            self.pool.device.copy_persist(self.region.offset + self.capacity + copy * layout.TAIL_MARK.size,
                                          layout.pack_tail_mark(self.generation, self.next_seq, uuid, copy))
        self.marked = self.next_seq

    def start_after_reclaim(self, target: int) -> tuple[int, int]:
        """(ring_start, ring_start_seq) for a root whose recovery target is `target` batches: the
        oldest record that root still needs, or the head when it needs none. Changes nothing."""
        with self._lock:
            for record in self._live:
                if record.batch >= target:
                    return record.offset, record.seq
            return self.head, self.next_seq

    def reclaim(self, target: int) -> None:
        """Forget records of batches < target. Call only once a root with that target is durable (U3)."""
        with self._lock:
            while self._live and self._live[0].batch < target:
                self.live_bytes -= self._live.popleft().size


# ---------------------------------------------------------------------------------------------
# Reading the ring back (recovery).
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ScannedRecord:
    offset: int
    header: layout.UndoHeader
    weights_region: Region
    state_region: Region | None


def scan(pool: Pool, generation: int, start: int, start_seq: int) -> list[ScannedRecord]:
    """The live records, oldest first, each fully checked: header, payload checksum, the regions it
    names and the row indices it holds. Raises PoolCorruptError on a record whose header is valid
    but whose body is not (media corruption: by U1 a valid header vouches for its payload), and
    when the log ends before a record the tail mark says is complete (its header was damaged)."""
    region = pool.region(layout.RING_REGION)
    capacity = layout.ring_record_bytes(region.size)
    ring = pool.device.array[region.offset : region.offset + capacity]
    uuid = pool.superblock.uuid
    marked = _tail_mark(pool.device.array[region.offset + capacity : region.end], uuid, generation)
    by_index = {r.index: r for r in pool.regions.values()}
    records: list[ScannedRecord] = []
    pos, seq = start, start_seq
    while len(records) <= region.size // layout.RECORD_ALIGN:
        header = _header_at(ring, pos, uuid, generation, seq)
        if header is None and pos != 0:
            pos, header = 0, _header_at(ring, 0, uuid, generation, seq)  # the writer wrapped
        if header is None:
            break  # the end of the log: by U1, no in-place store of this record's batch was issued
        records.append(_check_record(ring, pos, header, by_index, uuid))
        pos += header.record_bytes
        seq += 1
    if seq < marked:
        raise PoolCorruptError(f"undo record {seq} is damaged: no valid header where it should be, but the ring's "
                               f"tail mark says records up to {marked - 1} are complete (media corruption)")
    return records


def _tail_mark(tail: np.ndarray, uuid: bytes, generation: int) -> int:
    """seq_end of the tail mark for `generation` (0: none yet). One bad copy is a torn write or
    damage the other copy outlives; both bad is damage, refused."""
    if tail.size < layout.TAIL_BYTES:
        return 0
    copies = [tail[i * layout.TAIL_MARK.size : (i + 1) * layout.TAIL_MARK.size] for i in range(layout.TAIL_COPIES)]
    marks = [layout.unpack_tail_mark(raw.tobytes(), uuid, i) for i, raw in enumerate(copies)]
    if all(mark is None and raw.any() for mark, raw in zip(marks, copies)):
        raise PoolCorruptError("the undo ring's tail mark is damaged (both copies)")
    return max((mark[1] for mark in marks if mark is not None and mark[0] == generation), default=0)


def _header_at(ring: np.ndarray, pos: int, uuid: bytes, generation: int, seq: int) -> layout.UndoHeader | None:
    if pos + layout.UNDO_HEADER.size > ring.size:
        return None
    header = layout.unpack_undo_header(ring[pos : pos + layout.UNDO_HEADER.size].tobytes(), uuid)
    if header is None or header.generation != generation or header.seq != seq:
        return None
    if pos + header.record_bytes > ring.size:
        return None
    return header


def _check_record(ring: np.ndarray, pos: int, header: layout.UndoHeader, by_index: dict[int, Region],
                  uuid: bytes) -> ScannedRecord:
    where = f"undo record {header.seq} (batch {header.batch}) at ring offset {pos}"
    payload = ring[pos + layout.UNDO_HEADER.size : pos + layout.UNDO_HEADER.size + header.payload_bytes]
    if layout.payload_checksum(payload, uuid, header.generation, header.seq) != header.payload_crc:
        raise PoolCorruptError(f"{where}: payload checksum mismatch (media corruption)")
    weights = by_index.get(header.weight_region)
    if weights is None or weights.kind != RegionKind.TABLE_WEIGHTS or weights.row_stride != header.row_bytes:
        raise PoolCorruptError(f"{where}: names no table weight region with {header.row_bytes}-byte rows")
    state = None
    if header.state_region is not None:
        state = by_index.get(header.state_region)
        if (state is None or state.kind != RegionKind.TABLE_OPTIM_STATE or state.row_stride != header.state_bytes
                or state.shape[0] != weights.shape[0]):
            raise PoolCorruptError(f"{where}: names no optimizer-state region matching its table")
    elif header.state_bytes:
        raise PoolCorruptError(f"{where}: carries optimizer state but names no region for it")
    indices = layout.split_payload(payload, header.count, header.row_bytes, header.state_bytes)[2]
    if header.count and (int(indices.min()) < 0 or int(indices.max()) >= weights.shape[0]):
        raise PoolCorruptError(f"{where}: row index out of range for {weights.name!r}")
    return ScannedRecord(pos, header, weights, state)


def restore(pool: Pool, ring_region: Region, record: ScannedRecord) -> None:
    """Write a record's old rows back in place and flush them (the caller drains). Absolute values:
    restoring twice is the same as once, so a crash during recovery is repaired by recovering again."""
    h = record.header
    array = pool.device.array  # the ring is the primary's
    base = ring_region.offset + record.offset + layout.UNDO_HEADER.size
    old_weights, old_state, rows = layout.split_payload(array[base : base + h.payload_bytes], h.count, h.row_bytes,
                                                        h.state_bytes)
    _scatter_rows(pool, record.weights_region, rows, old_weights)
    if record.state_region is not None:
        _scatter_rows(pool, record.state_region, rows, old_state)


def _scatter_rows(pool: Pool, region: Region, rows: np.ndarray, values: np.ndarray) -> None:
    """region row r := values[i] for r = rows[i], as raw bytes; flushed, not drained. The region
    may be a capacity pool's (a pool set): its own device holds it."""
    device = pool.device_for(region) if pool.members else pool.device
    table = device.array[region.offset : region.end].reshape(region.shape[0], region.row_stride)
    table[rows] = values
    device.flush_rows(region.offset, region.row_stride, rows)

