"""`cxltrain.Runtime`: put a model's tables in a pool, make every batch durable, resume after a crash.

    model = DLRM(embedding_rows=[100_000] * 8, embedding_dim=64)
    dense_opt = torch.optim.Adam(model.dense_parameters())
    with cxltrain.Runtime("/dev/shm/ctr.pool", model, dense_opt) as rt:
        print(rt.start_batch)                   # 0 on a fresh pool; after a crash, the batch to redo
        for batch in rt.batches(source, stop=1000):
            loss = model.loss(batch)
            loss.backward()                     # tables update their rows in the pool here
            dense_opt.step(); dense_opt.zero_grad()

Entering the block creates the pool (or opens it), attaches every PersistentEmbeddingBag of the
model, and — if the pool holds a committed checkpoint — recovers it: tables rolled back to the last
committed batch, dense parameters, optimizer and scheduler state and RNG states restored. Each
batch from `rt.batches` is committed when the loop moves past it (docs/architecture.md §4: undo log, dense
snapshot, commit record); leaving the block normally commits the last batch and closes the pool;
an exception leaves the batch in flight uncommitted (the next Runtime rolls it back) and
propagates. A crash costs at most the batch in flight. A NaN or inf table gradient is such an
exception: NonFiniteError, raised in backward before that table stores anything (tables.py).

Works for any nn.Module whose embedding tables are PersistentEmbeddingBag modules, with any torch
optimizers and LR schedulers for its dense parameters.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..checkpoint import (
    BatchGuard,
    Checkpointer,
    CheckpointOptions,
    CheckpointStats,
    NoCheckpoint,
    dense,
    first_commit,
    has_checkpoint,
    layout,
    pending,
    pending_words,
    recover,
    verify,
)
from ..checkpoint.layout import record_bytes
from ..checkpoint.offline import check_checkpoint, recover_pool  # noqa: F401 (re-exported: no model needed)
from ..checkpoint.seam import dense_only
from ..data.loader import batches_from
from ..errors import ConfigError, CxlTrainError, PoolError, RecoveryError
from ..kernels.cpu_threads import resolve_vml_dispatch
from ..knobs import KNOBS
from ..modes import CHECKPOINTS, MODES, OFF, STRICT, UNDO
from ..placement import planner
from ..pool.format import INCOMPAT_DENSE_SLICES, RegionKind, pool_size_for
from ..pool.handle import Pool, RegionSpec, publish, remove_stale
from ..tables import cache as hot_cache
from ..tables.bag import PersistentEmbeddingBag, name_unnamed, pool_holds, refuse_optimized_tables, region_names
from . import tiers as tiering
from .group_recovery import whole_dense_of_dir
from .recovery_point import AgreedMinimum, OwnBatch
from .streamed_save import Streamed

DEFAULT_UNDO_RING_BYTES = 64 << 20
MIN_UNDO_RING_BYTES = 8 << 20  # the smallest ring a Runtime sizes itself
_END = object()  # an iterable source ran out


class Runtime:
    """Context manager binding a model, its dense optimizers and a pool (see the module docstring).

    Args:
        pool: path of the pool (file or DAX device; created when missing).
        model: an nn.Module holding one or more PersistentEmbeddingBag modules.
        optimizers: the torch optimizer(s) of the dense parameters (may be empty).
        schedulers: LR schedulers whose state belongs in the snapshot.
        checkpoint: "undo" (every batch durable) or "off" (the pool is made consistent only when the
            block exits normally; a crash before that means starting over).
        dense_every: take the dense snapshot every k batches. Strict mode commits with it: undo
            records are kept back to the last snapshot, so recovery stays exact and a crash costs at
            most k batches.
        mode: "strict" (recovery exact) or "relaxed" (embeddings committed every batch, the dense
            state every dense_every batches: after a crash it may be up to k batches older than the
            embeddings; `recovery.dense_lag` says by how many). See docs/architecture.md §4.
        pipeline: run commits on a background worker (True), or on the training thread (False: the
            synchronous baseline). Same durability either way.
        background_capture: with the pipeline, the worker also takes the undo captures (during
            forward, instead of the training thread right before each table's update) and the row
            flushes (during the next batch, instead of right after each update), which pays off
            where the worker has a core of its own (see checkpoint/checkpointer.py).
        fused_capture: capture each table's undo record inside its update where the kernels and the
            device allow it (True), or as a pass of its own before the update (False: the comparison).
        metadata: a JSON-like dict describing the run (e.g. its configuration), stored in every
            snapshot; resuming a pool whose metadata differs is refused (every differing key named),
            except in the keys of mutable_metadata. `update_metadata` adds to it as the run goes.
        mutable_metadata: metadata keys a resumed run may change (e.g. a learning rate): given
            ones replace the stored ones from the next commit on, missing ones keep the stored value.
            `rt.resumed_metadata` is the snapshot's metadata as it was (None on a fresh pool).
        keep_given_lr: on resume, the learning rates the optimizers were built with win over the
            snapshot's (put back after the restore: a run that changes its learning rate). False:
            the snapshot's win, and a warning names each that differed from the built one. A group
            an LR scheduler drives is compared by its base rate (initial_lr) and keeps the
            snapshot's: its restored scheduler decides the rate.
        pool_size, undo_ring_bytes, dense_slot_bytes: sizes for a new pool (defaults: computed
            from the model; a 64 MiB undo ring; 4x the dense state + 1 MiB per snapshot slot).
        backend: device backend (see cxltrain.devices); default the `device` knob.
        discard_checkpoint: with checkpoint "off", accept opening a pool that holds committed
            batches: the run stops vouching for them, so a crash during it restarts at batch 0.
            Without it, that is refused (ConfigError) before anything is written.
        capacity_pool: a pool set (docs/tiers.md): the tables named by capacity_tables (default:
            all) live in this capacity pool on block storage, the rest of the model in `pool`, the
            set's primary. Created with the primary; an existing set must name this path.
        prefetch_ids: with a capacity pool, batch -> {table name: row ids [N]}: `batches` then
            fetches batch b+1 while b computes and reads its cold rows ahead (tiering.ColdRowPrefetcher).
        plan: with a capacity pool, a planner.Plan (docs/planner.md): its capacity tables go to the
            capacity pool (unless capacity_tables says otherwise), and it is stored in a new set;
            an existing set whose stored plan differs is refused. `rt.plan` is the set's plan
            once open (the stored one when none is given; None for a set made without one).
        hot_rows: with a capacity pool, {capacity table: row ids, hottest first}: a new set gives
            those tables a persistent hot-row cache of that many rows in the primary (cache.py,
            docs/tiers.md), filled by the first batch. An existing set keeps its cache: hot rows given
            for it must be as many as it caches, per table, or it is refused.
        write_back_every: a pool set's capacity pages written back every this many batches, its cold
            rows durable by redo records in between (docs/tiers.md); None: the write_back_every knob.
        cache_replace_every: re-place the hot-row caches every this many batches from the lookups
            counted since (cache.HotRowCache.replace; 0: the hot list stays). Not stored: a run may
            change it; where rows are cached never changes a value.
        rows_per_batch: the most ids a batch looks up in one table (batch size x pooling): a new
            pool's undo ring is then sized from the tables (undo_ring_bytes; the rule is
            ring_bytes below), instead of the 64 MiB default.
        recovery_point: where the Runtime resumes (recovery_point.py): OwnBatch (the default: one
            process, its own durable batch) or AgreedMinimum (one rank of a group: the agreed G).

    After entering: `start_batch`, `recovered_batch` (None on a fresh pool), `recovery_seconds`,
    `restarted` (the pool held tables but no committed checkpoint: training starts over), `stats`;
    in a group, `durable_target`, `agreed` and `agree(G)`.
    """

    def __init__(self, pool: str | os.PathLike, model: nn.Module,
                 optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None, *,
                 schedulers: Sequence = (), checkpoint: str = UNDO, dense_every: int = 1,
                 mode: str = STRICT, pipeline: bool = True, background_capture: bool = False,
                 fused_capture: bool = True, metadata: dict | None = None, pool_size: int | None = None, undo_ring_bytes: int | None = None,
                 dense_slot_bytes: int | None = None, backend: str | None = None,
                 discard_checkpoint: bool = False, capacity_pool: str | os.PathLike | None = None,
                 capacity_tables: Sequence[str] | None = None, prefetch_ids: Callable | None = None,
                 plan: planner.Plan | None = None, hot_rows: dict | None = None,
                 cache_replace_every: int = 0, write_back_every: int | None = None,
                 rows_per_batch: int | None = None,
                 recovery_point: OwnBatch | AgreedMinimum | None = None, mutable_metadata: Sequence[str] = (),
                 keep_given_lr: bool = False) -> None:
        if checkpoint not in CHECKPOINTS:
            raise ConfigError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        for name, value in (("dense_every", dense_every), ("pool_size", pool_size),
                            ("undo_ring_bytes", undo_ring_bytes), ("dense_slot_bytes", dense_slot_bytes),
                            ("rows_per_batch", rows_per_batch)):
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if metadata is not None and not isinstance(metadata, dict):
            raise ConfigError(f"metadata must be a dict, got {type(metadata).__name__}")
        resolve_vml_dispatch()  # before this run's first op can split across threads (kernels/cpu_threads.py)
        self.path = os.fspath(pool)
        self.model = model
        self.recovery_point = recovery_point if recovery_point is not None else OwnBatch()
        metadata, stored_metadata = self.recovery_point.snapshot_metadata(metadata)
        if optimizers is None:
            optimizers = []
        elif isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.optimizers = list(optimizers)
        if not all(isinstance(o, torch.optim.Optimizer) for o in self.optimizers):
            raise ConfigError("optimizers must be torch.optim.Optimizer instances")
        self.schedulers = list(schedulers)
        self.checkpoint, self.dense_every, self.metadata = checkpoint, dense_every, metadata
        self.mutable_metadata, self.keep_given_lr = tuple(mutable_metadata), bool(keep_given_lr)
        self.mode, self.pipeline, self.background_capture = mode, bool(pipeline), bool(background_capture)
        self.checkpoint_options = CheckpointOptions(dense_every=dense_every, mode=mode, pipeline=self.pipeline,
                                                    background_capture=self.background_capture,
                                                    fused_capture=bool(fused_capture),
                                                    write_back_every=(KNOBS.write_back_every if write_back_every
                                                                      is None else write_back_every),
                                                    **({"undo_chunk_rows": KNOBS.undo_chunk_rows}
                                                       if KNOBS.undo_chunk_rows else {}))
        self.backend, self.discard_checkpoint = backend, bool(discard_checkpoint)
        self.tables = persistent_tables(model)
        if plan is not None and capacity_tables is None:
            capacity_tables = plan.capacity_tables
        self.plan = plan
        self.tiers = tiering.Tiers.of(self.tables, capacity_pool, capacity_tables)
        self._hot = self._checked_hot_rows(hot_rows or {})
        if type(cache_replace_every) is not int or cache_replace_every < 0:
            raise ConfigError(f"cache_replace_every must be an integer >= 0, got {cache_replace_every!r}")
        self.cache_replace_every = cache_replace_every
        self._prefetch_ids = prefetch_ids if self.tiers.capacity_path else None
        self._prefetch_threads = KNOBS.prefetch_threads  # process-wide: read once, here
        self.prefetcher: tiering.ColdRowPrefetcher | None = None
        self._rows_per_batch = rows_per_batch
        self._sizes = (pool_size, undo_ring_bytes or self.ring_bytes(),
                       dense_slot_bytes or _default_slot_bytes(model))
        self.pool: Pool | None = None
        self._state = dense.DenseState(model, self.optimizers, self.schedulers,
                                       {path: t.name for path, t in self.tables.items()}, stored_metadata,
                                       self.recovery_point.dense_slice)
        self._reset()

    def _checked_hot_rows(self, hot_rows: dict) -> dict:
        """{table name: hot rows int64 [C]}, checked against the model and its tiers."""
        by_name = {t.name: t for t in self.tables.values()}
        if hot_rows and self.tiers.capacity_path is None:
            raise ConfigError("a hot-row cache caches a capacity pool's rows: it needs capacity_pool (--capacity-pool)")
        checked = {}
        for name, rows in hot_rows.items():
            if name not in by_name or self.tiers.is_fast(by_name[name]):
                raise ConfigError(f"hot_rows names {name!r}, which is not a table of the capacity pool")
            checked[name] = hot_cache.checked_hot_rows(by_name[name], rows)
        return checked

    def _cache_specs(self) -> list[RegionSpec]:
        return [spec for t in self.tables.values() if t.name in self._hot
                for spec in hot_cache.region_specs(t, self._hot[t.name].size)]

    def _reset(self) -> None:
        """What one `with` block learns about the pool and where it is in it."""
        self._guard: BatchGuard | None = None  # the Checkpointer, or NoCheckpoint with checkpoint "off"
        self.start_batch = 0
        self.recovered_batch: int | None = None
        self.recovery = None                # the RecoveryReport, when the pool was recovered
        self.recovery_seconds = 0.0
        self.restarted = False
        self.resumed_metadata: dict | None = None  # the snapshot's metadata, when the pool was resumed
        self._caches: dict[str, hot_cache.HotRowCache] = {}

    # -- entering ---------------------------------------------------------------------------
    def __enter__(self) -> "Runtime":
        if self.pool is not None:
            raise RuntimeError("this Runtime is already open")
        refuse_optimized_tables(self.tables.values(), self.optimizers)  # before anything is written
        self._reset()
        self.recovery_point.before_open()
        created = not os.path.exists(self.path)
        # Built under a side name and renamed into place once its first commit is durable, so a
        # crash while creating never leaves a half-made pool under the name the next run opens.
        building = self.path + ".creating"
        if created:
            remove_stale(building)  # its errors are about that file: they name it
            self.tiers.check_new()
        try:
            pool = (Pool.create(building, self.pool_bytes(), backend=self.backend, incompat=self.pool_incompat)
                    if created
                    else Pool.open(self.path, backend=self.backend))
            if created:
                self.tiers.create_members(pool, self._table_specs(fast=False))
                if self.tiers.capacity_path:  # a new set holds all its tables, in both tiers, at once
                    pool.add_regions(self._table_specs(fast=True) + self._cache_specs())
                if self.plan is not None and self.tiers.capacity_path:
                    planner.store_plan(pool, self.plan)
                self.recovery_point.created(pool)
            else:
                self.tiers.check_open(pool)
                self._check_plan(pool)
                self._check_cache(pool)
            self._set_up_or_clean_up(pool, created)
        except CxlTrainError as e:  # the user asked for self.path: never show the side name
            raise type(e)(str(e).replace(building, self.path)) from None
        self.pool = pool
        if self._prefetch_ids is not None and self._prefetch_threads:
            cold = [t for t in self.tables.values() if not self.tiers.is_fast(t)]
            self.prefetcher = tiering.ColdRowPrefetcher(pool, cold, self._prefetch_threads)
        self.recovery_point.opened(self)
        return self

    def _check_plan(self, pool: Pool) -> None:
        """Before anything is written: an existing set keeps the plan it was made with."""
        try:
            stored = planner.stored_plan(pool) if pool.members else None
            if self.plan is not None and pool.members:
                planner.check_same(stored, self.plan, self.path)
        except BaseException:
            pool.close()
            raise
        self.plan = stored if pool.members else None

    def _check_cache(self, pool: Pool) -> None:
        """Before anything is written: an existing set keeps the cache it was made with."""
        for name, hot in self._hot.items():
            have = hot_cache.cached_slots(pool, name)
            if have != hot.size:
                pool.close()
                raise ConfigError(f"{self.path}: table {name!r} caches {have:,} hot rows in this pool set, not "
                                  f"{hot.size:,}; a set keeps its cache size: resume with --cache-rows {have} (or "
                                  "without it), or use another pool")

    def _set_up_or_clean_up(self, pool: Pool, created: bool) -> None:
        try:
            self._setup(pool)
            self.restarted = self.restarted and not created  # a new set's capacity pool holds its tables
            if created:
                self.tiers.publish_members(pool)  # the members first: a primary never names a side name
                publish(pool, self.path)
        except BaseException:
            if self._guard is not None:
                self._guard.detach()
            building = [m.path for m in pool.members] if created else []
            pool.close()
            if created:
                os.unlink(pool.path)  # never leave a half-built pool behind
                for path in building:
                    os.unlink(path)
            raise

    def _specs(self) -> list[RegionSpec]:
        _, ring_bytes, slot_bytes = self._sizes
        slot_names = layout.dense_slot_names(self.recovery_point.dense_slice is not None)
        return [RegionSpec(layout.RING_REGION, RegionKind.UNDO_RING, "uint8", (ring_bytes,)),
                *(RegionSpec(name, RegionKind.DENSE_SLOT, "uint8", (slot_bytes,)) for name in slot_names)]

    @property
    def pool_incompat(self) -> int:
        """The feature bits of a pool this Runtime creates: a group rank's holds dense slices."""
        return INCOMPAT_DENSE_SLICES if self.recovery_point.dense_slice else 0

    def ring_bytes(self) -> int:
        """The undo ring a new pool gets: room for the records of the largest batch this Runtime's
        tables can make (each table: at most rows_per_batch rows, at most the table, twice for a
        max_norm table: its renorm's record in forward, its update's in backward; a cached
        table's slots twice more, for the admission's record and the hits' in the first batch, and
        its evicted rows once more when it re-places; a capacity table's updated rows once more,
        for their redo record, which a set that steals writes each batch and keeps until the next
        write-back: counted for every set, since a resumed run may steal), times the batches a
        commit keeps: up to dense_every (at most 4) and the one in flight, and in a group those G
        trails by (a stealing set writes back early when the ring is half full). The
        `undo_ring_bytes` knob, when set, decides instead; without rows_per_batch, 64 MiB."""
        if KNOBS.undo_ring_bytes:
            return KNOBS.undo_ring_bytes
        if self._rows_per_batch is None:
            return DEFAULT_UNDO_RING_BYTES
        largest = 0
        for table in self.tables.values():
            columns = table.optimizer.state_columns
            spec = table.region_specs()[0]
            records = 1 if table.max_norm is None else 2
            records += not self.tiers.is_fast(table)  # its redo record (docs/tiers.md, Steal, no force)
            largest += records * record_bytes(min(table.num_embeddings, self._rows_per_batch),
                                              spec.row_stride(KNOBS.row_align), columns * 4)
            if table.name in self._hot:
                slots = self._hot[table.name].size
                stride = hot_cache.region_specs(table, slots)[0].row_stride(KNOBS.row_align)
                largest += 2 * record_bytes(slots, stride, (columns + hot_cache.MAP_COLUMNS) * 4)
                if self.cache_replace_every:  # and a re-placing batch's evicted capacity rows
                    largest += record_bytes(slots, stride, columns * 4)
        batches = min(self.dense_every, 4) + 1 + self.recovery_point.lag_batches
        return max(MIN_UNDO_RING_BYTES, batches * largest)

    def new_pool_regions(self) -> list[RegionSpec]:
        """Every region a new pool of this Runtime holds, tables first (all in one pool)."""
        return self._table_specs() + self._specs()

    def _table_specs(self, *, fast: bool | None = None) -> list[RegionSpec]:
        """The tables' regions: all of them, or (fast=True/False) those of the fast / capacity tier."""
        return [spec for table in self.tables.values() if fast is None or self.tiers.is_fast(table) == fast
                for spec in table.region_specs()]

    def pool_bytes(self) -> int:
        """Size of the pool this Runtime creates when there is none: tables, undo ring, dense slots."""
        size = self._sizes[0]
        if size is not None:
            return size
        sizes = [spec.nbytes(KNOBS.row_align) for spec in self._table_specs(fast=True) + self._specs()]
        sizes += self.tiers.primary_extra_bytes()
        sizes += [spec.nbytes(KNOBS.row_align) for spec in self._cache_specs()]
        if self.plan is not None and self.tiers.capacity_path:
            sizes.append(planner.PLAN_BYTES)
        sizes += self.recovery_point.extra_bytes()
        return pool_size_for(sizes, KNOBS.dir_capacity, KNOBS.region_align)

    def _setup(self, pool: Pool) -> None:
        tables = list(self.tables.values())
        ours = {t.weight_region for t in tables} | {hot_cache.region_names(t.name)[0] for t in tables}
        foreign = sorted(r.name for r in pool.regions.values() if r.kind == RegionKind.TABLE_WEIGHTS and r.name not in ours)
        try:
            if foreign:
                raise RecoveryError(f"{pool.path}: holds tables of another model ({', '.join(foreign[:3])})")
            present = pool_holds(pool, tables)
        except (ConfigError, PoolError) as e:
            raise RecoveryError(f"{e} (a pool holds one model: use another pool, or delete this one)") from None
        if present and has_checkpoint(pool):
            if any(t.pending_load for t in tables):
                raise ConfigError(f"{pool.path}: already holds a checkpoint of these tables, which would replace the "
                                  "values load_state_dict (or training before the Runtime) gave them; use a new pool "
                                  "to start from them")
            self._refuse_to_risk_committed_batches(pool)
            self._resume(pool)
        else:
            self.restarted = present
            self._start_fresh(pool, tables_present=present)
        logged = tables + self._attach_caches(pool)
        self._guard = (Checkpointer(pool, logged, self._state, self.checkpoint_options)
                       if self.checkpoint == UNDO else NoCheckpoint(pool, logged, self._state))

    def _attach_caches(self, pool: Pool) -> list:
        """The hot-row caches of the tables that have one, read from the (recovered) pool; their
        slots, which the guard logs as tables of their own."""
        for table in self.tables.values():
            if slots := hot_cache.cached_slots(pool, table.name):
                hot_cache.check_table(table, slots)
                table.cache = self._caches[table.name] = hot_cache.HotRowCache(table, pool, self.cache_replace_every)
        return [cache.slots for cache in self._caches.values()]

    @property
    def cache_stats(self) -> dict:
        """{table name: cache.CacheStats} of the tables with a hot-row cache (this block's lookups)."""
        return {name: cache.stats for name, cache in self._caches.items()}

    @property
    def cache_rows(self) -> dict[str, int]:
        """{table name: the slots of its hot-row cache} of the tables with one."""
        return {name: int(cache.map.shape[0]) for name, cache in self._caches.items()}

    def _refuse_to_risk_committed_batches(self, pool: Pool) -> None:
        """checkpoint "off" makes the root stop vouching for the tables once they change: a crash
        in the run then loses every batch committed before it. Only when asked for."""
        done = pool.root.batches_done
        if self.checkpoint == OFF and done > 0 and not self.discard_checkpoint:
            raise ConfigError(f"{pool.path}: holds {done} committed batches that --checkpoint off would put at "
                              "risk (a crash in this run restarts at batch 0); pass --discard-checkpoint "
                              "(Runtime: discard_checkpoint=True) to accept that, or keep --checkpoint undo")

    def _resume(self, pool: Pool) -> None:
        started = time.perf_counter()
        own = dense.read_snapshot(pool, pool.root.dense_slot, pool.root.dense_batch)
        snapshot = self.recovery_point.whole_dense(pool, own)  # a group rank's: every rank's slice, gathered
        stored = snapshot["metadata"]
        if self.metadata is not None:
            differ = sorted(k for k in set(stored) | set(self.metadata)
                            if stored.get(k) != self.metadata.get(k) and k not in self.mutable_metadata)
            if differ:  # all of them at once: one refusal, one retry
                shown = ", ".join(f"{k} {stored.get(k)!r} vs {self.metadata.get(k)!r}" for k in differ)
                raise RecoveryError(f"{pool.path}: was written by a run with other settings ({shown}); "
                                    "resume with the same settings, or use another pool")
        self._state.check(snapshot, pool.path)  # a snapshot of another model is refused before recovery writes
        for table in self.tables.values():
            table.attach(pool, initialize=False)
        report, _ = recover(pool, own)
        # the rate a group was built with: an LR scheduler keeps it as initial_lr and moves lr itself
        built_lrs = [[group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
                     for optimizer in self.optimizers]
        self._state.restore(snapshot, pool.path)
        self._settle_lrs(built_lrs, pool.path)
        self.resumed_metadata = dict(stored)
        if self.metadata is not None and self.mutable_metadata:  # the changed keys go into the next snapshots
            self._state.metadata = {**stored, **{k: self.metadata[k] for k in self.mutable_metadata
                                                 if k in self.metadata}}
        self.recovered_batch = self.start_batch = report.batch
        self.recovery_seconds = time.perf_counter() - started  # reading and checking included, as for `recover`
        self.recovery = report

    def _settle_lrs(self, built: list[list[float]], where: str) -> None:
        """After a restore: the built learning rates put back (keep_given_lr), or each the snapshot
        replaced named in a warning, never silently."""
        for optimizer, lrs in zip(self.optimizers, built):
            for i, (group, lr) in enumerate(zip(optimizer.param_groups, lrs)):
                key = "initial_lr" if "initial_lr" in group else "lr"  # a scheduled group: its base rate
                if group[key] == lr:
                    continue
                if self.keep_given_lr and key == "lr":
                    group["lr"] = lr
                else:
                    hint = ("its LR scheduler's restored state decides its rate" if key != "lr"
                            else "pass keep_given_lr=True to keep yours")
                    warnings.warn(f"{where}: the snapshot's learning rate {group[key]:g} replaces the {lr:g} "
                                  f"{type(optimizer).__name__} was built with (param group {i}); {hint}",
                                  stacklevel=6)

    def update_metadata(self, **items) -> None:
        """Adds JSON-like items to the run's metadata: stored with every snapshot from the next commit
        on (a crash before it loses them, with the batches after the last commit)."""
        self._state.metadata = {**self._state.metadata, **items}

    def _start_fresh(self, pool: Pool, tables_present: bool) -> None:
        missing = [s for s in ([] if tables_present else self._table_specs(fast=True)) + self._specs()
                   if s.name not in pool.regions]
        pool.add_regions(missing)  # first: a pool too small is refused before anything else changes
        if tables_present and pool.root.batches_done != -1:
            # ORDERING: the root stops vouching for the tables before they are re-initialised
            pool.commit(batches_done=-1, dense_slot=0)
        for table in self.tables.values():
            table.attach(pool, initialize=True)  # initialised from its seed and persisted
            if hot_cache.cached_slots(pool, table.name):  # every slot empty: the first batch fills them
                hot_cache.initialise(pool, table, self._hot.get(table.name))
        first_commit(pool, 0, self._state.capture(0))

    # -- batches ----------------------------------------------------------------------------
    def batches(self, source, stop: int | None = None) -> Iterator:
        """Batches start_batch, start_batch+1, ... of `source` (an object with .batch(b), a callable
        b -> batch, a list, a torch DataLoader or any iterable: data/loader.py says which can resume
        past batch 0), up to `stop` (default: source.num_batches when it has one, the end of an
        iterable or of a resumable DataLoader's epoch (a stop past it goes on into the next epochs),
        else endless). A batch is committed when the
        loop asks for the next one, or when the block exits normally."""
        self._end_in_flight()
        get, items, stop = batches_from(source, self.batch, stop, committed=any(s is source for s in self.schedulers))
        ahead = None  # (b + 1, its batch), fetched early so that its cold rows can be read ahead
        while stop is None or self.batch < stop:
            b = self.batch
            if get is not None:
                item = ahead[1] if ahead is not None and ahead[0] == b else get(b)
                if self.prefetcher is not None and (stop is None or b + 1 < stop):
                    ahead = b + 1, get(b + 1)
                    if self.prefetcher.due():
                        self.prefetcher.submit(self._cold_ids(ahead[1]))
            else:
                item = next(items, _END)
                if item is _END:
                    return
            self._begin(b)
            yield item
            self._end_in_flight()

    def _cold_ids(self, batch) -> dict:
        """The ids of `batch` the prefetcher reads ahead: a cached table's hits are in the fast tier."""
        ids = self._prefetch_ids(batch)
        return {name: self._caches[name].misses(rows) if name in self._caches else rows for name, rows in ids.items()}

    def _begin(self, b: int) -> None:
        self._require_open()
        self._guard.begin_batch(b)
        self.recovery_point.at_batch(self)

    def _end_in_flight(self) -> None:
        if self._guard is not None and self._guard.in_flight is not None:
            self._guard.end_batch(self._guard.in_flight)

    def wait_durable(self) -> float:
        """Wait until every commit handed over so far is durable (the background worker has at most
        one in flight); returns the seconds waited. The batch in flight, if any, is committed when
        the loop asks for the next batch or the block exits, not by this."""
        self._require_open()
        return self._guard.wait_durable()

    def wait_idle(self) -> float:
        """wait_durable, then the work still running beside the training thread: a stealing pool
        set's capacity write-back (which makes no batch durable, so wait_durable leaves it). A
        benchmark ends its blocks here, so no run's commits or write-backs are billed to another
        run's block. Returns the seconds waited."""
        self._require_open()
        return self._guard.wait_idle()

    @property
    def dense_state(self) -> dense.DenseState:
        """What a dense snapshot captures: the dense modules, optimizers, schedulers, metadata."""
        return self._state

    @property
    def durable_target(self) -> int:
        """The batch this pool's durable root names: what this rank offers when a group agrees on G."""
        self._require_open()
        return self._guard.durable

    @property
    def agreed(self) -> int | None:
        """The last G agreed by the group (None in one process, or before the block)."""
        return None if self._guard is None else self._guard.agreed

    def agree(self, target: int) -> None:
        """G, agreed by every rank of the group: commits handed over from now on keep the undo
        records of batches >= G, and the snapshots say so (their metadata's "agreed")."""
        metadata = self._state.metadata
        if not isinstance(metadata, dict) or "agreed" not in metadata:
            raise ConfigError("agree() is for one rank of a group: Runtime(recovery_point=AgreedMinimum(...))")
        metadata["agreed"] = target
        if self._guard is not None:
            self._guard.agree(target)

    @property
    def stats(self) -> CheckpointStats | None:
        return self._guard.stats if self._guard is not None else None

    @property
    def batch(self) -> int:
        """Batches done (committed or about to be): the batch in flight, or the next to begin."""
        if self._guard is None:
            return self.start_batch
        return self._guard.in_flight if self._guard.in_flight is not None else self._guard.next_batch

    def _require_open(self) -> None:
        if self.pool is None:
            raise RuntimeError("the Runtime is not open: use it as `with Runtime(...) as rt:`")

    # -- leaving ----------------------------------------------------------------------------
    def __exit__(self, exc_type, exc, tb) -> None:
        pool, self.pool = self.pool, None
        if pool is None:
            return
        try:
            if exc_type is None:
                if self._guard.in_flight is not None and not self._guard.touched:
                    # left before the batch did anything (a break at the top of the loop, zip()
                    # fetching one batch too many): it is not done, the next run starts with it
                    self._guard.abort_batch()
                self._end_in_flight()
                self._guard.finish(self.batch)  # everything durable and committed at the batch reached
        finally:
            self._guard.detach()  # kept: rt.stats stays readable after the block
            if self.prefetcher is not None:
                self.prefetcher.close()
                self.prefetcher = None
            pool.close()


def persistent_tables(model: nn.Module) -> dict[str, PersistentEmbeddingBag]:
    """{module path: table} of every PersistentEmbeddingBag in `model`."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    tables = {path: m for path, m in model.named_modules() if isinstance(m, PersistentEmbeddingBag)}
    if not tables:
        raise ConfigError("the model has no PersistentEmbeddingBag: nothing for a pool to hold")
    name_unnamed(tables)
    names = [t.name for t in tables.values()]
    if len(set(names)) != len(names):
        raise ConfigError(f"table names must be unique in a model, got {names}")
    return tables


def _default_slot_bytes(model: nn.Module) -> int:
    """Room for a dense snapshot: the dense state, and optimizer state up to 3x its size (Adam with
    amsgrad keeps 3 tensors per parameter), plus 1 MiB for RNG states and the manifest."""
    with dense_only():
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return 4 * state_bytes + (1 << 20)


# ---------------------------------------------------------------------------------------------
# Without a model: `cxltrain recover` and `cxltrain export`.
# ---------------------------------------------------------------------------------------------
# recover_pool and check_checkpoint (re-exported above) are checkpoint/offline.py's: they need no torch.


def _records_to_roll_back(pool: Pool) -> tuple[str | None, dict]:
    """(the live records recovery would write back, in words, or None for none; the checked dense
    snapshot); writes nothing."""
    live, snapshot = verify(pool)
    target = pool.root.batches_done
    return (pending_words(live, target) if pending(live, target) else None), snapshot


def export_state(path: str) -> dict:
    """The recovered model of the pool at `path` as a plain state dict (torch.load(weights_only=True)):

        {"batch": batches done,
         "model": {dense parameter/buffer name: tensor,
                   "<table module path>.weight": [R, D], "<table module path>.optimizer_state": [R, K]},
         "optimizers": [optimizer.state_dict(), ...], "schedulers": [...],
         "tables": {table module path: table name}, "metadata": the run's description (Runtime metadata)}

    Every table is copied into memory whole: a file export streams them instead (open_export).
    """
    with open_export(path) as state:
        return materialized(state)


@contextlib.contextmanager
def open_export(path: str) -> Iterator[dict]:
    """export_state's dict with every table's weights and optimizer state a streamed_save.Streamed:
    read from the pool chunk by chunk (cached rows from their slots) when written, so memory stays a
    chunk whatever the tables' size. The pool stays open inside the block.

    A pool with nothing to roll back is read, never written (read-only access is enough); one with
    undo records to roll back (or a set's redo records to apply) is recovered in place first, which
    needs write access. A group rank's pool is exported only with every rank at its batch.
    """
    with Pool.open(path, writable=False) as pool:
        rollback, snapshot = _records_to_roll_back(pool)
        # ORDERING U3e: a group rank's pool is recovered alone (a root of a new ring generation,
        # retiring every record) only once every rank's root names its batch, G then: at mixed
        # batches it is refused here, before any write, and keeps the records of batches at or above
        # a lower G that the group's roll-back needs (a stealing rank's redo records are always live).
        whole = _whole_dense(pool, snapshot)
        if not rollback:
            yield _exported(pool, pool.root.batches_done, whole)
            return
    if not os.access(path, os.W_OK):
        raise RecoveryError(f"{path}: {rollback} in place before it can be "
                            "exported, which needs write access to the pool (run `cxltrain recover` on it as "
                            "a user who may write it)")
    with Pool.open(path) as pool:
        report, _ = recover(pool)  # to its own target: `whole` is the dense state there
        yield _exported(pool, report.batch, whole)


def _whole_dense(pool: Pool, snapshot: dict) -> dict:
    """The pool's dense snapshot whole: a group rank's pool holds only its slice, the others' are in
    the other rank pools of its directory (each at the same batch: `cxltrain recover DIR` first)."""
    if not pool.superblock.incompat & INCOMPAT_DENSE_SLICES:
        return snapshot
    meta = snapshot["metadata"]
    return whole_dense_of_dir(os.path.dirname(pool.path), meta["slices"], own=meta["rank"], have=snapshot)


def materialized(state):
    """`state` with every Streamed value read into a tensor of its own."""
    if isinstance(state, Streamed):
        return state.materialize()
    if type(state) is dict:
        return {k: materialized(v) for k, v in state.items()}
    return state


def _exported(pool: Pool, batch: int, snapshot: dict) -> dict:
    model = dict(snapshot["model"])
    for module_path, name in snapshot["tables"].items():
        prefix = f"{module_path}." if module_path else ""
        weight_region, state_region = region_names(name)
        model[f"{prefix}weight"] = _streamed(pool, name, weight_region, False)
        if state_region in pool.regions:
            model[f"{prefix}optimizer_state"] = _streamed(pool, name, state_region, True)
    return {"batch": batch, "model": model, "optimizers": snapshot["optimizers"], "schedulers": snapshot["schedulers"],
            "tables": dict(snapshot["tables"]), "metadata": snapshot["metadata"]}


def _streamed(pool: Pool, table: str, region: str, optimizer_state: bool) -> Streamed:
    """A table region as training sees it (cached rows from their slots), read when written."""
    shape = pool.array(region).shape
    dtype = torch.from_numpy(np.empty(0, pool.region(region).dtype.numpy)).dtype
    return Streamed(shape, dtype, lambda: hot_cache.merged_chunks(pool, table, region, optimizer_state))
