"""The emulated CXL device: a memory-backed file standing in for CXL-attached or persistent memory.

The file lives on tmpfs (or hugetlbfs): its pages are ordinary DRAM, like a CXL memory expander's,
and they outlive the process, like persistent memory's contents outlive a crash. Persisting runs
the real cache-line write-back instructions through libpmem (pmem_flush = CLWB/CLFLUSHOPT,
pmem_drain = SFENCE) so the cost of the protocol is the cost it has on the hardware; without
libpmem, persist does nothing, because the page is already the media.

What it models is chosen by knobs (cxltrain.knobs; `cxltrain train --power-loss --domain D
--evict-rate R` sets them), and `open_device` builds the matching device:

  power_loss=0            process death only (SIGKILL): the page cache survives, as PMEM contents do,
                          so every store survives. EmulatedCXLDevice.
  power_loss=1, domain=   power loss:
    adr   (default)       stores live in a private view, the "CPU caches"; persist copies whole
                          64-byte lines to the media. A kill loses every unpersisted store.
                          PowerLossCXLDevice; with evict_rate > 0 an evictor (emulation/evictor.py)
                          also writes random unpersisted lines back early, some torn at 8-byte
                          boundaries, as write-back caches do.
    eadr                  the caches are in the persistence domain: every store is durable as it is
                          made, flush is not needed (and costs nothing). EADRCXLDevice.
    none                  volatile memory (a CXL expander without persistence): nothing survives a
                          power loss; a process that closes the pool normally leaves its contents
                          in memory, as a powered machine would. VolatileCXLDevice.

Not modelled: timing (the emulation is not cycle-accurate: loads and stores run at DRAM speed; the
persist bandwidth cap and the cost model in emulation/costmodel.py stand in for the device's
speed), and a remote NUMA node is not real CXL either.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import threading

import numpy as np

from cxltrain.devices.base import Device
from cxltrain.devices.libpmem import load as load_libpmem
from cxltrain.faults import crash_point
from cxltrain.kernels import native
from cxltrain.knobs import KNOBS

from .bandwidth import BandwidthCap
from .evictor import CACHE_LINE, Evictor


POOL_NAME = f"cxltrain-{os.getuid()}-train.pool"
# Crash tests can die at the n-th flush of an emulated device: a random moment of the persistence traffic.
FLUSH_POINT = "device:flush"


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
    bandwidth_cap: BandwidthCap | None = None   # set by open_device when the knob asks for one

    def __init__(self, path: str, fd: int, size: int) -> None:
        self._pmem = load_libpmem()
        super().__init__(path, size, writable=True, is_pmem=self._pmem is not None)
        self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self._array.ctypes.data

    def _account(self, nbytes: int) -> None:
        """Every flush passes here: the crash tests' flush point, then the bandwidth cap."""
        crash_point(FLUSH_POINT)
        if self.bandwidth_cap is not None:
            self.bandwidth_cap.charge(nbytes)

    def flush(self, offset: int, length: int) -> None:
        self._check_range(offset, length)
        self._account(length)
        if self._pmem is not None:
            self._pmem.pmem_flush(self.address + offset, length)

    def flush_rows(self, offset: int, stride: int, rows: np.ndarray) -> None:
        if rows.size and self._pmem is not None and native.lib() is not None:
            self._account(rows.size * stride)  # the native walk below calls no flush() to account for it
        super().flush_rows(offset, stride, rows)

    def drain(self) -> None:
        if self._pmem is not None:
            self._pmem.pmem_drain()

    def persist_streamed(self, offset: int, length: int) -> None:
        if self._pmem is None:
            return super().persist_streamed(offset, length)
        self._check_range(offset, length)
        self._account(length)
        self._pmem.pmem_drain()  # as on a DAX device: the stores went around the caches

    def copy_persist(self, offset: int, data) -> None:
        if self._pmem is None:
            return super().copy_persist(offset, data)
        src = self._source_bytes(data)
        self._check_range(offset, src.size)
        self._account(src.size)
        # as on a DAX device: non-temporal stores for large copies (no cache lines to write back), one fence
        self._pmem.pmem_memcpy_persist(self.address + offset, src.ctypes.data, src.size)

    def close(self) -> None:
        super().close()
        try:
            self._mmap.close()
        except BufferError:
            pass  # views still alive: the mapping goes when the last of them does


def open_device(path: str, fd: int, size: int) -> Device:
    """The emulated device for an open pool file, modelling what the knobs ask for (see above)."""
    if not KNOBS.power_loss:
        device = EmulatedCXLDevice(path, fd, size)
    elif KNOBS.domain == "eadr":
        device = EADRCXLDevice(path, fd, size)
    elif KNOBS.domain == "none":
        device = VolatileCXLDevice(path, fd, size)
    else:
        device = PowerLossCXLDevice(path, fd, size, evict_rate=KNOBS.evict_rate, evict_seed=KNOBS.evict_seed)
    device.model = describe_model()
    if KNOBS.persist_bandwidth:
        device.bandwidth_cap = BandwidthCap(KNOBS.persist_bandwidth)
    return device


def describe_model() -> str:
    """What the knobs make the emulated device model, in words (for `train`'s output)."""
    if not KNOBS.power_loss:
        text = "process crashes (SIGKILL); no power-loss model"
        return text + (f", persistence capped at {KNOBS.persist_bandwidth / 1e9:g} GB/s" if KNOBS.persist_bandwidth else "")
    text = {"adr": "power loss, ADR domain (unflushed stores are lost)",
            "eadr": "power loss, eADR domain (caches persistent)",
            "none": "power loss, volatile memory (nothing survives)"}[KNOBS.domain]
    if KNOBS.domain == "adr" and KNOBS.evict_rate:
        text += f", early write-back {KNOBS.evict_rate:,} lines/s"
    if KNOBS.persist_bandwidth:
        text += f", persistence capped at {KNOBS.persist_bandwidth / 1e9:g} GB/s"
    return text


class _FlushWritesNothing:
    """For domains where a flush changes nothing durable (eADR: already durable; none: never):
    flushes are still checked and still count as the crash tests' flush points."""

    def flush(self, offset: int, length: int) -> None:
        self._check_range(offset, length)
        crash_point(FLUSH_POINT)

    def flush_rows(self, offset: int, stride: int, rows: np.ndarray) -> None:
        self._check_range(offset, 0)
        crash_point(FLUSH_POINT)

    copy_persist = Device.copy_persist  # stores, then the flush above (the libpmem copy is for ADR)
    persist_streamed = Device.persist_streamed


class EADRCXLDevice(_FlushWritesNothing, EmulatedCXLDevice):
    """Power loss with eADR: the CPU caches are inside the persistence domain, so a store is durable
    once it is made (the shared mapping is the media) and flush has nothing to do; drain still
    orders (SFENCE through libpmem when present)."""


class PowerLossCXLDevice(EmulatedCXLDevice):
    """The emulated device with a power-loss model (knob `power_loss` = 1; map_device picks it).

    Two mappings of the memory-backed file:

      array  MAP_PRIVATE (mmap.ACCESS_COPY): the process's view, its "CPU caches". A page it writes
             becomes a private copy that the file never sees.
      media  MAP_SHARED: the file itself, which outlives the process.

    flush copies the range, rounded out to whole cache lines, from the private view to the media;
    drain has nothing to wait for. SIGKILL then does what a power failure does: the private copies
    die with the process, and the file holds exactly what was persisted (plus whatever shared a
    cache line with it: real write-back is per line too).

    Reading a page this process never wrote shows the file's current bytes (a private mapping
    shares unwritten pages with the page cache). That is the right answer here: the pool lock makes
    this process the file's only writer, and it writes the media only by copying from this very
    view, so an unwritten page's bytes are the same in both.

    Costs and limits: each page the process writes becomes an anonymous private copy, so the
    written part of the pool takes twice its size in memory; persist costs a memcpy of the lines
    (no libpmem flush: the copy is the persistence). A forked child's stores go to its own private
    copies and are not seen by the parent, persisted or not.

    With `evict_rate` > 0 an Evictor thread also writes random unpersisted lines to the media early
    (emulation/evictor.py). Every write to the media holds `media_lock`, so the evictor can never
    put an older value of a line over a newer one that flush has just persisted.
    """

    kind = "emulated-cxl"
    power_loss = True

    def __init__(self, path: str, fd: int, size: int, *, evict_rate: int = 0, evict_seed: int = 0) -> None:
        # Not EmulatedCXLDevice.__init__: that maps the file shared and flushes through libpmem.
        Device.__init__(self, path, size, writable=True, is_pmem=True)  # flush is per cache line
        self._pmem = None
        self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self._array.ctypes.data
        self._media_mmap = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        # the only view of the media: close() drops it, then unmaps (nobody else can hold one)
        self._media: np.ndarray | None = np.frombuffer(self._media_mmap, dtype=np.uint8)
        self._media_address = self._media.ctypes.data
        self.media_lock = threading.Lock()
        self.evictor = (Evictor(self._array, self._media, self.media_lock, rate=evict_rate, seed=evict_seed)
                        if evict_rate else None)

    def flush(self, offset: int, length: int) -> None:
        self._check_range(offset, length)
        if self._media is None:
            raise ValueError(f"{self.path}: device is closed")
        if length == 0:
            return
        self._account(length)
        # Whole lines, as CLWB does: unpersisted neighbours in the first and last line go along.
        start = offset - offset % CACHE_LINE
        end = min(-(-(offset + length) // CACHE_LINE) * CACHE_LINE, self.size)
        with self.media_lock:
            ctypes.memmove(self._media_address + start, self.address + start, end - start)

    def flush_rows(self, offset: int, stride: int, rows: np.ndarray) -> None:
        if rows.size == 0 or native.lib() is None:
            return Device.flush_rows(self, offset, stride, rows)  # one flush() per run of rows
        self._check_range(offset, 0)
        if self._media is None:
            raise ValueError(f"{self.path}: device is closed")
        self._account(rows.size * stride)
        rows = np.require(rows, np.int64, "CA")
        with self.media_lock:  # the kernel runs without the GIL: the lock alone keeps the evictor out
            native.copy_lines(self.address, self._media_address, self.size, offset, stride,
                              (self.size - offset) // stride, rows)

    def drain(self) -> None:
        # Nothing is in flight: flush's copy has landed in the media (the page cache, which outlives
        # the process) before flush returns, and this thread's stores are seen in program order, so
        # every flush issued so far is complete and ordered before whatever comes after.
        pass

    # persist = flush + drain, and copy_persist = store into the private view + persist, are the
    # inherited ones: the media gets the bytes by the same line copy as any persisted store.

    def close(self) -> None:
        if self.evictor is not None:
            self.evictor.stop()  # before the views go: it reads and writes both
            self.evictor = None
        super().close()  # the private view: unmapped now, or when the last view of it goes
        self._media = None
        try:
            self._media_mmap.close()
        except BufferError:
            pass  # cannot happen (no view of the media escapes), but never unmap under a view

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "ro"
        return f"<{type(self).__name__} {self.kind} power-loss {self.path} {self.size} bytes {mode}>"


class VolatileCXLDevice(_FlushWritesNothing, PowerLossCXLDevice):
    """Power loss with no persistence domain at all (volatile CXL memory): flush makes nothing
    durable, so a kill loses every store since the pool was opened. Closing the pool normally
    writes the private view back whole: the process ended, the machine (and its memory) did not."""

    def close(self) -> None:
        if self._media is not None and self._array is not None:
            with self.media_lock:
                self._media[:] = self._array
        super().close()
