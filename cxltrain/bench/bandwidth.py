"""The machine's copy bandwidth: the physical ceiling for gathering table rows.

A copy of n bytes reads n and writes n; the figures are bytes copied per second (GB = 1e9 bytes),
as memcpy benchmarks report them. Row gathers are measured the way the checkpointer captures undo
records (torch.index_select of the batch's unique rows [U, P] out of a table [R, P], ring.py).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..config import TrainConfig
from ..trainer import build_source


def _best_gbps(nbytes: int, copy: Callable[[], None], repeats: int) -> float:
    """Bytes per second of the fastest of `repeats` copies (the least disturbed by other load)."""
    copy()  # first touch of the destination's pages stays out
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        copy()
        seconds.append(time.perf_counter() - started)
    return nbytes / min(seconds) / 1e9


def copy_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> dict:
    """GB/s of a single-threaded numpy copy and of a torch copy with `threads` threads."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    numpy_gbps = _best_gbps(src.nbytes, lambda: np.copyto(dst, src), repeats)
    torch.set_num_threads(threads)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    torch_gbps = _best_gbps(src.nbytes, lambda: tdst.copy_(tsrc), repeats)
    return {"bytes": src.nbytes, "numpy_1_thread_gbps": numpy_gbps, f"torch_{threads}_threads_gbps": torch_gbps,
            "threads": threads}


def gather_bandwidth(config: TrainConfig, threads: int, repeats: int = 20) -> dict:
    """GB/s of gathering one batch's unique rows of one table (table 0 of batch 0, skewed ids)."""
    torch.set_num_threads(threads)
    table = torch.rand(config.rows, config.dim)
    rows = torch.unique(build_source(config).batch(0).values[0])
    out = torch.empty(rows.numel(), config.dim)
    gbps = _best_gbps(out.numel() * 4, lambda: torch.index_select(table, 0, rows, out=out), repeats)
    return {"rows": rows.numel(), "row_bytes": config.dim * 4, "gather_gbps": gbps,
            "note": "torch.index_select, as the undo capture gathers rows today"}

