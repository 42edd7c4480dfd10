"""The checkpointer's on-media structures, defined here and nowhere else (docs/architecture.md §4).

The checkpointer owns three pool regions, named below, and the commit fields of the root
(pool_format.Root: ring_generation, ring_start, ring_start_seq, dense_slot, dense_batch).

Undo ring (`cxltrain.undo`, uint8 [capacity]): a circular log of records, each 64-byte aligned:

    +0     header, 64 bytes           written LAST: a valid header vouches for a durable payload (U1)
    +64    old weights [U, row_bytes]  the rows' bytes as they were before the batch's update
           old state   [U, state_bytes]
           row indices [U] int64       sorted ascending, unique
    (zero padding to a multiple of 64)

A redo record (pool sets, docs/tiers.md "Steal, no force") is laid out the same, with the magic
REDO: the weights and state are a capacity table's rows as batch `batch` left them (new values,
written after the update, before the commit that names the batch). Recovery applies the committed
ones (batch < target) oldest first, before it restores the undo records. A build that knows only
UNDO stops its scan at a redo header and, the tail mark saying more records follow, refuses the
pool as damaged: it never rolls back with a redo record missed.

A record is live when its header checksum holds, it carries the root's ring generation, and its
sequence number is the one the scan expects next (records are numbered 0, 1, 2, ... within a
generation, so a stale record left over in a reused place never carries the expected number). A
record that does not fit before the end of the ring goes to offset 0; the scan follows it there.

A table's record of one batch may come as several records (chunks), each an ordinary record of a
part of the batch's rows: the fused capture (kernels/undo.c, checkpoint/fused.py) writes one per chunk of
the batch's unique rows, each durable before the rows in it are updated, so a crash mid-batch leaves
the valid records of the chunks it updated, followed by an invalid one (or none) that ends the
scan: by U1 per chunk, no row of that chunk or any later one was stored. Nothing on the media tells
a chunk from a whole record: recovery restores each the same way, and a pool written either way
reads back with the same code (no format change, no feature bit).

Record batch numbers are batch indices (0-based): the record of batch b holds the rows as they
were after b batches. Recovery to target T (= root.batches_done, batches done) restores every live
record with batch >= T; records with batch < T are reclaimable.

The ring's last 128 bytes are not records but two copies of the tail mark (64 bytes each, the same
values written to both, one after the other): "records [0, seq_end) of generation g are complete".
It is persisted before the first in-place store of a batch whose records it covers, so the scan can
tell a header that never became valid (a crash: the log ends there) from a valid header damaged
later (media corruption: refused), which a header's checksum alone cannot.

Dense slots (`cxltrain.dense.A`, `cxltrain.dense.B`, uint8 [capacity]): header (64 bytes, written
last) + the snapshot encoded by codec.py (dense parameters, optimizer state, RNG states, data
position). The root names the slot that holds the snapshot of its target.

Checksums are CRC-32 seeded with the pool UUID and, for records, the generation and sequence
number, so a record or snapshot from another pool, generation or place never validates.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np

from ..pool.format import align_up, checksum_more, checksum_seed, is_sealed, seal

RING_REGION = "cxltrain.undo"
DENSE_REGIONS = ("cxltrain.dense.A", "cxltrain.dense.B")   # root.dense_slot 1 and 2
# root.dense_slot 3: a group rank's pool (INCOMPAT_DENSE_SLICES) keeps its dense slices in three slots
SLICE_REGION = "cxltrain.dense.C"


def dense_slot_names(sliced: bool) -> tuple[str, ...]:
    """The dense slots' regions, slot 1 first: two, or three in a group rank's pool (its slices)."""
    return DENSE_REGIONS + ((SLICE_REGION,) if sliced else ())


RECORD_ALIGN = 64

UNDO_MAGIC = 0x4F444E55   # b"UNDO" little-endian
REDO_MAGIC = 0x4F444552   # b"REDO" little-endian: a redo record (new values of capacity rows)
TAIL_MAGIC = 0x4C494154   # b"TAIL" little-endian
DENSE_MAGIC = 0x534E4544  # b"DENS" little-endian

UNDO_HEADER = struct.Struct(
    "<"
    "I"    # magic
    "I"    # weight region: directory index of the table's weights
    "Q"    # ring generation
    "Q"    # sequence number within the generation
    "q"    # batch index whose update the record undoes
    "I"    # U: rows in the record
    "I"    # row_bytes: bytes per weight row (the padded row stride)
    "I"    # state_bytes: bytes per optimizer-state row (0: none)
    "I"    # payload checksum
    "Q"    # payload bytes
    "I"    # state region: directory index + 1 (0: none)
    "I"    # header checksum
)
assert UNDO_HEADER.size == 64
# where the native undo writer (kernels/undo.c) fills in the two checksums of a header template
# (and sets seq, count and payload bytes of each record's copy of one template)
UNDO_SEQ_AT, UNDO_COUNT_AT, UNDO_PAYLOAD_CRC_AT, UNDO_PAYLOAD_BYTES_AT, UNDO_HEADER_CRC_AT = 16, 32, 44, 48, 60
assert [struct.calcsize(f) for f in ("<IIQ", "<IIQQq", "<IIQQqIII", "<IIQQqIIII")] == \
    [UNDO_SEQ_AT, UNDO_COUNT_AT, UNDO_PAYLOAD_CRC_AT, UNDO_PAYLOAD_BYTES_AT]
assert UNDO_HEADER.size - 4 == UNDO_HEADER_CRC_AT


@dataclasses.dataclass(frozen=True)
class UndoHeader:
    weight_region: int
    generation: int
    seq: int
    batch: int
    count: int
    row_bytes: int
    state_bytes: int
    payload_crc: int
    state_region: int | None
    redo: bool = False    # a redo record: the rows' new values, not their old ones

    @property
    def payload_bytes(self) -> int:
        return payload_bytes(self.count, self.row_bytes, self.state_bytes)

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.count, self.row_bytes, self.state_bytes)

    def pack(self, uuid: bytes) -> bytes:
        state = 0 if self.state_region is None else self.state_region + 1
        magic = REDO_MAGIC if self.redo else UNDO_MAGIC
        body = UNDO_HEADER.pack(magic, self.weight_region, self.generation, self.seq, self.batch, self.count,
                                self.row_bytes, self.state_bytes, self.payload_crc, self.payload_bytes, state, 0)
        return seal(body, uuid, self.generation)

    def template(self) -> bytes:
        """The header with both checksum fields zero (payload_crc ignored), for a kernel to complete:
        the payload checksum at UNDO_PAYLOAD_CRC_AT, then the header's (seeded with
        header_checksum_seed) over the bytes before UNDO_HEADER_CRC_AT. pack() gives the same bytes."""
        state = 0 if self.state_region is None else self.state_region + 1
        return UNDO_HEADER.pack(UNDO_MAGIC, self.weight_region, self.generation, self.seq, self.batch, self.count,
                                self.row_bytes, self.state_bytes, 0, self.payload_bytes, state, 0)


def header_checksum_seed(uuid: bytes, generation: int) -> int:
    """What an undo header's checksum starts from (seal(body, uuid, generation))."""
    return checksum_seed(uuid, generation)


def unpack_undo_header(raw: bytes, uuid: bytes) -> UndoHeader | None:
    """The header in `raw`, or None when it is not a well-formed, checksummed header."""
    (magic, weight_region, generation, seq, batch, count, row_bytes, state_bytes, payload_crc, payload_bytes,
     state, _) = UNDO_HEADER.unpack(raw)
    if magic not in (UNDO_MAGIC, REDO_MAGIC) or not is_sealed(raw, uuid, generation):
        return None
    header = UndoHeader(weight_region, generation, seq, batch, count, row_bytes, state_bytes, payload_crc,
                        None if state == 0 else state - 1, magic == REDO_MAGIC)
    if batch < 0 or payload_bytes != header.payload_bytes:
        return None
    return header


TAIL_MARK = struct.Struct(
    "<"
    "I"    # magic
    "I"    # zero
    "Q"    # ring generation
    "Q"    # seq_end: records [0, seq_end) of that generation are complete
    "36s"  # reserved, zero
    "I"    # checksum
)
assert TAIL_MARK.size == 64
TAIL_COPIES = 2
TAIL_BYTES = TAIL_COPIES * TAIL_MARK.size  # at the end of the ring region


def ring_record_bytes(ring_bytes: int) -> int:
    """Bytes of a ring region of `ring_bytes` that hold records: all but the tail mark."""
    return max(0, ring_bytes - TAIL_BYTES)


def pack_tail_mark(generation: int, seq_end: int, uuid: bytes, copy: int) -> bytes:
    body = TAIL_MARK.pack(TAIL_MAGIC, 0, generation, seq_end, bytes(36), 0)
    return seal(body, uuid, copy)


def tail_mark_template(generation: int) -> bytes:
    """The tail mark with seq_end and the checksum zero, for a kernel to complete (seq_end at byte
    TAIL_SEQ_END_AT, then the checksum of the bytes before the last 4, seeded with checksum_seed(uuid,
    copy)); pack_tail_mark gives the same bytes."""
    return TAIL_MARK.pack(TAIL_MAGIC, 0, generation, 0, bytes(36), 0)


TAIL_SEQ_END_AT = 16
assert struct.calcsize("<IIQ") == TAIL_SEQ_END_AT


def native_undo_layout() -> dict[str, int]:
    """What the native undo writer (kernels/undo.c) must have compiled in, from the definitions
    above; checkpoint/fused.py compares it with the build's UNDO_LAYOUT before the first use."""
    return {"UNDO_HEADER_BYTES": UNDO_HEADER.size, "UNDO_SEQ_AT": UNDO_SEQ_AT, "UNDO_COUNT_AT": UNDO_COUNT_AT,
            "UNDO_PAYLOAD_CRC_AT": UNDO_PAYLOAD_CRC_AT, "UNDO_PAYLOAD_BYTES_AT": UNDO_PAYLOAD_BYTES_AT,
            "UNDO_HEADER_CRC_AT": UNDO_HEADER_CRC_AT, "TAIL_MARK_BYTES": TAIL_MARK.size,
            "TAIL_SEQ_END_AT": TAIL_SEQ_END_AT, "TAIL_CRC_AT": TAIL_MARK.size - 4, "TAIL_COPIES": TAIL_COPIES,
            "ROW_ID_BYTES": np.dtype(np.int64).itemsize}


def unpack_tail_mark(raw: bytes, uuid: bytes, copy: int) -> tuple[int, int] | None:
    """(generation, seq_end), or None when the copy is not a valid tail mark (torn or damaged)."""
    magic, zero, generation, seq_end, reserved, _ = TAIL_MARK.unpack(raw)
    if magic != TAIL_MAGIC or zero or any(reserved) or not is_sealed(raw, uuid, copy):
        return None
    return generation, seq_end


def payload_bytes(count: int, row_bytes: int, state_bytes: int) -> int:
    return count * (row_bytes + state_bytes + 8)


def record_bytes(count: int, row_bytes: int, state_bytes: int) -> int:
    """Ring bytes one record of `count` rows takes, header and padding included."""
    return align_up(UNDO_HEADER.size + payload_bytes(count, row_bytes, state_bytes), RECORD_ALIGN)


def split_payload(payload: np.ndarray, count: int, row_bytes: int, state_bytes: int):
    """The parts of a record payload (uint8 [payload_bytes], a view of the ring), as views:
    (weights uint8 [U, row_bytes], state uint8 [U, state_bytes], row indices int64 [U])."""
    w_end = count * row_bytes
    s_end = w_end + count * state_bytes
    return (payload[:w_end].reshape(count, row_bytes), payload[w_end:s_end].reshape(count, state_bytes),
            payload[s_end:].view(np.int64))


def payload_checksum(payload, uuid: bytes, generation: int, seq: int) -> int:
    return checksum_more(payload, payload_checksum_seed(uuid, generation, seq))


def payload_checksum_base(uuid: bytes, generation: int) -> int:
    """payload_checksum_seed before the seq: that seed is the CRC continued over the seq's low 32
    bits, little-endian (what the fused capture computes per record)."""
    return zlib.crc32(uuid + generation.to_bytes(8, "little"))


def payload_checksum_seed(uuid: bytes, generation: int, seq: int) -> int:
    """payload_checksum's start, for a payload checksummed piece by piece (pool_format.checksum_more)."""
    return checksum_seed(uuid + generation.to_bytes(8, "little"), seq & 0xFFFFFFFF)


DENSE_HEADER = struct.Struct(
    "<"
    "I"    # magic
    "I"    # zero
    "q"    # batch: batches the snapshot has seen
    "Q"    # payload bytes
    "I"    # payload checksum
    "32s"  # reserved, zero
    "I"    # header checksum
)
assert DENSE_HEADER.size == 64


def pack_dense_header(batch: int, payload_bytes: int, payload_crc: int, uuid: bytes, slot: int) -> bytes:
    body = DENSE_HEADER.pack(DENSE_MAGIC, 0, batch, payload_bytes, payload_crc, bytes(32), 0)
    return seal(body, uuid, slot)


def unpack_dense_header(raw: bytes, uuid: bytes, slot: int) -> tuple[int, int, int] | None:
    """(batch, payload bytes, payload checksum), or None when the header is not valid for `slot`."""
    magic, zero, batch, payload_bytes, payload_crc, reserved, _ = DENSE_HEADER.unpack(raw)
    if magic != DENSE_MAGIC or zero or any(reserved) or not is_sealed(raw, uuid, slot):
        return None
    return batch, payload_bytes, payload_crc
