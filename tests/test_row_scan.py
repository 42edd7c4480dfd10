"""Rows carry no checksum (issue 35, item 5): `pool check` scans every table row for NaN and
infinity, chunk by chunk, and names the region and row; a cache's row map column (row ids, -1 for
an empty slot, a NaN as a float) is not taken for a value."""

from __future__ import annotations

import numpy as np

from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import train
from cxltrain.pool import rows as row_scan
from cxltrain.pool.format import RegionKind
from cxltrain.pool.handle import Pool
from cxltrain.pool.info import inspect
from helpers import cxltrain


def _region(path: str, name: str):
    return next(r for r in inspect(path).regions if r.name == name)


def test_pool_check_names_the_row_that_holds_a_nan(shm_dir):
    path = str(shm_dir / "rows.pool")
    train(TrainConfig(steps=2, batch_size=64, num_tables=2, rows=1000, dim=16), pool_path=path, progress=False)
    assert cxltrain("pool", "check", path).returncode == 0
    region = _region(path, "t1.weight")
    with open(path, "r+b") as f:
        f.seek(region.offset + 17 * region.row_stride + 8)
        f.write(np.float32("nan").tobytes())
    done = cxltrain("pool", "check", path)
    assert done.returncode == 1 and "t1.weight: row 17 holds a non-finite value" in done.stderr, done


def test_the_scan_reads_chunk_by_chunk_and_skips_the_row_map(shm_dir, monkeypatch):
    path = str(shm_dir / "chunks.pool")
    with Pool.create(path, 1 << 20) as pool:
        pool.add_region("t.weight", RegionKind.TABLE_WEIGHTS, "float32", (100, 4), aligned_rows=True)
        pool.add_region("t.cache.optim", RegionKind.TABLE_OPTIM_STATE, "float32", (10, 2))
        pool.array("t.cache.optim")[:, 1] = np.int32(-1).view(np.float32)  # every slot empty
        pool.array("t.weight")[63, 3] = np.inf
        pool.persist_region("t.weight")
        pool.persist_region("t.cache.optim")
        pool.commit(batches_done=0)
    monkeypatch.setattr(row_scan, "CHUNK_BYTES", 5 * 64)  # 5 rows a read: row 63 is in the 13th
    report = inspect(path)
    with open(path, "rb") as f:
        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)
        assert row_scan.non_finite_rows(report.regions, read) == [
            "t.weight: row 63 holds a non-finite value (rows carry no checksum: the table was damaged, or a step "
            "wrote it)"]
