"""The persistent hot-row cache (docs/tiers.md): a capacity table's hottest rows live in
the fast tier, and are looked up and updated there only.

For a capacity table T with C cache slots, three regions of the set's primary pool (the fast tier):

    T.cache.weight  [C, D] float32, rows aligned as T's own (kind table_weights)
    T.cache.optim   [C, K + 1] float32 (kind table_optim_state): columns :K a cached row's optimizer
                    state, column K the slot's entry of the row map: the row id held there, an int32
                    stored as its bit pattern (-1: the slot is empty)
    T.cache.hot     [C] int64 (blob): the rows the cache admits, hottest first; written once, when
                    the set is made, never changed after

The row map sits in the slots' state region on purpose: every undo record of a slot holds the
slot's weights, optimizer state and map entry together, so the existing protocol (U1-U4, the undo
ring, recovery) covers the cache with nothing new — recovery restores rows and map at once.

A cached row's authoritative copy is its slot: its capacity row is stale while it is cached. So
lookups consult the map first (`slot_of`, a DRAM index [R] rebuilt from the map when the pool is
opened or recovered), hits read and update the slot, misses the capacity row; everything that
reads a whole table reads through the map (`merged`).

Admission: the set is made with every slot empty and the hot list written; the first batch that
looks the table up with gradients admits the list before its lookups, inside that batch: the
slots' undo record is made durable first (ORDERING U1e, through the guard), then each slot gets
its capacity row's weights and state and its map entry, flushed as an update's rows are, and the
batch's commit makes them durable (U2) with the batch's updates. A crash before that commit rolls
the slots back to empty; the next run admits again. Re-placement (every `replace_every` batches,
from running counts) evicts with write-back and refills the same way, logged first (U1g).

Exactness: a batch's update is the table's one fused kernel call, given the row map and the
slots (`locations`): each unique row is read and updated where it lives, its slot or its capacity
row, its lookups' gradients scaled and summed in lookup order as for any row, so a cached run
ends bit-identical to an uncached one. Its undo records are written by the kernel itself, chunk
by chunk of the unique rows, where the checkpointer fuses the capture (U1h): each chunk's misses'
table rows, then its hits' slots, durable before the chunk's first store; else both are durable
before the kernel starts (U1f, slots first).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
import torch

from ..errors import ConfigError, PoolError
from ..faults import CrashPoint, crash_point
from ..kernels import ops as row_ops
from ..pool.cache_format import EMPTY, MAP_COLUMNS, region_names
from ..pool.format import RegionKind
from ..pool.handle import Pool, RegionSpec

MAX_ROWS = (1 << 31) - 1
CHUNK_BYTES = 16 << 20   # what reading a whole table holds at once (merged_chunks)


def region_specs(table, slots: int) -> list[RegionSpec]:
    weight, state, hot = region_names(table.name)
    return [RegionSpec(weight, RegionKind.TABLE_WEIGHTS, "float32", (slots, table.embedding_dim), aligned_rows=True),
            RegionSpec(state, RegionKind.TABLE_OPTIM_STATE, "float32",
                       (slots, table.optimizer.state_columns + MAP_COLUMNS)),
            RegionSpec(hot, RegionKind.BLOB, "int64", (slots,))]


def cached_slots(pool: Pool, table_name: str) -> int:
    """Slots of the table's cache in `pool`, 0 without one."""
    weight = region_names(table_name)[0]
    return pool.region(weight).shape[0] if weight in pool.regions else 0


def check_table(table, slots: int) -> None:
    """Refuse (ConfigError) a cache this table cannot have."""
    where = f"table {table.name!r}"
    # include_last_offset bags take the general lookup, which reads and updates the capacity rows:
    # a cached row's slot would be bypassed, its updates lost to the map's copy
    if not table._fused or table.include_last_offset:
        raise ConfigError(f"{where}: the hot-row cache needs a plain sum/mean table (no max mode, padding_idx, "
                          "scale_grad_by_freq or include_last_offset)")
    if table.num_embeddings > MAX_ROWS:
        raise ConfigError(f"{where}: the hot-row cache maps at most {MAX_ROWS:,} rows")
    if not 1 <= slots <= table.num_embeddings:
        raise ConfigError(f"{where}: cache rows must be between 1 and its {table.num_embeddings:,} rows, got {slots}")


def checked_hot_rows(table, rows) -> np.ndarray:
    """The hot list `rows` (hottest first) as int64 [C], or ConfigError."""
    hot = np.asarray(rows, dtype=np.int64).reshape(-1)
    check_table(table, hot.size)
    if hot.min() < 0 or hot.max() >= table.num_embeddings or np.unique(hot).size != hot.size:
        raise ConfigError(f"table {table.name!r}: hot rows must be distinct row ids in [0, {table.num_embeddings})")
    return hot


def initialise(pool: Pool, table, hot: np.ndarray | None) -> None:
    """Every slot empty (weights and state zero, map -1), and the hot list `hot` when given (else
    the one the pool holds); all durable. For a new set, before its first commit."""
    weight, state, hot_region = region_names(table.name)
    pool.array(weight, padded=True)[:] = 0
    slots = pool.array(state)
    slots[:] = 0
    slots[:, table.optimizer.state_columns:].view(np.int32)[:] = EMPTY
    if hot is not None:
        pool.array(hot_region)[:] = hot
    for name in (weight, state, hot_region):
        pool.persist_region(name)


@dataclasses.dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    admitted: int = 0
    evicted: int = 0          # written back to the capacity tier by re-placement
    replacements: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class _SlotColumns:
    """What the checkpointer asks of a logged table's optimizer: its state columns (map included)."""

    def __init__(self, columns: int) -> None:
        self.state_columns = columns


class CacheSlots:
    """The cache's slots as the checkpointer sees them (seam.LoggedTable): a table of C rows, named
    `<table>.cache`, whose state rows carry the map entries."""

    def __init__(self, table, pool: Pool) -> None:
        self.name = f"{table.name}.cache"
        self.checkpointer = None
        weight, state, _ = region_names(table.name)
        self._regions = weight, state
        self.optimizer = _SlotColumns(table.optimizer.state_columns + MAP_COLUMNS)
        self.pool = pool
        self.rows = torch.from_numpy(pool.array(weight, padded=True))
        self.state = torch.from_numpy(pool.array(state))

    @property
    def weight_region(self) -> str:
        return self._regions[0]

    @property
    def state_region(self) -> str:
        return self._regions[1]

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows, self.state

    def persist(self) -> None:
        for name in self._regions:
            self.pool.persist_region(name)


class HotRowCache:
    """A table's cache, mapped from the pool it is open in (after recovery: the map is read here)."""

    def __init__(self, table, pool: Pool, replace_every: int = 0) -> None:
        self.table = table
        self.replace_every = replace_every
        self.counts = torch.zeros(table.num_embeddings, dtype=torch.int32) if replace_every else None
        self.replaced_in: int | None = None  # the batch that re-placed last
        self.slots = CacheSlots(table, pool)
        k = table.optimizer.state_columns
        self._k = k
        self.map = self.slots.state[:, k:].view(torch.int32)[:, 0]   # [C] row id per slot, -1 empty
        self.size = self.map.numel()
        self._hot = pool.array(region_names(table.name)[2])
        self.stats = CacheStats()
        self.slot_of = torch.full((table.num_embeddings,), EMPTY, dtype=torch.int32)
        self._index()

    def _index(self) -> None:
        held = torch.nonzero(self.map >= 0).reshape(-1)
        rows = self.map[held].to(torch.int64)
        if rows.numel() and (int(rows.max()) >= self.table.num_embeddings or rows.unique().numel() != rows.numel()):
            raise PoolError(f"{self.slots.pool.path}: the row map of table {self.table.name!r}'s cache is damaged")
        self.slot_of.fill_(EMPTY)
        self.slot_of[rows] = held.to(torch.int32)
        self.admitted = held.numel()

    @property
    def pending(self) -> bool:
        """Whether the hot list is still to be admitted (every slot empty)."""
        return self.admitted == 0

    def misses(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of `rows` [N] that are not cached."""
        return rows[self.slot_of[rows] < 0]

    # -- admission ------------------------------------------------------------------------------
    def admit(self, guard) -> None:
        """Fill every slot from the hot list, inside the batch in flight (see the module docstring)."""
        slots = torch.arange(self.size, dtype=torch.int64)
        # ORDERING U1e: the slots' undo record (old weights, state and map entries) is durable
        # (log_before_write returns only then) before the admission's first store into them.
        batch = guard.log_before_write(self.slots, slots)
        self._fill(guard, batch, slots, torch.from_numpy(np.array(self._hot)))

    def _fill(self, guard, batch: int, slots: torch.Tensor, wanted: torch.Tensor) -> None:
        """Slots `slots` [M] (sorted) get the capacity rows `wanted` [M] and their map entries, in two
        halves, each flushed as updated rows are (their undo record is durable already)."""
        rows, state = self.table.storage()
        half = (slots.numel() + 1) // 2
        for chunk, rows_of in ((slots[:half], wanted[:half]), (slots[half:], wanted[half:])):
            if not chunk.numel():
                continue
            self.slots.rows[chunk] = row_ops.gather_rows(rows, rows_of)
            if self._k:
                self.slots.state[chunk, : self._k] = state[rows_of]
            self.map[chunk] = rows_of.to(torch.int32)
            guard.after_update(self.slots, batch, chunk)  # flushed as updated rows are
            crash_point(CrashPoint.CACHE_MID_ADMISSION)
        self._index()
        self.stats.admitted += slots.numel()

    # -- re-placement ---------------------------------------------------------------------------
    def count(self, indices: torch.Tensor) -> None:
        """Count a batch's lookups with gradients, for re-placement (running counts, in DRAM)."""
        if self.counts is not None:
            self.counts.index_add_(0, indices, torch.ones(indices.numel(), dtype=torch.int32))

    def replace(self, guard) -> None:
        """Re-place the cache inside the batch in flight: the rows counted most since the last time
        take the slots of the cached rows counted least. Each evicted row is written back to its
        capacity row first; then its slot is filled with the admitted row. Both are logged first,
        so recovery restores the map, the slots and the capacity rows together. The counts are
        halved, so the hot set follows drift. Counts live in DRAM: a resumed run starts them over,
        which changes where rows are cached, never a value (the update is the same either way)."""
        order = torch.sort(self.counts, descending=True, stable=True).indices[: self.size]
        order = order[self.counts[order] > 0]  # rows never looked up since are not worth a slot
        self.counts >>= 1
        admit = order[self.slot_of[order] < 0]
        if not admit.numel():
            return
        hot = torch.zeros(self.table.num_embeddings, dtype=torch.bool)
        hot[order] = True
        held = self.map.to(torch.int64)
        cold = torch.nonzero(~hot[held.clamp(min=0)] | (held < 0)).reshape(-1)  # slots to give up
        slots = cold[: admit.numel()]
        admit = admit[: slots.numel()]
        slots, by_slot = torch.sort(slots)
        admit = admit[by_slot]
        evicted = held[slots]
        evicted = torch.sort(evicted[evicted >= 0]).values
        rows, state = self.table.storage()
        # ORDERING U1g: the evicted rows' capacity records, then the slots' (weights, state, map
        # entries), are durable (log_before_write returns only then) before the write-back's first
        # store into a capacity row and the refill's first store into a slot.
        if evicted.numel():
            guard.log_before_write(self.table, evicted)
        batch = guard.log_before_write(self.slots, slots)
        if evicted.numel():  # write-back: the cached value becomes the capacity row's again
            from_slots = self.slot_of[evicted].to(torch.int64)
            rows[evicted] = self.slots.rows[from_slots]
            if self._k:
                state[evicted] = self.slots.state[from_slots, : self._k]
            guard.after_update(self.table, batch, evicted)
            crash_point(CrashPoint.CACHE_AFTER_WRITE_BACK)
        self._fill(guard, batch, slots, admit)
        self.stats.evicted += evicted.numel()
        self.stats.replacements += 1

    # -- lookups and updates --------------------------------------------------------------------
    def lookups(self, guard, table, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """A forward's lookups `indices` [N] of the table: admission or re-placement first when due
        (guard: the table's checkpointer when the lookups have gradients, else None), then the
        undo capture (of the hits' slots and the misses' table rows), whose records must be durable
        before backward stores. Returns (rows [N, P]: each lookup's row, the lookups' positions in
        them [N], the batch or None) for the pooling."""
        batch = None
        if guard is not None:
            batch = guard.in_flight
            if self.pending:
                self.admit(guard)  # the first batch with gradients fills the cache, logged
            elif self.replace_every and batch is not None and batch % self.replace_every == 0 \
                    and self.replaced_in != batch:
                self.replace(guard)  # every replace_every batches, logged
            self.replaced_in = batch
            self.count(indices)
        # each lookup's row from its slot or its capacity row, in lookup order: pooling them adds
        # the same values in the same order as pooling the table would
        local, hits = row_ops.gather_cached(self.table.storage()[0], self.locations(), indices)
        self.stats.lookups += indices.numel()
        self.stats.hits += hits
        if guard is not None:  # the update's lookups: the hits' store in their slots, the misses' in the table
            batch = guard.capture(table, indices, self)
        return local, torch.arange(indices.numel()), batch

    def locations(self) -> row_ops.CachedRows:
        """The row map and the slots' arrays, as the fused update takes them: each cached row is
        read and updated in its slot, with the arithmetic it would get in the table."""
        # the slots' state with the map column, even for sgd: a fused update records it with the slot
        return row_ops.CachedRows(self.slot_of, self.slots.rows, self.slots.state)

    def homes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the update's rows [U] (sorted) were stored: (the slots of the cached ones [U'],
        sorted; the table rows of the others [U - U'], sorted)."""
        # numpy: a batch's few thousand rows pay torch's per-op overhead several times over
        table_rows = rows.numpy()
        slots = self.slot_of.numpy()[table_rows]
        hit = slots >= 0
        return torch.from_numpy(np.sort(slots[hit]).astype(np.int64)), torch.from_numpy(table_rows[~hit])


def merged_chunks(pool: Pool, table_name: str, region: str, optimizer_state: bool) -> Iterator[np.ndarray]:
    """The table `table_name` as training sees it, chunk by chunk: its region `region` (weights
    [R, D], or with optimizer_state its state [R, K]) in copies of at most CHUNK_BYTES (one row at
    least), rows in order, each chunk's cached rows taken from their slots (their capacity rows are
    stale). Memory stays a chunk whatever the table's size."""
    table = pool.array(region)
    row_bytes = max(1, table.shape[1] * table.itemsize)
    step = max(1, CHUNK_BYTES // row_bytes)
    rows, slots = _held(pool, table_name)
    slot_region = region_names(table_name)[1 if optimizer_state else 0]
    cached = pool.array(slot_region) if rows.size else None
    for first in range(0, table.shape[0], step):
        last = min(table.shape[0], first + step)
        chunk = np.array(table[first:last])  # a copy: never the mapping itself
        lo, hi = np.searchsorted(rows, (first, last))
        if hi > lo:
            chunk[rows[lo:hi] - first] = cached[slots[lo:hi], : chunk.shape[1]]
        yield chunk


def _held(pool: Pool, table_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(the rows the table's cache holds [H], sorted; the slot of each [H]); empty without a cache."""
    state_region = region_names(table_name)[1]
    if state_region not in pool.regions:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    state = pool.array(state_region)
    k = state.shape[1] - MAP_COLUMNS
    rows = np.ascontiguousarray(state[:, k:]).view(np.int32)[:, 0].astype(np.int64)
    slots = np.nonzero(rows >= 0)[0]
    order = np.argsort(rows[slots], kind="stable")
    return rows[slots][order], slots[order]
