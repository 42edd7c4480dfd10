"""The native row kernels (kernels/rows.c, built by setup.py as `cxltrain.kernels._rows`).

`lib()` is the extension module, or None when it was not built (then one warning line, once) or
the `native_kernels` knob is 0; callers then use the torch kernels of rows.py. The C functions
take raw addresses: only this module, ops.py and lookups.py call them, after checking every array
they describe. This module needs numpy only (no torch), so the devices layer can use it.

The two row-set flushes, for devices (rows int64 [U], sorted ascending, unique); each returns the
number of runs of adjacent rows it wrote back (what a device counts as flushes):

    flush_rows(address, stride, table_rows, rows, flush_address=None, drain_address=None, drain=False)
        write back each run of adjacent rows of the table at `address` ([table_rows, stride] bytes)
        with one call of the C function at `flush_address` (libpmem's pmem_flush, signature
        void(const void *, size_t)) per run, or with CLWB/CLFLUSHOPT when it is None
        (RuntimeError "no flush available" when the CPU has neither); then, if `drain`, one call of
        the C function at `drain_address` (pmem_drain), or one SFENCE when it is None.

    copy_lines(view_address, media_address, map_size, offset, stride, table_rows, rows)
        the power-loss emulator's flush: for each run of adjacent rows of the table at mapping
        offset `offset`, copy the whole 64-byte lines it touches from the view mapping to the media
        mapping (both `map_size` bytes, page aligned), clamped to the mapping's end.

A device whose stores native code can make durable by itself says how in one value,
NativePersistence (Device.native_persistence), which the kernels read by field name (kernels/persist.h
pm_domain_from): the fused update's undo records and row write-back, a dense snapshot's payload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import zlib

import numpy as np

from ..knobs import KNOBS


@dataclasses.dataclass(frozen=True)
class NativePersistence:
    """How a device's stores become durable when native code makes them so (kernels/persist.h, the
    generic primitives, read these fields by name):

        kind LINES  write back: the C flush at `flush` on each range (libpmem's pmem_flush,
                    void(const void *, size_t); 0: the CPU's CLWB or CLFLUSHOPT); streamed
                    (non-temporal) stores: a fence is all that is left
        kind MEDIA  the power-loss emulator: write back copies a range's whole lines from the view
                    [map_start, map_end) to the media mapping `media_offset` bytes further on;
                    streamed stores are fenced, then copied the same way
        kind NONE   nothing to write back (the stores need none); a fence orders them

    on_fence: 0, or the address of a C function void(void) called after each of native code's
    persists (fence done, lines copied): how a crash-state recorder sees them (jobs/crash_states.py).
    lock: held while native code persists on this device (the emulator's media lock)."""

    LINES, MEDIA, NONE = 1, 2, 3  # kernels/persist.h enum pm_kind
    kind: int
    flush: int = 0
    media_offset: int = 0
    map_start: int = 0
    map_end: int = 0
    on_fence: int = 0
    lock: contextlib.AbstractContextManager = dataclasses.field(default_factory=contextlib.nullcontext,
                                                                 compare=False, repr=False)


def _load():
    try:
        from . import _rows
    except ImportError as e:
        print(f"cxltrain: warning: native row kernels not built ({e}); using the slower torch kernels",
              file=sys.stderr)
        return None
    return _rows


_LIB = _load()


def built() -> bool:
    """Whether the extension was built and imports."""
    return _LIB is not None


def lib():
    """The extension module when it is built and the native_kernels knob is 1, else None."""
    return _LIB if KNOBS.native_kernels else None


def cpu_flush() -> str:
    """The cache-line flush the kernels use without libpmem: "clwb", "clflushopt" or "none"."""
    return _require().cpu_flush()


def address(buffer) -> int:
    """The address of a C-contiguous buffer's first byte (a numpy array's `ctypes.data`), at a tenth
    of numpy's cost where the extension is built."""
    return _LIB.addresses(buffer)[0] if _LIB is not None else buffer.ctypes.data


def check_rows(rows: np.ndarray) -> None:
    """Refuse anything but a 1-D C-contiguous, 8-byte aligned int64 numpy array of row ids."""
    if not isinstance(rows, np.ndarray) or rows.dtype != np.int64 or rows.ndim != 1 \
            or not rows.flags.c_contiguous or not rows.flags.aligned:
        raise TypeError(f"rows must be a 1-D contiguous, aligned int64 numpy array, got "
                        f"{getattr(rows, 'dtype', type(rows).__name__)} {getattr(rows, 'shape', '')}")


def flush_rows(address: int, stride: int, table_rows: int, rows: np.ndarray, flush_address: int | None = None,
               drain_address: int | None = None, drain: bool = False) -> int:
    check_rows(rows)
    lib = _require()
    return lib.flush_rows(address, stride, table_rows, *lib.addresses(rows), rows.size, flush_address or 0,
                          drain_address or 0, drain)


def copy_lines(view_address: int, media_address: int, map_size: int, offset: int, stride: int, table_rows: int,
               rows: np.ndarray) -> int:
    check_rows(rows)
    lib = _require()
    return lib.copy_lines(view_address, media_address, map_size, offset, stride, table_rows, *lib.addresses(rows),
                          rows.size)


def crc32(data, seed: int = 0) -> int:
    """zlib.crc32(data, seed), the same value, computed by the native kernel when it is built and
    enabled: folded with carry-less multiplies where the CPU has them (VPCLMULQDQ on AVX-512, else
    PCLMULQDQ; docs/benchmarks.md has their speeds; lib().crc32_path() says which).
    data: bytes-like, or a C-contiguous numpy array of any dtype (its bytes)."""
    native = lib()
    if native is None:
        return zlib.crc32(data, seed)
    try:
        return native.crc32(data, seed & 0xFFFFFFFF)
    except BufferError:
        raise ValueError("crc32 needs contiguous bytes") from None


def _require():
    if _LIB is None:
        raise RuntimeError("the native row kernels are not built (pip install -e . compiles kernels/rows.c)")
    return _LIB
