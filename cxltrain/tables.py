"""PersistentEmbeddingBag: an nn.EmbeddingBag whose weights and optimizer state live in a pool.

The weights are a zero-copy torch view of the pool region `<name>.weight` ([rows, dim] float32,
each row starting on a 64-byte boundary), the optimizer state a view of `<name>.optim` ([rows, K]).
Nothing is copied in or out: forward reads rows straight from the pool mapping, and backward
applies the fused sparse optimizer (optim.py) to the unique rows of the batch, in place.

Shape letters: B bags (samples), L lookups per bag, N lookups in all, D = embedding_dim,
R = num_embeddings, U unique rows of a batch.

Example (B = 2, D = 4):

    pool = Pool.create("/dev/shm/example.pool", size=16 << 20)
    bag = PersistentEmbeddingBag(1000, 4, name="t0", optimizer=SGD(lr=0.1))
    bag.attach(pool)                        # creates and initialises t0.weight [1000, 4]
    out = bag(torch.tensor([3, 7, 7]), torch.tensor([0, 2]))   # bags [3, 7] and [7] → [2, 4]
    out.sum().backward()                    # rows 3 and 7 updated in the pool (7 once, grad 2x)

Inputs follow nn.EmbeddingBag: (input [N], offsets [B]) or input [B, L] with offsets=None; mode
"sum" or "mean"; per_sample_weights [N] with mode "sum" (treated as constants: no gradient flows
to them). Indices that are out of range, negative, or not int32/int64 raise before anything is
written.

Non-finite gradients stop the run: backward raises NonFiniteError, naming the table and the batch,
before the table stores anything (one isfinite check of the [U, D] gradient per table per batch).
A table whose backward ran earlier in the same batch has stored; the batch is never committed,
so recovery (the next Runtime, `cxltrain recover`) rolls those rows back to the previous batch.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, NonFiniteError, PoolError
from .kernels import ops as row_ops
from .optim import SGD, RowWiseAdagrad, SparseOptimizer
from .pool import Pool, RegionSpec
from .pool_format import RegionKind

if TYPE_CHECKING:
    from .checkpoint.seam import TableGuard

MODES = ("sum", "mean")


@dataclasses.dataclass
class TableStats:
    """Running totals of a table's sparse updates (what a batch dirties, and what it costs)."""

    updates: int = 0          # backward passes that updated rows
    lookups: int = 0          # N, summed over updates
    rows_updated: int = 0     # U, summed over updates
    update_seconds: float = 0.0


class PersistentEmbeddingBag(nn.Module):
    """An embedding bag table whose storage is a persistent-memory pool (or DRAM, unattached).

    Args:
        num_embeddings: R, rows in the table.
        embedding_dim: D, floats per row.
        name: the table's name; its pool regions are `<name>.weight` and `<name>.optim`.
        mode: "sum" or "mean" pooling of each bag.
        optimizer: the fused sparse optimizer applied in backward (default RowWiseAdagrad(0.01)).
        seed: initial weights are uniform(-1/sqrt(R), 1/sqrt(R)) drawn from this seed alone.
        feature_names: the sparse features that look up this table (torchrec's vocabulary).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str, mode: str = "sum",
                 optimizer: SparseOptimizer | None = None, seed: int = 0,
                 feature_names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise ConfigError(f"table {name!r}: num_embeddings must be a positive int, got {num_embeddings!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ConfigError(f"table {name!r}: embedding_dim must be a positive int, got {embedding_dim!r}")
        if mode not in MODES:
            raise ConfigError(f"table {name!r}: mode must be one of {MODES}, got {mode!r}")
        if not name or "." in name:
            raise ConfigError(f"table name {name!r} must be non-empty and contain no '.'")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.name = name
        self.mode = mode
        self.optimizer = optimizer if optimizer is not None else RowWiseAdagrad()
        if not isinstance(self.optimizer, (SGD, RowWiseAdagrad)):
            raise ConfigError(f"table {name!r}: optimizer must be cxltrain.optim.SGD or RowWiseAdagrad")
        self.seed = seed
        self.feature_names = tuple(feature_names) if feature_names else (name,)
        self.pool: Pool | None = None
        # [R, P] contiguous row storage (P >= D: row padding included), and [R, K] optimizer state.
        self._rows: torch.Tensor | None = None
        self._state: torch.Tensor | None = None
        self.stats = TableStats()  # totals over the table's lifetime
        # set by a Runtime's guard: told of every lookup with gradients (forward) and every in-place
        # update (backward), so it can log them and keep them inside batches (checkpoint/seam.py)
        self.checkpointer: TableGuard | None = None

    # -- storage ----------------------------------------------------------------------------
    @property
    def weight_region(self) -> str:
        return region_names(self.name)[0]

    @property
    def state_region(self) -> str:
        return region_names(self.name)[1]

    def region_specs(self) -> list[RegionSpec]:
        """The pool regions this table needs: weights (rows aligned), then optimizer state if any."""
        specs = [RegionSpec(self.weight_region, RegionKind.TABLE_WEIGHTS, "float32",
                            (self.num_embeddings, self.embedding_dim), aligned_rows=True)]
        if self.optimizer.state_columns:
            specs.append(RegionSpec(self.state_region, RegionKind.TABLE_OPTIM_STATE, "float32",
                                    (self.num_embeddings, self.optimizer.state_columns)))
        return specs

    def attach(self, pool: Pool, *, initialize: bool | None = None) -> bool:
        """Map this table's regions from `pool`, creating them (all or none) if absent.

        New regions are initialised from `seed` and persisted; existing ones are checked against
        this table (kind, dtype, shape) and adopted as they are, unless initialize=True.
        Returns True when the regions were created. Committing (pool.commit) is the caller's step.
        """
        created = self.weight_region not in pool.regions
        if created:
            pool.add_regions(self.region_specs())
        else:
            self.check_regions(pool)
        rows = torch.from_numpy(pool.array(self.weight_region, padded=True))
        state = (torch.from_numpy(pool.array(self.state_region))
                 if self.optimizer.state_columns else None)
        self._set_storage(rows, state)
        self.pool = pool
        pool.on_close(self.release_storage)
        if created if initialize is None else initialize:
            self.reset_parameters()
            self.persist()
        return created

    def check_regions(self, pool: Pool) -> None:
        """Raise PoolError unless `pool` holds regions that match this table exactly. Writes nothing."""
        if not self.optimizer.state_columns and self.state_region in pool.regions:
            raise PoolError(f"{pool.path}: table {self.name!r} has optimizer state in the pool "
                            f"({self.state_region!r}); this table's optimizer {self.optimizer} keeps none")
        for spec in self.region_specs():
            if spec.name not in pool.regions:
                raise PoolError(f"{pool.path}: table {self.name!r} needs region {spec.name!r}, which is missing")
            region = pool.region(spec.name)
            if (region.kind != spec.kind or region.dtype.numpy.name != spec.dtype or region.shape != spec.shape
                    or region.row_stride % 4):
                raise PoolError(f"{pool.path}: region {region.name!r} is {region.kind.name.lower()} "
                                f"{region.dtype.numpy.name} {list(region.shape)}, table {self.name!r} expects "
                                f"{spec.kind.name.lower()} {spec.dtype} {list(spec.shape)}")

    def persist(self) -> None:
        """Make every row and the optimizer state durable (whole regions)."""
        if self.pool is None:
            raise RuntimeError(f"table {self.name!r} is not attached to a pool")
        for spec in self.region_specs():
            self.pool.persist_region(spec.name)

    def materialize(self) -> None:
        """Give the table volatile DRAM storage, initialised from `seed` (no pool, no durability)."""
        k = self.optimizer.state_columns
        self._set_storage(torch.empty(self.num_embeddings, self.embedding_dim),
                          torch.empty(self.num_embeddings, k) if k else None)
        self.reset_parameters()

    def _set_storage(self, rows: torch.Tensor, state: torch.Tensor | None) -> None:
        self._rows, self._state = rows, state

    def release_storage(self) -> None:
        """Let go of the pool's memory (called when the pool closes); the table is unusable after."""
        self._rows = self._state = None
        self.pool = None

    def reset_parameters(self) -> None:
        """Deterministic initial values: weights uniform(±1/sqrt(R)) from `seed`, state as the optimizer says."""
        rows = self._require_storage()
        generator = torch.Generator().manual_seed(_table_seed(self.seed, self.name))
        bound = self.num_embeddings ** -0.5
        with torch.no_grad():
            rows.zero_()  # padding columns too: they are part of every row flush
            rows[:, : self.embedding_dim].uniform_(-bound, bound, generator=generator)
            if self._state is not None:
                self._state.fill_(self.optimizer.initial_state())

    def _require_storage(self) -> torch.Tensor:
        if self._rows is None:
            raise RuntimeError(f"table {self.name!r} has no storage: attach(pool) or materialize() it first "
                               "(or its pool was closed)")
        return self._rows

    def storage(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows [R, P] contiguous, padding included; optimizer state [R, K] or None)."""
        return self._require_storage(), self._state

    @property
    def weight(self) -> torch.Tensor:
        """[R, D] zero-copy view of the weights (rows may be padded: not necessarily contiguous)."""
        return self._require_storage()[:, : self.embedding_dim]

    @property
    def optimizer_state(self) -> torch.Tensor | None:
        """[R, K] view of the optimizer state, or None for SGD."""
        self._require_storage()
        return self._state

    # -- forward / backward -----------------------------------------------------------------
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings [B, D] of the bags given by (input [N], offsets [B]) or input [B, L]."""
        rows = self._require_storage()
        indices, offsets, per_sample_weights = self._validate(input, offsets, per_sample_weights)
        batch = None
        if self.checkpointer is not None and torch.is_grad_enabled() and indices.numel():
            # the rows' undo record must be durable before backward stores into them
            batch = self.checkpointer.capture(self, indices)
        anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
        return _BagLookup.apply(anchor, self, rows, indices, offsets, per_sample_weights, batch)

    def _validate(self, input, offsets, per_sample_weights):
        where = f"table {self.name!r}"
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{where}: input must be a torch.Tensor, got {type(input).__name__}")
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{where}: indices must be int64 or int32, got {input.dtype}")
        if input.device.type != "cpu":
            raise NotImplementedError(f"{where}: only CPU inputs are supported, got {input.device}")
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError(f"{where}: offsets must be None when input is 2-D [B, L]")
            batch, length = input.shape
            offsets = torch.arange(0, batch * length, length, dtype=torch.int64)
            input = input.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        elif input.dim() == 1:
            if offsets is None:
                raise ValueError(f"{where}: offsets are required when input is 1-D")
            if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32) \
                    or offsets.dim() != 1:
                raise TypeError(f"{where}: offsets must be a 1-D int64 or int32 tensor")
            if offsets.numel() == 0 or offsets[0] != 0:
                raise ValueError(f"{where}: offsets must start at 0")
            if (offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any())) or offsets[-1] > input.numel():
                raise ValueError(f"{where}: offsets must be non-decreasing and at most len(input)={input.numel()}")
        else:
            raise ValueError(f"{where}: input must be 1-D (with offsets) or 2-D [B, L], got {input.dim()}-D")
        indices = input.to(torch.int64)
        if indices.numel():
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise IndexError(f"{where}: index {bad} is out of range [0, {self.num_embeddings})")
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError(f"{where}: per_sample_weights need mode 'sum', table mode is {self.mode!r}")
            if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point() \
                    or per_sample_weights.shape != indices.shape:
                raise TypeError(f"{where}: per_sample_weights must be a float tensor shaped like the indices "
                                f"{list(indices.shape)}")
            per_sample_weights = per_sample_weights.to(torch.float32)
        return indices, offsets.to(torch.int64), per_sample_weights

    def update_from_lookups(self, indices: torch.Tensor, offsets: torch.Tensor,
                            per_sample_weights: torch.Tensor | None, grad_out: torch.Tensor) -> torch.Tensor:
        """The batch's fused sparse update in place, straight from its lookups (indices [N], offsets [B],
        grad_out [B, D]): one kernel call reduces duplicates and updates each unique row once.
        Returns the rows it updated [U], sorted. (A crash test's update:mid kill lands inside that
        kernel: kernels/ops.py.)"""
        storage = self._require_storage()
        weights = None if per_sample_weights is None else per_sample_weights.contiguous()
        with torch.no_grad():
            return self.optimizer.update(storage, self._state, indices.contiguous(), grad_out.float().contiguous(),
                                         offsets.contiguous(), weights, self.mode)

    def extra_repr(self) -> str:
        where = self.pool.path if self.pool is not None else ("dram" if self._rows is not None else "unattached")
        return (f"{self.num_embeddings}, {self.embedding_dim}, name={self.name!r}, mode={self.mode!r}, "
                f"optimizer={self.optimizer}, storage={where}")


def region_names(table_name: str) -> tuple[str, str]:
    """The pool regions of the table called `table_name`: (weights, optimizer state)."""
    return f"{table_name}.weight", f"{table_name}.optim"


def pool_holds(pool: Pool, tables) -> bool:
    """Whether `pool` holds these tables: True if all of them, each matching (check_regions), False if
    none. Some but not all raises ConfigError, a mismatching one PoolError. Writes nothing, so a
    pool that holds another model is refused untouched."""
    tables = list(tables)
    present = [table.weight_region in pool.regions for table in tables]
    if any(present) and not all(present):
        missing = [t.name for t, here in zip(tables, present) if not here]
        raise ConfigError(f"{pool.path}: holds some of this model's tables but not {', '.join(missing)}")
    if not all(present):
        return False
    for table in tables:
        table.check_regions(pool)
    return True


class _BagLookup(torch.autograd.Function):
    """Forward: embedding_bag over the pool rows. Backward: the fused sparse update, in place.

    `anchor` is an empty tensor that requires grad, so autograd calls backward although the
    table's rows are not a Parameter (they must not be: torch would then allocate a dense
    [R, D] gradient).
    """

    @staticmethod
    def forward(ctx, anchor, table, rows, indices, offsets, per_sample_weights, batch):
        ctx.table, ctx.batch = table, batch
        ctx.save_for_backward(indices, offsets, per_sample_weights)
        # the contiguous padded rows [R, P]: embedding_bag copies a non-contiguous table whole
        pooled = F.embedding_bag(indices, rows, offsets, mode=table.mode, per_sample_weights=per_sample_weights)
        return pooled[:, : table.embedding_dim] if rows.shape[1] != table.embedding_dim else pooled

    @staticmethod
    def backward(ctx, grad_out):
        indices, offsets, per_sample_weights = ctx.saved_tensors
        table = ctx.table
        if indices.numel():
            started = time.perf_counter()
            # per lookup, the gradient is grad_out's row (times a per-sample weight): all finite if these are
            finite = row_ops.all_finite(grad_out) and (
                per_sample_weights is None or row_ops.all_finite(per_sample_weights))
            if not finite:
                # stop, never store: rows updated with NaN/inf would be silently wrong from now on
                batch = "" if ctx.batch is None else f" in batch {ctx.batch}"
                raise NonFiniteError(f"table {table.name!r}: gradient{batch} is not finite (NaN or inf); stopped "
                                     "before updating the table, and the batch is not committed")
            if table.checkpointer is not None:
                # ORDERING U1c: the undo record of these rows is durable (before_update returns only
                # then) before the update below issues the batch's first in-place store into them.
                table.checkpointer.before_update(table, ctx.batch)
            unique_rows = table.update_from_lookups(indices, offsets, per_sample_weights, grad_out)
            if table.checkpointer is not None:
                table.checkpointer.after_update(table, ctx.batch, unique_rows)
            stats = table.stats
            stats.updates += 1
            stats.lookups += indices.numel()
            stats.rows_updated += unique_rows.numel()
            stats.update_seconds += time.perf_counter() - started
        return None, None, None, None, None, None, None


def _table_seed(seed: int, name: str) -> int:
    """One generator seed per (seed, table name), so tables differ and each is reproducible alone."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)
