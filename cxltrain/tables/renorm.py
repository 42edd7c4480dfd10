"""max_norm: a table's forward renormalises its looked-up rows in place, as torch's does, undo-logged.

F.embedding_bag(max_norm=m, norm_type=p) first rescales, in place, every distinct row its indices
look up whose p-norm exceeds m (torch.embedding_renorm_: row *= m / (norm + 1e-7)), then pools the
bags from the rescaled rows; the rescale is not differentiated. A pool table does the same, with
torch's own renorm run over a copy of just the distinct rows (so the values are torch's, bit for
bit), then stores the rows that changed. That store is not the backward update: it is logged like
one, its undo record durable first (U1), and reported to the guard after, so the commit persists
the rows and recovery rolls them back with their batch.

Shapes: N lookups, U distinct rows looked up, V of them renormalised, P >= D the stored row width.

    table = PersistentEmbeddingBag(100, 4, name="t", max_norm=1.0, mode="sum")
    table(torch.tensor([3, 7, 7]), torch.tensor([0]))   # rows 3 and 7 scaled to norm < 1 if above it
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..faults import Planted, planted
from ..kernels import ops as row_ops


def renormalised(storage: torch.Tensor, indices: torch.Tensor, dim: int, max_norm: float,
                 norm_type: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [U] sorted, their values after torch's renorm [U, D], changed [U] bool) for the
    distinct rows indices [N] look up in storage [R, P]. Writes nothing."""
    rows = row_ops.unique_rows(indices.contiguous(), storage.shape[0])
    before = row_ops.gather_rows(storage, rows)[:, :dim].contiguous()
    after = before.clone()
    torch.embedding_renorm_(after, torch.arange(rows.numel()), max_norm, norm_type)
    # compared as bits: a row whose store would change nothing needs no store (and no undo record)
    changed = (after.view(torch.int32) != before.view(torch.int32)).any(dim=1)
    return rows, after, changed


def renormalise(table, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Renormalise the rows indices [N] look up in `table` (a PersistentEmbeddingBag with max_norm),
    in place, and return None; or, between batches of a Runtime (evaluation), where nothing may
    store into the rows, leave them as they are and return (rows [U], renormalised copy [U, D]) to
    pool the bags from (pooled)."""
    storage = table.storage()[0]
    rows, values, changed = renormalised(storage, indices, table.embedding_dim, table.max_norm, table.norm_type)
    guard = table.checkpointer
    if guard is not None and guard.in_flight is None:
        return rows, values
    if bool(changed.any()):
        _store(table, storage, rows[changed], values[changed])
    return None


def pooled(table, rows: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
           per_sample_weights: torch.Tensor | None, last_offset: bool) -> torch.Tensor:
    """[B, D]: the bags of indices [N] (offsets [B]) pooled as `table` pools them, from the copy
    values [U, D] of its rows [U] (sorted) instead of the table."""
    padding = None
    if table.padding_idx is not None:
        at = int(torch.searchsorted(rows, table.padding_idx))
        padding = at if at < rows.numel() and int(rows[at]) == table.padding_idx else None
    return F.embedding_bag(torch.searchsorted(rows, indices), values, offsets, mode=table.mode,
                           per_sample_weights=per_sample_weights, include_last_offset=last_offset,
                           padding_idx=padding)


def _store(table, storage: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """values [V, D] into rows [V] of storage, inside the guard's batch when there is one."""
    guard, batch = table.checkpointer, None
    unlogged = guard is not None and planted(Planted.RENORM_UNLOGGED)  # a crash test's planted bug
    if guard is not None and not unlogged:
        # ORDERING U1j: the renormalised rows' undo record is durable (log_before_write returns
        # only then) before max_norm's first store into them, below.
        batch = guard.log_before_write(table, rows)
    with torch.no_grad():
        storage[rows, : table.embedding_dim] = values
    if guard is None:
        table.note_changed_in_memory()
        return
    if unlogged:  # the planted bug: the record taken after the stores, holding the new values
        batch = guard.log_before_write(table, rows)
    guard.after_update(table, batch, rows)
