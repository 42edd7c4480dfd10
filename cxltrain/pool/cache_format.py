"""The hot-row cache's regions on the media (cache.py has the rest): their names, the row map's
column, and what `pool info` says about them. No torch here: `pool info` must not import it."""

from __future__ import annotations

import numpy as np

MAP_COLUMNS = 1   # the row map's column in a slot's state row (an int32 row id)
EMPTY = -1        # the row id of an empty slot


def region_names(table_name: str) -> tuple[str, str, str]:
    """The cache regions of table `table_name`: (slot weights, slot state and map, hot list)."""
    return f"{table_name}.cache.weight", f"{table_name}.cache.optim", f"{table_name}.cache.hot"


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
            column = raw.reshape(state.shape[0], state.row_stride)[:, (state.shape[1] - MAP_COLUMNS) * 4:][:, :4]
            held = int((np.ascontiguousarray(column).view(np.int32)[:, 0] >= 0).sum())
        found.append({"table": table, "rows": r.shape[0], "held": held})
    return found
