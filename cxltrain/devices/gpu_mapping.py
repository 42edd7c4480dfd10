"""A pool mapping as a GPU sees it: registered with CUDA (page-locked, mapped into the GPU's address
space), so kernels read and write the pool's rows over the link with no copy in between (DESIGN §9).

    view = mapped_view(pool, "t0.weight", rows_tensor, device)   # a CUDA tensor over the pool's rows,
                                                                 # or None where CUDA refuses the mapping

CUDA registers a mapping of memory (a /dev/shm file, DRAM, a DAX device) but refuses one of a file
on a disk; the caller then goes through a pinned bounce buffer instead. Each device mapping is
registered once, whole, and unregistered when its pool closes. CuPy is imported only here.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

REGISTER_PORTABLE_MAPPED = 3   # cudaHostRegisterPortable | cudaHostRegisterMapped

_lock = threading.Lock()
_registered: dict[int, tuple[int, np.ndarray]] = {}   # mapping address -> (bytes, the mapping's array)


def gpu_problem() -> str | None:
    """Why a GPU cannot be used here, in one line, or None when it can (CUDA seen by torch, CuPy there)."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install 'cxltrain[gpu]')"
    return None


def _register(pool, mapping: np.ndarray) -> bool:
    """Register the whole mapping once (unregistered when `pool` closes); False where CUDA refuses it."""
    import cupy

    address = mapping.ctypes.data
    with _lock:
        if address in _registered:
            return True
        try:
            cupy.cuda.runtime.hostRegister(address, mapping.nbytes, REGISTER_PORTABLE_MAPPED)
        except cupy.cuda.runtime.CUDARuntimeError:
            return False
        _registered[address] = (mapping.nbytes, mapping)
    pool.on_close(lambda: _unregister(address))
    return True


def _unregister(address: int) -> None:
    """The pool closes: its tables have dropped their views, so no kernel can reach the mapping."""
    import cupy

    with _lock:
        if _registered.pop(address, None) is not None:
            torch.cuda.synchronize()  # no kernel still reading or writing the mapping
            cupy.cuda.runtime.hostUnregister(address)


def mapped_view(pool, region: str, host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over the same bytes as `host` (a float32 view of `region`'s rows in `pool`, any
    shape and strides), or None where CUDA refuses to register the region's mapping."""
    import cupy

    mapping = pool.device_for(pool.region(region)).array if pool.members else pool.device.array
    if not _register(pool, mapping):
        return None
    pointer = host.data_ptr()  # unified addressing: a registered mapping's device address is its host address
    item = host.element_size()
    extent = item * (1 + sum((size - 1) * stride for size, stride in zip(host.shape, host.stride())))
    with cupy.cuda.Device(device.index or 0):
        memory = cupy.cuda.UnownedMemory(pointer, extent, owner=mapping, device_id=device.index or 0)
        array = cupy.ndarray(tuple(host.shape), dtype=np.float32, memptr=cupy.cuda.MemoryPointer(memory, 0),
                             strides=tuple(stride * item for stride in host.stride()))
    return torch.as_tensor(array, device=device)
