"""The undo ring: append records of old rows (U1), reclaim them once a durable root allows (U3),
and scan the live ones back for recovery. The byte layout is in layout.py.

Shapes: U rows in a record, R rows in the table, P floats per padded row, K state columns.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch

from ..errors import CheckpointError, PoolCorruptError
from ..faults import crash_point, planted
from ..pool import Pool
from ..pool_format import Region, RegionKind
from . import layout


@dataclasses.dataclass(frozen=True)
class LiveRecord:
    offset: int     # within the ring region
    size: int       # ring bytes, header and padding included
    seq: int
    batch: int


class RingFull(CheckpointError):
    """No room for a record until a commit reclaims older ones."""


class UndoRing:
    """Writer side of the ring. It starts empty, at (start, start_seq) of the current generation:
    the checkpointer only writes after recovery has begun a fresh generation."""

    def __init__(self, pool: Pool, generation: int, start: int, start_seq: int) -> None:
        self.pool = pool
        self.region = pool.region(layout.RING_REGION)
        self.capacity = self.region.size
        self.generation = generation
        self.head = start            # where the next record goes (if it fits there)
        self.next_seq = start_seq
        self._live: collections.deque[LiveRecord] = collections.deque()
        # kept as a running total: the training thread reads it while the worker appends
        self.live_bytes = 0

    @property
    def free_bytes(self) -> int:
        """Bytes a record could still be given, at most (fragmentation at the wrap aside)."""
        return self.capacity - self.live_bytes

    def _place(self, size: int) -> int:
        """Ring offset for a record of `size` bytes; raises RingFull when there is no room."""
        if size > self.capacity:
            raise CheckpointError(f"an undo record of {size:,} bytes cannot fit the {self.capacity:,}-byte undo ring; "
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
               weights: torch.Tensor, state: torch.Tensor | None) -> int:
        """Write the record of `batch` for one table and make it durable; returns its ring bytes.

        rows [U] int64 unique; weights [R, P] the table's padded rows; state [R, K] or None.
        The old values are gathered straight into the ring (no staging copy).
        """
        count = rows.numel()
        row_bytes = weights_region.row_stride
        state_bytes = state_region.row_stride if state_region is not None else 0
        size = layout.record_bytes(count, row_bytes, state_bytes)
        offset = self._place(size)
        base = self.region.offset + offset
        device = self.pool.device
        payload_len = layout.payload_bytes(count, row_bytes, state_bytes)
        payload = device.array[base + layout.UNDO_HEADER.size : base + layout.UNDO_HEADER.size + payload_len]
        old_weights, old_state, indices = layout.split_payload(payload, count, row_bytes, state_bytes)
        torch.index_select(weights, 0, rows, out=torch.from_numpy(old_weights.view(np.float32)))
        if state is not None:
            torch.index_select(state, 0, rows, out=torch.from_numpy(old_state.view(np.float32)))
        indices[:] = rows.numpy()
        header = layout.UndoHeader(weights_region.index, self.generation, self.next_seq, batch, count, row_bytes,
                                   state_bytes, layout.payload_checksum(payload, self.pool.superblock.uuid,
                                                                        self.generation, self.next_seq),
                                   None if state_region is None else state_region.index)
        if not planted("skip-undo-persist"):  # test-only: U1's persists left out on purpose
            device.persist(base + layout.UNDO_HEADER.size, payload_len)
            crash_point("undo:between-payload-and-header")
            # U1 — undo before overwrite: the payload is durable before the header that makes it
            # valid, and the whole record is durable when append returns, which the caller does
            # before the batch's first in-place store into these rows.
            device.copy_persist(base, header.pack(self.pool.superblock.uuid))
        else:
            device.array[base : base + layout.UNDO_HEADER.size] = np.frombuffer(
                header.pack(self.pool.superblock.uuid), dtype=np.uint8)
        self._live.append(LiveRecord(offset, size, self.next_seq, batch))
        self.live_bytes += size
        self.head = offset + size
        self.next_seq += 1
        return size

    def start_after_reclaim(self, target: int) -> tuple[int, int]:
        """(ring_start, ring_start_seq) for a root whose recovery target is `target` batches: the
        oldest record that root still needs, or the head when it needs none. Changes nothing."""
        for record in self._live:
            if record.batch >= target:
                return record.offset, record.seq
        return self.head, self.next_seq

    def reclaim(self, target: int) -> None:
        """Forget records of batches < target. Call only once a root with that target is durable (U3)."""
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
    but whose body is not (media corruption: by U1 a valid header vouches for its payload)."""
    region = pool.region(layout.RING_REGION)
    ring = pool.device.array[region.offset : region.end]
    uuid = pool.superblock.uuid
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
    return records


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
    array = pool.device.array
    base = ring_region.offset + record.offset + layout.UNDO_HEADER.size
    old_weights, old_state, rows = layout.split_payload(array[base : base + h.payload_bytes], h.count, h.row_bytes,
                                                        h.state_bytes)
    _scatter_rows(pool, record.weights_region, rows, old_weights)
    if record.state_region is not None:
        _scatter_rows(pool, record.state_region, rows, old_state)


def _scatter_rows(pool: Pool, region: Region, rows: np.ndarray, values: np.ndarray) -> None:
    """region row r := values[i] for r = rows[i], as raw bytes; flushed, not drained."""
    array = pool.device.array
    table = array[region.offset : region.end].reshape(region.shape[0], region.row_stride)
    table[rows] = values
    pool.device.flush_rows(region.offset, region.row_stride, rows)

