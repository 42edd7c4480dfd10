"""The device interface: a mapped byte range whose stores can be made durable.

Three calls, three meanings — the same three PMDK's libpmem offers:

  flush(offset, length)  start writing the range back towards the persistence domain; no ordering.
  drain()                wait until every flush issued so far has completed.
  persist(offset, length) flush + drain: when it returns, the range is durable.

What each really does depends on the backend, chosen once when the pool is opened:

  backend        flush                                   drain              durable means
  -------------  --------------------------------------  -----------------  ----------------------
  pmem (DAX)     pmem_flush: CLWB/CLFLUSHOPT per line    pmem_drain: SFENCE in the ADR domain
  pmem (no DAX)  pmem_msync: msync(MS_SYNC) of the pages nothing             on the file system
  msync          mmap.flush: msync(MS_SYNC) of the pages nothing             on the file system
  emulated CXL   pmem_flush when libpmem is there (the   pmem_drain         in the memory-backed
                 real instructions, at their real cost);                    file, which survives
                 nothing otherwise                                          the process (SIGKILL)

`copy_persist` writes bytes and makes them durable in one call (non-temporal stores plus one fence
on DAX), the cheapest way to append a log record.

A device hands out one numpy view of the whole mapping (`array`). The mapping stays alive while any
view of it does — closing the device drops the device's own reference only — so a tensor that
outlives its pool can never point at unmapped memory.
"""

from __future__ import annotations

import abc
import os

import numpy as np

from ..kernels import native


class Device(abc.ABC):
    """A pool's backing store, mapped whole.

    Attributes:
        kind: backend name ("pmem", "msync", "emulated-cxl").
        path: the file or device path.
        size: mapped length in bytes.
        writable: False for read-only inspection mappings.
        is_pmem: True when flush/drain are cache-line operations (DAX or forced), False when
            persistence goes through msync or the backend has no flush at all.
        model: for the emulated device, what it models (cxltrain.emulation), else None.
    """

    kind: str = "abstract"
    model: str | None = None   # what an emulated device models (power loss, domain, write-back), in words
    evictor = None             # an emulated device's early write-back thread, when it has one

    def __init__(self, path: str, size: int, writable: bool, is_pmem: bool) -> None:
        self.path = path
        self.size = size
        self.writable = writable
        self.is_pmem = is_pmem
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        """uint8 view of the whole mapping, shape [size]. Raises after close()."""
        if self._array is None:
            raise ValueError(f"{self.path}: device is closed")
        return self._array

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range [{offset}, {offset + length}) outside the mapping of {self.size} bytes")
        if not self.writable:
            raise ValueError(f"{self.path}: mapped read-only")

    @abc.abstractmethod
    def flush(self, offset: int, length: int) -> None:
        """Start write-back of [offset, offset+length); no ordering guarantee until drain()."""

    @abc.abstractmethod
    def drain(self) -> None:
        """Wait for every flush issued so far."""

    def persist(self, offset: int, length: int) -> None:
        """Make [offset, offset+length) durable before returning."""
        self.flush(offset, length)
        self.drain()

    def persist_streamed(self, offset: int, length: int) -> None:
        """Make [offset, offset+length) durable after it was written with non-temporal stores (the
        native undo capture's). Where those go around the caches into the persistence domain
        (libpmem's backends) a fence is all that is left, as in pmem_memcpy_persist; elsewhere
        this is persist()."""
        self.persist(offset, length)

    def flush_rows(self, offset: int, stride: int, rows: np.ndarray) -> None:
        """Flush rows `rows` (sorted ascending, int64 [U]) of a table at `offset` with `stride`-byte
        rows; no ordering until drain(). Adjacent rows go as one range, so the skewed, clustered
        row sets of a batch cost far fewer calls than rows. Where flush is libpmem's pmem_flush, the
        native kernel walks the row set in one call; elsewhere flush() is called once per run."""
        if rows.size == 0:
            return
        # PmemDevice and EmulatedCXLDevice keep libpmem as `_pmem` and flush with its pmem_flush
        # exactly when is_pmem: then one C call does every run (a ctypes call per run costs ~0.5 µs).
        pmem = getattr(self, "_pmem", None)
        if pmem is not None and self.is_pmem and native.lib() is not None:
            self._check_range(offset, 0)
            rows = np.require(rows, np.int64, "CA")  # a record's row ids may sit 4 bytes off alignment
            native.flush_rows(self.address + offset, stride, (self.size - offset) // stride, rows, pmem.flush_address)
            return
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        starts = rows[np.concatenate(([0], breaks))]
        counts = np.diff(np.concatenate(([0], breaks, [rows.size])))
        for start, count in zip(starts.tolist(), counts.tolist()):
            self.flush(offset + start * stride, count * stride)

    def copy_persist(self, offset: int, data: np.ndarray | bytes) -> None:
        """Store `data` at `offset` and make it durable. Backends with non-temporal stores override."""
        src = self._source_bytes(data)
        self._check_range(offset, src.size)
        self.array[offset : offset + src.size] = src
        self.persist(offset, src.size)

    @staticmethod
    def _source_bytes(data: np.ndarray | bytes) -> np.ndarray:
        """copy_persist's `data` as a contiguous uint8 array [nbytes] (a view when it already is one)."""
        if isinstance(data, (bytes, bytearray)):
            return np.frombuffer(data, dtype=np.uint8)
        return np.ascontiguousarray(data.view(np.uint8).reshape(-1))

    def close(self) -> None:
        """Drop this device's reference to the mapping; it is unmapped when the last view goes."""
        self._array = None

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "ro"
        return f"<{type(self).__name__} {self.kind} {self.path} {self.size} bytes {mode}>"


def page_range(offset: int, length: int) -> tuple[int, int]:
    """Round [offset, offset+length) out to whole pages, as msync requires. Returns (start, length)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = offset - offset % page
    end = -(-(offset + length) // page) * page
    return start, end - start
