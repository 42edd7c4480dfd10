"""One table's placement: the tier it lives in (and how many of its hot rows the fast tier caches),
and the ranks that hold it (the whole table, a row range each, or a copy each).

The tier planner (planner.py) fills the tier fields and the sharding plan (sharding.py) the rank
fields; each stores only its own fields (`tier_fields`, `shard_fields`), so the pool set's stored
plan and a run folder's manifest keep their formats.
"""

from __future__ import annotations

import dataclasses

FAST, CAPACITY = "fast", "capacity"
TABLE_WISE, ROW_WISE, DATA_PARALLEL = "table-wise", "row-wise", "data-parallel"

TIER_FIELDS = ("name", "rows", "bytes", "tier", "cached_rows", "hit_rate", "lookups_per_batch")
SHARD_FIELDS = ("name", "rows", "kind", "ranks", "bounds")


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    name: str
    rows: int
    # the tiers of one pool set
    bytes: int = 0                         # rows x row bytes, optimizer state included
    tier: str = FAST                       # FAST or CAPACITY
    cached_rows: int = 0                   # capacity tables: hot rows the fast tier caches (0 for fast ones)
    hit_rate: float = 1.0                  # expected share of lookups served by the fast tier
    lookups_per_batch: float = 0.0
    # the ranks of a group
    kind: str = TABLE_WISE                 # TABLE_WISE, ROW_WISE or DATA_PARALLEL
    ranks: tuple[int, ...] = (0,)          # the ranks holding (part of) it
    bounds: tuple[int, ...] = ()           # row-wise: ranks[i] holds rows [bounds[i], bounds[i+1])

    def rows_of(self, rank: int) -> tuple[int, int]:
        """(lo, hi): the rows of this table that `rank` holds ((0, 0) for none)."""
        if rank not in self.ranks:
            return 0, 0
        if self.kind == ROW_WISE:
            i = self.ranks.index(rank)
            return self.bounds[i], self.bounds[i + 1]
        return 0, self.rows

    def tier_fields(self) -> dict:
        """What a pool set's stored plan holds of it."""
        return {k: getattr(self, k) for k in TIER_FIELDS}

    def shard_fields(self) -> dict:
        """What a run folder's manifest holds of it (tuples as lists, as JSON has them)."""
        return {k: list(v) if isinstance(v, tuple) else v for k in SHARD_FIELDS for v in [getattr(self, k)]}
