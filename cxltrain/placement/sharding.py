"""The sharding plan: which rank holds which table, or which rows of it (TorchRec's vocabulary).

    plan = make_plan([100_000, 100_000, 64], world_size=2)   # automatic from the sizes
    print(plan.describe())
    plan.owners(0)          # ranks holding table 0
    plan.rows_of(0, rank)   # (lo, hi): the rows of table 0 that `rank` holds

Kinds:
    table-wise      the whole table on one rank (tables spread largest first over the least loaded)
    row-wise        rows [bounds[i], bounds[i+1]) on rank i: for a table too big for one rank
    data-parallel   a full copy on every rank, updated identically: for small tables

Automatic: tables of at most SMALL_TABLE_ROWS rows are data-parallel, a table larger than twice a
rank's fair share of all rows is row-wise, the others table-wise; when that leaves a rank with
nothing, the table-wise tables become row-wise. Torch-free, so the command line plans fast.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from ..errors import ConfigError
from .table import DATA_PARALLEL, ROW_WISE, TABLE_WISE, TablePlacement

KINDS = (TABLE_WISE, ROW_WISE, DATA_PARALLEL)


def _placement_problem(t: TablePlacement, world_size: int) -> str:
    """What makes table placement `t` impossible on `world_size` ranks ("" when nothing does)."""
    if t.kind not in KINDS:
        return f"unknown kind {t.kind!r}"
    if t.rows < 1 or not t.ranks or len(set(t.ranks)) != len(t.ranks) or not all(0 <= r < world_size for r in t.ranks):
        return f"{t.rows} rows on ranks {list(t.ranks)} of {world_size}"
    if t.kind == TABLE_WISE and len(t.ranks) != 1:
        return f"table-wise on {len(t.ranks)} ranks"
    if t.kind == DATA_PARALLEL and sorted(t.ranks) != list(range(world_size)):
        return f"data-parallel on ranks {list(t.ranks)}, not every rank"
    if t.kind == ROW_WISE and (len(t.bounds) != len(t.ranks) + 1 or t.bounds[0] != 0 or t.bounds[-1] != t.rows
                               or any(a >= b for a, b in zip(t.bounds, t.bounds[1:]))):
        return f"row-wise bounds {list(t.bounds)} do not split {t.rows} rows over {len(t.ranks)} ranks"
    if t.kind != ROW_WISE and t.bounds:
        return f"{t.kind} with row bounds"
    return ""
AUTO = "auto"
SMALL_TABLE_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    world_size: int
    tables: tuple[TablePlacement, ...]

    def owners(self, t: int) -> tuple[int, ...]:
        return self.tables[t].ranks

    def rows_of(self, t: int, rank: int) -> tuple[int, int]:
        return self.tables[t].rows_of(rank)

    def held_by(self, rank: int) -> list[int]:
        """Indices of the tables `rank` holds (a part of), in table order."""
        return [t for t, table in enumerate(self.tables) if rank in table.ranks]

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "tables": [t.shard_fields() for t in self.tables]}

    @classmethod
    def from_json(cls, data: dict) -> "ShardingPlan":
        try:
            tables = tuple(TablePlacement(str(t["name"]), int(t["rows"]), kind=str(t["kind"]),
                                          ranks=tuple(int(r) for r in t["ranks"]),
                                          bounds=tuple(int(b) for b in t["bounds"])) for t in data["tables"])
            plan = cls(int(data["world_size"]), tables)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a sharding plan ({e!r})") from None
        for table in plan.tables:  # a stored plan is read before any pool is: it must hold together
            problem = _placement_problem(table, plan.world_size)
            if problem:
                raise ConfigError(f"not a sharding plan (table {table.name!r}: {problem})")
        return plan

    def describe(self) -> str:
        """One line per table, as the run prints it."""
        lines = [f"sharding plan for {self.world_size} rank(s):"]
        for t in self.tables:
            if t.kind == ROW_WISE:
                where = ", ".join(f"rank {r} rows {lo:,}-{hi - 1:,}" for r, lo, hi in zip(t.ranks, t.bounds, t.bounds[1:]))
            elif t.kind == DATA_PARALLEL:
                where = "a copy on every rank"
            else:
                where = f"rank {t.ranks[0]}"
            lines.append(f"  {t.name}: {t.rows:,} rows, {t.kind}: {where}")
        return "\n".join(lines)

    def fingerprint(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def parse_kinds(spec: str, num_tables: int) -> list[str]:
    """`auto`, one kind for every table, or a comma-separated kind per table."""
    kinds = [k.strip() for k in spec.split(",")]
    if len(kinds) == 1:
        kinds = kinds * num_tables
    if len(kinds) != num_tables or any(k not in (*KINDS, AUTO) for k in kinds):
        raise ConfigError(f"--sharding {spec!r}: give auto, one of {', '.join(KINDS)}, or one of them per table "
                          f"({num_tables} comma-separated)")
    return kinds


def make_plan(rows: Sequence[int], world_size: int, kinds: Sequence[str] | None = None,
              names: Sequence[str] | None = None) -> ShardingPlan:
    """The plan for tables of `rows` rows over `world_size` ranks; kinds: per table, "auto" or a kind."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    names = list(names) if names is not None else [f"t{i}" for i in range(len(rows))]
    kinds = list(kinds) if kinds is not None else [AUTO] * len(rows)
    fair = sum(rows) / world_size
    chosen = [k if k != AUTO else (DATA_PARALLEL if world_size > 1 and r <= SMALL_TABLE_ROWS
                                   else ROW_WISE if world_size > 1 and r > 2 * fair else TABLE_WISE)
              for r, k in zip(rows, kinds)]
    placed = _place_table_wise(rows, chosen, world_size)
    spread = any(k != TABLE_WISE for k in chosen)  # a row-wise or data-parallel table reaches every rank
    if AUTO in kinds and not spread and len(set(placed.values())) < world_size:
        chosen = [ROW_WISE if k == TABLE_WISE and given == AUTO else k for k, given in zip(chosen, kinds)]
        placed = _place_table_wise(rows, chosen, world_size)
    tables = []
    for t, (name, r, kind) in enumerate(zip(names, rows, chosen)):
        if kind == ROW_WISE:
            if r < world_size:
                raise ConfigError(f"table {name}: {r} rows cannot be split row-wise over {world_size} ranks")
            ranks = tuple(range(world_size))
            bounds = tuple(r * i // world_size for i in range(world_size + 1))
            tables.append(TablePlacement(name, r, kind=kind, ranks=ranks, bounds=bounds))
        elif kind == DATA_PARALLEL:
            tables.append(TablePlacement(name, r, kind=kind, ranks=tuple(range(world_size))))
        else:
            tables.append(TablePlacement(name, r, kind=kind, ranks=(placed[t],)))
    plan = ShardingPlan(world_size, tuple(tables))
    idle = [r for r in range(world_size) if not plan.held_by(r)]
    if idle:
        raise ConfigError(f"the sharding plan leaves rank(s) {', '.join(map(str, idle))} without a table "
                          f"({len(rows)} table-wise table(s) over {world_size} ranks); shard some row-wise")
    return plan


def _place_table_wise(rows: Sequence[int], kinds: list[str], world_size: int) -> dict[int, int]:
    """Table-wise tables, largest first, each to the rank with the fewest rows so far (lowest on a tie)."""
    load = [0] * world_size
    placed = {}
    for t in sorted((t for t, k in enumerate(kinds) if k == TABLE_WISE), key=lambda t: (-rows[t], t)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        placed[t] = rank
        load[rank] += rows[t]
    return placed
