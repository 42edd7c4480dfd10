"""The row operations the rest of cxltrain calls, one call per table per batch: the native C kernels
(kernels/rows.c, via native.py) when they are built and the `native_kernels` knob is 1, the torch
kernels of rows.py otherwise. Both refuse a row index outside the table before writing anything.

Inputs are checked here, before any address reaches C: CPU tensors of the stated dtype, contiguous
(a non-contiguous or wrongly typed tensor is refused, never silently copied), shapes that agree.

Shapes: N lookups, B bags, U unique rows, R table rows, P floats per padded row, D <= P embedding
dim, K optimizer-state columns.

    weight = torch.zeros(1000, 16); state = torch.zeros(1000, 1)
    rows = sparse_update("rowwise_adagrad", weight, state, torch.tensor([7, 3, 7]),
                         torch.ones(3, 16), lr=0.1, eps=1e-8)      # three bags of one lookup
    rows                                                           # tensor([3, 7]); row 7 got 2x
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from ..faults import CrashPoint, crash_due, crash_point
from . import native
from . import rows as torch_rows

RULES = {"sgd": 0, "rowwise_adagrad": 1}  # the C kernel's rule numbers
MODES = ("sum", "mean")


def gather_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """table [R, P] float32, rows [U] int64 → [U, P], a copy of those rows."""
    _check("table", table, torch.float32, 2)
    _check("rows", rows, torch.int64, 1)
    lib = native.lib()
    if lib is None:
        _check_bounds(rows, table.shape[0])
        return torch_rows.gather_rows(table, rows)
    out = torch.empty(rows.numel(), table.shape[1], dtype=table.dtype)
    row_bytes = table.shape[1] * table.element_size()
    lib.copy_rows(out.data_ptr(), row_bytes, table.data_ptr(), row_bytes, row_bytes, False, table.shape[0],
                  rows.data_ptr(), rows.numel())
    return out


def all_finite(values: torch.Tensor) -> bool:
    """Whether a float32 tensor holds no inf or NaN (any shape; a strided one is copied first)."""
    if values.dtype != torch.float32 or values.device.type != "cpu":
        return bool(torch.isfinite(values).all())
    lib = native.lib()
    if lib is None:
        return bool(torch.isfinite(values).all())
    values = values.contiguous()
    return lib.all_finite(values.data_ptr(), values.numel())


def unique_rows(indices: torch.Tensor, table_rows: int) -> torch.Tensor:
    """The sorted distinct values [U] int64 of indices [N] int64, each checked against [0, table_rows)."""
    _check("indices", indices, torch.int64, 1)
    lib = native.lib()
    if lib is None:
        _check_bounds(indices, table_rows)
        return torch.unique(indices, sorted=True)
    out = torch.empty(indices.numel(), dtype=torch.int64)
    count = lib.unique_rows(indices.data_ptr(), indices.numel(), table_rows, out.data_ptr())
    return out[:count]


def unique_rows_and_order(indices: torch.Tensor, table_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows [U], order [N]), both int64: unique_rows of indices [N], and the lookups' positions
    sorted stably by row, the order sparse_update's kernel would sort them into itself (an undo
    plan hands it over, so a fused update sorts its lookups once)."""
    _check("indices", indices, torch.int64, 1)
    lib = native.lib()
    if lib is None:
        _check_bounds(indices, table_rows)
        keys = indices.numpy()
        return np.unique(keys), np.argsort(keys, kind="stable").astype(np.int64)
    rows = np.empty(indices.numel(), dtype=np.int64)
    order = np.empty(indices.numel(), dtype=np.int64)
    count = lib.unique_rows(indices.data_ptr(), indices.numel(), table_rows, *lib.addresses(rows, order))
    return rows[:count], order


def undo_chunk_counts(rows: np.ndarray, recorded: np.ndarray, chunk_rows: int, header_bytes: int, row_payload: int,
                      align: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The fused update's undo records (checkpoint/ring.py plan_chunks), before they are placed:
    (rec_first int64 [C + 1], sizes int64 [K], total bytes). rows [U] int64 sorted unique, taken
    in C chunks of `chunk_rows`; recorded [V] the sorted subset that needs a record; chunk c's
    record holds recorded[rec_first[c] : rec_first[c + 1]], and each of the K chunks with a
    recorded row has a record of header_bytes + count * row_payload bytes rounded up to `align`."""
    native.check_rows(rows)
    native.check_rows(recorded)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    lib = _fused_lib()
    chunks = -(-rows.size // chunk_rows)
    rec_first = np.empty(chunks + 1, dtype=np.int64)
    sizes = np.empty(chunks, dtype=np.int64)
    rows_at, recorded_at, rec_first_at, sizes_at = lib.addresses(rows, recorded, rec_first, sizes)
    records, total = lib.undo_chunk_counts(rows_at, rows.size, recorded_at, recorded.size, chunk_rows, header_bytes,
                                           row_payload, align, rec_first_at, sizes_at)
    return rec_first, sizes[:records], total


def undo_chunk_headers(template: bytes, seq: int, rec_first: np.ndarray, sizes: np.ndarray,
                       offsets: np.ndarray | None, run_start: int, row_payload: int) -> tuple[np.ndarray, np.ndarray]:
    """The placed records of undo_chunk_counts: (rec_offset int64 [C], headers uint8 [C, 64]).
    Each chunk's header is the 64-byte `template` with its count and payload bytes, and, for the
    k-th chunk with a record, seq + k; its ring offset is offsets[k] (offsets [K]), or with offsets
    None the records lie back to back from run_start (sizes [K]); -1 for a chunk without one."""
    for block in (rec_first, sizes) if offsets is None else (rec_first, sizes, offsets):
        native.check_rows(block)  # 1-D contiguous int64, as the kernel reads them
    chunks = rec_first.size - 1
    if len(template) != 64 or (offsets is not None and offsets.size != sizes.size):
        raise ValueError("undo_chunk_headers: a 64-byte template, and an offset for each record's size")
    lib = _fused_lib()
    rec_offset = np.empty(chunks, dtype=np.int64)
    headers = np.empty((chunks, 64), dtype=np.uint8)
    template_at, rec_first_at, sizes_at, offsets_at, rec_offset_at, headers_at = lib.addresses(
        template, rec_first, sizes, offsets, rec_offset, headers)
    lib.undo_chunk_headers(template_at, seq, rec_first_at, chunks, sizes_at, offsets_at, run_start, row_payload,
                           rec_offset_at, headers_at)
    return rec_offset, headers


@dataclasses.dataclass
class UndoChunks:
    """The undo records a fused update writes (checkpoint/ring.py lays them out): the batch's U unique
    rows in chunks of `chunk_rows`, chunk c's rows that need a record (recorded[rec_first[c] :
    rec_first[c + 1]], V rows in all, sorted) in their own ring record at ring offset rec_offset[c]
    (-1: none). headers uint8 [C, 64]: each record's header, both checksum fields zero (the kernel
    fills them in); payload_seed: the payload checksums' seed before the record's seq; tails uint8
    [2, 64]: the tail mark's copies with seq_end and checksum zero, tail_seeds uint32 [2] their
    checksum seeds (the kernel writes the mark covering each record after its header); ring: the
    ring region's address in the process's mapping; media: the power-loss emulator's address of the
    same bytes (0: a fence persists the kernel's streamed stores), whose copies hold `lock`. order:
    0, or a planted bug's (checkpoint/ordering.py). lookup_order int64 [N], or None: the update's
    lookups sorted by row (unique_rows_and_order), which the kernel checks and uses instead of
    sorting them again. row_flush: how the kernel writes each chunk's updated rows back right
    after updating them (Device.native_row_flush), or None."""

    ring: int
    media: int
    lock: contextlib.AbstractContextManager
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
    order: int = 0
    lookup_order: np.ndarray | None = None  # int64 [N]
    row_flush: native.RowFlush | None = None  # None: the caller flushes the updated rows after the call
    flushed_runs: int = 0  # set by sparse_update: the runs of adjacent rows row_flush wrote back

    def stop_chunk(self) -> int:
        """The chunk a crash test stops in: the one holding the middle recorded row (-1: no record)."""
        if not self.recorded.size:
            return -1
        return int(np.searchsorted(self.rec_first, self.recorded.size // 2, side="right")) - 1


_PLAN_SIZE, _PLAN_STOPPED, _PLAN_FLUSH_RUNS = 25, 16, 24  # kernels/rows.c enum fused_plan: size, outputs
_STOPS = {1: CrashPoint.UNDO_BETWEEN_PAYLOAD_AND_HEADER, 2: CrashPoint.UNDO_BETWEEN_HEADER_AND_UPDATE}


def fused_available() -> bool:
    """Whether sparse_update can take an UndoChunks: the native kernels with streamed stores, built
    from the rows.c that reads this module's plan (a stale build would ignore what it does not know,
    such as the row write-back, and silently skip it)."""
    lib = native.lib()
    return lib is not None and bool(lib.STREAMS) and getattr(lib, "FUSED_PLAN_SIZE", None) == _PLAN_SIZE


def _fused_lib():
    """The native kernels, for the fused capture (its layout and its update: only where fused_available)."""
    if not fused_available():
        raise RuntimeError("a fused undo capture needs the native kernels' streamed stores, built from this "
                           "kernels/rows.c (make setup rebuilds them)")
    return native.lib()


def _fused_plan(undo: UndoChunks, lib) -> np.ndarray:
    """The int64 plan the kernel (`lib`: native.lib()) reads (kernels/rows.c enum fused_plan), after
    checking every array."""
    chunks = undo.rec_offset.size
    # the kernel writes only the headers (their checksums); the rest it reads
    for name, block, dtype, shape in (("recorded", undo.recorded, np.int64, (undo.recorded.size,)),
                                      ("rec_offset", undo.rec_offset, np.int64, (chunks,)),
                                      ("rec_first", undo.rec_first, np.int64, (chunks + 1,)),
                                      ("tails", undo.tails, np.uint8, (2, 64)),
                                      ("tail_seeds", undo.tail_seeds, np.uint32, (2,))):
        _check_block(name, block, dtype, shape, written=False)
    _check_block("headers", undo.headers, np.uint8, (chunks, 64))
    lookups = undo.lookup_order
    if lookups is not None:
        _check_block("lookup_order", lookups, np.int64, (lookups.size,), written=False)
    if undo.chunk_rows < 1 or -(-undo.rows.size // undo.chunk_rows) != chunks:
        raise ValueError(f"{chunks} chunks of {undo.chunk_rows} rows cannot hold {undo.rows.size} unique rows")
    stop_chunk, stop_phase = -1, 0
    for phase, point in _STOPS.items():
        if crash_due(point):  # a crash test's stop, worked out only then
            stop_chunk = undo.stop_chunk()
            stop_phase = phase if stop_chunk >= 0 else 0
    recorded_at, rec_offset_at, rec_first_at, headers_at, tails_at, tail_seeds_at, lookups_at = lib.addresses(
        undo.recorded, undo.rec_offset, undo.rec_first, undo.headers, undo.tails, undo.tail_seeds, lookups)
    plan = np.array([undo.ring, undo.media, recorded_at, undo.recorded.size, undo.chunk_rows, chunks,
                     rec_offset_at, rec_first_at, headers_at, undo.payload_seed, undo.header_seed, tails_at,
                     undo.tail_offset, undo.order, stop_chunk, stop_phase, 0, tail_seeds_at,
                     lookups_at, 0 if lookups is None else lookups.size,
                     *((0, 0, 0, 0) if undo.row_flush is None else
                       (undo.row_flush.kind, undo.row_flush.address, undo.row_flush.map_start,
                        undo.row_flush.map_end)), 0],
                    dtype=np.int64)
    assert plan.size == _PLAN_SIZE
    return plan


def sparse_update(rule: str, weight: torch.Tensor, state: torch.Tensor | None, indices: torch.Tensor,
                  grad_out: torch.Tensor, offsets: torch.Tensor | None = None,
                  per_sample_weights: torch.Tensor | None = None, mode: str = "sum", *, lr: float,
                  eps: float = 0.0, undo: UndoChunks | None = None) -> torch.Tensor:
    """The fused sparse update of one table for one batch, in place; returns the rows [U] it updated,
    sorted ascending (U <= N).

    weight [R, P] float32 (columns :D updated), state [R, K] float32 (column 0; rowwise_adagrad
    only), indices [N] int64, grad_out [B, D] float32 (each bag's gradient), offsets [B] int64
    (bag starts; None: every lookup is its own bag, B = N), per_sample_weights [N] float32 (mode
    "sum" only). A row's lookup gradients are summed in lookup order, then the rule is applied once
    per row: sgd w -= lr*g; rowwise_adagrad s += mean(g^2), w -= lr*g/(sqrt(s)+eps).

    The C kernel is bit-identical to the torch kernels except in rowwise_adagrad's mean(g^2), where
    torch's vectorised sum adds in another order (a few float32 ulps; same bits at D = 1), and is
    deterministic run to run.

    undo (fused_available() only): the batch's undo records are written in the same pass, chunk by
    chunk of the unique rows, each durable right before its chunk's rows are updated (UndoChunks;
    the updated values are the same bits as without), and with undo.row_flush each chunk's updated
    rows written back right after (the runs in undo.flushed_runs). The crash points undo:between-payload-and-header
    and undo:between-header-and-update stop that kernel in the chunk of the middle recorded row.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check("weight", weight, torch.float32, 2)
    _check("indices", indices, torch.int64, 1)
    _check("grad_out", grad_out, torch.float32, 2)
    bags, dim = grad_out.shape
    if dim > weight.shape[1]:
        raise ValueError(f"grad_out has {dim} columns, more than the table's {weight.shape[1]}")
    if rule == "rowwise_adagrad":
        _check("state", state, torch.float32, 2)
        if state.shape[0] != weight.shape[0] or state.shape[1] < 1:
            raise ValueError(f"state must be [{weight.shape[0]}, K >= 1], got {list(state.shape)}")
    if offsets is None:
        if bags != indices.numel():
            raise ValueError(f"without offsets grad_out needs one row per lookup ({indices.numel()}), got {bags}")
    else:
        _check("offsets", offsets, torch.int64, 1)
        if offsets.numel() != bags:
            raise ValueError(f"offsets has {offsets.numel()} bags, grad_out {bags}")
    if per_sample_weights is not None:
        _check("per_sample_weights", per_sample_weights, torch.float32, 1)
        if mode != "sum" or per_sample_weights.numel() != indices.numel():
            raise ValueError("per_sample_weights need mode 'sum' and one weight per lookup")
    lib = native.lib()
    if lib is None:
        _check_bounds(indices, weight.shape[0])
        if offsets is None:
            offsets = torch.arange(bags, dtype=torch.int64)
        rows = torch_rows.sparse_update(rule, weight, state, indices, grad_out, offsets, per_sample_weights, mode,
                                        lr, eps, _stop_after(indices, weight.shape[0]))
        crash_point(CrashPoint.UPDATE_MID)
        return rows
    out = torch.empty(indices.numel(), dtype=torch.int64)
    arguments = (RULES[rule], weight.data_ptr(), weight.shape[1], _address(state),
                 state.shape[1] if state is not None else 0, weight.shape[0], dim, indices.data_ptr(), indices.numel(),
                 grad_out.data_ptr(), dim, bags, _address(offsets), mode == "mean", _address(per_sample_weights), lr,
                 eps, out.data_ptr(), _stop_after(indices, weight.shape[0]))
    if undo is None:
        unique = lib.sparse_update(*arguments)
    else:
        _fused_lib()  # refuses without the streamed stores
        plan = _fused_plan(undo, lib)
        if not undo.recorded.size:  # no record to stop in (all rows recorded earlier in the window)
            for point in _STOPS.values():
                crash_point(point)
        with undo.lock:
            # ORDERING U1h: per chunk of the unique rows, the kernel persists the record's payload,
            # then its header and the tail mark covering it, then stores into the chunk's rows
            # (kernels/rows.c undo_chunk), so no row is stored before its record is durable. With
            # undo.row_flush it then writes the chunk's rows back (no drain: U2a drains them).
            unique = lib.sparse_update(*arguments, *lib.addresses(plan))
        undo.flushed_runs = int(plan[_PLAN_FLUSH_RUNS])
        stopped = int(plan[_PLAN_STOPPED])
        if stopped:
            crash_point(_STOPS[stopped])  # a crash test's kill, with the kernel stopped in a chunk
            raise RuntimeError(f"the fused update stopped at {_STOPS[stopped]}, which did not kill")
        if undo.recorded.size:
            for point in _STOPS.values():
                crash_point(point)
    crash_point(CrashPoint.UPDATE_MID)  # a crash test's kill, with the kernel stopped half-way
    return out[:unique]


def _stop_after(indices: torch.Tensor, table_rows: int) -> int:
    """-1 (update every row), unless this update is the one CXLTRAIN_CRASH_AT=update:mid kills:
    then half its unique rows, so the kill leaves the table half-updated in place by the very
    kernel production runs."""
    if not crash_due(CrashPoint.UPDATE_MID):
        return -1
    return unique_rows(indices, table_rows).numel() // 2


def capture_undo(old_weights: np.ndarray, old_state: np.ndarray, old_rows: np.ndarray, weights: torch.Tensor,
                 state: torch.Tensor | None, rows: torch.Tensor) -> bool:
    """Fill an undo record's payload (the three views layout.split_payload gives) with the rows'
    current values: old_weights uint8 [U, P*4] := weights[rows], old_state uint8 [U, K*4] :=
    state[rows], old_rows int64 [U] := rows. weights [R, P] and state [R, K] float32, rows [U] int64.

    The C kernel writes with non-temporal stores and ends with one SFENCE: the payload goes towards
    memory without displacing the caches. Returns whether it did (True: the caller needs no cache
    write-back, Device.persist_streamed; False: ordinary stores, Device.persist).
    """
    _check("weights", weights, torch.float32, 2)
    _check("rows", rows, torch.int64, 1)
    count = rows.numel()
    _check_block("old_weights", old_weights, np.uint8, (count, weights.shape[1] * 4))
    _check_block("old_rows", old_rows, np.int64, (count,))
    state_bytes = 0
    if state is not None:
        _check("state", state, torch.float32, 2)
        state_bytes = state.shape[1] * 4
        _check_block("old_state", old_state, np.uint8, (count, state_bytes))
    lib = native.lib()
    if lib is None:
        _check_bounds(rows, weights.shape[0])
        torch_rows.capture_undo(
            torch.from_numpy(old_weights.view(np.float32)),
            None if state is None else torch.from_numpy(old_state.view(np.float32)),
            torch.from_numpy(old_rows), weights, state, rows)
        return False
    lib.capture_undo(old_weights.ctypes.data, old_state.ctypes.data if state is not None else 0,
                     old_rows.ctypes.data, weights.data_ptr(), weights.shape[1] * 4, _address(state), state_bytes,
                     weights.shape[0], rows.data_ptr(), count)
    return bool(lib.STREAMS)


def _check(name: str, tensor, dtype: torch.dtype, dim: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype or tensor.dim() != dim or tensor.device.type != "cpu":
        raise TypeError(f"{name} must be a {dim}-D {dtype} CPU tensor, got {tensor.dim()}-D {tensor.dtype} "
                        f"on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_block(name: str, block, dtype, shape: tuple[int, ...], written: bool = True) -> None:
    """Refuse anything but a C-contiguous `dtype` array of `shape`, writable where the kernel writes it."""
    if not isinstance(block, np.ndarray) or block.dtype != dtype or block.shape != shape \
            or not block.flags.c_contiguous or (written and not block.flags.writeable):
        raise ValueError(f"{name} must be a{' writable' if written else ''} contiguous {np.dtype(dtype).name} array "
                         f"{list(shape)}, got "
                         f"{getattr(block, 'dtype', type(block).__name__)} {list(getattr(block, 'shape', ()))}")


def _check_bounds(rows: torch.Tensor, table_rows: int) -> None:
    """The torch kernels' first pass, as the C kernels do it: refuse before any store."""
    if rows.numel():
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= table_rows:
            bad = low if low < 0 else high
            raise IndexError(f"row index {bad} is out of range [0, {table_rows}); nothing was written")


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()
