"""The libpmem backend: real PMEM/CXL DAX devices, fsdax files, and any file libpmem can map.

Mapped with pmem_map_file (which asks for MAP_SYNC on fsdax, so flushing caches is enough for
durability). When libpmem says the range is not pmem (no DAX and no PMEM_IS_PMEM_FORCE), stores
are made durable with pmem_msync instead, as libpmem's documentation requires.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..errors import DeviceError
from ..kernels import native
from .base import Device
from .libpmem import LibPmem


class _Mapping:
    """Owns one pmem_map_file mapping; unmaps it when the last view of it is gone."""

    def __init__(self, pmem: LibPmem, address: int, size: int) -> None:
        self.pmem, self.address, self.size = pmem, address, size

    def __del__(self) -> None:
        self.pmem.pmem_unmap(self.address, self.size)


class PmemDevice(Device):
    """A mapping made by libpmem; flush/drain are pmem_flush/pmem_drain, or pmem_msync off DAX."""

    kind = "pmem"

    def __init__(self, pmem: LibPmem, path: str, size: int) -> None:
        mapped = ctypes.c_size_t(0)
        is_pmem = ctypes.c_int(0)
        # length 0 and no flags: map the whole existing file or device (device DAX needs exactly this).
        address = pmem.pmem_map_file(path.encode(), 0, 0, 0, ctypes.byref(mapped), ctypes.byref(is_pmem))
        if not address:
            raise DeviceError(f"{path}: libpmem could not map it: {pmem.errormsg()}")
        if mapped.value < size:
            pmem.pmem_unmap(address, mapped.value)
            raise DeviceError(f"{path}: mapped {mapped.value} bytes, expected at least {size}")
        super().__init__(path, mapped.value, writable=True, is_pmem=bool(is_pmem.value))
        self._pmem = pmem
        self.address = address
        buffer = (ctypes.c_ubyte * mapped.value).from_address(address)
        buffer._mapping = _Mapping(pmem, address, mapped.value)  # lives as long as any view
        self._array = np.frombuffer(buffer, dtype=np.uint8)

    def _write_back(self, offset: int, length: int) -> None:
        if self.is_pmem:
            self._pmem.pmem_flush(self.address + offset, length)
        elif self._pmem.pmem_msync(self.address + offset, length) != 0:
            raise DeviceError(f"{self.path}: pmem_msync failed: {self._pmem.errormsg()}")

    def _fence(self) -> None:
        if self.is_pmem:
            self._pmem.pmem_drain()

    def _persist_range(self, offset: int, length: int) -> None:
        if self.is_pmem:
            self._pmem.pmem_persist(self.address + offset, length)
        else:
            self._write_back(offset, length)  # msync is synchronous: nothing to drain

    def _persist_streamed(self, offset: int, length: int) -> None:
        if self.is_pmem:
            self._pmem.pmem_drain()  # the stores went around the caches: only the fence is left
        else:
            self._persist_range(offset, length)

    def _store_persist(self, offset: int, src: np.ndarray) -> None:
        if not self.is_pmem:
            return super()._store_persist(offset, src)
        # non-temporal stores for large copies, then one fence
        self._pmem.pmem_memcpy_persist(self.address + offset, native.address(src), src.size)

    def native_persistence(self) -> native.NativePersistence | None:
        # on DAX a flush is a cache-line write-back and streamed stores need only the fence; off DAX
        # both are an msync, which native code does not issue
        if not self.is_pmem:
            return None
        return native.NativePersistence(native.NativePersistence.LINES, self._pmem.flush_address)
