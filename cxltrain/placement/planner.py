"""The placement planner (docs/planner.md, docs/tiers.md): which tier each table lives in, and how many
of a capacity table's hottest rows the fast tier should cache.

    profiles = profile_source(source, tables, batches=16)   # ids counted per table
    plan = make_plan(profiles, fast_bytes=2 << 30)           # deterministic for the same inputs
    print(format_plan(plan))

Inputs: each table's size (rows x row bytes, optimizer state included), its measured access
frequencies (a profile of the run's first batches) and the fast tier's budget in bytes. Whole
tables go to the fast tier first, densest (lookups per byte) first, while they fit; what is left of
the budget caches the capacity tables' hottest rows, the rows with the most lookups per byte first,
across tables. A capacity table's expected hit rate is the share of its profiled lookups that fall
on its cached rows. Measured bandwidths only estimate times (format_plan); they never change the
plan, so the same data and options give the same plan on any day.

The plan is stored in the pool set's primary (a BLOB region of its own, `cxltrain.plan`) when the
set is created; a restart reads it back and never plans again (store_plan, stored_plan).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ConfigError
from ..pool.format import RegionKind
from ..pool.plan_format import PLAN_BYTES, PLAN_REGION, pack_plan_json, plan_json
from .table import CAPACITY, FAST, TablePlacement

PAGE_BYTES = 4096                          # what a capacity-tier read of one cold row costs at least


@dataclasses.dataclass(frozen=True)
class TableProfile:
    """One table's size and the ids its first batches looked up. The even batches rank the rows
    (`counts`); the odd ones, held out, say how often those rows come back (`held_out`), so the
    expected hit rate is not measured on the very lookups that chose the rows."""

    name: str
    rows: int
    row_bytes: int                         # weights and optimizer state of one row, padding included
    counts: np.ndarray                     # [U] lookups of each distinct id of the even batches, most first
    held_out: np.ndarray                   # [U] lookups of the same ids (same order) in the odd batches
    held_out_lookups: int                  # every lookup of the odd batches
    batches: int                           # batches profiled, even and odd
    ids: np.ndarray | None = None          # [U] the distinct ids `counts` counts, most looked up first

    def hot_rows(self, n: int) -> np.ndarray:
        """The n rows a cache of n rows holds: the most looked-up first, then (when the profile saw
        fewer) the unseen rows in id order."""
        seen = self.ids[:n]
        if seen.size == n:
            return seen
        rest = np.setdiff1d(np.arange(self.rows, dtype=np.int64), seen, assume_unique=True)
        return np.concatenate([seen, rest[: n - seen.size]])

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def lookups(self) -> int:
        return int(self.counts.sum()) + self.held_out_lookups

    def hit_rate(self, cached: int) -> float:
        """Share of the held-out lookups that the `cached` highest-ranked rows serve."""
        if not self.held_out_lookups:
            return 0.0
        return float(self.held_out[:cached].sum() / self.held_out_lookups)


@dataclasses.dataclass(frozen=True)
class Plan:
    fast_bytes: int                        # the fast tier's budget for tables and cached rows
    profile_batches: int
    tables: tuple[TablePlacement, ...]
    cache_rows: int | None = None          # `--cache-rows`: every capacity table caches this many (None: planned)

    @property
    def capacity_tables(self) -> list[str]:
        return [t.name for t in self.tables if t.tier == CAPACITY]

    @property
    def cached_rows(self) -> dict[str, int]:
        """{capacity table: hot rows to cache in the fast tier}: what the hot-row cache reads."""
        return {t.name: t.cached_rows for t in self.tables if t.tier == CAPACITY}

    def placement(self) -> list[tuple[str, str, int]]:
        """What a restart must agree with: (table, tier, cached rows)."""
        return [(t.name, t.tier, t.cached_rows) for t in self.tables]

    def to_json(self) -> dict:
        return {"fast_bytes": self.fast_bytes, "profile_batches": self.profile_batches,
                "tables": [t.tier_fields() for t in self.tables],
                **({} if self.cache_rows is None else {"cache_rows": self.cache_rows})}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        cache_rows = data.get("cache_rows")  # absent from plans made before the cache
        return cls(int(data["fast_bytes"]), int(data["profile_batches"]),
                   tuple(TablePlacement(**t) for t in data["tables"]), None if cache_rows is None else int(cache_rows))


def make_plan(profiles: list[TableProfile], fast_bytes: int, cache_rows: int | None = None) -> Plan:
    """The plan for `profiles` within `fast_bytes` of fast tier (see the module docstring);
    `cache_rows` (the `--cache-rows` override) caches that many rows of every capacity table."""
    if fast_bytes < 0:
        raise ConfigError(f"the fast tier's budget must be >= 0 bytes, got {fast_bytes}")
    left = fast_bytes
    fast = set()
    # densest first; ties by name, so the order never depends on the input's order
    for p in sorted(profiles, key=lambda p: (-p.lookups / p.bytes, p.name)):
        if p.bytes <= left:
            fast.add(p.name)
            left -= p.bytes
    cached = _cache_rows([p for p in profiles if p.name not in fast], left)
    if cache_rows is not None:
        cached = {p.name: min(cache_rows, p.rows) for p in profiles if p.name not in fast}
    plans = []
    for p in profiles:
        per_batch = p.lookups / p.batches if p.batches else 0.0
        if p.name in fast:
            plans.append(TablePlacement(p.name, p.rows, p.bytes, FAST, 0, 1.0, per_batch))
            continue
        n = cached.get(p.name, 0)
        plans.append(TablePlacement(p.name, p.rows, p.bytes, CAPACITY, n, p.hit_rate(n), per_batch))
    batches = max((p.batches for p in profiles), default=0)
    return Plan(fast_bytes, batches, tuple(plans), cache_rows)


def _cache_rows(profiles: list[TableProfile], budget: int) -> dict[str, int]:
    """{table: rows cached}: the rows with the most lookups per byte first, while they fit."""
    if not profiles or budget <= 0:
        return {}
    value = np.concatenate([p.counts / p.row_bytes for p in profiles])
    size = np.concatenate([np.full(p.counts.size, p.row_bytes, np.int64) for p in profiles])
    by_name = sorted(range(len(profiles)), key=lambda i: profiles[i].name)
    owner = np.concatenate([np.full(p.counts.size, i, np.int64) for i, p in enumerate(profiles)])
    name_rank = np.argsort(by_name)[owner]
    rank = np.concatenate([np.arange(p.counts.size) for p in profiles])
    # most lookups per byte first; ties by table name, then by the rows' rank: never by input order
    order = np.lexsort((rank, name_rank, -value))
    taken = order[np.cumsum(size[order]) <= budget]
    counts = np.bincount(owner[taken], minlength=len(profiles))
    return {p.name: int(counts[i]) for i, p in enumerate(profiles) if counts[i]}


def profile_source(source, tables: list[tuple[str, int, int]], batches: int) -> list[TableProfile]:
    """Count the ids of `source`'s batches 0..batches-1 per table, even and odd batches apart (a
    single batch is both). tables: (name, rows, row bytes) in the source's feature order. A source
    with fewer batches is profiled whole."""
    total = batches if source.num_batches is None else min(batches, source.num_batches)
    return profiles_of(tables, [[v.numpy() for v in source.batch(b).values[: len(tables)]] for b in range(total)])


def profiles_of(tables: list[tuple[str, int, int]], batches: list[list[np.ndarray]]) -> list[TableProfile]:
    """profile_source's profiles of batches already read: each a list of ids [N] per table."""
    seen: list[tuple[list, list]] = [([], []) for _ in tables]
    for b, values in enumerate(batches):
        for f, ids in enumerate(values):
            seen[f][b % 2].append(ids)
    return [profile_ids(name, rows, row_bytes, _joined(even), _joined(odd or even), len(batches))
            for (name, rows, row_bytes), (even, odd) in zip(tables, seen)]


def profile_ids(name: str, rows: int, row_bytes: int, ranked_by: np.ndarray, held_out: np.ndarray,
                batches: int) -> TableProfile:
    """The profile of ids `ranked_by` [N] (which rank the rows) and `held_out` [M] (which test them)."""
    ids, counts = np.unique(ranked_by, return_counts=True)
    # most lookups first; equal counts by id (np.unique sorted them), so the order is reproducible
    order = np.argsort(-counts, kind="stable")
    ids, counts = ids[order], counts[order]
    held_ids, held_counts = np.unique(held_out, return_counts=True)
    again = np.zeros_like(counts)
    if held_ids.size:
        where = np.minimum(np.searchsorted(held_ids, ids), held_ids.size - 1)
        again = np.where(held_ids[where] == ids, held_counts[where], 0)
    return TableProfile(name, rows, row_bytes, counts, again, int(held_out.size), batches, ids)


def _joined(parts: list) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)


def format_plan(plan: Plan, tiers: dict | None = None) -> str:
    """TorchRec-planner-like text: one line per table, then the totals; `tiers` (measure output,
    optional) adds each tier's free space and the estimated capacity-tier reads per batch."""
    head = f"{'table':<14} {'rows':>13} {'bytes':>15} {'tier':<9} {'cached rows':>12} {'hit rate':>9}"
    lines = [head, "-" * len(head)]
    for t in plan.tables:
        cached = f"{t.cached_rows:,}" if t.tier == CAPACITY else "-"
        lines.append(f"{t.name:<14} {t.rows:>13,} {t.bytes:>15,} {t.tier:<9} {cached:>12} {t.hit_rate:>9.1%}")
    fast_used = sum(t.bytes for t in plan.tables if t.tier == FAST)
    cache_used = sum(t.cached_rows * t.bytes // t.rows for t in plan.tables if t.tier == CAPACITY)
    capacity = sum(t.bytes for t in plan.tables if t.tier == CAPACITY)
    lines.append(f"fast tier: {fast_used:,} bytes of tables + {cache_used:,} of cached rows, budget "
                 f"{plan.fast_bytes:,}; capacity tier: {capacity:,} bytes; profile of {plan.profile_batches} batches")
    misses = miss_reads_per_batch(plan)
    lines.append(f"expected capacity-tier reads per batch: {misses:,.0f} rows ({misses * PAGE_BYTES:,.0f} bytes at "
                 f"{PAGE_BYTES} per row)")
    for name, tier in (tiers or {}).items():
        lines.append(f"{name} tier: {tier['path']}: {tier['free_bytes']:,} bytes free, "
                     f"{tier['read_mb_s']:,.0f} MB/s measured ({tier['how']})")
    if tiers and tiers.get(CAPACITY, {}).get("read_mb_s"):
        ms = misses * PAGE_BYTES / (tiers[CAPACITY]["read_mb_s"] * 1e6) * 1e3
        lines.append(f"estimated capacity-tier read time per batch: {ms:,.1f} ms (no prefetch overlap)")
    return "\n".join(lines)


def miss_reads_per_batch(plan: Plan) -> float:
    """Lookups per batch that miss the fast tier (an upper bound on capacity-tier row reads)."""
    return sum(t.lookups_per_batch * (1 - t.hit_rate) for t in plan.tables if t.tier == CAPACITY)


# -- in the pool set ----------------------------------------------------------------------------
def pack_plan(plan: Plan, uuid: bytes) -> bytes:
    return pack_plan_json(plan.to_json(), uuid)


def unpack_plan(raw: bytes, uuid: bytes, where: str) -> Plan:
    return Plan.from_json(plan_json(raw, uuid, where))


def store_plan(pool, plan: Plan) -> None:
    """Write `plan` into the new primary `pool`, durably (before the set's first commit)."""
    region = pool.add_region(PLAN_REGION, RegionKind.BLOB, "uint8", (PLAN_BYTES,))
    pool.device.copy_persist(region.offset, pack_plan(plan, pool.superblock.uuid))


def stored_plan(pool) -> Plan | None:
    """The plan the primary `pool` holds; None for a set made without one."""
    if PLAN_REGION not in pool.regions:
        return None
    return unpack_plan(pool.array(PLAN_REGION).tobytes(), pool.superblock.uuid, pool.path)


def check_options(stored: Plan, fast_bytes: int | None, profile_batches: int | None, where: str,
                  cache_rows: int | None = None) -> None:
    """A restart uses the stored plan; options given that would plan differently are refused."""
    for option, given, had in (("--fast-bytes", fast_bytes, stored.fast_bytes),
                               ("--profile-batches", profile_batches, stored.profile_batches),
                               ("--cache-rows", cache_rows, stored.cache_rows)):
        if given is not None and given != had:
            if had is None:
                raise ConfigError(f"{where}: its stored plan was made without {option}, this run gives {option} "
                                  f"{given}; a pool set keeps its plan: resume without it, or use another pool")
            raise ConfigError(f"{where}: its stored plan was made with {option} {had}, not {given}; a pool set "
                              f"keeps its plan: resume with {option} {had} (or without it), or use another pool")


def check_same(stored: Plan | None, wanted: Plan, where: str) -> None:
    """Refuse (ConfigError) a restart whose plan differs from the one the set was made with."""
    if stored is None:
        raise ConfigError(f"{where}: this pool set was made without a placement plan, and this run has one; "
                          "resume without --fast-bytes, or use another pool")
    if stored.placement() != wanted.placement():
        differ = [f"{a[0]} {a[1]}/{a[2]} vs {b[1]}/{b[2]}"
                  for a, b in zip(stored.placement(), wanted.placement()) if a != b]
        shown = "; ".join(differ[:3]) or "other tables"
        raise ConfigError(f"{where}: its stored plan differs from this run's (tier/cached rows: {shown}); "
                          "resume with the options it was made with (see `cxltrain plan`), or use another pool")


def device_cache_rows(tables: list[tuple[str, int, int]], budget_bytes: int, batch_lookups: int,
                      rows: int | None = None) -> dict[str, int]:
    """Rows of each table (name, rows, bytes a row) a GPU's hot-row cache holds (DESIGN §9, FAE):
    `rows` each when given (capped at the table), else every row when all tables fit in
    `budget_bytes`, else each table's share of the budget by its size, and never fewer than two
    batches' lookups (`batch_lookups` a table a batch, the most unique rows a batch can have): a
    cache of about one batch misses what the next batch brings back."""
    if rows is not None:
        return {name: min(rows, count) for name, count, _ in tables}
    total = sum(count * row_bytes for _, count, row_bytes in tables)
    if total <= budget_bytes:
        return {name: count for name, count, _ in tables}
    return {name: min(count, max(2 * batch_lookups, int(budget_bytes * count * row_bytes / total) // row_bytes))
            for name, count, row_bytes in tables}
