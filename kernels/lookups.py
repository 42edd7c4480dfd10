"""The unique-row exchange's per-table work on a rank's lookups (cxltrain/models/replicated.py,
AskedRows): the native kernels of kernels/lookups.c when they are built and the `native_kernels`
knob is 1, the same results from torch calls otherwise. Inputs are checked here, as in ops.py.

Shapes: N lookups, B bags, H replicated ids (the copies), W holders, U distinct ids asked of them,
D dims.

    cold, starts, counts, positions = asked_rows(torch.tensor([7, 3, 7, 9]), 10,
                                                 torch.tensor([9]), [(5, 10), (0, 5)])
    cold, starts, counts    # tensor([3, 7]), [1, 0], [1, 1]: holder (5, 10) answers 7, then (0, 5) 3
    positions               # tensor([0, 1, 0, 2]): 7 is answer 0, 3 answer 1, 9 copy 0 (row U + 0)
"""

from __future__ import annotations

import torch

from . import native
from .ops import _check, _check_bounds


def asked_rows(keys: torch.Tensor, table_rows: int, copies: torch.Tensor, spans: list[tuple[int, int]]
               ) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """keys [N] int64 ids in [0, table_rows); copies [H] int64, ascending and distinct; spans: each
    holder's ids [lo, hi), disjoint, in the order the holders answer. Returns (cold [U]: the distinct
    keys not among the copies, ascending; starts, counts [W]: each span's run of cold; positions [N]:
    each key's row of the block of the answers [U] (span by span) then the copies [H])."""
    _check("keys", keys, torch.int64, 1)
    _check("copies", copies, torch.int64, 1)
    _check_spans(spans, table_rows)
    lib = native.lib()
    if lib is None:
        return _asked_rows_torch(keys, table_rows, copies, spans)
    cold = torch.empty(keys.numel(), dtype=torch.int64)
    positions = torch.empty(keys.numel(), dtype=torch.int64)
    u, starts, counts = lib.asked_rows(keys.data_ptr(), keys.numel(), table_rows, copies.data_ptr(), copies.numel(),
                                       tuple(bound for span in spans for bound in span), cold.data_ptr(),
                                       positions.data_ptr())
    return cold[:u], list(starts), list(counts), positions


def add_bags_to_rows(grad: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, D] float32: each lookup's bag gradient (grad [B, D], offsets [B] the bags' starts over
    positions [N]) added to its row positions[i] < rows, in lookup order (the same bits every run)."""
    _check("grad", grad, torch.float32, 2)
    _check("offsets", offsets, torch.int64, 1)
    _check("positions", positions, torch.int64, 1)
    if offsets.numel() != grad.shape[0]:
        raise ValueError(f"{offsets.numel()} bag offsets for {grad.shape[0]} bag gradients")
    out = torch.zeros(rows, grad.shape[1])
    lib = native.lib()
    if lib is None:
        _check_bounds(positions, rows)
        lengths = torch.diff(offsets, append=torch.tensor([positions.numel()]))
        bags = torch.repeat_interleave(torch.arange(offsets.numel()), lengths)
        return out.index_add_(0, positions, grad[bags])
    lib.add_bags_to_rows(grad.data_ptr(), grad.shape[0], grad.shape[1], offsets.data_ptr(), positions.data_ptr(),
                         positions.numel(), out.data_ptr(), rows, grad.shape[1])
    return out


def _check_spans(spans: list[tuple[int, int]], table_rows: int) -> None:
    """Refuse spans that are not disjoint ranges of [0, table_rows) (an empty one anywhere)."""
    held = sorted((lo, hi) for lo, hi in spans if lo != hi)
    if any(lo < 0 or hi < lo or hi > table_rows for lo, hi in spans) \
            or any(a[1] > b[0] for a, b in zip(held, held[1:])):
        raise ValueError(f"asked_rows: the holders' spans {spans} must be disjoint ranges of [0, {table_rows})")


def _asked_rows_torch(keys, table_rows, copies, spans):
    _check_bounds(keys, table_rows)
    if copies.numel() and (int(copies[0]) < 0 or int(copies[-1]) >= table_rows
                           or not bool((copies[1:] > copies[:-1]).all())):
        raise ValueError("asked_rows: the copies' ids must be distinct, ascending and in the table")
    seen, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    hot = torch.zeros(seen.numel(), dtype=torch.bool)
    if copies.numel():
        at = torch.searchsorted(copies, seen).clamp_(max=copies.numel() - 1)
        hot = copies[at] == seen
    cold = seen[~hot]
    answer = torch.full((cold.numel(),), -1, dtype=torch.int64)  # each cold id's row of the answers
    starts, counts, answered = [], [], 0
    for lo, hi in spans:
        start, end = torch.searchsorted(cold, torch.tensor([lo, hi])).tolist()
        answer[start:end] = torch.arange(answered, answered + end - start)
        starts.append(start)
        counts.append(end - start)
        answered += end - start
    if answered != cold.numel():
        raise ValueError("asked_rows: an id that no holder's span holds")
    row = torch.empty(seen.numel(), dtype=torch.int64)  # each distinct id's row of [U + H]
    row[~hot] = answer
    if copies.numel():
        row[hot] = cold.numel() + at[hot]
    return cold, starts, counts, row[inverse]
