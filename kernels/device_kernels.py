"""The row kernels of the device path (cxltrain/tables/device_rows.py): one set of calls, two
implementations — rows.cu through CuPy on a GPU (cupy_rows.py), and torch here, the reference the GPU
kernels are tested against and what runs the same path on CPU tensors.

The reference is the host path's torch kernels (rows.py) applied to the batch's block, so on the CPU
all three give the same bits: a row's gradients summed in lookup order (index_add_ on the CPU adds in
index order), then rows.py's rules, which round as kernels/rows.c does.

Shapes: N lookups, B bags, U unique rows of the batch (ids sorted ascending), W columns of a block
(P padded floats a row, or K state columns), R table rows, C cache slots, D embedding dim.

    kernels = row_kernels(torch.device("cuda"))      # CupyRowKernels; TorchRowKernels on "cpu"
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import rows as torch_rows


class TorchRowKernels:
    """The device path's kernels in torch (any device; deterministic on the CPU)."""

    name = "torch"

    def gather(self, out: torch.Tensor, source: torch.Tensor | None, ids: torch.Tensor, count: int,
               cache: torch.Tensor | None, slot_of: torch.Tensor | None) -> None:
        """out[u] := the row ids[u] (u < count), from its cache slot (slot_of[row] >= 0) or from source.
        out [U, W], source [R, W] or None (every row cached), ids [U] int64, cache [C, W], slot_of [R] int32."""
        ids = ids[:count]
        slots = None if slot_of is None else slot_of.index_select(0, ids).to(torch.int64)
        if source is not None:
            out[:count] = source.index_select(0, ids)
        if slots is not None:
            hit = slots >= 0
            out[:count][hit] = cache.index_select(0, slots[hit])

    def bag(self, rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: torch.Tensor | None, mean: bool, dim: int) -> torch.Tensor:
        """Pooled bags [B, D]: bag b sums (or averages) rows[inverse[i], :D] over its lookups i.
        rows [U, P], inverse [N] int64, offsets [B] int64 (bag starts), per_sample_weights [N] or None."""
        pooled = F.embedding_bag(inverse, rows, offsets, mode="mean" if mean else "sum",
                                 per_sample_weights=per_sample_weights)
        return pooled[:, :dim].contiguous()

    def update(self, rule: str, rows: torch.Tensor, state: torch.Tensor | None, order: torch.Tensor,
               starts: torch.Tensor, bag_of: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: torch.Tensor | None, mean: bool, grad: torch.Tensor, count: int,
               lr: float, eps: float) -> None:
        """The fused update of block rows u < count, in place: rows [U, P] (columns :D), state [U, K]
        (column 0, Adagrad). Row u's lookups are order[starts[u]:starts[u+1]] [N], lookup i's
        gradient grad[bag_of[i]] [B, D], times 1/len in mode mean or its per-sample weight."""
        lookups = order.numel()
        per_lookup = torch_rows.lookup_gradients(grad, offsets, lookups, "mean" if mean else "sum",
                                                 None if mean else per_sample_weights)
        unique_of = torch.repeat_interleave(torch.arange(starts.numel() - 1, device=grad.device), torch.diff(starts))
        summed = torch.zeros(starts.numel() - 1, grad.shape[1], dtype=torch.float32, device=grad.device)
        summed.index_add_(0, unique_of, per_lookup.index_select(0, order))
        at = torch.arange(count, device=grad.device)  # the block's own rows: the host path's rules apply as they are
        if rule == "sgd":
            torch_rows.sgd_update(rows, at, summed[:count], lr)
        else:
            torch_rows.rowwise_adagrad_update(rows, state, at, summed[:count], lr, eps)

    def scatter(self, dest: torch.Tensor | None, values: torch.Tensor, ids: torch.Tensor, count: int,
                cache: torch.Tensor | None, slot_of: torch.Tensor | None) -> None:
        """dest[ids[u]] := values[u] (dest None: no table copy), and the cached rows' slots too, for
        u < count. dest [R, W], values [U, W], ids [U] int64, cache [C, W], slot_of [R] int32 or None."""
        ids, values = ids[:count], values[:count]
        if dest is not None:
            dest.index_copy_(0, ids, values)
        if slot_of is not None:
            slots = slot_of.index_select(0, ids).to(torch.int64)
            hit = slots >= 0
            cache.index_copy_(0, slots[hit], values[hit])


def row_kernels(device: torch.device):
    """The kernels for `device`: CuPy's on CUDA, torch's on the CPU."""
    if device.type == "cuda":
        from .cupy_rows import CupyRowKernels

        return CupyRowKernels()
    if device.type == "cpu":
        return TorchRowKernels()
    raise ConfigError(f"no row kernels for device {device}")
