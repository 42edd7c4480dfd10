"""A table's batch on a device (DESIGN §9): the lookups and the fused update run where the model's
MLPs run, over the table's authoritative rows in the pool and an optional hot-row cache in device
memory. Written once over torch tensors; only the kernels differ (kernels/device_kernels.py: CuPy's
on CUDA, torch's on the CPU, where the tests run this very path).

Where the rows come from, per batch (U unique rows, sorted by id, which is also the order a gather
over the link reads fastest in):

    forward   on the host: ids [N] -> unique rows [U] (sorted), each lookup's block row, the lookups
              by row (BatchPlan), sent in one copy; on the device: block [U, P] := each row from its
              cache slot, else from the pool (the registered mapping, or a pinned bounce where CUDA
              refuses it); pooled [B, D] := the bags, from the block
    backward  state [U, K] gathered likewise; the fused update of the block (each row once, its
              lookups' gradients summed in lookup order); the block written back to the pool rows
              and to the cached rows' slots (write-through), then the stream synchronised

The pool is always current after a batch's update (the cache holds copies only), so the host-side
undo capture of the next batch (checkpoint layer, U4) reads the right old values, a crash loses
nothing more with the cache than without it, and recovery never needs to know a cache existed.

    rows = DeviceRows(table, torch.device("cuda"), cached_ids=torch.arange(table.num_embeddings))
    pooled, saved = rows.lookup(indices, offsets, None)         # [B, D] on the device
    updated = rows.update(saved, grad_out, table.optimizer)      # the rows stored [U], on the CPU
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..errors import ConfigError
from ..faults import CrashPoint, crash_due, crash_point
from ..kernels import ops as row_ops
from ..kernels.device_kernels import row_kernels


@dataclasses.dataclass
class BatchPlan:
    """How a table's batch maps onto its unique rows, worked out on the host (the lookups are there,
    and the undo capture needs the rows there too) and sent to the device in one copy: no device
    sort, and no device-to-host read of the rows. Shapes: N lookups, U unique rows, B bags."""

    rows: torch.Tensor             # [U] int64 on the CPU, sorted: the rows the update stores
    ids: torch.Tensor              # [U] the same, on the device
    inverse: torch.Tensor          # [N] lookup i reads block row inverse[i]
    order: torch.Tensor            # [N] the lookups sorted stably by row
    starts: torch.Tensor           # [U + 1] row u's lookups are order[starts[u]:starts[u+1]]
    bag_of: torch.Tensor           # [N] each lookup's bag
    offsets: torch.Tensor          # [B] bag starts
    per_sample_weights: torch.Tensor | None  # [N] float32


def plan_batch(indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
               table_rows: int, device: torch.device) -> BatchPlan:
    """The BatchPlan of lookups indices [N] int64 in bags offsets [B] int64 (CPU, checked)."""
    n, bags = indices.numel(), offsets.numel()
    rows, order = row_ops.unique_rows_and_order(indices.contiguous(), table_rows)
    changes = np.flatnonzero(np.diff(indices.numpy()[order])) + 1   # where the sorted ids change row
    starts = np.concatenate(([0], changes, [n])) if n else np.zeros(1, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.repeat(np.arange(rows.size, dtype=np.int64), np.diff(starts))
    lengths = np.diff(offsets.numpy(), append=n)
    bag_of = np.repeat(np.arange(bags, dtype=np.int64), lengths)
    parts = (rows, inverse, order, starts, bag_of, offsets.numpy())
    cuda = device.type == "cuda"
    packed = torch.empty(sum(p.size for p in parts), dtype=torch.int64, pin_memory=cuda)
    at = 0
    for part in parts:
        packed[at: at + part.size] = torch.from_numpy(np.ascontiguousarray(part, dtype=np.int64))
        at += part.size
    on_device = packed.to(device, non_blocking=True) if cuda else packed
    views, at = [], 0
    for part in parts:
        views.append(on_device[at: at + part.size])
        at += part.size
    weights = per_sample_weights
    if weights is not None and cuda:
        weights = weights.pin_memory().to(device, non_blocking=True)
    return BatchPlan(packed[: rows.size], *views, weights)


@dataclasses.dataclass
class SavedLookup:
    """What backward needs of a forward: the batch's plan and the rows as forward read them."""

    plan: BatchPlan
    block: torch.Tensor            # [U, P] float32 on the device


class DeviceRows:
    """The device's side of one table: kernels, the pool rows as the device reaches them, the cache.

    Args:
        table: an attached PersistentEmbeddingBag (sum or mean, no padding_idx / scale_grad_by_freq).
        device: where lookups and updates run (cuda, or cpu for the reference path).
        cached_ids: [C] int64 distinct rows held in device memory (None: no cache); all rows when the
            table fits (the planner sizes it, placement/planner.gpu_cache_rows).
    """

    def __init__(self, table, device: torch.device, cached_ids: torch.Tensor | None = None) -> None:
        self.table, self.device = table, torch.device(device)
        self.kernels = row_kernels(self.device)
        host_rows, host_state = table.storage()
        self.host_rows, self.host_state = host_rows, host_state
        self.rows, self.state = self._reach(table.weight_region, host_rows), None
        if host_state is not None:
            self.state = self._reach(table.state_region, host_state)
        # None: CUDA refused the mapping (a file on a disk): blocks travel through pinned host memory
        self.bounced = self.rows is None or (host_state is not None and self.state is None)
        if self.bounced:
            self.rows = self.state = None
        self.slot_of = self.cache_rows = self.cache_state = None
        if cached_ids is not None and cached_ids.numel():
            self._fill_cache(cached_ids.to(torch.int64))

    def _reach(self, region: str, host: torch.Tensor) -> torch.Tensor | None:
        """The pool rows as the device addresses them: themselves on the CPU, the registered mapping on
        CUDA (None where CUDA refuses it)."""
        if self.device.type == "cpu":
            return host
        from ..devices.gpu_mapping import mapped_view

        return mapped_view(self.table.pool, region, host, self.device)

    def _fill_cache(self, ids: torch.Tensor) -> None:
        """Copy rows `ids` [C] from the pool into device memory and map them: slot_of [R] int32."""
        if self.bounced:
            raise ConfigError(f"table {self.table.name!r}: a device cache needs the pool mapped into the device "
                              "(CUDA refused this pool's mapping: a file on a disk)")
        rows = self.table.num_embeddings
        if int(ids.min()) < 0 or int(ids.max()) >= rows or torch.unique(ids).numel() != ids.numel():
            raise ConfigError(f"table {self.table.name!r}: cached rows must be distinct ids in [0, {rows})")
        self.slot_of = torch.full((rows,), -1, dtype=torch.int32)
        self.slot_of[ids] = torch.arange(ids.numel(), dtype=torch.int32)
        self.slot_of = self.slot_of.to(self.device)
        self.cache_rows = self.host_rows.index_select(0, ids).to(self.device)
        if self.host_state is not None:
            self.cache_state = self.host_state.index_select(0, ids).to(self.device)

    @property
    def cached(self) -> int:
        """Rows held in device memory."""
        return 0 if self.cache_rows is None else self.cache_rows.shape[0]

    # -- the batch --------------------------------------------------------------------------
    def lookup(self, indices: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: torch.Tensor | None) -> tuple[torch.Tensor, SavedLookup]:
        """Pooled bags [B, D] on the device, and what backward needs. indices [N] int64 and offsets [B]
        int64 on the CPU (checked by the table), per_sample_weights [N] float32 or None."""
        plan = plan_batch(indices, offsets, per_sample_weights, self.table.num_embeddings, self.device)
        block = self._gather(self.host_rows, self.rows, self.cache_rows, plan)
        pooled = self.kernels.bag(block, plan.inverse, plan.offsets, plan.per_sample_weights,
                                  self.table.mode == "mean", self.table.embedding_dim)
        return pooled, SavedLookup(plan, block)

    def update(self, saved: SavedLookup, grad_out: torch.Tensor, optimizer) -> torch.Tensor:
        """The fused update of the looked-up rows, written back to the pool and the cache; returns the
        rows stored [U] int64 on the CPU, sorted. grad_out [B, D] float32 (any device). A crash test's
        update:mid stops it after half the rows, as the CPU kernel does."""
        plan, block = saved.plan, saved.block
        grad = grad_out.to(self.device).float().contiguous()
        unique = plan.rows.numel()
        count = unique // 2 if crash_due(CrashPoint.UPDATE_MID) else unique
        state = None
        if self.host_state is not None:
            state = self._gather(self.host_state, self.state, self.cache_state, plan)
        rule = "sgd" if optimizer.state_columns == 0 else "rowwise_adagrad"
        self.kernels.update(rule, block, state, plan.order, plan.starts, plan.bag_of, plan.offsets,
                            plan.per_sample_weights, self.table.mode == "mean", grad, count, optimizer.lr,
                            getattr(optimizer, "eps", 0.0))
        self._scatter(self.host_rows, self.rows, self.cache_rows, block, plan, count)
        if state is not None:
            self._scatter(self.host_state, self.state, self.cache_state, state, plan, count)
        if self.device.type == "cuda":
            # ORDERING U2e: the GPU's stores into the pool mapping have left the GPU (the stream is
            # synchronised) before the caller tells the guard of these rows, which flushes them on the
            # host, now or at the batch's commit.
            torch.cuda.current_stream(self.device).synchronize()
        crash_point(CrashPoint.UPDATE_MID)  # a crash test's kill, with the rows half-updated in the pool
        return plan.rows[:count]

    def _gather(self, host: torch.Tensor, reached: torch.Tensor | None, cache: torch.Tensor | None,
                plan: BatchPlan) -> torch.Tensor:
        """The batch's rows of one array (rows [R, P] or state [R, K]) as a device block [U, W]."""
        unique = plan.rows.numel()
        if self.bounced:  # pinned host copy, then one transfer
            staged = torch.empty(unique, host.shape[1], dtype=torch.float32, pin_memory=True)
            torch.index_select(host, 0, plan.rows, out=staged)
            return staged.to(self.device, non_blocking=True)
        block = torch.empty(unique, host.shape[1], dtype=torch.float32, device=self.device)
        self.kernels.gather(block, reached, plan.ids, unique, cache, self.slot_of)
        return block

    def _scatter(self, host: torch.Tensor, reached: torch.Tensor | None, cache: torch.Tensor | None,
                 block: torch.Tensor, plan: BatchPlan, count: int) -> None:
        """Block rows u < count back to their pool rows (and cache slots)."""
        if self.bounced:
            host.index_copy_(0, plan.rows[:count], block[:count].cpu())
            return
        self.kernels.scatter(reached, block, plan.ids, count, cache, self.slot_of)
