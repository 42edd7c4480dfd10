"""The emulated CXL device: a memory-backed file standing in for CXL-attached or persistent memory.

The file lives on tmpfs (or hugetlbfs): its pages are ordinary DRAM, like a CXL memory expander's,
and they outlive the process, like persistent memory's contents outlive a crash. Persisting runs
the real cache-line write-back instructions through libpmem (pmem_flush = CLWB/CLFLUSHOPT,
pmem_drain = SFENCE) so the cost of the protocol is the cost it has on the hardware; without
libpmem, persist does nothing, because the page is already the media.

What this models: process death (SIGKILL) — the page cache survives, exactly as PMEM contents do.
What it does not (yet): power loss, where unflushed stores vanish and others reach the media early;
the private copy-on-write view and evictor that model it come with the power-loss device.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np

from cxltrain.devices.base import Device
from cxltrain.devices.libpmem import load as load_libpmem
from cxltrain.knobs import KNOBS


POOL_NAME = f"cxltrain-{os.getuid()}-train.pool"


def default_pool_dir(required_bytes: int = 0) -> str:
    """Where the emulated pool lives by default: the knob, else /dev/shm when it exists and has room
    for `required_bytes` (or already holds the pool), else the temp folder."""
    if KNOBS.pool_dir:
        return KNOBS.pool_dir
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        if os.path.exists(os.path.join(shm, POOL_NAME)) or _free_bytes(shm) >= required_bytes:
            return shm
    return tempfile.gettempdir()


def default_pool_path(required_bytes: int = 0) -> str:
    """The pool `cxltrain train` uses when no --pool is given: one per user."""
    return os.path.join(default_pool_dir(required_bytes), POOL_NAME)


def _free_bytes(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


class EmulatedCXLDevice(Device):
    """A memory-backed file, mapped shared; flush/drain are libpmem's cache-line calls when present."""

    kind = "emulated-cxl"

    def __init__(self, path: str, fd: int, size: int) -> None:
        self._pmem = load_libpmem()
        super().__init__(path, size, writable=True, is_pmem=self._pmem is not None)
        self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self._array.ctypes.data

    def flush(self, offset: int, length: int) -> None:
        self._check_range(offset, length)
        if self._pmem is not None:
            self._pmem.pmem_flush(self.address + offset, length)

    def drain(self) -> None:
        if self._pmem is not None:
            self._pmem.pmem_drain()

    def close(self) -> None:
        super().close()
        try:
            self._mmap.close()
        except BufferError:
            pass  # views still alive: the mapping goes when the last of them does
