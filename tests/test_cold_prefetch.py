"""The capacity tier's prefetcher reads only pages the page cache does not hold (runtime/tiers.py)."""

from __future__ import annotations

import mmap
import os

import numpy as np

from cxltrain.pool.format import DType, Region, RegionKind
from cxltrain.runtime.tiers import PAGE, ColdRowPrefetcher, _Residency
from helpers import tier_folders


def test_residency_tells_held_pages_from_dropped_ones():
    with tier_folders("cxltrain-residency") as (_, disk):
        _check_residency(os.path.join(disk, "rows.bin"))


def _check_residency(path: str) -> None:
    """On block storage (the disk's page cache drops clean pages; /dev/shm's would not)."""
    pages = 64
    with open(path, "wb") as f:
        f.write(os.urandom(pages * PAGE))
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped from the page cache
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a read brings in its page alone, as the prefetcher's
        mapping = mmap.mmap(fd, pages * PAGE, mmap.MAP_SHARED)
        array = np.frombuffer(mapping, dtype=np.uint8)
        region = Region(index=0, name="t.weight", kind=RegionKind.TABLE_WEIGHTS, dtype=DType.FLOAT32, shape=(40, PAGE // 4),
                        offset=8 * PAGE, size=40 * PAGE, row_stride=PAGE)
        residency = _Residency(array, region)
        wanted = np.arange(8, 48, dtype=np.int64)
        assert not residency.held(wanted).any()
        for page in (10, 11, 30):
            os.pread(fd, 1, page * PAGE)
        assert np.flatnonzero(residency.held(wanted)).tolist() == [2, 3, 22]
        del array, residency
        mapping.close()
    finally:
        os.close(fd)


def test_the_prefetcher_looks_less_often_while_every_page_is_held_and_every_batch_once_one_is_not():
    with tier_folders("cxltrain-prefetch-backoff") as (_, disk):
        path = os.path.join(disk, "rows.bin")
        pages = 16
        with open(path, "wb") as f:
            f.write(os.urandom(pages * PAGE))
        fd = os.open(path, os.O_RDONLY)
        prefetcher = ColdRowPrefetcher(None, [], threads=2)  # no table: every page it is asked for is "held"
        try:
            looks = []
            for batch in range(200):
                if prefetcher.due():
                    prefetcher.submit({})
                    looks.append(batch)
            assert looks[:6] == [0, 2, 5, 9, 14, 20]  # 1, 2, 3, 4, 5 batches skipped after each
            assert looks[-1] - looks[-2] == ColdRowPrefetcher.MAX_SKIP + 1
            assert prefetcher.batches_skipped == 200 - len(looks)
            # a table whose pages the page cache dropped: the next look reads them, and looks again next batch
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            mapping = mmap.mmap(fd, pages * PAGE, mmap.MAP_SHARED, mmap.PROT_READ)
            region = Region(index=0, name="t.weight", kind=RegionKind.TABLE_WEIGHTS, dtype=DType.FLOAT32,
                            shape=(pages, PAGE // 4), offset=0, size=pages * PAGE, row_stride=PAGE)
            prefetcher._targets["t"] = [(fd, 0, PAGE, _Residency(np.frombuffer(mapping, dtype=np.uint8), region))]
            while not prefetcher.due():
                pass
            prefetcher.submit({"t": np.array([3, 7])})
            prefetcher.wait()
            assert prefetcher.pages_read == 2 and prefetcher.due() and prefetcher.due()
        finally:
            prefetcher.close()
            os.close(fd)
