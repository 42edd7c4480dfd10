"""Scanning a pool's table rows for values no training step writes (`pool check`).

Rows carry no checksum: a row is rewritten by every update, in place, and a checksum per row would
be one more store per update for every row touched. What the pool protects with checksums is
what recovery trusts (docs/architecture.md): the superblock, the root slots, the region directory,
the set, plan and member regions, the undo records and the dense snapshots. A damaged row is
found here at least when it holds a NaN or an infinity, which a step would otherwise meet only as
a NaN loss. Read chunk by chunk with pread: memory stays bounded whatever the table's size.
"""

from __future__ import annotations

import numpy as np

from . import cache_format
from .check import Reader
from .format import Region, RegionKind

CHUNK_BYTES = 16 << 20
TABLE_KINDS = (RegionKind.TABLE_WEIGHTS, RegionKind.TABLE_OPTIM_STATE)


def non_finite_rows(regions: list[Region], read: Reader) -> list[str]:
    """One line per table region (weights [R, D] or optimizer state [R, K]) that holds a NaN or an
    infinity, naming its first such row; [] when every value is finite."""
    found = []
    for region in regions:
        if region.kind not in TABLE_KINDS or region.dtype.numpy.kind != "f":
            continue
        row = _first_non_finite_row(region, read)
        if row is not None:
            found.append(f"{region.name}: row {row} holds a non-finite value (rows carry no checksum: the table "
                         "was damaged, or a step wrote it)")
    return found


def _first_non_finite_row(region: Region, read: Reader) -> int | None:
    dtype = region.dtype.numpy
    columns = int(np.prod(region.shape[1:])) if len(region.shape) > 1 else 1
    if region.name.endswith(".cache.optim"):  # its last column is the row map: row ids, not floats
        columns -= cache_format.MAP_COLUMNS
    per_row = region.row_stride // dtype.itemsize
    step = max(1, CHUNK_BYTES // region.row_stride)
    for first in range(0, region.shape[0], step):
        rows = min(step, region.shape[0] - first)
        chunk = np.frombuffer(read(region.offset + first * region.row_stride, rows * region.row_stride), dtype=dtype)
        bad = ~np.isfinite(chunk.reshape(rows, per_row)[:, :columns]).all(axis=1)
        if bad.any():
            return first + int(np.argmax(bad))
    return None
