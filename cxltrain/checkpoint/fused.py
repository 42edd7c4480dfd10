"""The fused capture's undo writer: the checkpoint layer's side of kernels/undo.c, which writes a
batch's undo records chunk by chunk inside the fused sparse update (kernels/ops.sparse_update).

The writer's record layout is layout.py's, the one definition: the C build exports the offsets it
compiled in (UNDO_LAYOUT) and `writer()` refuses a build that disagrees before its first use. Its
arguments go by name (FusedUndo.kernel_fields, read by undo.c undo_read). The order in which a
chunk's record is written is data, a step list the checkpointer's Ordering holds (ordering.py):

    PERSIST_PAYLOAD, PERSIST_HEADER, PERSIST_TAIL   store that part of the record, then persist it
    STORE_HEADER, STORE_TAIL                        store it only
    UPDATE                                          the chunk's rows are updated here; the steps
                                                    after it run for every chunk after the update
    PAYLOAD_STOP, HEADER_STOP                       a crash test's stop (its crash point's name)

A planted bug's order is another list; the kernel has no notion of right or wrong orders.

Shapes: U unique rows of the update, V recorded rows (a sorted subset), C chunks, K records.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from ..errors import CheckpointError
from ..faults import CrashPoint, crash_due, crash_point
from ..kernels import native, ops
from . import layout

PERSIST_PAYLOAD, PERSIST_HEADER, PERSIST_TAIL = "persist payload", "persist header", "persist tail"
STORE_HEADER, STORE_TAIL = "store header", "store tail"
UPDATE = "update"
PAYLOAD_STOP = CrashPoint.UNDO_BETWEEN_PAYLOAD_AND_HEADER
HEADER_STOP = CrashPoint.UNDO_BETWEEN_HEADER_AND_UPDATE
STOPS = (PAYLOAD_STOP, HEADER_STOP)  # a stop step's phase is its place here, from 1


def check_layout(lib) -> None:
    """Refuse a native undo writer built for another record layout than layout.py's."""
    built = dict(getattr(lib, "UNDO_LAYOUT", {}))
    wanted = layout.native_undo_layout()
    if built != wanted:
        differ = ", ".join(f"{name} {built.get(name)} in the build, {value} in layout.py"
                           for name, value in wanted.items() if built.get(name) != value)
        raise CheckpointError(f"the native undo writer (kernels/undo.c) was built for another record layout than "
                              f"cxltrain/checkpoint/layout.py ({differ}); rebuild it (make setup) with the layout "
                              "of layout.py")


_checked: set[int] = set()


def writer():
    """The native kernels, for the fused capture, once their undo layout is checked (CheckpointError
    when it is not layout.py's); only where ops.fused_available()."""
    if not ops.fused_available():
        raise RuntimeError("a fused undo capture needs the native kernels' streamed stores and undo writer "
                           "(make setup rebuilds them)")
    lib = native.lib()
    if id(lib) not in _checked:
        check_layout(lib)
        _checked.add(id(lib))
    return lib


_encoded: dict[tuple[str, ...], bytes] = {}


def encode_steps(steps: tuple[str, ...], lib) -> bytes:
    """A step list as the kernel reads it: (op, arg) byte pairs (kernels/undo.h undo_step)."""
    if steps not in _encoded:
        _encoded[steps] = _encode(steps, lib.UNDO_STEPS)
    return _encoded[steps]


def _encode(steps: tuple[str, ...], codes: dict) -> bytes:
    encoded = bytearray()
    for step in steps:
        if step in STOPS:
            encoded += bytes((codes["stop"], STOPS.index(step) + 1))
        elif step == UPDATE:
            encoded += bytes((codes["update"], 0))
        else:
            how, _, part = step.partition(" ")
            if how not in ("persist", "store") or part not in ("payload", "header", "tail"):
                raise ValueError(f"unknown undo step {step!r}")
            encoded += bytes((codes[part], codes["persist"] if how == "persist" else 0))
    return bytes(encoded)


def undo_chunk_counts(rows: np.ndarray, recorded: np.ndarray, chunk_rows: int, header_bytes: int, row_payload: int,
                      align: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The fused update's undo records (ring.py plan_chunks), before they are placed:
    (rec_first int64 [C + 1], sizes int64 [K], total bytes). rows [U] int64 sorted unique, taken
    in C chunks of `chunk_rows`; recorded [V] the sorted subset that needs a record; chunk c's
    record holds recorded[rec_first[c] : rec_first[c + 1]], and each of the K chunks with a
    recorded row has a record of header_bytes + count * row_payload bytes rounded up to `align`."""
    native.check_rows(recorded)
    lib, rec_first, sizes = _counting(rows, chunk_rows, 1)
    rows_at, recorded_at, rec_first_at, sizes_at = lib.addresses(rows, recorded, rec_first, sizes)
    records, total = lib.undo_chunk_counts(rows_at, rows.size, recorded_at, recorded.size, chunk_rows, header_bytes,
                                           row_payload, align, rec_first_at, sizes_at)
    return rec_first, sizes[:records], total


@dataclasses.dataclass(frozen=True)
class CachedCounts:
    """undo_cached_counts: a cached table's records of both kinds, before they are placed. Chunk c
    records the table rows recorded[rec_first[c] : rec_first[c + 1]] (int64 [V]) and then the
    slots slot_ids[slot_first[c] : slot_first[c + 1]] (int64 [V'], in the order of their rows),
    each kind in a record of its own where it has any; sizes int64 [K + K']: every record's ring
    bytes in ring order (the chunk's table record, then its slots'), `total` in all, `slot_bytes`
    of them the slots'."""

    rec_first: np.ndarray
    recorded: np.ndarray
    slot_first: np.ndarray
    slot_ids: np.ndarray
    sizes: np.ndarray
    total: int
    slot_bytes: int


def undo_cached_counts(rows: np.ndarray, recorded: np.ndarray | None, slot_of: np.ndarray, fresh: np.ndarray | None,
                       slot_count: int, chunk_rows: int, header_bytes: int, row_payload: int, slot_row_payload: int,
                       align: int) -> CachedCounts:
    """undo_chunk_counts for a table with a hot-row cache, both kinds in one kernel pass: rows [U]
    (sorted unique, < R) whose slot_of (int32 [R], -1: the row is its own copy) is one of the
    slot_count slots are updated in their slots, and recorded in the slots' record of their chunk
    where fresh (bool [slot_count], or None: every slot) says; recorded [V], the sorted uncached
    rows to record, or None: every one (capture once per window: the caller's subset otherwise).
    A slot outside the cache raises ValueError."""
    if recorded is not None:
        native.check_rows(recorded)
    if slot_of.dtype != np.int32 or slot_of.ndim != 1 or not slot_of.flags.c_contiguous:
        raise TypeError(f"slot_of must be a 1-D contiguous int32 array, got {slot_of.dtype} {slot_of.shape}")
    if fresh is not None and (fresh.dtype != np.bool_ or fresh.shape != (slot_count,) or not fresh.flags.c_contiguous):
        raise TypeError(f"fresh must be a contiguous bool array [{slot_count}], got {fresh.dtype} {fresh.shape}")
    lib, rec_first, sizes = _counting(rows, chunk_rows, 2)
    slot_first = np.empty_like(rec_first)
    slot_ids, recorded_out = np.empty(rows.size, dtype=np.int64), np.empty(rows.size, dtype=np.int64)
    (rows_at, recorded_at, rec_first_at, sizes_at, slot_of_at, fresh_at, slot_first_at, slot_ids_at,
     recorded_out_at) = lib.addresses(rows, recorded, rec_first, sizes, slot_of, fresh, slot_first, slot_ids,
                                      recorded_out)
    slots = dict(slot_of=slot_of_at, table_rows=slot_of.size, slot_count=slot_count, fresh=fresh_at,
                 slot_row_payload=slot_row_payload, slot_first=slot_first_at, slot_ids=slot_ids_at,
                 recorded_out=recorded_out_at)
    records, total, v, held, slot_bytes = lib.undo_chunk_counts(
        rows_at, rows.size, recorded_at, -1 if recorded is None else recorded.size, chunk_rows, header_bytes,
        row_payload, align, rec_first_at, sizes_at, slots)
    return CachedCounts(rec_first, recorded_out[:v] if recorded is None else recorded, slot_first, slot_ids[:held],
                        sizes[:records], total, slot_bytes)


def _counting(rows: np.ndarray, chunk_rows: int, kinds: int):
    """(the checked writer, rec_first [C + 1] and sizes [kinds * C] to fill in) for rows [U]."""
    native.check_rows(rows)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    chunks = -(-rows.size // chunk_rows)
    return writer(), np.empty(chunks + 1, dtype=np.int64), np.empty(kinds * chunks, dtype=np.int64)


def undo_chunk_headers(template: bytes, seq: int, rec_first: np.ndarray, sizes: np.ndarray,
                       offsets: np.ndarray | None, run_start: int, row_payload: int,
                       slots: tuple[bytes, np.ndarray, int] | None = None) -> tuple[np.ndarray, ...]:
    """The placed records of undo_chunk_counts: (rec_offset int64 [C], headers uint8 [C, 64]).
    Each chunk's header is the 64-byte `template` with its count and payload bytes, and, for the
    k-th record in ring order, seq + k; its ring offset is offsets[k] (offsets [K]), or with
    offsets None the records lie back to back from run_start (sizes [K]); -1 for a chunk without
    one. slots (a cached table's: its slots' template, slot_first [C + 1] and row payload, as
    undo_cached_counts gave them): each chunk's slots' record follows its table record in ring
    order, and (slot_offset [C], slot_headers [C, 64]) follow in the result."""
    templates, firsts = [template], [rec_first]
    if slots is not None:
        templates.append(slots[0])
        firsts.append(slots[1])
    for block in (sizes, *firsts, *([] if offsets is None else [offsets])):
        native.check_rows(block)  # 1-D contiguous int64, as the kernel reads them
    chunks = rec_first.size - 1
    if (any(len(t) != layout.UNDO_HEADER.size for t in templates) or any(f.size != chunks + 1 for f in firsts)
            or (offsets is not None and offsets.size != sizes.size)):
        raise ValueError("undo_chunk_headers: 64-byte templates, the slots' chunks the table's, and an offset (where "
                         "given) for each record's size")
    lib = writer()
    rec_offset = np.empty((len(firsts), chunks), dtype=np.int64)
    headers = np.empty((len(firsts), chunks, layout.UNDO_HEADER.size), dtype=np.uint8)
    template_at, rec_first_at, sizes_at, offsets_at, rec_offset_at, headers_at = lib.addresses(
        template, rec_first, sizes, offsets, rec_offset, headers)
    slot_arguments = ()
    if slots is not None:  # the second part of rec_offset and headers
        slot_template_at, slot_first_at, slot_offset_at, slot_headers_at = lib.addresses(
            slots[0], slots[1], rec_offset[1], headers[1])
        slot_arguments = (slot_template_at, slot_first_at, slots[2], slot_offset_at, slot_headers_at)
    lib.undo_chunk_headers(template_at, seq, rec_first_at, chunks, sizes_at, offsets_at, run_start, row_payload,
                           rec_offset_at, headers_at, *slot_arguments)
    return tuple(part for kind in range(len(firsts)) for part in (rec_offset[kind], headers[kind]))


@dataclasses.dataclass
class FusedUndo:
    """The undo records a fused update writes (ring.py plan_chunks lays them out; kernels/ops.UndoChunks
    is what sparse_update sees of it): the batch's U unique rows in chunks of `chunk_rows`, chunk
    c's rows that need a record (recorded[rec_first[c] : rec_first[c + 1]], V rows in all, sorted)
    in their own ring record at ring offset rec_offset[c] (-1: none). headers uint8 [C, 64]: each
    record's header, both checksum fields zero (the kernel fills them in); payload_seed: the payload
    checksums' seed before the record's seq; tails uint8 [2, 64]: the tail mark's copies with
    seq_end and checksum zero, tail_seeds uint32 [2] their checksum seeds; ring: the ring region's
    address in the process's mapping, made durable as `persistence` says (the device's). steps:
    the order a chunk's record is written in (the module docstring). lookup_order int64 [N], or
    None: the update's lookups sorted by row (ops.unique_rows_and_order), which the kernel checks
    and uses instead of sorting them again. row_flush: how the kernel writes each chunk's updated
    rows back right after updating them (the device's NativePersistence), or None: the caller does."""

    ring: int
    persistence: native.NativePersistence
    rows: np.ndarray         # int64 [U]: the update's unique rows (unique_rows of its indices)
    recorded: np.ndarray     # int64 [V]
    chunk_rows: int
    rec_offset: np.ndarray   # int64 [C]
    rec_first: np.ndarray    # int64 [C + 1]
    headers: np.ndarray      # uint8 [C, 64]
    payload_seed: int
    header_seed: int
    tails: np.ndarray        # uint8 [2, 64]
    tail_seeds: np.ndarray   # uint32 [2]
    tail_offset: int
    steps: tuple[str, ...]
    lookup_order: np.ndarray | None = None  # int64 [N]
    row_flush: native.NativePersistence | None = None
    flushed_runs: int = 0  # set after the kernel: the runs of adjacent rows row_flush wrote back
    ring_bytes: int = 0    # its records' ring bytes (headers and padding included)
    # a hot-row cache's slots (ring.plan_chunks with slots): their records, chunked by the same
    # unique rows (its recorded [V'] are slot ids, in row order), each chunk's right after this one's
    slots: FusedUndo | None = None

    @property
    def lock(self) -> contextlib.AbstractContextManager:
        return self.persistence.lock

    def stop_chunk(self, after_update: bool = False) -> int:
        """The chunk a crash test stops in (-1: no record): the one holding the middle recorded row,
        or for a stop after the update (which runs chunk by chunk), the first chunk with a record."""
        if not self.recorded.size:
            return -1
        if after_update:
            return int(np.flatnonzero(self.rec_offset >= 0)[0])
        return int(np.searchsorted(self.rec_first, self.recorded.size // 2, side="right")) - 1

    def kernel_fields(self, lib, stops: bool = True) -> dict:
        """The named fields kernels/undo.c undo_read takes, after checking every array. stops: a
        crash test's stop may land in these records (the table's; never the slots' beside them)."""
        chunks = self.rec_offset.size
        # the kernel writes only the headers (their checksums); the rest it reads
        for name, block, dtype, shape in (("recorded", self.recorded, np.int64, (self.recorded.size,)),
                                          ("rec_offset", self.rec_offset, np.int64, (chunks,)),
                                          ("rec_first", self.rec_first, np.int64, (chunks + 1,)),
                                          ("tails", self.tails, np.uint8, (layout.TAIL_COPIES, layout.TAIL_MARK.size)),
                                          ("tail_seeds", self.tail_seeds, np.uint32, (layout.TAIL_COPIES,))):
            ops.check_block(name, block, dtype, shape, written=False)
        ops.check_block("headers", self.headers, np.uint8, (chunks, layout.UNDO_HEADER.size))
        lookups = self.lookup_order
        if lookups is not None:
            ops.check_block("lookup_order", lookups, np.int64, (lookups.size,), written=False)
        if self.chunk_rows < 1 or -(-self.rows.size // self.chunk_rows) != chunks:
            raise ValueError(f"{chunks} chunks of {self.chunk_rows} rows cannot hold {self.rows.size} unique rows")
        stop_chunk, stop_phase = -1, 0
        for phase, point in enumerate(STOPS, 1):
            if stops and crash_due(point):  # a crash test's stop, worked out only then
                stop_chunk = self.stop_chunk(after_update=self.steps.index(point) > self.steps.index(UPDATE))
                stop_phase = phase if stop_chunk >= 0 else 0
        if stops and not self.recorded.size:  # no record to stop in (all rows recorded earlier in the window)
            for point in STOPS:
                crash_point(point)
        recorded_at, rec_offset_at, rec_first_at, headers_at, tails_at, tail_seeds_at, lookups_at = lib.addresses(
            self.recorded, self.rec_offset, self.rec_first, self.headers, self.tails, self.tail_seeds, lookups)
        return dict(ring=self.ring, ring_persistence=self.persistence, recorded=recorded_at,
                    recorded_count=self.recorded.size, chunk_rows=self.chunk_rows, chunks=chunks,
                    rec_offset=rec_offset_at, rec_first=rec_first_at, headers=headers_at,
                    payload_seed=self.payload_seed, header_seed=self.header_seed, tails=tails_at,
                    tail_seeds=tail_seeds_at, tail_offset=self.tail_offset, steps=encode_steps(self.steps, lib),
                    stop_chunk=stop_chunk, stop_phase=stop_phase, lookup_order=lookups_at,
                    lookup_count=0 if lookups is None else lookups.size, row_write_back=self.row_flush)

    def kernel_done(self, stopped: int, flushed_runs: int) -> None:
        self.flushed_runs = flushed_runs
        if stopped:
            crash_point(STOPS[stopped - 1])  # a crash test's kill, with the kernel stopped in a chunk
            raise RuntimeError(f"the fused update stopped at {STOPS[stopped - 1]}, which did not kill")
        if self.recorded.size:
            for point in STOPS:
                crash_point(point)
