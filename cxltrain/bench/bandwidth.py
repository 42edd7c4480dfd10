"""The machine's copy bandwidth: the physical ceiling for gathering table rows.

A copy of n bytes reads n and writes n; the figures are bytes copied per second (GB = 1e9 bytes),
as memcpy benchmarks report them. Row gathers are measured the way the checkpointer captures undo
records: the native capture kernel (kernels/rows.c capture_undo: the batch's unique rows [U, P] of a
table [R, P] gathered with non-temporal stores), as ring.py calls it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import numpy as np
import torch

from ..jobs.config import TrainConfig
from ..jobs.train import build_source
from ..kernels import ops
from ..kernels.cpu_threads import set_cpu_threads
from .records import Bandwidth


def measure_bandwidth(config: TrainConfig, nbytes: int, threads: int) -> Bandwidth:
    """Copy bandwidth of `nbytes`, and the row gather of one batch of `config`'s tables."""
    copied, numpy_gbps, torch_gbps = copy_bandwidth(nbytes, threads)
    rows, gather_gbps, note = gather_bandwidth(config, threads)
    return Bandwidth(bytes=copied, numpy_1_thread_gbps=numpy_gbps, torch_gbps=torch_gbps, threads=threads,
                     rows=rows, row_bytes=config.dim * 4, gather_gbps=gather_gbps, note=note)


def _best_gbps(nbytes: int, copy: Callable[[], None], repeats: int) -> float:
    """Bytes per second of the fastest of `repeats` copies (the least disturbed by other load)."""
    copy()  # first touch of the destination's pages stays out
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        copy()
        seconds.append(time.perf_counter() - started)
    return nbytes / min(seconds) / 1e9


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` for the block, then back: a measurement made
    before a training run (tools/bench_floors.py) must not leave that run on another thread count."""
    before = torch.get_num_threads()
    set_cpu_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def copy_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> tuple[int, float, float]:
    """(bytes copied, GB/s of a single-threaded numpy copy, GB/s of a torch copy with `threads` threads)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    numpy_gbps = _best_gbps(src.nbytes, lambda: np.copyto(dst, src), repeats)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    with _torch_threads(threads):
        torch_gbps = _best_gbps(src.nbytes, lambda: tdst.copy_(tsrc), repeats)
    return src.nbytes, numpy_gbps, torch_gbps


def gather_bandwidth(config: TrainConfig, threads: int, repeats: int = 20) -> tuple[int, float, str]:
    """(rows, GB/s, how) of gathering one batch's unique rows of one table (table 0 of batch 0,
    skewed ids)."""
    with _torch_threads(threads):
        table = torch.rand(config.rows, config.dim)
        rows = torch.unique(build_source(config).batch(0).values[0])
        payload = np.empty(rows.numel() * (config.dim * 4 + 8), dtype=np.uint8)  # old rows, then their ids
        old_rows = payload[: rows.numel() * config.dim * 4].reshape(rows.numel(), config.dim * 4)
        old_ids = payload[rows.numel() * config.dim * 4 :].view(np.int64)
        streamed = ops.capture_undo(old_rows, np.empty((rows.numel(), 0), np.uint8), old_ids, table, None, rows)
        gbps = _best_gbps(old_rows.size, lambda: ops.capture_undo(old_rows, None, old_ids, table, None, rows), repeats)
        return rows.numel(), gbps, "the undo capture's kernel" + (", non-temporal stores" if streamed else "")

