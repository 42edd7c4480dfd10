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
from typing import Protocol

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


def gather_cached(table: torch.Tensor, cached: CachedRows, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(out [N, P]: each of rows [N] int64 copied from where it lives, its slot where the cache's row
    map holds it, else table [R, P] float32; how many came from a slot): a cached table's lookups
    in one pass. Rows and their map entries are checked first."""
    _check("table", table, torch.float32, 2)
    _check("rows", rows, torch.int64, 1)
    _check_cached(cached, "sgd", table, None, table.shape[1])
    if cached.weights.shape[1] != table.shape[1]:
        raise ValueError(f"the slots hold {cached.weights.shape[1]} columns, the table {table.shape[1]}")
    lib = native.lib()
    if lib is None:
        _check_bounds(rows, table.shape[0])
        _check_slots(cached, rows)
        slots = cached.slot_of[rows].to(torch.int64)
        hit = slots >= 0
        out = torch_rows.gather_rows(table, rows)
        out[hit] = cached.weights[slots[hit]]
        return out, int(hit.sum())
    out = torch.empty(rows.numel(), table.shape[1], dtype=table.dtype)
    hits = lib.gather_cached(out.data_ptr(), table.data_ptr(), table.shape[1], table.shape[0], _cache_fields(cached),
                             rows.data_ptr(), rows.numel())
    return out, hits


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


@dataclasses.dataclass(frozen=True)
class CachedRows:
    """Where a table's cached rows live (as FBGEMM's caching kernels take cache locations): the row
    map slot_of [R] int32 or int64 (each row's slot, -1: not cached, the table row is its copy), the
    slots' weights [S, P'] and state [S, K'] (K' >= K; None for sgd). sparse_update reads and
    updates a cached row in its slot, every other row in the table."""

    slot_of: torch.Tensor
    weights: torch.Tensor
    state: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class FileRows:
    """A table whose rows lie in a file mapped shared (a capacity pool): sparse_update writes each
    updated table row to the file `fd` with pwrite, at weight_offset + row * its row stride (state
    likewise), instead of storing it through the mapping. The mapping reads the same page cache, so
    the new values are seen at once; a page written so is never mapped writable, so syncing it
    write-protects nothing and sends no TLB shootdown (docs/tiers.md, "Rows written to the file").
    Cached rows are stored in their slots as ever."""

    fd: int
    weight_offset: int
    state_offset: int


class UndoChunks(Protocol):
    """The undo records a fused update writes as it goes, as sparse_update sees them: the writer
    and its record layout are the checkpoint layer's (cxltrain/checkpoint/fused.py FusedUndo)."""

    lock: contextlib.AbstractContextManager  # held while the kernel persists (the device's)
    slots: UndoChunks | None  # a hot-row cache's slots' records, each chunk's after the table's (cached only)

    def kernel_fields(self, lib, stops: bool = True) -> dict:
        """The writer's named fields for the kernel (kernels/undo.c undo_read), every array checked
        (stops: a crash test's stop may land in these records)."""

    def kernel_done(self, stopped: int, flushed_runs: int) -> None:
        """After the kernel: the phase a crash test's stop step stopped it at (0: none), and the
        runs of adjacent rows it wrote back."""


def fused_available() -> bool:
    """Whether sparse_update can take an UndoChunks: the native kernels with streamed stores and an
    undo writer (kernels/undo.c; the checkpoint layer checks its layout before using it)."""
    lib = native.lib()
    return lib is not None and bool(lib.STREAMS) and hasattr(lib, "UNDO_LAYOUT")


def sparse_update(rule: str, weight: torch.Tensor, state: torch.Tensor | None, indices: torch.Tensor,
                  grad_out: torch.Tensor, offsets: torch.Tensor | None = None,
                  per_sample_weights: torch.Tensor | None = None, mode: str = "sum", *, lr: float,
                  eps: float = 0.0, undo: UndoChunks | None = None,
                  cached: CachedRows | None = None, file_rows: FileRows | None = None) -> torch.Tensor:
    """The fused sparse update of one table for one batch, in place; returns the rows [U] it updated,
    sorted ascending (U <= N).

    weight [R, P] float32 (columns :D updated), state [R, K] float32 (column 0; rowwise_adagrad
    only), indices [N] int64, grad_out [B, D] float32 (each bag's gradient), offsets [B] int64
    (bag starts; None: every lookup is its own bag, B = N), per_sample_weights [N] float32 (mode
    "sum" only). A row's lookup gradients are summed in lookup order, then the rule is applied once
    per row: sgd w -= lr*g; rowwise_adagrad s += mean(g^2), w -= lr*g/(sqrt(s)+eps).

    The C kernel and the torch kernels (rows.py) give the same bits, deterministic run to run.

    undo (fused_available() only): the batch's undo records are written in the same pass, chunk by
    chunk of the unique rows, by the writer's step list (UndoChunks; the updated values are the same
    bits as without), each durable right before its chunk's rows are updated, and the chunk's
    updated rows written back where the writer asks for it.

    cached: a hot-row cache's row map and slots (CachedRows): each unique row is read and updated
    where it lives, its slot or its table row, with the same arithmetic (the returned rows are
    table row ids either way). With undo, its records name table rows only, those the map does not
    cache; the slots' records are undo.slots' (each chunk's written right after the table's), or
    the caller's, durable before this call; the writer writes no rows back (the caller flushes the
    slots and the table rows).

    file_rows: the table rows are written to their file (FileRows) rather than stored through the
    mapping, by the C kernel; the torch kernels store through the mapping (the same bytes, in the
    same page cache). A failed write raises OSError with the rows before it written (the failing
    row's weights perhaps without its state), as a crash leaves them.
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
    if cached is not None:
        _check_cached(cached, rule, weight, state, dim)
    lib = native.lib()
    if lib is None:
        _check_bounds(indices, weight.shape[0])
        if cached is not None:
            _check_slots(cached, indices)
        if offsets is None:
            offsets = torch.arange(bags, dtype=torch.int64)
        rows = torch_rows.sparse_update(rule, weight, state, indices, grad_out, offsets, per_sample_weights, mode,
                                        lr, eps, _stop_after(indices, weight.shape[0]), cached)
        crash_point(CrashPoint.UPDATE_MID)
        return rows
    out = torch.empty(indices.numel(), dtype=torch.int64)
    arguments = (RULES[rule], weight.data_ptr(), weight.shape[1], _address(state),
                 state.shape[1] if state is not None else 0, weight.shape[0], dim, indices.data_ptr(), indices.numel(),
                 grad_out.data_ptr(), dim, bags, _address(offsets), mode == "mean", _address(per_sample_weights), lr,
                 eps, out.data_ptr(), _stop_after(indices, weight.shape[0]))
    cache = None if cached is None else _cache_fields(cached)
    file_fields = None if file_rows is None else (file_rows.fd, file_rows.weight_offset, file_rows.state_offset)
    if undo is None:
        unique = lib.sparse_update(*arguments, None, cache, None, file_fields)
    else:
        if not fused_available():
            raise RuntimeError("a fused undo capture needs the native kernels' streamed stores and undo writer "
                               "(make setup rebuilds them)")
        fields = undo.kernel_fields(lib)
        slots = None if undo.slots is None else undo.slots.kernel_fields(lib, stops=False)
        with undo.lock:
            unique, stopped, runs = lib.sparse_update(*arguments, fields, cache, slots, file_fields)
        undo.kernel_done(stopped, runs)
    crash_point(CrashPoint.UPDATE_MID)  # a crash test's kill, with the kernel stopped half-way
    return out[:unique]


def _check_cached(cached: CachedRows, rule: str, weight: torch.Tensor, state: torch.Tensor | None, dim: int) -> None:
    """The row map [R] and the slots' arrays, as sparse_update's kernels read them."""
    slot_of = cached.slot_of
    if not isinstance(slot_of, torch.Tensor) or slot_of.dtype not in (torch.int32, torch.int64):
        raise TypeError("the row map slot_of must be an int32 or int64 tensor")
    _check("slot_of", slot_of, slot_of.dtype, 1)
    if slot_of.numel() != weight.shape[0]:
        raise ValueError(f"the row map has {slot_of.numel()} entries, the table {weight.shape[0]} rows")
    _check("cached weights", cached.weights, torch.float32, 2)
    if cached.weights.shape[1] < dim:
        raise ValueError(f"the slots hold {cached.weights.shape[1]} columns, the update {dim}")
    if rule == "rowwise_adagrad":
        _check("cached state", cached.state, torch.float32, 2)
        if cached.state.shape[0] != cached.weights.shape[0] or cached.state.shape[1] < state.shape[1]:
            raise ValueError(f"the slots' state must be [{cached.weights.shape[0]}, >= {state.shape[1]}], "
                             f"got {list(cached.state.shape)}")


def _check_slots(cached: CachedRows, indices: torch.Tensor) -> None:
    """The torch kernels' first pass over the looked-up rows' map entries, as the C kernel's."""
    if indices.numel():
        slots = cached.slot_of[indices]
        if int(slots.min()) < -1 or int(slots.max()) >= cached.weights.shape[0]:
            raise ValueError(f"sparse_update: the row map sends a looked-up row outside the "
                             f"{cached.weights.shape[0]} slots; nothing was written")


def _cache_fields(cached: CachedRows) -> dict:
    """The named fields the C kernel reads the cache from (rows.c cached_rows_read)."""
    state = cached.state
    return dict(slot_of=cached.slot_of.data_ptr(), wide=cached.slot_of.dtype == torch.int64,
                weight=cached.weights.data_ptr(), w_stride=cached.weights.shape[1], state=_address(state),
                s_stride=0 if state is None else state.shape[1], slots=cached.weights.shape[0])


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
    check_block("old_weights", old_weights, np.uint8, (count, weights.shape[1] * 4))
    check_block("old_rows", old_rows, np.int64, (count,))
    state_bytes = 0
    if state is not None:
        _check("state", state, torch.float32, 2)
        state_bytes = state.shape[1] * 4
        check_block("old_state", old_state, np.uint8, (count, state_bytes))
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


def check_block(name: str, block, dtype, shape: tuple[int, ...], written: bool = True) -> None:
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
