"""The capacity tier's devices: a pool file on block storage (SSD, disk), the tier table rows
too large for memory live in (docs/tiers.md, Devices).

  CapacityDevice       mmap(MAP_SHARED) of the file. A flush notes nothing, drain is one
                       fdatasync of the file, which writes back every dirty page: one system call
                       per commit instead of one msync per run of rows. The row kernels write
                       updated rows to the file (row_file), not through the mapping.
                       persist(range) is msync of that range's pages alone (a root, a region).
                       The kernel may drop clean pages at any time, so resident memory stays
                       bounded by what the process touches between commits.
                       Counts what its syncs wrote: `synced_bytes`, the disk's own count of
                       bytes written during each drain (None where the file has no block
                       device), and `range_bytes`, the pages its ranged persists wrote.
  CapacityCrashDevice  the crash model (knob `capacity_crash` = 1), like SQLite's crash VFS: the
                       process writes into a private copy-on-write view, flush queues the touched
                       pages, drain writes them to the file and syncs it. A killed process loses
                       every page write it never synced, as a power loss loses page writes that
                       never reached the disk. Crash tests use it; it holds written pages in
                       private memory, so it is for small pools.

Both are writable mappings; a read-only inspection uses the msync device, as for any pool.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading

import numpy as np

from ..faults import CrashPoint, crash_point
from ..knobs import KNOBS
from .base import Device, page_range
from .msync import MsyncDevice
from .sysfs import disk_bytes_written

# Crash tests can die at the n-th page write of a capacity device (as at FLUSH_POINT on the fast tier).
PAGE_WRITE_POINT = CrashPoint.CAPACITY_PAGE_WRITE
PAGE = os.sysconf("SC_PAGE_SIZE")


class CapacityDevice(MsyncDevice):
    """A capacity pool mapped shared; durable at drain (fdatasync)."""

    kind = "capacity"

    def __init__(self, path: str, fd: int, size: int) -> None:
        super().__init__(path, fd, size, writable=True)
        self._fd = fd
        self._count_syncs(path)
        # Random rows: without this the page cache may hold the file in large folios, and one row's
        # store then dirties (and the commit's fdatasync writes back) a whole folio, not its page.
        self._mmap.madvise(mmap.MADV_RANDOM)

    def _count_syncs(self, path: str) -> None:
        self._disk_written = disk_bytes_written(path)
        self.synced_bytes: int | None = None if self._disk_written is None else 0
        self.range_bytes = 0

    def _write_back(self, offset: int, length: int) -> None:
        pass  # the page is already in the page cache: the drain's fdatasync writes it

    def row_file(self) -> int:
        # a page stored through this shared mapping must be write-protected by every sync, one TLB
        # shootdown each, on every core this process runs on; a page written with pwrite never
        # is (docs/tiers.md, "Rows written to the file")
        return self._fd

    def _write_back_rows(self, offset: int, stride: int, rows: np.ndarray) -> int:
        return 0 if rows.size == 0 else 1  # as _write_back: nothing until the drain

    def _fence(self) -> None:
        before = None if self._disk_written is None else self._disk_written()
        self._sync()
        after = None if before is None else self._disk_written()
        if after is not None:  # the disk's count: any other writer to it meanwhile counts too
            self.synced_bytes += after - before

    def _sync(self) -> None:
        crash_point(PAGE_WRITE_POINT)
        os.fdatasync(self._fd)

    def _persist_range(self, offset: int, length: int) -> None:
        self.range_bytes += page_range(offset, length)[1]
        self._persist_pages(offset, length)

    def _persist_pages(self, offset: int, length: int) -> None:
        # this range only (a root, a region), not every dirty page: msync of its pages
        crash_point(PAGE_WRITE_POINT)
        MsyncDevice._write_back(self, offset, length)


class CapacityCrashDevice(CapacityDevice):
    """The crash model: stores go to a private view; a flush queues the touched pages as they are
    then (a write the disk has accepted, not made durable); drain writes the queued pages to the
    file and syncs it. A kill loses the view and the queue: every page write never synced."""

    model = "capacity tier: page writes never synced are lost at a crash"
    crash_atom_bytes = PAGE   # a crash keeps or loses each page write whole

    def __init__(self, path: str, fd: int, size: int) -> None:
        Device.__init__(self, path, size, writable=True, is_pmem=False)
        self._fd = fd
        self._count_syncs(path)
        self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self._queued: dict[int, bytes] = {}  # page offset -> its bytes when flushed
        # the write-back may drain on a thread of its own while the commits flush more pages
        self._queue_lock = threading.Lock()

    def row_file(self) -> None:
        return None  # the model's view is private: every store goes through it, to be queued at flush

    def _write_back(self, offset: int, length: int) -> None:
        start, span = page_range(offset, length)
        with self._queue_lock:
            for page in range(start, min(start + span, self.size), PAGE):
                self._queued[page] = self._array[page : min(page + PAGE, self.size)].tobytes()

    def _write_back_rows(self, offset: int, stride: int, rows: np.ndarray) -> int | None:
        return None  # flush() per run of rows: each run's pages are queued

    def _sync(self) -> None:
        with self._queue_lock:
            queued, self._queued = self._queued, {}
        pages = sorted(queued)  # in file order: the write-back is one sweep over the file
        for i, page in enumerate(pages):
            if i == len(pages) // 2 and i:
                crash_point(CrashPoint.CAPACITY_MID_WRITE_BACK)  # half the pages written, the rest not
            crash_point(PAGE_WRITE_POINT)
            os.pwrite(self._fd, queued[page], page)
        if pages:
            crash_point(CrashPoint.CAPACITY_BEFORE_SYNC)  # every page written (the disk may keep them), none synced
        os.fdatasync(self._fd)

    def _persist_pages(self, offset: int, length: int) -> None:
        # this range's pages written and synced; pages flushed earlier stay queued until a drain
        start, span = page_range(offset, length)
        for page in range(start, min(start + span, self.size), PAGE):
            with self._queue_lock:
                self._queued.pop(page, None)
            crash_point(PAGE_WRITE_POINT)
            os.pwrite(self._fd, self._array[page : min(page + PAGE, self.size)], page)
        os.fdatasync(self._fd)

    def durable(self) -> np.ndarray:
        """What a crash now would leave of the pool: the file's bytes [size] uint8."""
        return np.frombuffer(os.pread(self._fd, self.size, 0), dtype=np.uint8)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} crash-model {self.path} {self.size} bytes>"


def open_capacity(path: str, fd: int, size: int) -> Device:
    """The capacity device for a writable member pool: the crash model when the knob asks for it."""
    return CapacityCrashDevice(path, fd, size) if KNOBS.capacity_crash else CapacityDevice(path, fd, size)


def disk_dir() -> str:
    """A folder on a real disk for capacity pools (/var/tmp survives reboots, so it is not tmpfs)."""
    return "/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir()
