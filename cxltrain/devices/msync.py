"""The plain-file backend: mmap plus msync (the block tier of MTrainS, or any file without DAX).

Also used, read-only, to inspect any pool (`pool info`/`check`): a read-only mapping cannot change the
file, whatever the checks find.
"""

from __future__ import annotations

import mmap

import numpy as np

from .base import Device, page_range


class MsyncDevice(Device):
    """mmap(MAP_SHARED) of a file; flush = msync(MS_SYNC) of the touched pages, drain = nothing."""

    kind = "msync"

    def __init__(self, path: str, fd: int, size: int, writable: bool) -> None:
        super().__init__(path, size, writable, is_pmem=False)
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self._mmap = mmap.mmap(fd, size, access=access)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        if not writable:
            self._array.flags.writeable = False

    def _write_back(self, offset: int, length: int) -> None:
        start, span = page_range(offset, length)
        self._mmap.flush(start, min(span, self.size - start))

    def _fence(self) -> None:
        # msync(MS_SYNC) is synchronous: every flush has completed when it returns.
        pass

    def close(self) -> None:
        super().close()
        try:
            self._mmap.close()
        except BufferError:
            pass  # views still alive: the mapping goes when the last of them does
