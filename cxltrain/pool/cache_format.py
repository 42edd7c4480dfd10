"""The hot-row cache's regions on the media (cache.py has the rest): their names, the row map's
column, and what `pool info` says about them. No torch here: `pool info` must not import it."""

from __future__ import annotations

import numpy as np

from ..errors import PoolCorruptError

MAP_COLUMNS = 1   # the row map's column in a slot's state row (an int32 row id)
EMPTY = -1        # the row id of an empty slot


def region_names(table_name: str) -> tuple[str, str, str]:
    """The cache regions of table `table_name`: (slot weights, slot state and map, hot list)."""
    return f"{table_name}.cache.weight", f"{table_name}.cache.optim", f"{table_name}.cache.hot"


def table_of(region_name: str) -> str | None:
    """The table whose cache slot weights `region_name` names; None for any other region."""
    return region_name[: -len(".cache.weight")] if region_name.endswith(".cache.weight") else None


def map_of(state, raw: bytes) -> np.ndarray:
    """The row map [C] int32 inside the bytes `raw` of the slot state region `state` [C, K + 1]."""
    rows = np.frombuffer(raw, dtype=np.uint8, count=state.size).reshape(state.shape[0], state.row_stride)
    column = rows[:, (state.shape[1] - MAP_COLUMNS) * 4:][:, :4]
    return np.ascontiguousarray(column).view(np.int32)[:, 0]


def check_map(held: np.ndarray, table_rows: int, where: str) -> None:
    """Refuse (PoolCorruptError) a row map [C] naming a row outside [0, table_rows) or a row twice:
    either would make a read through the cache return another row's values. No crash state has
    either: admission and re-placement write only rows no slot holds."""
    rows = held[held != EMPTY]
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= table_rows):
        bad = int(rows[(rows < 0) | (rows >= table_rows)][0])
        raise PoolCorruptError(f"{where}: its row map names row {bad}, outside the table's {table_rows:,} rows")
    if np.unique(rows).size != rows.size:
        values, counts = np.unique(rows, return_counts=True)
        raise PoolCorruptError(f"{where}: its row map names row {int(values[counts > 1][0])} in two slots")


def describe(path: str, regions) -> list[dict]:
    """The hot-row caches a pool's `regions` (pool_inspect's) hold: per table its slots and the
    rows its map holds on the media (`pool info`); reads the file, writes nothing."""
    by_name = {r.name: r for r in regions}
    found = []
    for r in regions:
        if not r.name.endswith(".cache.weight"):
            continue
        table = r.name[: -len(".cache.weight")]
        state = by_name.get(region_names(table)[1])
        held = None
        if state is not None and state.shape[1] >= MAP_COLUMNS:
            raw = np.fromfile(path, dtype=np.uint8, count=state.size, offset=state.offset)
            held = int((map_of(state, raw.tobytes()) >= 0).sum())
        found.append({"table": table, "rows": r.shape[0], "held": held})
    return found
