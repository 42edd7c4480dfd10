"""The device interface: a mapped byte range whose stores can be made durable.

At its core, three calls, three meanings — the same three PMDK's libpmem offers:

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

Around them, the cheaper forms of the same work, each checked and counted like the three:

  copy_persist(offset, data)       store and persist in one call (non-temporal stores + one fence on DAX)
  persist_streamed(offset, length) persist a range written with non-temporal stores (a fence on DAX)
  flush_rows(offset, stride, rows) flush each run of adjacent rows of a table, in one native call where it can

and, for native code that persists by itself (the fused update's undo records and row write-back,
a dense snapshot's payload):

  native_persistence()             how: one NativePersistence value (kernels/native.py), or None
  streamed_persisted(...)          count what such code persists, before it runs
  rows_flushed(...)                count the rows such code wrote back

Every device counts what it is asked to make durable (`Device.counters`: flushes, drains, bytes),
in the base class's public calls, so the cost model reads real counts instead of guessing them.

A device hands out one numpy view of the whole mapping (`array`). The mapping stays alive while any
view of it does — closing the device drops the device's own reference only — so a tensor that
outlives its pool can never point at unmapped memory.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Callable

import numpy as np

from ..kernels import native


@dataclasses.dataclass
class DeviceCounters:
    """What a device was asked to make durable, counted where each request is served (the cost
    model in emulation/costmodel.py reads these; trainer.traffic_per_batch takes their difference
    over a run). Requests, not backend work: a persist on msync counts one flush and one drain
    although msync has nothing to drain, so the counts say what the protocol costs on PMEM/CXL.

    flushes: write-back requests, one contiguous range each (a row set counts its runs of
        adjacent rows; persist and copy_persist count one; streamed stores need none).
    drains: fences waited for (drain, persist, copy_persist, persist_streamed: one each).
    persisted_bytes: bytes asked to be made durable (a range's length, not rounded to lines).
    """

    flushes: int = 0
    drains: int = 0
    persisted_bytes: int = 0

    def copy(self) -> DeviceCounters:
        return dataclasses.replace(self)

    def __sub__(self, earlier: DeviceCounters) -> DeviceCounters:
        return DeviceCounters(self.flushes - earlier.flushes, self.drains - earlier.drains,
                              self.persisted_bytes - earlier.persisted_bytes)


class Device(abc.ABC):
    """A pool's backing store, mapped whole.

    The public calls (flush, drain, persist, flush_rows, copy_persist, persist_streamed,
    streamed_persisted, rows_flushed) check the range and count the request in `counters`, here
    and only here; backends implement the hooks they call (_write_back and _fence, and where they
    have something cheaper, _persist_range, _store_persist, _persist_streamed or _write_back_rows)
    and say how native code persists on them (native_persistence).

    Attributes:
        kind: backend name ("pmem", "msync", "emulated-cxl").
        path: the file or device path.
        size: mapped length in bytes.
        writable: False for read-only inspection mappings.
        is_pmem: True when a flush is a cache-line write-back (DAX or forced, or an emulation of
            one), cheap enough to flush rows right after their update; False when persistence
            goes through msync of whole pages or the backend has no flush at all. It says how a
            flush behaves, not whether libpmem does it.
        counters: flushes, drains and bytes persisted so far (DeviceCounters).
        model: for the emulated device, what it models (cxltrain.emulation), else None.
    """

    kind: str = "abstract"
    model: str | None = None   # what an emulated device models (power loss, domain, write-back), in words
    evictor = None             # an emulated device's early write-back thread, when it has one
    # called with the device after each fence it completes, and once at close (fence=False): how
    # jobs/crash_states.py records the persistence events of a crash-model device (atom, durable)
    observer: Callable[[Device, bool], None] | None = None

    def __init__(self, path: str, size: int, writable: bool, is_pmem: bool) -> None:
        self.path = path
        self.size = size
        self.writable = writable
        self.is_pmem = is_pmem
        self.counters = DeviceCounters()
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

    # -- the interface: checked and counted here, done by the hooks below -----------------------
    def flush(self, offset: int, length: int) -> None:
        """Start write-back of [offset, offset+length); no ordering guarantee until drain()."""
        self._check_range(offset, length)
        counters = self.counters
        counters.flushes += 1
        counters.persisted_bytes += length
        self._write_back(offset, length)

    def drain(self) -> None:
        """Wait for every flush issued so far."""
        self.counters.drains += 1
        self._fence()
        self._observe()

    def persist(self, offset: int, length: int) -> None:
        """Make [offset, offset+length) durable before returning."""
        self._check_range(offset, length)
        counters = self.counters
        counters.flushes += 1
        counters.drains += 1
        counters.persisted_bytes += length
        self._persist_range(offset, length)
        self._observe()

    def persist_streamed(self, offset: int, length: int) -> None:
        """Make [offset, offset+length) durable after it was written with non-temporal stores (the
        native undo capture's). Where those go around the caches into the persistence domain
        (libpmem's backends) a fence is all that is left, as in pmem_memcpy_persist; elsewhere
        the hook persists the range. Counted as a fence: on PMEM/CXL streamed stores need no flush."""
        self._check_range(offset, length)
        counters = self.counters
        counters.drains += 1
        counters.persisted_bytes += length
        self._persist_streamed(offset, length)
        self._observe()

    def flush_rows(self, offset: int, stride: int, rows: np.ndarray) -> None:
        """Flush rows `rows` (sorted ascending, int64 [U]) of a table at `offset` with `stride`-byte
        rows; no ordering until drain(). Adjacent rows go as one range, so the skewed, clustered
        row sets of a batch cost far fewer calls than rows. Where the device has a native row-set
        flush (_write_back_rows) one C call walks the set; elsewhere flush() is called once per run."""
        runs = self._write_back_rows(offset, stride, rows)
        if runs is not None:
            counters = self.counters
            counters.flushes += runs
            counters.persisted_bytes += rows.size * stride
            return
        if rows.size == 0:
            return
        starts, counts = runs_of(rows)
        for start, count in zip(starts.tolist(), counts.tolist()):
            self.flush(offset + start * stride, count * stride)  # counted there

    def row_file(self) -> int | None:
        """A file descriptor the row kernels write updated table rows to, with pwrite at the rows'
        offsets in this mapping, instead of storing them through it (kernels/ops.FileRows); None:
        they store in place."""
        return None

    def native_persistence(self) -> native.NativePersistence | None:
        """How native code that stores into this mapping makes its stores durable by itself, as this
        device's flush and persist_streamed would (kernels/native.NativePersistence), or None where a
        persist must go through this object. Count what it does with streamed_persisted and
        rows_flushed. Changes nothing."""
        return None

    def rows_flushed(self, offset: int, stride: int, count: int, runs: int) -> None:
        """Count `count` rows of the table at `offset` (`stride`-byte rows), `runs` runs of adjacent
        ones, that a native kernel wrote back itself (native_persistence), as flush_rows counts its
        own (the fused kernel's runs end at its chunks' ends, so it may count a few more)."""
        self._check_range(offset, 0)
        counters = self.counters
        counters.flushes += runs
        counters.persisted_bytes += count * stride

    def streamed_persisted(self, offset: int, length: int, fences: int) -> None:
        """What a native kernel persists by itself (native_persistence) in [offset, offset+length),
        with `fences` fences: checked and
        counted here as that many persist_streamed calls (call it before the kernel runs)."""
        self._check_range(offset, length)
        counters = self.counters
        counters.drains += fences
        counters.persisted_bytes += length

    def copy_persist(self, offset: int, data: np.ndarray | bytes) -> None:
        """Store `data` at `offset` and make it durable."""
        src = self._source_bytes(data)
        self._check_range(offset, src.size)
        counters = self.counters
        counters.flushes += 1
        counters.drains += 1
        counters.persisted_bytes += src.size
        self._store_persist(offset, src)
        self._observe()

    def _observe(self, fence: bool = True) -> None:
        if self.observer is not None:
            self.observer(self, fence)

    # -- the hooks: what each backend does; ranges are checked and counted before they run -------
    @abc.abstractmethod
    def _write_back(self, offset: int, length: int) -> None:
        """flush()'s work: start writing the range back to the persistence domain."""

    @abc.abstractmethod
    def _fence(self) -> None:
        """drain()'s work: wait for every write-back issued so far."""

    def _persist_range(self, offset: int, length: int) -> None:
        """persist()'s work; backends with a single call for both override."""
        self._write_back(offset, length)
        self._fence()

    def _persist_streamed(self, offset: int, length: int) -> None:
        """persist_streamed()'s work: where streamed stores are not already durable, a persist."""
        self._persist_range(offset, length)

    def _store_persist(self, offset: int, src: np.ndarray) -> None:
        """copy_persist()'s work: store, then persist. Backends with non-temporal stores override."""
        self.array[offset : offset + src.size] = src
        self._persist_range(offset, src.size)

    def _write_back_rows(self, offset: int, stride: int, rows: np.ndarray) -> int | None:
        """flush_rows()'s work in one native call: returns the number of runs written back, or None
        where the device has no native row-set flush (then flush_rows calls flush() per run). Called
        for every row set, empty ones too."""
        persistence = self.native_persistence()
        if rows.size == 0 or persistence is None or persistence.kind != persistence.LINES or native.lib() is None:
            return None  # a ctypes call per run is slow: only C makes the row walk cheap
        self._check_range(offset, 0)
        rows = np.require(rows, np.int64, "CA")  # a record's row ids may sit 4 bytes off alignment
        return native.flush_rows(self.address + offset, stride, (self.size - offset) // stride, rows,
                                 persistence.flush)

    @staticmethod
    def _source_bytes(data: np.ndarray | bytes) -> np.ndarray:
        """copy_persist's `data` as a contiguous uint8 array [nbytes] (a view when it already is one)."""
        if isinstance(data, (bytes, bytearray)):
            return np.frombuffer(data, dtype=np.uint8)
        return np.ascontiguousarray(data.view(np.uint8).reshape(-1))

    def close(self) -> None:
        """Drop this device's reference to the mapping; it is unmapped when the last view goes."""
        if self._array is not None:
            self._observe(fence=False)  # the stores made since the last fence
        self.observer = None
        self._array = None

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "ro"
        return f"<{type(self).__name__} {self.kind} {self.path} {self.size} bytes {mode}>"


def runs_of(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs of adjacent rows in `rows` (sorted ascending, unique, not empty): (first row of each
    run, rows in it)."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.concatenate(([0], breaks))]
    counts = np.diff(np.concatenate(([0], breaks, [rows.size])))
    return starts, counts


def page_range(offset: int, length: int) -> tuple[int, int]:
    """Round [offset, offset+length) out to whole pages, as msync requires. Returns (start, length)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = offset - offset % page
    end = -(-(offset + length) // page) * page
    return start, end - start
