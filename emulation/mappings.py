"""The two ways an emulated device maps its memory-backed file (emulation/cxl.py).

  SharedFile   the file mapped shared: a store is in the file (the page cache, which outlives the
               process) the moment it is made. Process crashes, eADR.
  CachedFile   a private copy-on-write view, the process's "CPU caches", over the file mapped
               shared, the media: only what is copied from view to media outlives the process.
               Power loss (ADR, volatile).

Each is owned by one device, which hands out `array` as its own and closes the file with itself.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

from cxltrain.kernels import native

from .evictor import CACHE_LINE


def _unmap(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # views still alive: the mapping goes when the last of them does


class SharedFile:
    """The file mapped shared (MAP_SHARED): the mapping is the media."""

    def __init__(self, fd: int, size: int) -> None:
        self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def close(self) -> None:
        self.array = None
        _unmap(self._mmap)


class CachedFile:
    """A private view (MAP_PRIVATE, mmap.ACCESS_COPY) over the media (the file, MAP_SHARED).

    A page the process writes becomes a private copy that the file never sees, until a line of it is
    copied to the media. Every copy to the media holds `lock`, so an evictor (emulation/evictor.py)
    can never put an older value of a line over a newer one that a flush has just copied.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._view_mmap = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        self.array = np.frombuffer(self._view_mmap, dtype=np.uint8)
        self._media_mmap = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        # the only view of the media: close() drops it, then unmaps (nobody else can hold one)
        self.media: np.ndarray | None = np.frombuffer(self._media_mmap, dtype=np.uint8)
        self._view_address = self.array.ctypes.data
        self._media_address = self.media.ctypes.data
        self.lock = threading.Lock()

    def copy_lines(self, offset: int, length: int) -> None:
        """Copy [offset, offset+length), rounded out to whole cache lines, from view to media: as CLWB
        does, unpersisted neighbours in the first and last line go along."""
        start = offset - offset % CACHE_LINE
        end = min(-(-(offset + length) // CACHE_LINE) * CACHE_LINE, self.size)
        with self.lock:
            ctypes.memmove(self._media_address + start, self._view_address + start, end - start)

    def copy_rows(self, offset: int, stride: int, rows: np.ndarray) -> int:
        """copy_lines for each run of adjacent rows of the table at `offset`, in one native call;
        returns the number of runs."""
        rows = np.require(rows, np.int64, "CA")
        with self.lock:  # the kernel runs without the GIL: the lock alone keeps the evictor out
            return native.copy_lines(self._view_address, self._media_address, self.size, offset, stride,
                                     (self.size - offset) // stride, rows)

    def copy_all(self) -> None:
        """The whole view to the media (a volatile device closed normally: the machine kept power)."""
        if self.media is not None and self.array is not None:
            with self.lock:
                self.media[:] = self.array

    def close(self) -> None:
        self.array = None  # the private view: unmapped now, or when the last view of it goes
        _unmap(self._view_mmap)
        self.media = None
        _unmap(self._media_mmap)  # cannot fail (no view of the media escapes), but never unmap under a view
