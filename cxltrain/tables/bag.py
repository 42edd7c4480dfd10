"""PersistentEmbeddingBag: an nn.EmbeddingBag whose weights and optimizer state live in a pool.

The weights are a zero-copy torch view of the pool region `<name>.weight` ([rows, dim] float32,
each row starting on a 64-byte boundary), the optimizer state a view of `<name>.optim` ([rows, K]).
Nothing is copied in or out: forward reads rows straight from the pool mapping, and backward
applies the fused sparse optimizer (optim.py) to the unique rows of the batch, in place.

Shape letters: B bags (samples), L lookups per bag, N lookups in all, D = embedding_dim,
R = num_embeddings, U unique rows of a batch.

Example (B = 2, D = 4):

    pool = Pool.create("/dev/shm/example.pool", size=16 << 20)
    bag = PersistentEmbeddingBag(1000, 4, name="t0", mode="sum", optimizer=SGD(lr=0.1))
    bag.attach(pool)                        # creates and initialises t0.weight [1000, 4]
    out = bag(torch.tensor([3, 7, 7]), torch.tensor([0, 2]))   # bags [3, 7] and [7] → [2, 4]
    out.sum().backward()                    # rows 3 and 7 updated in the pool (7 once, grad 2x)

Inputs and constructor arguments follow nn.EmbeddingBag: (input [N], offsets [B], or [B + 1] with
include_last_offset) or input [B, L] with offsets=None; mode "sum", "mean" (the default, as
nn.EmbeddingBag's) or "max"; padding_idx; scale_grad_by_freq; per_sample_weights [N] with mode "sum"
(treated as constants: no gradient flows to them); max_norm/norm_type; `from_pretrained`. Indices
that are out of range, negative, or not int32/int64 raise before anything is written. Plain sum/mean
bags take the fused kernel; the other modes (and max_norm) compute the unique rows' gradient with
autograd on a copy of just those rows, then apply the same fused rule per row.

max_norm: forward renormalises the looked-up rows whose norm exceeds it, in place, as torch does
(renorm.py). That is a store outside the backward update: under a Runtime the renormalised rows get
their undo record first, like an update's (U1), so recovery undoes the renorm with the batch. A
lookup outside a batch (evaluation between batches) uses the renormalised rows but leaves them as
they are: no batch could undo the store; the next training lookup stores them.

Before it is attached to a pool (or after materialize()) a table is an ordinary in-memory table, as
nn.EmbeddingBag is: forward, backward (its own fused optimizer) and state_dict() work on DRAM rows,
drawn from `seed` on first use. A pool created for it starts from those rows; a pool that already
holds a checkpoint is refused if they were trained (runtime.py, as for load_state_dict). Its rows are
never nn.Parameters (a dense [R, D] gradient would be allocated), so `model.parameters()` leaves
them out; a torch optimizer handed them is refused by the Runtime (refuse_optimized_tables).

Non-finite gradients stop the run: backward raises NonFiniteError, naming the table and the batch,
before the table stores anything (one isfinite check of the [U, D] gradient per table per batch).
A table whose backward ran earlier in the same batch has stored; the batch is never committed,
so recovery (the next Runtime, `cxltrain recover`) rolls those rows back to the previous batch.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import tempfile
import time
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.seam import in_dense_only
from ..errors import ConfigError, NonFiniteError, PoolError
from ..faults import PlantedDevice, planted
from ..kernels import ops as row_ops
from ..pool.format import RegionKind
from ..pool.handle import Pool, RegionSpec
from . import renorm
from .cache import HotRowCache, merged_chunks
from .device_rows import DeviceRows
from .optim import SGD, RowWiseAdagrad, SparseOptimizer

if TYPE_CHECKING:
    from ..checkpoint.seam import TableGuard

MODES = ("sum", "mean", "max")


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
        max_norm, norm_type: renormalise each looked-up row whose norm_type-norm exceeds max_norm, in
            forward, in place (as nn.EmbeddingBag; undo-logged: renorm.py).
        mode: "mean" (the default, as nn.EmbeddingBag's), "sum" or "max" pooling of each bag.
        optimizer: the fused sparse optimizer applied in backward (default RowWiseAdagrad(0.01)).
        seed: initial weights are uniform(-1/sqrt(R), 1/sqrt(R)) drawn from this seed alone.
        feature_names: the sparse features that look up this table (torchrec's vocabulary).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                 _weight: torch.Tensor | None = None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device=None, dtype=None, *, name: str | None = None,
                 optimizer: SparseOptimizer | None = None, seed: int = 0,
                 feature_names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        where = f"table {name!r}"
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise ConfigError(f"{where}: num_embeddings must be a positive int, got {num_embeddings!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ConfigError(f"{where}: embedding_dim must be a positive int, got {embedding_dim!r}")
        if mode not in MODES:
            raise ConfigError(f"{where}: mode must be one of {MODES}, got {mode!r}")
        if name is not None and (not name or "." in name):
            raise ConfigError(f"table name {name!r} must be non-empty and contain no '.'")
        _refuse_unsupported(where, max_norm, norm_type, device, dtype)
        if padding_idx is not None:
            if not isinstance(padding_idx, int) or not -num_embeddings <= padding_idx < num_embeddings:
                raise ConfigError(f"{where}: padding_idx must be an int in [-{num_embeddings}, {num_embeddings}), "
                                  f"got {padding_idx!r}")
            padding_idx %= num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.name = name
        self.mode = mode
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type, self.sparse = float(norm_type), bool(sparse)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.include_last_offset = bool(include_last_offset)
        self.padding_idx = padding_idx
        # sum/mean bags with none of the extras take the fused kernel straight from the lookups
        # (max_norm's do not: so neither a hot-row cache nor a device placement takes them)
        self._fused = mode != "max" and padding_idx is None and not self.scale_grad_by_freq and max_norm is None
        self.frozen = False  # from_pretrained(freeze=True): looked up, never updated
        self._initial = None if _weight is None else _checked_weight(where, _weight, num_embeddings, embedding_dim)
        self._initial_state: torch.Tensor | None = None  # from load_state_dict, with _initial
        self._loaded = False  # load_state_dict gave the values a new pool starts from
        self.optimizer = optimizer if optimizer is not None else RowWiseAdagrad()
        if not isinstance(self.optimizer, (SGD, RowWiseAdagrad)):
            raise ConfigError(f"{where}: optimizer must be cxltrain.tables.optim.SGD or RowWiseAdagrad")
        self.seed = seed
        self.feature_names = tuple(feature_names) if feature_names else (name,) if name else ()
        self.pool: Pool | None = None
        self._released = False  # its pool closed: the rows are there, never silently redrawn in DRAM
        self._changed_in_memory = False  # DRAM rows trained or renormalised since they were drawn
        # [R, P] contiguous row storage (P >= D: row padding included), and [R, K] optimizer state.
        self._rows: torch.Tensor | None = None
        self._state: torch.Tensor | None = None
        self.stats = TableStats()  # totals over the table's lifetime
        # set by a Runtime's guard: told of every lookup with gradients (forward) and every in-place
        # update (backward), so it can log them and keep them inside batches (checkpoint/seam.py)
        self.checkpointer: TableGuard | None = None
        # a pool set's hot-row cache of this table (cache.py), set by the Runtime; None: uncached
        self.cache: HotRowCache | None = None
        # where lookups and updates run when not on the host's own path (place(): a GPU, DESIGN §9)
        self.device_rows: DeviceRows | None = None

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, max_norm: float | None = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                        sparse: bool = False, include_last_offset: bool = False, padding_idx: int | None = None,
                        **kwargs) -> "PersistentEmbeddingBag":
        """A table whose initial rows are `embeddings` [R, D] (copied in when it gets storage), as
        nn.EmbeddingBag.from_pretrained; freeze=True: looked up, never updated. kwargs: name,
        optimizer, seed, feature_names."""
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            raise ConfigError("from_pretrained: embeddings must be a 2-D tensor [rows, dim]")
        rows, dim = embeddings.shape
        table = cls(rows, dim, max_norm, norm_type, scale_grad_by_freq, mode, sparse, embeddings,
                    include_last_offset, padding_idx, **kwargs)
        table.frozen = bool(freeze)
        return table

    # -- storage ----------------------------------------------------------------------------
    @property
    def weight_region(self) -> str:
        if not self.name:
            raise ConfigError("a table needs a name (its pool regions' prefix): PersistentEmbeddingBag(..., "
                              "name=...), or let a Runtime name it after its module path")
        return region_names(self.name)[0]

    @property
    def state_region(self) -> str:
        self.weight_region  # noqa: B018 (the same check of the name)
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
        in_memory = self.pool is None and self._rows is not None
        given = self._initial, self._initial_state
        if in_memory:
            # rows used before attaching (or materialize()): a new pool starts from them
            self._initial, self._initial_state = self._rows[:, : self.embedding_dim], self._state
        rows = torch.from_numpy(pool.array(self.weight_region, padded=True))
        state = (torch.from_numpy(pool.array(self.state_region))
                 if self.optimizer.state_columns else None)
        self._set_storage(rows, state)
        self.pool = pool
        self._changed_in_memory = False
        pool.on_close(self.release_storage)
        if created if initialize is None else initialize:
            self.reset_parameters()
            self.persist()
            # the given or loaded values are in the pool now: drop the copy (from_pretrained's too)
            self._initial = self._initial_state = None
            self._loaded = False
        elif in_memory:
            self._initial, self._initial_state = given  # an existing pool's rows win
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
        self._released = False

    def release_storage(self) -> None:
        """Let go of the pool's memory (called when the pool closes); the table is unusable after."""
        self._rows = self._state = None
        self.pool = None
        self._released = True
        self.cache = None
        self.device_rows = None

    def place(self, device, cached_ids: torch.Tensor | None = None) -> DeviceRows:
        """Run this table's lookups and updates on `device` (a GPU: DESIGN §9), over its rows in the
        pool, with rows `cached_ids` [C] held in device memory (None: no cache). Lookups then return
        [B, D] on that device and take indices on the CPU or on it. Call after attach (and after any
        recovery): the cache is filled from the pool as it is now."""
        where = f"table {self.name!r}"
        if self.pool is None:
            raise ConfigError(f"{where}: place() needs the table attached to a pool first")
        if self.cache is not None:
            raise ConfigError(f"{where}: a pool set's host cache and a device placement do not combine yet; "
                              "train on the CPU or without --capacity-pool")
        if not self._fused or self.include_last_offset:
            raise ConfigError(f"{where}: the device path takes sum and mean bags without padding_idx, "
                              "scale_grad_by_freq, include_last_offset or max_norm")
        self.device_rows = DeviceRows(self, torch.device(device), cached_ids)
        return self.device_rows

    def reset_parameters(self) -> None:
        """Deterministic initial values: weights uniform(±1/sqrt(R)) from `seed`, state as the optimizer says."""
        rows = self._require_storage()
        # an unnamed table drawn in memory before a Runtime names it: a pool created for it copies these
        generator = torch.Generator().manual_seed(_table_seed(self.seed, self.name or ""))
        bound = self.num_embeddings ** -0.5
        with torch.no_grad():
            rows.zero_()  # padding columns too: they are part of every row flush
            if self._initial is not None:
                rows[:, : self.embedding_dim].copy_(self._initial)
            else:
                rows[:, : self.embedding_dim].uniform_(-bound, bound, generator=generator)
            if self.padding_idx is not None and self._initial is None:
                rows[self.padding_idx].zero_()  # as nn.EmbeddingBag initialises it
            if self._state is not None and self._initial_state is not None:
                self._state.copy_(self._initial_state)
            elif self._state is not None:
                self._state.fill_(self.optimizer.initial_state())

    def _require_storage(self) -> torch.Tensor:
        if self._rows is None and not self._released:
            self.materialize()  # not attached yet: an ordinary in-memory table, as nn.EmbeddingBag
        if self._rows is None:
            raise RuntimeError(f"table {self.name!r} has no storage: its pool was closed (the rows are there; "
                               "open it again with a Runtime, or `cxltrain export` it)")
        return self._rows

    def note_changed_in_memory(self) -> None:
        """In-memory rows were stored into (trained or renormalised): a pool that already holds a
        checkpoint of this table would silently replace them, so a Runtime refuses it (pending_load)."""
        if self.pool is None:
            self._changed_in_memory = True

    def storage(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows [R, P] contiguous, padding included; optimizer state [R, K] or None)."""
        return self._require_storage(), self._state

    @property
    def weight(self) -> torch.Tensor:
        """[R, D] zero-copy view of the weights (rows may be padded: not necessarily contiguous).
        A table with a hot-row cache gives a copy instead, its cached rows read from the cache
        (their capacity rows are stale): writing into it changes nothing."""
        if self.cache is not None:
            return self._merged(optimizer_state=False)
        return self._require_storage()[:, : self.embedding_dim]

    @property
    def optimizer_state(self) -> torch.Tensor | None:
        """[R, K] view of the optimizer state, or None for SGD (a copy through the cache, as weight)."""
        self._require_storage()
        if self.cache is not None and self._state is not None:
            return self._merged(optimizer_state=True)
        return self._state

    def _merged(self, optimizer_state: bool) -> torch.Tensor:
        """A copy of the weights [R, D] (or the state [R, K]) with the cached rows taken from the cache,
        filled a chunk at a time into an unlinked file beside the table's capacity pool, mapped: its
        pages are the disk's to write back and the kernel's to reclaim, so a cached table's copy (a
        state_dict's) costs no more memory than a view of an uncached one does. Where no such file
        can be made (a folder we may not write, a full disk), the copy is in memory."""
        columns = self._state.shape[1] if optimizer_state else self.embedding_dim
        region = self.state_region if optimizer_state else self.weight_region
        pool = self.cache.slots.pool
        out = _file_backed(pool.device_for(pool.region(region)).path, (self.num_embeddings, columns))
        at = 0
        for chunk in merged_chunks(pool, self.name, region, optimizer_state):
            out[at : at + chunk.shape[0]] = torch.from_numpy(chunk)
            at += chunk.shape[0]
        return out

    @property
    def pending_load(self) -> bool:
        """Whether load_state_dict, or training in memory before attaching, gave values that no pool
        holds yet."""
        return self._loaded or self._changed_in_memory

    # -- state dict ---------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """`weight` [R, D] and `optimizer_state` [R, K]: views of the pool (no copy until saved), or
        of the in-memory rows before attaching; nothing once its pool is closed, or inside a dense
        snapshot (seam.dense_only)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._released or in_dense_only():
            return
        destination[prefix + "weight"] = self.weight.detach()
        if self._state is not None:
            destination[prefix + "optimizer_state"] = self.optimizer_state.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Take `weight` (and `optimizer_state`) as the values the table starts from. A table in a
        pool is refused: the rows would change outside any batch, where no undo record covers them.
        Unattached, the values wait for attach() (a Runtime creating its pool writes them, durable
        before the first commit); in DRAM (materialize) they are copied in at once."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        weight_key, state_key = prefix + "weight", prefix + "optimizer_state"
        for key in (weight_key, state_key):  # ours, though no Parameter or buffer holds them
            if key in unexpected_keys:
                unexpected_keys.remove(key)
        if in_dense_only():
            return
        if weight_key not in state_dict:
            missing_keys.append(weight_key)
            return
        where = f"table {self.name or prefix.rstrip('.')!r}"
        if self.pool is not None:
            error_msgs.append(f"{where} lives in pool {self.pool.path}: loading rows there would change them outside "
                              "any batch, uncovered by the undo log; load the state dict before attaching (a "
                              "Runtime then creates a new pool from it), or build a pool with `cxltrain import`")
            return
        k = self.optimizer.state_columns
        state = state_dict.get(state_key)
        if state is not None and (not isinstance(state, torch.Tensor) or tuple(state.shape) != (self.num_embeddings, k)):
            error_msgs.append(f"{where}: {state_key} must be [{self.num_embeddings}, {k}] for {self.optimizer}")
            return
        try:
            weight = _checked_weight(where, state_dict[weight_key], self.num_embeddings, self.embedding_dim)
        except ConfigError as e:
            error_msgs.append(str(e))
            return
        self._initial = weight
        self._initial_state = None if state is None else state.detach().to(torch.float32).clone()
        self._loaded = True
        if self._rows is not None:  # DRAM storage: take the values now
            self.reset_parameters()

    # -- forward / backward -----------------------------------------------------------------
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings [B, D] of the bags given by (input [N], offsets [B]) or input [B, L]."""
        rows = self._require_storage()
        last_offset = self.include_last_offset and input.dim() == 1
        indices, offsets, per_sample_weights = self._validate(input, offsets, per_sample_weights)
        if last_offset and offsets.numel() < 1:
            raise ValueError(f"table {self.name!r}: include_last_offset needs at least one offset")
        learns = torch.is_grad_enabled() and not self.frozen
        guard = self.checkpointer if learns and indices.numel() else None
        if learns and self.pool is None:
            self.note_changed_in_memory()  # its backward updates the in-memory rows
        if self.device_rows is not None:
            # the host notes the lookups; their undo record is taken from the pool before the update
            batch = guard.capture(self, indices) if guard is not None else None
            anchor = torch.empty(0, requires_grad=learns)
            return _DeviceBagLookup.apply(anchor, self, indices, offsets, per_sample_weights, batch)
        source, positions, batch = rows, indices, None
        if self.max_norm is not None and indices.numel():
            # before the lookups are noted: the renorm's own undo record comes first (renorm.py);
            # never with a cache or a device placement (not _fused: cache.check_table, place)
            unstored = renorm.renormalise(self, indices)
            if unstored is not None and guard is None:  # evaluation between batches: rows left as they are
                return renorm.pooled(self, *unstored, indices, offsets, per_sample_weights, last_offset)
        if self.cache is not None:  # never with include_last_offset (cache.check_table)
            source, positions, batch = self.cache.lookups(guard, self, indices)
        elif guard is not None:
            # the rows' undo record must be durable before backward stores into them
            batch = guard.capture(self, indices)
        anchor = torch.empty(0, requires_grad=learns)
        general = not self._fused or last_offset
        return _BagLookup.apply(anchor, self, source, positions, indices, offsets, per_sample_weights, batch, general,
                                last_offset)

    def _validate(self, input, offsets, per_sample_weights):
        where = f"table {self.name!r}"
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{where}: input must be a torch.Tensor, got {type(input).__name__}")
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{where}: indices must be int64 or int32, got {input.dtype}")
        if input.device.type != "cpu":
            if self.device_rows is None or input.device != self.device_rows.device:
                raise NotImplementedError(f"{where}: only CPU inputs are supported, got {input.device}")
            # a placed table's lookups are checked and undo-logged on the host
            input = input.cpu()
            offsets = None if offsets is None else offsets.cpu()
            per_sample_weights = None if per_sample_weights is None else per_sample_weights.cpu()
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
                            per_sample_weights: torch.Tensor | None, grad_out: torch.Tensor,
                            undo: row_ops.UndoChunks | None = None) -> torch.Tensor:
        """The batch's fused sparse update in place, straight from its lookups (indices [N], offsets [B],
        grad_out [B, D]): one kernel call reduces duplicates and updates each unique row once, where
        it lives (a cached row in its cache slot). Returns the rows it updated [U], sorted. (A crash
        test's update:mid kill lands inside that kernel: kernels/ops.py.) undo: the undo records the
        kernel writes as it goes (the checkpointer's)."""
        storage = self._require_storage()
        weights = None if per_sample_weights is None else per_sample_weights.contiguous()
        cached = None if self.cache is None else self.cache.locations()
        with torch.no_grad():
            return self.optimizer.update(storage, self._state, indices.contiguous(), _dense_gradient(grad_out),
                                         offsets.contiguous(), weights, self.mode, undo, cached, self._file_rows())

    def _file_rows(self) -> row_ops.FileRows | None:
        """The file the fused update writes this table's rows to, where its pool's device offers one
        (Device.row_file: a capacity pool), or None: it stores them through the mapping. A table's
        regions are added to one pool together, so its state lies in its weights' file."""
        pool = self.pool
        if pool is None or not pool.members:
            return None
        weights = pool.region(self.weight_region)
        fd = pool.device_for(weights).row_file()
        if fd is None:
            return None
        state = pool.region(self.state_region).offset if self.optimizer.state_columns else 0
        return row_ops.FileRows(fd, weights.offset, state)

    def row_gradients(self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
                      grad_out: torch.Tensor, last_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [U] sorted, their gradient [U, D]) as autograd gives it for F.embedding_bag with
        this table's options, computed over a copy of just those rows (the padding row left out)."""
        storage = self._require_storage()
        rows = row_ops.unique_rows(indices.contiguous(), self.num_embeddings)
        local = row_ops.gather_rows(storage, rows)[:, : self.embedding_dim].clone().requires_grad_()
        padding = None
        if self.padding_idx is not None:
            at = int(torch.searchsorted(rows, self.padding_idx))
            padding = at if at < rows.numel() and int(rows[at]) == self.padding_idx else None
        with torch.enable_grad():
            pooled = F.embedding_bag(torch.searchsorted(rows, indices.contiguous()), local, offsets, mode=self.mode,
                                     per_sample_weights=per_sample_weights, include_last_offset=last_offset,
                                     padding_idx=padding, scale_grad_by_freq=self.scale_grad_by_freq)
            (grad,) = torch.autograd.grad(pooled, local, grad_out.float())
        if padding is not None:  # never updated, as in torch
            keep = rows != self.padding_idx
            rows, grad = rows[keep], grad[keep]
        return rows, grad

    def update_from_row_gradients(self, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The optimizer's rule applied once to each of rows [U] (distinct) with its gradient [U, D],
        in place; returns rows."""
        storage = self._require_storage()
        with torch.no_grad():
            self.optimizer.update(storage, self._state, rows.contiguous(), grad.contiguous())
        return rows

    def extra_repr(self) -> str:
        where = self.pool.path if self.pool is not None else ("dram" if self._rows is not None else "unattached")
        return (f"{self.num_embeddings}, {self.embedding_dim}, name={self.name!r}, mode={self.mode!r}, "
                f"optimizer={self.optimizer}, storage={where}")


def name_unnamed(tables: dict[str, PersistentEmbeddingBag]) -> None:
    """Name each table made without a name (as nn.EmbeddingBag is) after its module path in the
    model, `.` replaced by `_` ("tables.0" -> "tables_0")."""
    for path, table in tables.items():
        if table.name is None:
            table.name = path.replace(".", "_") or "table"
            table.feature_names = table.feature_names or (table.name,)


def refuse_optimized_tables(tables, optimizers) -> None:
    """ConfigError when a torch optimizer holds a tensor that shares storage with a table's rows or
    optimizer state (given `bag.weight`, say): it would never step them (they get no .grad), while
    the user believes it trains them. A table trains in backward with its own fused optimizer."""
    held = {}
    for table in tables:
        for what, tensor in (("weight", table._rows), ("optimizer_state", table._state)):
            if tensor is not None:
                held[tensor.untyped_storage().data_ptr()] = table.name, what
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if (hit := held.get(param.untyped_storage().data_ptr())) is not None:
                    raise ConfigError(f"optimizer {i} ({type(optimizer).__name__}) holds table {hit[0]!r}'s {hit[1]}, "
                                      "which it would never train: a table trains in backward with its own fused "
                                      "optimizer (PersistentEmbeddingBag(optimizer=SGD(lr) or RowWiseAdagrad(lr))); "
                                      "give torch optimizers the dense parameters only (model.parameters() holds no "
                                      "table rows)")


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
    """Forward: embedding_bag over `source` [*, P] at `positions` [N]: the pool rows at the indices
    themselves, or for a table with a hot-row cache each lookup's row gathered from its slot or its
    table row (cache.HotRowCache.lookups). Backward: the fused sparse update, in place, each row
    where it lives (general: the per-row update from autograd's row gradients, for the modes the
    kernel lacks; never cached).

    `anchor` is an empty tensor that requires grad, so autograd calls backward although the
    table's rows are not a Parameter (they must not be: torch would then allocate a dense
    [R, D] gradient).
    """

    @staticmethod
    def forward(ctx, anchor, table, source, positions, indices, offsets, per_sample_weights, batch, general,
                last_offset):
        ctx.table, ctx.batch, ctx.general, ctx.last_offset = table, batch, general, last_offset
        ctx.save_for_backward(indices, offsets, per_sample_weights)
        # the contiguous padded rows [R, P]: embedding_bag copies a non-contiguous table whole
        pooled = F.embedding_bag(positions, source, offsets, mode=table.mode, per_sample_weights=per_sample_weights,
                                 include_last_offset=last_offset, padding_idx=table.padding_idx)
        return pooled[:, : table.embedding_dim] if source.shape[1] != table.embedding_dim else pooled

    @staticmethod
    def backward(ctx, grad_out):
        indices, offsets, per_sample_weights = ctx.saved_tensors
        table = ctx.table
        if indices.numel():
            grad_out = _dense_gradient(grad_out)
            if ctx.general:
                # max, padding_idx, scale_grad_by_freq, include_last_offset: autograd's gradient of
                # just the batch's unique rows [U, D], then the optimizer's rule once per row
                def update(undo):  # never fused: undo is None
                    rows, grads = table.row_gradients(indices, offsets, per_sample_weights, grad_out, ctx.last_offset)
                    return table.update_from_row_gradients(rows, grads)
            else:
                def update(undo):
                    return table.update_from_lookups(indices, offsets, per_sample_weights, grad_out, undo)
            _guarded_update(table, ctx.batch, indices, grad_out, per_sample_weights, update, not ctx.general)
        return None, None, None, None, None, None, None, None, None, None


class _DeviceBagLookup(torch.autograd.Function):
    """A placed table's lookup (device_rows.py): forward pools the bags on the device, backward runs
    the fused update there and writes the rows back to the pool, inside the same guard as the host
    path (_guarded_update: finiteness, U1 before the update, the rows noted after)."""

    @staticmethod
    def forward(ctx, anchor, table, indices, offsets, per_sample_weights, batch):
        pooled, ctx.saved = table.device_rows.lookup(indices, offsets, per_sample_weights)
        ctx.table, ctx.batch = table, batch
        ctx.indices, ctx.per_sample_weights = indices, per_sample_weights
        return pooled

    @staticmethod
    def backward(ctx, grad_out):
        table, saved = ctx.table, ctx.saved
        if ctx.indices.numel():
            rows = table.device_rows
            stored = None
            if planted(PlantedDevice.DEVICE_UPDATE_BEFORE_CAPTURE):  # a crash test's planted bug: U1 broken
                stored = rows.update(saved, grad_out, table.optimizer)

            def update(undo):
                # called by _guarded_update after before_update (U1c): no kernel stores into the
                # rows before their undo record is durable on the host
                return stored if stored is not None else rows.update(saved, grad_out, table.optimizer)
            _guarded_update(table, ctx.batch, ctx.indices, grad_out, ctx.per_sample_weights, update)
        ctx.saved = None
        return None, None, None, None, None, None


def _dense_gradient(grad_out: torch.Tensor) -> torch.Tensor:
    """grad_out [B, D] as float32 and contiguous: copied once here when it is a strided view (a
    model that stacks its tables' outputs hands each table a slice), not once by the finiteness
    check and again by the update."""
    return grad_out.float().contiguous()


def _guarded_update(table, batch, indices, grad_out, per_sample_weights, update, fusable=False) -> None:
    """Run `update(undo)` (which stores the batch's rows and returns them [U]) between the finiteness
    check, the undo-log wait and the checkpointer's note of the rows; count it in table.stats.
    fusable: update is the fused kernel over these lookups, which can write their undo records
    itself (`undo`, from the checkpointer: each chunk's record durable before its rows' update)."""
    started = time.perf_counter()
    # per lookup, the gradient is grad_out's row (times a per-sample weight): all finite if these are
    finite = row_ops.all_finite(grad_out) and (
        per_sample_weights is None or row_ops.all_finite(per_sample_weights))
    if not finite:
        # stop, never store: rows updated with NaN/inf would be silently wrong from now on
        where = "" if batch is None else f" in batch {batch}"
        raise NonFiniteError(f"table {table.name!r}: gradient{where} is not finite (NaN or inf); stopped "
                             "before updating the table, and the batch is not committed")
    undo, guard, cache = None, table.checkpointer, table.cache
    if guard is not None:
        # ORDERING U1c: the undo record of these rows (a cached table's: of its slots and of its
        # table rows) is durable (before_update returns only then) before the update below issues
        # the batch's first in-place store into them, or the update writes it, chunk by chunk,
        # each durable before its rows are stored (U1h).
        undo = guard.before_update(table, batch, fusable)
    try:
        unique_rows = update(undo)
    except BaseException:
        if guard is not None:
            guard.fail_batch(table)
        raise
    if guard is not None:
        table_rows = unique_rows
        if cache is not None:  # the cached rows were updated in their slots
            slots, table_rows = cache.homes(unique_rows)
            guard.after_update(cache.slots, batch, slots)
        guard.after_update(table, batch, table_rows)
    stats = table.stats
    stats.updates += 1
    stats.lookups += indices.numel()
    stats.rows_updated += unique_rows.numel()
    stats.update_seconds += time.perf_counter() - started


def _refuse_unsupported(where: str, max_norm, norm_type, device, dtype) -> None:
    """nn.EmbeddingBag arguments a pool table cannot honour (or that make no sense): one line each."""
    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real)
                                 or not 0 < max_norm < float("inf")):
        raise ConfigError(f"{where}: max_norm must be a positive number, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or norm_type != norm_type:
        raise ConfigError(f"{where}: norm_type must be a number, got {norm_type!r}")
    if device is not None and torch.device(device).type != "cpu":
        raise ConfigError(f"{where}: rows live in a host-memory pool; device must be cpu, got {device}")
    if dtype is not None and dtype != torch.float32:
        raise ConfigError(f"{where}: pool rows are float32; dtype {dtype} is not supported")


def _file_backed(beside: str, shape: tuple[int, int]) -> torch.Tensor:
    """An uninitialised float32 tensor [shape] mapped from an unlinked file in the folder of `beside`,
    its blocks allocated first (a store into a page the disk has no room for would be SIGBUS);
    in memory where that fails."""
    nbytes = shape[0] * shape[1] * 4
    try:
        with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(beside)), prefix=".cxltrain-copy-") as f:
            os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))
            return torch.from_numpy(np.memmap(f, np.float32, "r+", shape=shape))  # the mapping keeps the file
    except OSError:
        return torch.empty(shape)


def _checked_weight(where: str, weight, rows: int, dim: int) -> torch.Tensor:
    """A detached float32 CPU copy of initial weights [rows, dim], or ConfigError."""
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (rows, dim):
        got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ConfigError(f"{where}: initial weights must be a tensor [{rows}, {dim}], got {got}")
    return weight.detach().to("cpu", torch.float32).clone()


def _table_seed(seed: int, name: str) -> int:
    """One generator seed per (seed, table name), so tables differ and each is reproducible alone."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)
