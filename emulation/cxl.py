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
import hashlib
import os
import tempfile

import numpy as np

from cxltrain.devices.base import Device, runs_of
from cxltrain.devices.libpmem import load as load_libpmem
from cxltrain.faults import crash_point
from cxltrain.kernels import native
from cxltrain.knobs import KNOBS

from .bandwidth import BandwidthCap
from .evictor import Evictor
from .mappings import CachedFile, SharedFile

# Crash tests can die at the n-th flush of an emulated device: a random moment of the persistence traffic.
FLUSH_POINT = "device:flush"


# What a native kernel calls after each of its persists while an observer listens (kernels/persist.h on_fence).
_FENCE_CALLBACK = ctypes.CFUNCTYPE(None)

# The memory-backed file system an emulated pool lives on where the machine has one.
SHM = "/dev/shm"


def memory_dir() -> str:
    """The folder for memory-backed scratch pools: /dev/shm where this process may write there,
    else the temp folder (not memory-backed: slower, and not an emulated CXL device)."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK):
        return SHM
    return tempfile.gettempdir()


def pool_name() -> str:
    """The default pool's file name: one per user and working directory (a short hash of its real
    path), so two checkouts on one machine never resume, or refuse, each other's pool."""
    where = hashlib.sha256(os.path.realpath(os.getcwd()).encode()).hexdigest()[:8]
    return f"cxltrain-{os.getuid()}-{where}-train.pool"


def default_pool_dir(required_bytes: int = 0) -> str:
    """Where the emulated pool lives by default: the knob, else memory_dir() when that is /dev/shm
    and has room for `required_bytes` (or already holds the pool), else the temp folder."""
    if KNOBS.pool_dir:
        return KNOBS.pool_dir
    if memory_dir() == SHM and (os.path.exists(os.path.join(SHM, pool_name())) or free_bytes(SHM) >= required_bytes):
        return SHM
    return tempfile.gettempdir()


def default_pool_path(required_bytes: int = 0) -> str:
    """The pool `cxltrain train` uses when no --pool is given: one per user and working directory."""
    return os.path.join(default_pool_dir(required_bytes), pool_name())


def free_bytes(folder: str) -> int:
    """Bytes an unprivileged writer may still use in `folder`'s file system (OSError if none)."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


class _EmulatedDevice(Device):
    """What the four emulated devices below share, and all they share: a memory-backed file mapped
    by `_file` (emulation/mappings.py), the crash tests' flush point and the bandwidth cap on what is
    written back. Each device is a direct child of this one and says itself what flush and drain do."""

    kind = "emulated-cxl"
    power_loss = False                          # True: the process works in a private view (CachedFile)
    bandwidth_cap: BandwidthCap | None = None   # set by open_device when the knob asks for one

    def __init__(self, path: str, size: int, file: SharedFile | CachedFile, *, is_pmem: bool) -> None:
        super().__init__(path, size, writable=True, is_pmem=is_pmem)
        self._file = file
        self._array = file.array
        self.address = self._array.ctypes.data

    def _account(self, nbytes: int) -> None:
        """Every write-back passes here: the crash tests' flush point, then the bandwidth cap."""
        crash_point(FLUSH_POINT)
        if self.bandwidth_cap is not None:
            self.bandwidth_cap.charge(nbytes)

    def streamed_persisted(self, offset: int, length: int, fences: int) -> None:
        super().streamed_persisted(offset, length, fences)
        self._account(length)  # what a kernel persisted itself (native_persistence) is written back too

    def rows_flushed(self, offset: int, stride: int, count: int, runs: int) -> None:
        super().rows_flushed(offset, stride, count, runs)
        self._account(count * stride)  # what a kernel wrote back itself (native_persistence)

    def close(self) -> None:
        if self.evictor is not None:
            self.evictor.stop()  # before the views go: it reads and writes both
            self.evictor = None
        super().close()  # the device's reference; the file unmaps now, or when the last view goes
        self._file.close()

    def __repr__(self) -> str:
        if not self.power_loss:
            return super().__repr__()
        mode = "rw" if self.writable else "ro"
        return f"<{type(self).__name__} {self.kind} power-loss {self.path} {self.size} bytes {mode}>"


class EmulatedCXLDevice(_EmulatedDevice):
    """A memory-backed file, mapped shared; flush/drain are libpmem's cache-line calls when present.
    is_pmem exactly when libpmem is there: then a flush is CLWB/CLFLUSHOPT, as on a DAX device."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self._pmem = load_libpmem()
        super().__init__(path, size, SharedFile(fd, size), is_pmem=self._pmem is not None)

    def _write_back(self, offset: int, length: int) -> None:
        self._account(length)
        if self._pmem is not None:
            self._pmem.pmem_flush(self.address + offset, length)

    def _fence(self) -> None:
        if self._pmem is not None:
            self._pmem.pmem_drain()

    def native_persistence(self) -> native.NativePersistence | None:
        # as on a DAX device: libpmem's flush, and streamed stores need only the fence
        if self._pmem is None:
            return None
        return native.NativePersistence(native.NativePersistence.LINES, self._pmem.flush_address)

    def _write_back_rows(self, offset: int, stride: int, rows: np.ndarray) -> int | None:
        if rows.size == 0 or self._pmem is None or native.lib() is None:
            return None  # flush() per run, each accounted in _write_back
        self._account(rows.size * stride)  # the native walk calls no _write_back to account for it
        return super()._write_back_rows(offset, stride, rows)

    def _persist_streamed(self, offset: int, length: int) -> None:
        if self._pmem is None:
            return super()._persist_streamed(offset, length)
        self._account(length)
        self._pmem.pmem_drain()  # as on a DAX device: the stores went around the caches

    def _store_persist(self, offset: int, src: np.ndarray) -> None:
        if self._pmem is None:
            return super()._store_persist(offset, src)
        self._account(src.size)
        # as on a DAX device: non-temporal stores for large copies (no cache lines to write back), one fence
        self._pmem.pmem_memcpy_persist(self.address + offset, native.address(src), src.size)


class EADRCXLDevice(_EmulatedDevice):
    """Power loss with eADR: the CPU caches are inside the persistence domain, so a store is durable
    once it is made (the shared mapping is the media) and a flush writes nothing, though it is still
    checked and still a crash tests' flush point; drain still orders (SFENCE through libpmem when
    present). is_pmem as on EmulatedCXLDevice, so the checkpointer flushes rows where it would there."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self._pmem = load_libpmem()
        super().__init__(path, size, SharedFile(fd, size), is_pmem=self._pmem is not None)

    def _write_back(self, offset: int, length: int) -> None:
        crash_point(FLUSH_POINT)

    def _fence(self) -> None:
        if self._pmem is not None:
            self._pmem.pmem_drain()

    def _write_back_rows(self, offset: int, stride: int, rows: np.ndarray) -> int:
        return _no_write_back_rows(self, offset, rows)


class PowerLossCXLDevice(_EmulatedDevice):
    """The emulated device with a power-loss model (knob `power_loss` = 1; map_device picks it).

    Two mappings of the memory-backed file (emulation/mappings.py, CachedFile):

      array  MAP_PRIVATE (mmap.ACCESS_COPY): the process's view, its "CPU caches". A page it writes
             becomes a private copy that the file never sees.
      media  MAP_SHARED: the file itself, which outlives the process.

    flush copies the range, rounded out to whole cache lines, from the private view to the media;
    drain has nothing to wait for. SIGKILL then does what a power failure does: the private copies
    die with the process, and the file holds exactly what was persisted (plus whatever shared a
    cache line with it: real write-back is per line too). is_pmem: a flush is per cache line, as
    CLWB is (cheap per row), though libpmem is never used.

    Reading a page this process never wrote shows the file's current bytes (a private mapping
    shares unwritten pages with the page cache). That is the right answer here: the pool lock makes
    this process the file's only writer, and it writes the media only by copying from this very
    view, so an unwritten page's bytes are the same in both.

    Costs and limits: each page the process writes becomes an anonymous private copy, so the
    written part of the pool takes twice its size in memory; persist costs a memcpy of the lines
    (no libpmem flush: the copy is the persistence). A forked child's stores go to its own private
    copies and are not seen by the parent, persisted or not.

    With `evict_rate` > 0 an Evictor thread also writes random unpersisted lines to the media early
    (emulation/evictor.py), under the same lock as flush's copies (`media_lock`).
    """

    power_loss = True
    crash_atom_bytes = 8   # a crash keeps or loses each aligned 8-byte word whole (x86's atomic store)

    def __init__(self, path: str, fd: int, size: int, *, evict_rate: int = 0, evict_seed: int = 0) -> None:
        super().__init__(path, size, CachedFile(fd, size), is_pmem=True)
        self._on_fence = None
        self.media_lock = self._file.lock
        self.evictor = (Evictor(self._array, self._file.media, self.media_lock, rate=evict_rate, seed=evict_seed)
                        if evict_rate else None)

    @property
    def _media(self) -> np.ndarray | None:
        """The media mapping (the file), None once closed."""
        return self._file.media

    def _write_back(self, offset: int, length: int) -> None:
        if self._media is None:
            raise ValueError(f"{self.path}: device is closed")
        if length == 0:
            return
        self._account(length)
        self._file.copy_lines(offset, length)

    def _fence(self) -> None:
        # Nothing is in flight: flush's copy has landed in the media (the page cache, which outlives
        # the process) before flush returns, and this thread's stores are seen in program order, so
        # every flush issued so far is complete and ordered before whatever comes after.
        pass

    def _write_back_rows(self, offset: int, stride: int, rows: np.ndarray) -> int | None:
        if rows.size == 0 or native.lib() is None:
            return None  # one flush() per run of rows
        self._check_range(offset, 0)
        if self._media is None:
            raise ValueError(f"{self.path}: device is closed")
        self._account(rows.size * stride)
        return self._file.copy_rows(offset, stride, rows)

    def durable(self) -> np.ndarray:
        """What a power loss now would leave of the pool: the media, as a copy [size] uint8. Only
        with no early write-back: then this thread is the media's only writer, and the copy needs
        no lock (an observer calls it from inside native persists, which hold the media lock)."""
        if self._media is None:
            raise ValueError(f"{self.path}: device is closed")
        if self.evictor is not None:
            raise ValueError(f"{self.path}: what is durable is not fixed while lines are written back early")
        return self._media.copy()

    def native_persistence(self) -> native.NativePersistence | None:
        if self._media is None:
            raise ValueError(f"{self.path}: device is closed")
        # native code copies whole lines to the media as copy_rows does, holding the media lock;
        # an observer hears of each of its persists as of the device's own
        return native.NativePersistence(native.NativePersistence.MEDIA,
                                        media_offset=self._media.ctypes.data - self.address,
                                        map_start=self.address, map_end=self.address + self.size,
                                        on_fence=self._fence_callback(), lock=self.media_lock)

    def _fence_callback(self) -> int:
        """The address of a C function void(void) that tells the observer of a fence; 0 without one."""
        if self.observer is None:
            return 0
        if self._on_fence is None:  # kept with the device: native code may call it while the device lives
            self._on_fence = _FENCE_CALLBACK(self._observe)
        return ctypes.cast(self._on_fence, ctypes.c_void_p).value

    # persist = write-back + fence, and copy_persist = store into the private view + persist, are the
    # base class's: the media gets the bytes by the same line copy as any persisted store.


class VolatileCXLDevice(_EmulatedDevice):
    """Power loss with no persistence domain at all (volatile CXL memory): the process works in a
    private view, as on PowerLossCXLDevice, but a flush copies nothing to the media (it is still
    checked and still a crash tests' flush point), so a kill loses every store since the pool was
    opened. Closing the pool normally writes the view back whole: the process ended, the machine
    (and its memory) did not. is_pmem as on PowerLossCXLDevice."""

    power_loss = True

    def __init__(self, path: str, fd: int, size: int) -> None:
        super().__init__(path, size, CachedFile(fd, size), is_pmem=True)

    def _write_back(self, offset: int, length: int) -> None:
        crash_point(FLUSH_POINT)

    def _fence(self) -> None:
        pass  # nothing was written back, so nothing is in flight

    def _write_back_rows(self, offset: int, stride: int, rows: np.ndarray) -> int:
        return _no_write_back_rows(self, offset, rows)

    def close(self) -> None:
        self._file.copy_all()
        super().close()


def _no_write_back_rows(device: Device, offset: int, rows: np.ndarray) -> int:
    """A row-set flush where a flush writes nothing (eADR, volatile): checked, one flush point for
    the whole set (not one per run), and the runs it stands for, for the device's counters."""
    device._check_range(offset, 0)
    crash_point(FLUSH_POINT)
    return len(runs_of(rows)[0]) if rows.size else 0


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
