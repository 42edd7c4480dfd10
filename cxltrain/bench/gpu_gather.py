"""`cxltrain bench --gpu`'s gather bandwidth: rows read by the GPU from a registered pool mapping, in id
order and in the batch's order, against a pinned host-to-device copy of as many bytes (DESIGN §9: the
order of the ids decides a gather's speed over the link, which is why DeviceRows gathers a batch's
unique rows sorted).

One table of R rows [R, P] (P floats a row, padded) in a pool of its own in `folder`, its mapping
registered with CUDA (devices/gpu_mapping.mapped_view); N ids drawn uniformly from [0, R) afresh for
each repeat (so no repeat finds the last one's rows in the GPU's L2), and gathered into [N, P] in
device memory by CupyRowKernels.gather. GB/s = N P 4 bytes / the CUDA-event time; the median of the
repeats, after one warm-up repeat (which also compiles the kernels). On the CPU the same code runs
over the pool's rows with torch's kernels and a wall clock (for tests: its figures say nothing).

    gather_bandwidth(rows=1_000_000, dim=64, count=327_680, repeats=10, folder="/dev/shm/x", device=cuda)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from ..kernels.device_kernels import row_kernels
from ..knobs import KNOBS
from ..pool.handle import Pool
from ..tables.bag import PersistentEmbeddingBag
from ..tables.optim import SGD

POOL_SLACK = 64 << 20  # the pool's metadata and alignment, beyond the table's rows


def _event_seconds(work: Callable[[], None]) -> float:
    """Device seconds `work`'s queued operations took, between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def _wall_seconds(work: Callable[[], None]) -> float:
    """The CPU's stand-in for _event_seconds (tests run the same code on CPU tensors)."""
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _reach(pool: Pool, table: PersistentEmbeddingBag, device: torch.device) -> tuple[torch.Tensor | None, str]:
    """(the table's rows [R, P] as `device` addresses them, the gather kernel's name): the registered
    mapping on CUDA (None where CUDA refuses it), the host rows themselves on the CPU."""
    host = table.storage()[0]
    if device.type == "cpu":
        return host, "torch index_select"
    from ..devices.gpu_mapping import mapped_view
    from ..kernels.cupy_rows import _vector_width

    source = mapped_view(pool, table.weight_region, host, device)
    if source is None:
        return None, ""
    return source, "gather_rows4" if _vector_width(source, width=source.shape[1]) == 4 else "gather_rows"


def _time_repeats(kernels, source: torch.Tensor, rows: int, count: int, repeats: int,
                  device: torch.device) -> dict[str, list[float]]:
    """Seconds of each repeat (after one to warm up) of: gathering N random rows of `source` [R, P]
    sorted by id, the same rows in their drawn order, and a host-to-device copy of as many bytes."""
    cuda = device.type == "cuda"
    width = source.shape[1]
    out = torch.empty(count, width, dtype=torch.float32, device=device)
    pinned = torch.empty(count, width, dtype=torch.float32, pin_memory=cuda)
    landed = torch.empty_like(out)
    timed = _event_seconds if cuda else _wall_seconds
    generator = torch.Generator(device=device)
    timings: dict[str, list[float]] = {"sorted": [], "batch_order": [], "pinned_copy": []}
    for r in range(1 + repeats):
        generator.manual_seed(r)
        ids = torch.randint(0, rows, (count,), device=device, generator=generator)
        ordered = torch.sort(ids).values
        if cuda:
            torch.cuda.synchronize()
        runs = {"sorted": lambda: kernels.gather(out, source, ordered, count, None, None),
                "batch_order": lambda: kernels.gather(out, source, ids, count, None, None),
                "pinned_copy": lambda: landed.copy_(pinned, non_blocking=True)}
        for name in list(runs) if r % 2 else list(reversed(runs)):  # neither always runs first
            seconds = timed(runs[name])
            if r:  # repeat 0 warms up (and compiles rows.cu)
                timings[name].append(seconds)
    if cuda:
        torch.cuda.synchronize()  # nothing still reads the mapping when the pool lets go of it
    return timings


def gather_bandwidth(*, rows: int, dim: int, count: int, repeats: int, folder: str, device: torch.device,
                     log: Callable[[str], None] = lambda line: None) -> dict:
    """{"sorted_gb_s", "batch_order_gb_s", "pinned_copy_gb_s", "rows", "folder", "row_bytes", "bytes",
    "repeats", "kernel"}, or {"skipped": why} where CUDA refuses the pool's mapping. On CUDA (with
    CuPy) the figures mean something; on the CPU the same code runs with torch's kernels, for tests."""
    table = PersistentEmbeddingBag(rows, dim, name="gather", mode="sum", optimizer=SGD(), seed=0)  # SGD: no state region
    path = os.path.join(folder, "gather.pool")
    log(f"gather bandwidth: a pool of {rows:,} rows x dim {dim}")
    with Pool.create(path, sum(spec.nbytes(KNOBS.row_align) for spec in table.region_specs()) + POOL_SLACK) as pool:
        table.attach(pool)
        source, kernel = _reach(pool, table, device)
        if source is None:
            return {"skipped": f"CUDA refused to register the mapping of {path}"}
        row_bytes = source.shape[1] * 4
        timings = _time_repeats(row_kernels(device), source, rows, count, repeats, device)
        source = None  # let go of the mapping's view before the pool unregisters the mapping
    os.unlink(path)
    total = count * row_bytes
    return {"rows": count, "folder": folder, "row_bytes": row_bytes, "bytes": total, "repeats": repeats,
            "kernel": kernel,
            **{f"{name}_gb_s": total / statistics.median(times) / 1e9 for name, times in timings.items()}}
