"""Which tier each table of a Runtime lives in, and the capacity pool of its pool set (docs/tiers.md).

    tiers = Tiers.of(tables, "/data/ctr.cap", capacity_tables=None)   # every table on the disk
    tiers.is_fast(table)                                               # False: in the capacity pool

The fast tier is the primary pool (the emulated CXL device by default: root, undo ring, dense
slots, and the tables placed there); the capacity tier is one capacity pool on block storage
(devices/capacity.py). The Runtime asks this module to create the capacity pool with the primary,
to publish it before the primary, and to check that an existing set is the one it was given.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import os

import numpy as np

from ..devices.capacity import open_capacity
from ..errors import ConfigError, PoolError
from ..knobs import KNOBS
from ..pool import set_format as pool_set
from ..pool.format import pool_size_for
from ..pool.handle import Pool, RegionSpec, publish, remove_stale
from ..pool.set_format import MEMBER_BYTES, SET_BYTES

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(frozen=True)
class Tiers:
    capacity_path: str | None        # the capacity pool, or None: one pool holds everything
    capacity_tables: frozenset[str]  # names of the tables that live there

    @classmethod
    def of(cls, tables: dict, capacity_pool, capacity_tables) -> "Tiers":
        names = [t.name for t in tables.values()]
        if capacity_pool is None:
            if capacity_tables:
                raise ConfigError("capacity_tables need a capacity_pool to live in")
            return cls(None, frozenset())
        chosen = frozenset(names if capacity_tables is None else capacity_tables)
        unknown = sorted(chosen - set(names))
        if unknown:
            raise ConfigError(f"capacity_tables name tables the model does not have: {', '.join(unknown)}")
        return cls(os.path.abspath(os.fspath(capacity_pool)), chosen)

    def primary_extra_bytes(self) -> list[int]:
        """What the primary holds for the set beyond a single pool's regions: its list of members,
        and room for the list's second slot (added when a moved capacity pool is re-pointed)."""
        return [SET_BYTES, SET_BYTES] if self.capacity_path else []

    def is_fast(self, table) -> bool:
        return table.name not in self.capacity_tables

    @property
    def building(self) -> str:
        return self.capacity_path + ".creating"

    def check_new(self) -> None:
        """Before a new set is made: its capacity pool must not exist (it would belong to another set)."""
        if self.capacity_path is None:
            return
        if os.path.exists(self.capacity_path):
            raise PoolError(f"{self.capacity_path}: already exists, and the primary pool it would join does not; "
                            "a capacity pool belongs to one set: delete it or use another path")
        remove_stale(self.building)

    def create_members(self, primary: Pool, specs: list[RegionSpec]) -> None:
        """Create the capacity pool (under a side name), holding `specs`, and bind it to `primary`."""
        if self.capacity_path is None:
            return
        sizes = [spec.nbytes(KNOBS.row_align) for spec in specs] + [MEMBER_BYTES]
        member = Pool.create(self.building, pool_size_for(sizes, KNOBS.dir_capacity, KNOBS.region_align),
                             mapper=open_capacity)
        try:
            primary.add_member(member, self.capacity_path)
        except BaseException:
            member.close()
            os.unlink(self.building)
            raise
        member.add_regions(specs)

    def publish_members(self, primary: Pool) -> None:
        for member in primary.members:
            publish(member, self.capacity_path)

    def check_open(self, primary: Pool) -> None:
        """The opened set is the one asked for: the same capacity pool, or none on both sides."""
        have = [m.path for m in primary.members]
        want = [self.capacity_path] if self.capacity_path else []
        if [os.path.abspath(p) for p in have] != want:
            primary.close()
            said = ", ".join(have) or "no capacity pool"
            raise ConfigError(f"{primary.path}: is a pool set with {said}, not "
                              f"{self.capacity_path or 'a single pool'}; pass the same --capacity-pool as "
                              "when it was created")


class ColdRowPrefetcher:
    """Reads the next batch's cold rows into the page cache while this batch computes (docs/tiers.md, Prefetch).

    One pread of a byte per page the rows live on and the page cache does not hold (mincore of the
    set's own mapping), spread over `threads` threads: pread releases the GIL and the disk serves
    many reads at once, where a lookup faulting the pages in would wait for each one alone.
    Readahead is switched off for these reads (POSIX_FADV_RANDOM): rows are scattered, so reading
    ahead would fetch pages nobody asked for. `pages_read` counts the reads, `pages_resident` the
    pages skipped as already held.

    Finding what to read costs the training thread a few ms a batch (the misses of every table,
    their pages, mincore), all wasted while the page cache holds the whole set. So after a batch
    whose pages were all held the next `due()` batches are skipped, one more after each such batch
    in a row, up to MAX_SKIP; a batch with a page to read resets it. A page dropped meanwhile is
    read by the lookup that needs it, as without a prefetcher. `batches_skipped` counts them.
    """

    MAX_SKIP = 16

    def __init__(self, primary: Pool, tables: list, threads: int = 8) -> None:
        self._targets = {}  # table name -> [(fd, offset, row stride, residency)] of its weights and optimizer state
        self._fds = []
        for table in tables:
            regions = [primary.region(table.weight_region)]
            if table.optimizer.state_columns:
                regions.append(primary.region(table.state_region))
            member = primary.members[pool_set.member_of_index(regions[0].index)]
            fd = os.open(member.path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds.append(fd)
            self._targets[table.name] = [(fd, r.offset, r.row_stride, _Residency(member.device.array, r))
                                         for r in regions]
        self._threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="cxltrain-prefetch")
        self._pending: list = []
        self.pages_read = 0
        self.pages_resident = 0
        self.batches_skipped = 0
        self._held_in_a_row = 0  # batches in a row whose pages were all held
        self._skip = 0           # batches still to skip

    def due(self) -> bool:
        """Whether the next batch's rows should be looked for (submit); False: skip this one."""
        if self._skip:
            self._skip -= 1
            self.batches_skipped += 1
            return False
        return True

    def submit(self, ids: dict) -> None:
        """Start reading the pages of rows `ids` ({table name: int64 tensor [N]}); returns at once.
        The reads of the previous call are waited for first, so at most one batch is in flight."""
        self.wait()
        work = []
        for name, rows in ids.items():
            rows = np.unique(rows.numpy()) if hasattr(rows, "numpy") else np.unique(rows)
            for fd, offset, stride, residency in self._targets.get(name, ()):
                pages = np.unique((offset + rows * stride) // PAGE)
                # a page the page cache holds costs a system call and a core for nothing (on 2 cores,
                # the training thread's): only the others are read
                absent = pages[~residency.held(pages)]
                self.pages_resident += pages.size - absent.size
                work += [(fd, int(page) * PAGE) for page in absent]
        self.pages_read += len(work)
        self._held_in_a_row = 0 if work else self._held_in_a_row + 1
        self._skip = min(self._held_in_a_row, self.MAX_SKIP)
        chunk = -(-len(work) // self._threads) if work else 0
        self._pending = [self._executor.submit(_read_pages, work[i : i + chunk]) for i in range(0, len(work), chunk or 1)]

    def wait(self) -> None:
        for future in self._pending:
            future.result()
        self._pending = []

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        for fd in self._fds:
            os.close(fd)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class _Residency:
    """Which file pages of one region of a capacity pool the page cache holds (mincore(2) over the
    pool's shared mapping `array`, uint8 [pool bytes]; pages counted from the file's start)."""

    def __init__(self, array: np.ndarray, region) -> None:
        self._array = array  # kept: the mapping must outlive the address taken from it
        self._first = region.offset // PAGE
        self._vector = np.zeros(-(-(region.offset + region.size) // PAGE) - self._first, dtype=np.uint8)
        self._address = array.ctypes.data + self._first * PAGE

    def held(self, pages: np.ndarray) -> np.ndarray:
        """bool [P]: whether each of `pages` (file page numbers, int64 [P] inside the region) is held;
        all False where mincore fails (then every page is read, as before it was asked)."""
        if _LIBC.mincore(self._address, self._vector.size * PAGE, self._vector.ctypes.data) != 0:
            return np.zeros(pages.size, dtype=bool)
        return (self._vector[pages - self._first] & 1).astype(bool)


def _read_pages(work: list[tuple[int, int]]) -> None:
    for fd, offset in work:
        os.pread(fd, 1, offset)
