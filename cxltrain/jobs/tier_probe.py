"""A short probe of the two tiers for the step model (placement/step_model.py, docs/planner.md):
random 256-byte row reads and writes in a file mapped from each tier's folder, as the tables are
(a capacity row read through the mapping and written to the file with pwrite, as the update
writes it: docs/tiers.md), and the write-back of clean capacity pages one row dirtied each.

    speeds = measure_speeds("/dev/shm", "/var/tmp")     # about half a second; the files removed
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

from ..placement.step_model import PAGE_BYTES, TierSpeeds

PROBE_BYTES = 32 << 20     # written pages scattered over 8,192, as a pool's are over its file
ROW_FLOATS = 64                 # a 256-byte row, as the tables' default dim lays it out
PROBE_ROWS = 8192               # random rows a row-cost probe reads and writes
FEW_PAGES, MANY_PAGES = 16, 1024  # two write-backs, for the fixed cost and the cost a page
REPEATS = 3
COPY_BYTES = 8 << 20


def measure_speeds(fast_dir: str, capacity_dir: str) -> TierSpeeds:
    """Each tier measured in a probe file of its own folder (removed after), median of REPEATS."""
    rng = np.random.default_rng(0)

    def fast(fd: int, rows: np.ndarray) -> float:
        return _row_seconds(rows, rng, None)

    def capacity(fd: int, rows: np.ndarray) -> tuple[float, float, float]:
        row = _row_seconds(rows, rng, fd)  # its pages cached: no disk
        os.fdatasync(fd)
        return row, _write_back_seconds(fd, rows, FEW_PAGES, rng), _write_back_seconds(fd, rows, MANY_PAGES, rng)

    fast_row = _in_probe_file(fast_dir, fast)
    capacity_row, few, many = _in_probe_file(capacity_dir, capacity)
    per_page = max(0.0, (many - few) / (MANY_PAGES - FEW_PAGES))
    return TierSpeeds(fast_row_us=fast_row * 1e6, capacity_row_us=capacity_row * 1e6,
                      page_write_back_us=per_page * 1e6, sync_ms=max(0.0, few - FEW_PAGES * per_page) * 1e3,
                      copy_mb_s=copy_mb_s(COPY_BYTES))


def copy_mb_s(nbytes: int) -> float:
    """MB/s of a copy of `nbytes` in memory (the second of two: the first faults the pages in)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    started = time.perf_counter()
    np.copyto(dst, src)
    return src.nbytes / (time.perf_counter() - started) / 1e6


def _in_probe_file(folder: str, work):
    """work(fd, rows): rows a float32 [R, ROW_FLOATS] view of a shared mapping of a new probe file
    in `folder`, written whole (blocks allocated, as a pool's are), synced and read in first. The
    file is removed after."""
    path = os.path.join(folder, f".cxltrain-step-probe-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(PROBE_BYTES))
        os.fsync(fd)
        mapping = mmap.mmap(fd, PROBE_BYTES)
        mapping.madvise(mmap.MADV_RANDOM)  # as the capacity mapping is (docs/tiers.md: large folios)
        rows = np.frombuffer(mapping, np.float32).reshape(-1, ROW_FLOATS)
        rows[:] = 0  # every page present and dirty
        return work(fd, rows)
    finally:
        os.close(fd)
        os.unlink(path)


def _row_seconds(rows: np.ndarray, rng, fd: int | None) -> float:
    """Seconds a random row takes to read and write back, of PROBE_ROWS: stored through the
    mapping (fd None: the fast tier), or written to the file `fd` (the capacity tier)."""
    times = []
    for _ in range(REPEATS):
        picked = rng.integers(0, rows.shape[0], PROBE_ROWS)
        started = time.perf_counter()
        _add_one(rows, picked, fd)
        times.append(time.perf_counter() - started)
    return float(np.median(times)) / PROBE_ROWS


def _add_one(rows: np.ndarray, picked: np.ndarray, fd: int | None) -> None:
    """rows[picked] += 1, each row read through the mapping and written back as the update does."""
    if fd is None:
        rows[picked] = rows[picked] + 1.0
        return
    row_bytes = rows.shape[1] * rows.itemsize
    for row, values in zip(picked.tolist(), rows[picked] + 1.0):
        os.pwrite(fd, values, row * row_bytes)


def _write_back_seconds(fd: int, rows: np.ndarray, pages: int, rng) -> float:
    """Seconds to dirty `pages` clean pages by one row each and sync them (the file starts synced)."""
    per_page = PAGE_BYTES // (ROW_FLOATS * 4)
    times = []
    for _ in range(REPEATS):
        picked = rng.choice(rows.shape[0] // per_page, pages, replace=False) * per_page
        started = time.perf_counter()
        _add_one(rows, picked, fd)
        os.fdatasync(fd)
        times.append(time.perf_counter() - started)
    return float(np.median(times))
