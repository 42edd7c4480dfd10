"""The GPU row kernels (kernels/cuda/rows.cu) over torch CUDA tensors, through CuPy's RawModule.

CuPy is imported here only, on the first call: a CPU-only install never needs it. The module is
compiled once per process, on first use, and every launch goes on torch's current stream, so the
kernels order with torch's own work on the GPU without any extra synchronisation.

The calls take the same arguments as their reference in device_kernels.py (TorchRowKernels), which
says the shapes; `DeviceRows` (cxltrain/tables/device_rows.py) calls whichever the device needs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("cuda") / "rows.cu"
THREADS = 256                 # 8 warps a block: one row (or bag) a warp
MAX_UPDATE_DIM = 32 * 8       # rows.cu's MAX_CHUNKS columns per lane


@functools.lru_cache(maxsize=None)
def _module():
    import cupy

    # explicit round-to-nearest intrinsics carry the arithmetic; --fmad=false keeps the rest honest
    return cupy.RawModule(code=SOURCE.read_text(), options=("--std=c++17", "--fmad=false"))


def _launch(name: str, units: int, *args) -> None:
    """Launch kernel `name` with one warp per unit (row or bag) on torch's current stream."""
    if units <= 0:
        return
    import cupy

    blocks = (units * 32 + THREADS - 1) // THREADS
    kernel = _module().get_function(name)
    stream = torch.cuda.current_stream()
    with cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index or 0):
        kernel((blocks,), (THREADS,), args)


def _ptr(tensor: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def _i(value: int) -> np.int64:
    return np.int64(value)


def _vector_width(*tensors: torch.Tensor | None, width: int) -> int:
    """4 when every row start and the width fall on 16 bytes (the float4 kernel), else 1."""
    if width % 4:
        return 1
    for t in tensors:
        if t is not None and (t.data_ptr() % 16 or t.stride(0) % 4):
            return 1
    return 4


class CupyRowKernels:
    """rows.cu's kernels; the arguments and results of device_kernels.TorchRowKernels."""

    name = "cupy"

    def gather(self, out: torch.Tensor, source: torch.Tensor | None, ids: torch.Tensor, count: int,
               cache: torch.Tensor | None, slot_of: torch.Tensor | None) -> None:
        width = out.shape[1]
        v = _vector_width(out, source, cache, width=width)
        _launch("gather_rows4" if v == 4 else "gather_rows", count, _ptr(out), _i(out.stride(0) // v), _ptr(source),
                _i(0 if source is None else source.stride(0) // v), _ptr(ids), _i(count), _i(width // v), _ptr(cache),
                _i(0 if cache is None else cache.stride(0) // v), _ptr(slot_of))

    def bag(self, rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: torch.Tensor | None, mean: bool, dim: int) -> torch.Tensor:
        bags = offsets.numel()
        out = torch.empty(bags, dim, dtype=torch.float32, device=rows.device)
        _launch("bag_forward", bags, _ptr(out), _ptr(rows), _i(rows.stride(0)), _ptr(inverse), _ptr(offsets),
                _i(bags), _i(inverse.numel()), _ptr(per_sample_weights), np.int32(mean), _i(dim))
        return out

    def update(self, rule: str, rows: torch.Tensor, state: torch.Tensor | None, order: torch.Tensor,
               starts: torch.Tensor, bag_of: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: torch.Tensor | None, mean: bool, grad: torch.Tensor, count: int,
               lr: float, eps: float) -> None:
        dim = grad.shape[1]
        if dim > MAX_UPDATE_DIM:
            raise ValueError(f"the GPU update takes rows of at most {MAX_UPDATE_DIM} floats, got {dim}")
        _launch("update_rows", count, _ptr(rows), _i(rows.stride(0)), _ptr(state),
                _i(0 if state is None else state.stride(0)), _ptr(order), _ptr(starts), _ptr(bag_of), _ptr(offsets),
                _i(offsets.numel()), _i(order.numel()), _ptr(per_sample_weights), np.int32(mean), _ptr(grad),
                _i(grad.stride(0)), _i(count), _i(dim), np.int32(0 if rule == "sgd" else 1), np.float32(lr),
                np.float32(eps))

    def scatter(self, dest: torch.Tensor | None, values: torch.Tensor, ids: torch.Tensor, count: int,
                cache: torch.Tensor | None, slot_of: torch.Tensor | None) -> None:
        _launch("scatter_rows", count, _ptr(dest), _i(0 if dest is None else dest.stride(0)), _ptr(values),
                _i(values.stride(0)), _ptr(ids), _i(count), _i(values.shape[1]), _ptr(cache),
                _i(0 if cache is None else cache.stride(0)), _ptr(slot_of))
