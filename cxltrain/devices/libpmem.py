"""A thin ctypes binding to PMDK's libpmem (the OS package `libpmem1`).

Why our own binding: no maintained Python package wraps libpmem (the nearest, pynvm 0.3.1, has been
unmaintained since 2017 and needs five PMDK -dev packages and nose to build). We need eight C calls;
ctypes reaches them with no build step. A ctypes call per row is too slow for a hot loop
(docs/benchmarks.md), so hot loops belong in kernels/ (C), not here.

`load()` returns None when libpmem is not installed; callers fall back to msync.
`PMEM_IS_PMEM_FORCE=1` in the environment is read by libpmem itself, at load time: it makes
`pmem_is_pmem` report true, so flushes are used instead of msync (what PMDK's own tests do on
non-DAX files).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


class LibPmem:
    """The libpmem functions cxltrain uses, with argument types declared."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self._declare("pmem_map_file", vp, [ctypes.c_char_p, sz, ctypes.c_int, ctypes.c_uint,
                                            ctypes.POINTER(sz), ctypes.POINTER(ctypes.c_int)])
        self._declare("pmem_unmap", ctypes.c_int, [vp, sz])
        self._declare("pmem_flush", None, [vp, sz])
        self._declare("pmem_drain", None, [])
        self._declare("pmem_persist", None, [vp, sz])
        self._declare("pmem_msync", ctypes.c_int, [vp, sz])
        self._declare("pmem_memcpy_persist", vp, [vp, vp, sz])
        self._declare("pmem_errormsg", ctypes.c_char_p, [])
        # C addresses of flush and drain, for the native row kernels to call without ctypes
        self.flush_address = ctypes.cast(self.pmem_flush, ctypes.c_void_p).value
        self.drain_address = ctypes.cast(self.pmem_drain, ctypes.c_void_p).value

    def _declare(self, name: str, restype, argtypes) -> None:
        fn = getattr(self.lib, name)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(self, name, fn)

    def errormsg(self) -> str:
        msg = self.pmem_errormsg()
        return msg.decode(errors="replace") if msg else "unknown libpmem error"


@functools.lru_cache(maxsize=1)
def load() -> LibPmem | None:
    """libpmem, or None when it is not installed (or CXLTRAIN_NO_LIBPMEM=1 asks to ignore it)."""
    if os.environ.get("CXLTRAIN_NO_LIBPMEM") == "1":
        return None
    for name in ("libpmem.so.1", ctypes.util.find_library("pmem")):
        if not name:
            continue
        try:
            return LibPmem(ctypes.CDLL(name))
        except OSError:
            continue
    return None
