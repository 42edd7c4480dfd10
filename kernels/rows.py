"""CPU row kernels on a table's rows: reduce duplicate gradients, apply fused sparse updates.

These are torch primitives picked by measurement on the development machine (docs/benchmarks.md).
embedding_bag on a row-padded (non-contiguous) view copies the whole table, so tables always hand
it the contiguous padded view.

Every function is one call per table per batch; no Python loop runs per row. Reductions are
deterministic: torch.unique sorts, and index_add_ on the CPU adds in index order.

Shapes: N lookups, U unique rows, D embedding dim, P padded row width (P >= D), K state columns.
"""

from __future__ import annotations

import torch


def lookup_gradients(grad_out: torch.Tensor, offsets: torch.Tensor, num_lookups: int, mode: str,
                     per_sample_weights: torch.Tensor | None) -> torch.Tensor:
    """Gradient of each lookup from the gradient of its bag.

    grad_out [B, D], offsets [B] (bag starts) → [N, D]. mode "mean" divides by the bag's length.
    """
    batch = grad_out.shape[0]
    lengths = torch.diff(offsets, append=offsets.new_tensor([num_lookups]))
    bag_of_lookup = torch.repeat_interleave(torch.arange(batch, device=grad_out.device), lengths)
    grads = grad_out.index_select(0, bag_of_lookup)
    if mode == "mean":
        # scale by the reciprocal, as torch's own embedding_bag backward does (bit-identical results)
        grads = grads * (1.0 / lengths.index_select(0, bag_of_lookup).to(grads.dtype)).unsqueeze(1)
    if per_sample_weights is not None:
        grads = grads * per_sample_weights.unsqueeze(1)
    return grads


def reduce_duplicates(indices: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradients of repeated rows, deterministically.

    indices [N] int64, grads [N, D] → (rows [U] sorted ascending, summed [U, D]); each row's
    gradients are added in lookup order.
    """
    rows, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    summed = torch.zeros(rows.shape[0], grads.shape[1], dtype=grads.dtype, device=grads.device)
    summed.index_add_(0, inverse, grads)
    return rows, summed


def sgd_update(weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
    """weight[rows, :D] -= lr * grads, in place. weight [R, P], rows [U], grads [U, D]."""
    dim = grads.shape[1]
    updated = weight.index_select(0, rows)
    updated[:, :dim].add_(grads, alpha=-lr)
    weight.index_copy_(0, rows, updated)


def rowwise_adagrad_update(weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                           grads: torch.Tensor, lr: float, eps: float) -> None:
    """Row-wise Adagrad (one accumulator per row, FBGEMM's EXACT_ROWWISE_ADAGRAD), in place.

        state[r] += mean(grads[r] ** 2);   weight[r, :D] -= lr * grads[r] / (sqrt(state[r]) + eps)

    weight [R, P], state [R, K] (column 0 used), rows [U], grads [U, D].
    """
    dim = grads.shape[1]
    # rounded as kernels/rows.c: the squares added in column order, the root correctly rounded
    # (torch's float32 sqrt on the CPU is not always), so this fallback gives the C kernel's bits
    squares = torch.zeros(grads.shape[0], dtype=grads.dtype, device=grads.device)
    for column in range(dim):
        squares = squares + grads[:, column] * grads[:, column]
    accumulated = state.index_select(0, rows)
    accumulated[:, 0].add_(squares / float(dim))
    state.index_copy_(0, rows, accumulated)
    step = grads / (accumulated[:, :1].double().sqrt().float() + eps)
    updated = weight.index_select(0, rows)
    updated[:, :dim].add_(step, alpha=-lr)
    weight.index_copy_(0, rows, updated)


def gather_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """table[rows]: table [R, P], rows [U] → [U, P] (a copy)."""
    return table.index_select(0, rows)


def sparse_update(rule: str, weight: torch.Tensor, state: torch.Tensor | None, indices: torch.Tensor,
                  grad_out: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
                  mode: str, lr: float, eps: float, stop_after: int = -1, cached=None) -> torch.Tensor:
    """The fused sparse update composed of the steps above; returns the updated rows [U], sorted.

    indices [N], grad_out [B, D] (one gradient per bag), offsets [B]; rule "sgd" or "rowwise_adagrad";
    stop_after: update only the first that many unique rows (crash tests; -1: all), as the C kernel.
    cached: a hot-row cache (ops.CachedRows): the cached rows are updated in their slots instead.
    """
    grads = lookup_gradients(grad_out, offsets, indices.numel(), mode, per_sample_weights)
    rows, summed = reduce_duplicates(indices, grads)
    if stop_after >= 0:
        rows, summed = rows[:stop_after], summed[:stop_after]
    homes = [(weight, state, rows, summed)]
    if cached is not None:  # each row's rule is its own: updating slots and table rows apart changes no bit
        slots = cached.slot_of[rows].to(torch.int64)
        hit = slots >= 0
        homes = [(weight, state, rows[~hit], summed[~hit]), (cached.weights, cached.state, slots[hit], summed[hit])]
    for where, where_state, at, grads_at in homes:
        if rule == "sgd":
            sgd_update(where, at, grads_at, lr)
        else:
            rowwise_adagrad_update(where, where_state, at, grads_at, lr, eps)
    return rows


def capture_undo(old_weights: torch.Tensor, old_state: torch.Tensor | None, old_rows: torch.Tensor,
                 weights: torch.Tensor, state: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Copy the rows' current values into an undo payload: old_weights [U, P] := weights[rows],
    old_state [U, K] := state[rows], old_rows [U] := rows. Ordinary (cached) stores."""
    torch.index_select(weights, 0, rows, out=old_weights)
    if state is not None:
        torch.index_select(state, 0, rows, out=old_state)
    old_rows.copy_(rows)
