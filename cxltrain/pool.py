"""The pool: one file or DAX device, mapped whole, holding named regions (DESIGN §3).

    pool = Pool.create("/dev/shm/ctr.pool", size=1 << 30)
    w = pool.add_region("t0.weight", RegionKind.TABLE_WEIGHTS, "float32", (1000, 64), aligned_rows=True)
    pool.array("t0.weight")[:] = 0.0                  # zero-copy numpy view, shape [1000, 64]
    pool.persist_region("t0.weight")
    pool.commit(batch=0)
    pool.close()

Nothing read from a pool is trusted before it is checked: `Pool.open` reads the superblock, both
root slots and the live directory entries with pread, validates all of them (fixed order, one
distinct error per failure), and only then maps the pool. A pool that fails any check is never
mapped writable, so a refused pool is left byte-for-byte untouched. `inspect()` runs the same checks
and reports every problem instead of raising on the first.

A pool is opened by one process at a time: an exclusive flock on the file (shared for read-only
inspection); a second opener gets PoolLockedError.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import math
import os
import stat
import time
import uuid as uuidlib
from typing import Callable

import numpy as np

from . import pool_format as fmt
from .devices import Device, device_size, open_target
from .devices.registry import map_device
from .faults import crash_armed, crash_point, planted
from .errors import (ConfigError, DeviceError, NotAPoolError, PoolCorruptError, PoolError, PoolFullError,
                     PoolLockedError, PoolVersionError)
from .knobs import KNOBS
from .pool_format import DType, Region, RegionKind, Root, Superblock

Reader = Callable[[int, int], bytes]


@dataclasses.dataclass(frozen=True)
class RegionSpec:
    """A region to allocate: `shape` of `dtype`; aligned_rows starts each row (dimension 0) on the
    pool's row alignment (64 bytes), so flushing one row never touches a neighbour's cache line."""

    name: str
    kind: RegionKind
    dtype: object
    shape: tuple[int, ...]
    aligned_rows: bool = False

    def validate(self) -> None:
        if not self.name or len(self.name.encode()) > fmt.NAME_BYTES or not self.name.isprintable():
            raise ConfigError(f"region name {self.name!r} must be 1..{fmt.NAME_BYTES} printable UTF-8 bytes")
        if not 1 <= len(self.shape) <= fmt.MAX_NDIM or any(int(d) <= 0 for d in self.shape):
            raise ConfigError(f"region {self.name!r}: shape {self.shape} must have 1..{fmt.MAX_NDIM} "
                              "positive dimensions")
        try:
            DType.of(self.dtype)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"region {self.name!r}: {e}") from None

    def row_stride(self, row_align: int) -> int:
        """Bytes from one row (dimension 0) to the next, rows aligned to `row_align` if asked."""
        packed = math.prod(self.shape[1:]) * DType.of(self.dtype).numpy.itemsize
        return fmt.align_up(packed, row_align) if self.aligned_rows else packed

    def nbytes(self, row_align: int) -> int:
        return self.shape[0] * self.row_stride(row_align)


SLOT_NAMES = ("A", "B")


# ---------------------------------------------------------------------------------------------
# Validation: pure functions over a reader; each failure is a distinct, one-line error.
# ---------------------------------------------------------------------------------------------
def validate_superblock(read: Reader, file_size: int) -> Superblock:
    """Magic, version, feature bits, checksum, bounds — in that order (the order LMDB uses)."""
    if file_size < 8:
        raise NotAPoolError(f"not a cxltrain pool: {file_size} bytes is too small")
    raw = read(fmt.SUPERBLOCK_OFFSET, fmt.SUPERBLOCK.size)
    magic = int.from_bytes(raw[:8], "little")
    if magic == fmt.MAGIC_SWAPPED:
        raise NotAPoolError("pool was written with the other byte order; it cannot be used on this machine")
    if magic == 0:
        raise NotAPoolError("not a cxltrain pool (no superblock: an empty file, or a `pool create` "
                            "that was interrupted; delete it to start over)")
    if magic != fmt.MAGIC:
        raise NotAPoolError("not a cxltrain pool (bad magic)")
    if len(raw) < fmt.SUPERBLOCK.size or file_size < fmt.DIR_OFFSET:
        raise PoolCorruptError(f"pool is truncated: {file_size} bytes is shorter than its own header")
    sb, _, sb_size, entry_size, reserved, csum = fmt.unpack_superblock(raw)
    if sb.version > fmt.FORMAT_VERSION:
        raise PoolVersionError(f"pool format v{sb.version} is newer than this cxltrain supports "
                               f"(v{fmt.FORMAT_VERSION}); upgrade cxltrain")
    if sb.version == 0:
        raise PoolCorruptError("superblock is corrupt (format version 0)")
    if sb.incompat & ~fmt.KNOWN_INCOMPAT_FEATURES:
        raise PoolVersionError(f"pool uses features this cxltrain does not know "
                               f"(incompat bits {sb.incompat:#x}); upgrade cxltrain")
    if csum != fmt.checksum(raw[:-4]):
        raise PoolCorruptError("superblock checksum mismatch")
    _check_superblock_bounds(sb, sb_size, entry_size, reserved, file_size)
    return sb


def _check_superblock_bounds(sb: Superblock, sb_size: int, entry_size: int, reserved: bytes,
                             file_size: int) -> None:
    def bad(what: str) -> PoolCorruptError:
        return PoolCorruptError(f"superblock is inconsistent: {what}")

    if sb_size != fmt.SUPERBLOCK.size or entry_size != fmt.DIR_ENTRY.size:
        raise bad(f"structure sizes {sb_size}/{entry_size}, expected {fmt.SUPERBLOCK.size}/{fmt.DIR_ENTRY.size}")
    if any(reserved):
        raise bad("reserved bytes are not zero")
    if sb.root_offsets != fmt.ROOT_OFFSETS or sb.dir_offset != fmt.DIR_OFFSET:
        raise bad("root or directory offsets differ from the v1 layout")
    if not 1 <= sb.dir_capacity <= 65536:
        raise bad(f"directory capacity {sb.dir_capacity}")
    if sb.region_align < fmt.PAGE or sb.region_align & (sb.region_align - 1):
        raise bad(f"region alignment {sb.region_align} is not a power of two >= {fmt.PAGE}")
    if not 8 <= sb.row_align <= fmt.PAGE or sb.row_align & (sb.row_align - 1):
        raise bad(f"row alignment {sb.row_align}")
    if sb.data_offset != fmt.data_offset(sb.dir_capacity, sb.region_align):
        raise bad(f"data offset {sb.data_offset}")
    if sb.pool_size < sb.data_offset:
        raise bad(f"pool size {sb.pool_size} is smaller than its metadata")
    if file_size < sb.pool_size:
        raise PoolCorruptError(f"pool is truncated: superblock says {sb.pool_size} bytes, file has {file_size}")


def new_superblock(size: int, dir_capacity: int, region_align: int, row_align: int) -> Superblock:
    """The superblock of a new pool, held to the same bounds `open` checks (as a ConfigError)."""
    data_off = fmt.data_offset(max(dir_capacity, 1), max(region_align, 1))
    sb = Superblock(fmt.FORMAT_VERSION, 0, 0, uuidlib.uuid4().bytes, size, time.time_ns(), fmt.ROOT_OFFSETS,
                    fmt.DIR_OFFSET, dir_capacity, data_off, region_align, row_align)
    if size < data_off:
        raise ConfigError(f"pool size {size} is too small: the metadata alone takes {data_off} bytes")
    try:
        _check_superblock_bounds(sb, fmt.SUPERBLOCK.size, fmt.DIR_ENTRY.size, bytes(1), size)
    except PoolCorruptError as e:
        raise ConfigError(str(e).replace("superblock is inconsistent", "cannot create a pool with")) from None
    return sb


@dataclasses.dataclass(frozen=True)
class SlotStatus:
    slot: int
    state: str          # "valid", "empty" (never written) or "corrupt"
    root: Root | None
    reason: str = ""


def read_root_slot(read: Reader, sb: Superblock, slot: int) -> SlotStatus:
    raw = read(sb.root_offsets[slot], fmt.ROOT.size)
    if not any(raw):
        return SlotStatus(slot, "empty", None)
    root, reserved, csum, pad = fmt.unpack_root(raw)
    if csum != fmt.root_checksum(raw, sb.uuid, slot):
        return SlotStatus(slot, "corrupt", None, "checksum mismatch (torn or damaged)")
    problem = ("seq is 0" if root.seq == 0 else
               f"seq {root.seq} belongs in slot {SLOT_NAMES[root.seq % 2]}" if root.seq % 2 != slot else
               "reserved bytes are not zero" if any(reserved) or any(pad) else
               f"unknown flags {root.flags:#x}" if root.flags & ~fmt.ROOT_KNOWN_FLAGS else
               f"dir_count {root.dir_count} exceeds capacity {sb.dir_capacity}" if root.dir_count > sb.dir_capacity else
               f"batch {root.batch} is below -1" if root.batch < -1 else
               f"dense slot {root.dense_slot} is not 0, 1 or 2" if root.dense_slot > 2 else
               f"dense batch {root.dense_batch} is negative" if root.dense_batch < 0 else "")
    if problem:
        return SlotStatus(slot, "corrupt", None, problem)
    return SlotStatus(slot, "valid", root)


def pick_root(slots: list[SlotStatus]) -> SlotStatus:
    """The valid slot with the higher seq wins (LMDB's mdb_env_pick_meta, with checksums)."""
    valid = [s for s in slots if s.state == "valid"]
    if not valid:
        states = ", ".join(f"slot {SLOT_NAMES[s.slot]} {s.state}" for s in slots)
        raise PoolCorruptError(f"no valid root ({states})")
    return max(valid, key=lambda s: s.root.seq)


def read_region(read: Reader, sb: Superblock, index: int) -> Region:
    """Decode and check directory entry `index` on its own (bounds against the pool, not overlap)."""
    raw = read(sb.dir_offset + index * fmt.DIR_ENTRY.size, fmt.DIR_ENTRY.size)
    name_b, kind, dtype, ndim, flags, offset, size, stride, shape4, reserved, csum = fmt.unpack_entry(raw)

    def bad(what: str) -> PoolCorruptError:
        return PoolCorruptError(f"region directory entry {index} is corrupt: {what}")

    if csum != fmt.entry_checksum(raw, sb.uuid, index):
        raise bad("checksum mismatch")
    name_b = name_b.rstrip(b"\0")
    try:
        name = name_b.decode()
    except UnicodeDecodeError:
        raise bad("name is not UTF-8") from None
    if not name or "\0" in name or not name.isprintable():
        raise bad("name is empty or unprintable")
    if kind not in RegionKind._value2member_map_ or dtype not in DType._value2member_map_:
        raise bad(f"unknown kind {kind} or dtype {dtype}")
    if not 1 <= ndim <= fmt.MAX_NDIM or flags or any(reserved):
        raise bad("ndim, flags or reserved bytes out of range")
    shape, rest = shape4[:ndim], shape4[ndim:]
    if any(d <= 0 for d in shape) or any(rest):
        raise bad(f"shape {shape4}")
    itemsize = DType(dtype).numpy.itemsize
    packed_row = math.prod(shape[1:]) * itemsize
    if stride < packed_row or stride % itemsize or size != shape[0] * stride:
        raise bad(f"size {size} and row stride {stride} do not fit shape {shape}")
    if offset % sb.region_align or offset < sb.data_offset or offset + size > sb.pool_size:
        raise bad(f"span [{offset}, {offset + size}) is misaligned or outside the data area")
    return Region(index, name, RegionKind(kind), DType(dtype), tuple(shape), offset, size, stride)


def check_regions_disjoint(regions: list[Region]) -> None:
    names = set()
    for r in regions:
        if r.name in names:
            raise PoolCorruptError(f"region directory names {r.name!r} twice")
        names.add(r.name)
    spans = sorted(regions, key=lambda r: r.offset)
    for a, b in zip(spans, spans[1:]):
        if a.end > b.offset:
            raise PoolCorruptError(f"regions {a.name!r} and {b.name!r} overlap")


# ---------------------------------------------------------------------------------------------
# Inspection (pool info / pool check): every check, every problem, never a write.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PoolReport:
    path: str
    file_size: int
    superblock: Superblock | None = None
    slots: list[SlotStatus] = dataclasses.field(default_factory=list)
    root: Root | None = None
    regions: list[Region] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def inspect(path: str) -> PoolReport:
    """Check a pool without mapping or changing it. Raises PoolError only when the file cannot be
    read at all or a writer holds it (PoolLockedError); every other problem goes in the report."""
    with _open_fd(path, writable=False) as (fd, file_size):
        lock_fd = _lock(path, writable=False)
        try:
            return _inspect(path, _reader(fd), file_size)
        finally:
            os.close(lock_fd)


def _inspect(path: str, read: Reader, file_size: int) -> PoolReport:
    report = PoolReport(path, file_size)
    try:
        sb = report.superblock = validate_superblock(read, file_size)
    except PoolError as e:
        report.problems.append(str(e))
        return report
    report.slots = [read_root_slot(read, sb, slot) for slot in (0, 1)]
    try:
        winner = pick_root(report.slots)
    except PoolError as e:
        report.problems.append(str(e))
        return report
    report.root = winner.root
    for index in range(winner.root.dir_count):
        try:
            report.regions.append(read_region(read, sb, index))
        except PoolError as e:
            report.problems.append(str(e))
    try:
        check_regions_disjoint(report.regions)
    except PoolError as e:
        report.problems.append(str(e))
    return report


# ---------------------------------------------------------------------------------------------
# The pool handle.
# ---------------------------------------------------------------------------------------------
class Pool:
    """An open pool. Use `Pool.create` or `Pool.open`; close it (or use `with`)."""

    def __init__(self, path: str, fd: int, lock_fd: int, device: Device, sb: Superblock, root: Root,
                 regions: list[Region]):
        self.path, self._fd, self._lock_fd, self.device, self.superblock = path, fd, lock_fd, device, sb
        self.root = root
        self._regions = {r.name: r for r in regions}
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        self._failed: str | None = None  # set when a commit failed part-way: the handle refuses all use

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, size: int | None = None, *, backend: str | None = None,
               dir_capacity: int | None = None, region_align: int | None = None) -> "Pool":
        """Create a new pool at `path`: a new file of `size` bytes, or a DAX character device
        (all of it when size is None) that holds no cxltrain pool yet.

        The superblock is written last: a crash during creation leaves a file that is refused as
        "not a cxltrain pool", never one that looks valid and is not.
        """
        layout = (dir_capacity or KNOBS.dir_capacity, region_align or KNOBS.region_align, KNOBS.row_align)
        # a file's size is known: refuse a bad layout before the file exists (a device's, once opened)
        sb = new_superblock(size, *layout) if size is not None else None
        target = open_target(path, size)
        lock_fd = -1
        try:
            lock_fd = _lock(path, writable=True)
            if target.existing and int.from_bytes(os.pread(target.fd, 8, 0), "little") == fmt.MAGIC:
                raise PoolError(f"{path}: already holds a cxltrain pool")
            sb = sb or new_superblock(target.size, *layout)
            device = map_device(path, target.fd, target.size, writable=True, backend=backend)
            pool = cls(path, target.fd, lock_fd, device, sb, Root(seq=0, dir_count=0, batch=-1), [])
            pool._write_root(Root(seq=1, dir_count=0, batch=-1))
            crash_point("create:before-superblock")
            # ORDERING: root durable before the superblock that makes the file a pool.
            device.copy_persist(fmt.SUPERBLOCK_OFFSET, sb.pack())
            return pool
        except BaseException:
            if not target.existing:
                os.unlink(path)  # never leave a half-made pool file behind
            os.close(target.fd)
            if lock_fd >= 0:
                os.close(lock_fd)
            raise

    @classmethod
    def open(cls, path: str, *, writable: bool = True, backend: str | None = None) -> "Pool":
        """Open and validate an existing pool. Nothing is mapped until every check has passed."""
        with _open_fd(path, writable, keep=True) as (fd, file_size):
            lock_fd = _lock(path, writable)
            read = _reader(fd)
            try:
                sb = validate_superblock(read, file_size)
                root = pick_root([read_root_slot(read, sb, slot) for slot in (0, 1)]).root
                regions = [read_region(read, sb, i) for i in range(root.dir_count)]
                check_regions_disjoint(regions)
                device = map_device(path, fd, sb.pool_size, writable=writable, backend=backend)
            except BaseException as e:
                os.close(lock_fd)
                if isinstance(e, NotAPoolError) and stat.S_ISCHR(os.fstat(fd).st_mode):
                    raise NotAPoolError(f"{path}: not a cxltrain pool; format the device with "
                                        f"`cxltrain pool create {path}`") from None
                if isinstance(e, PoolError) and not str(e).startswith(path):
                    raise type(e)(f"{path}: {e}") from None
                raise
            return cls(path, fd, lock_fd, device, sb, root, regions)

    # -- regions ----------------------------------------------------------------------------
    @property
    def regions(self) -> dict[str, Region]:
        return dict(self._regions)

    def region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise PoolError(f"{self.path}: no region named {name!r}") from None

    def _next_offset(self) -> int:
        end = max((r.end for r in self._regions.values()), default=self.superblock.data_offset)
        return fmt.align_up(end, self.superblock.region_align)

    def add_region(self, name: str, kind: RegionKind, dtype, shape: tuple[int, ...], *,
                   aligned_rows: bool = False) -> Region:
        """Allocate one zero-filled region; see add_regions."""
        return self.add_regions([RegionSpec(name, kind, dtype, tuple(shape), aligned_rows)])[0]

    def add_regions(self, specs: list["RegionSpec"]) -> list[Region]:
        """Allocate zero-filled regions, all or none: one root commit makes every one of them live.

        Everything is checked (names, shapes, directory room, space) before anything is written, so
        a refused request leaves the pool as it was. Durable when this returns.
        """
        self._check_open(writable=True)
        sb = self.superblock
        names = set(self._regions)
        if self.root.dir_count + len(specs) > sb.dir_capacity:
            raise PoolFullError(f"{self.path}: region directory has room for "
                                f"{sb.dir_capacity - self.root.dir_count} more regions, {len(specs)} asked for")
        regions, offset = [], self._next_offset()
        for i, spec in enumerate(specs):
            spec.validate()
            if spec.name in names:
                raise PoolError(f"{self.path}: region {spec.name!r} already exists")
            names.add(spec.name)
            region = Region(self.root.dir_count + i, spec.name, spec.kind, DType.of(spec.dtype), spec.shape,
                            offset, spec.nbytes(sb.row_align), spec.row_stride(sb.row_align))
            regions.append(region)
            offset = fmt.align_up(region.end, sb.region_align)
        if regions and regions[-1].end > sb.pool_size:
            needed = regions[-1].end - regions[0].offset
            raise PoolFullError(f"{self.path}: {len(regions)} region(s) need {needed:,} bytes, "
                                f"{max(0, sb.pool_size - regions[0].offset):,} are free")
        first = sb.dir_offset + self.root.dir_count * fmt.DIR_ENTRY.size
        entries = np.frombuffer(b"".join(r.pack(sb.uuid) for r in regions), dtype=np.uint8)
        new_root = dataclasses.replace(self.root, seq=self.root.seq + 1, dir_count=self.root.dir_count + len(regions))
        root_first = planted("root-before-entries")  # test-only: the ordering below, broken on purpose
        if root_first:
            self._write_root(new_root)
            crash_point("add-regions:between")
        self.device.array[first : first + entries.size] = entries
        # ORDERING: directory entries durable before the root that counts them, so a crash in
        # between leaves unused (ignored) entries, never live entries with garbage in them.
        self.device.persist(first, entries.size)
        if not root_first:
            crash_point("add-regions:between")
            self._write_root(new_root)
        self._regions.update((r.name, r) for r in regions)
        return regions

    def array(self, name: str, *, padded: bool = False) -> np.ndarray:
        """Zero-copy numpy view of a region.

        padded=False: the region's own shape; rows honour its row stride (may be non-contiguous).
        padded=True: 2-D [rows, row_stride / itemsize], contiguous, row padding included — what
        row kernels want, since e.g. torch's embedding_bag copies a non-contiguous table whole.
        """
        self._check_open()
        r = self.region(name)
        itemsize = r.dtype.numpy.itemsize
        flat = self.device.array[r.offset : r.offset + r.size].view(r.dtype.numpy)
        if padded:
            return flat.reshape(r.shape[0], r.row_stride // itemsize)
        inner = r.shape[1:]
        strides = [r.row_stride] + [math.prod(inner[i + 1:]) * itemsize for i in range(len(inner))]
        return np.lib.stride_tricks.as_strided(flat, shape=r.shape, strides=tuple(strides),
                                               writeable=self.device.writable)

    def persist_region(self, name: str) -> None:
        r = self.region(name)
        self.device.persist(r.offset, r.size)

    # -- commits ----------------------------------------------------------------------------
    def commit(self, *, batch: int, **checkpoint_fields: int) -> Root:
        """Write the next root (seq + 1) into the other slot and persist it.

        checkpoint_fields: the checkpointer's commit fields of Root (flags, ring_generation,
        ring_start, ring_start_seq, dense_slot, dense_batch); fields not given keep their current values.
        """
        self._check_open(writable=True)
        if batch < -1:
            raise ValueError(f"batch {batch} must be >= -1")
        self._write_root(dataclasses.replace(self.root, seq=self.root.seq + 1, batch=batch, **checkpoint_fields))
        return self.root

    def _write_root(self, root: Root) -> None:
        slot = root.seq % 2  # transaction n writes slot n % 2 (LMDB); the other slot stays valid
        packed = root.pack(self.superblock.uuid, slot)
        offset = self.superblock.root_offsets[slot]
        try:
            if crash_armed("commit:torn-root"):  # a crash half-way through the slot: the checksum must catch it
                self.device.copy_persist(offset, packed[: len(packed) // 2])
                crash_point("commit:torn-root")
            self.device.copy_persist(offset, packed)
        except BaseException as e:
            # the slot may be half-written: poison the handle (LMDB's MDB_PANIC); reopening picks
            # the newest valid root again
            self._failed = f"a commit failed ({e!r}); reopen the pool"
            raise
        self.root = root

    # -- closing ----------------------------------------------------------------------------
    def on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` before the pool closes (tables use it to let go of their views)."""
        self._on_close.append(callback)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, writable: bool = False) -> None:
        if self._closed:
            raise PoolError(f"{self.path}: pool is closed")
        if self._failed:
            raise PoolError(f"{self.path}: {self._failed}")
        if writable and not self.device.writable:
            raise PoolError(f"{self.path}: pool is open read-only")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for callback in reversed(self._on_close):
                callback()
        finally:
            self.device.close()
            os.close(self._fd)
            os.close(self._lock_fd)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Pool {self.path} {self.device.kind} seq={self.root.seq} regions={len(self._regions)}>"


def remove_stale(path: str) -> None:
    """Delete `path` (a pool a crashed process was building under a side name), unless another
    process holds it open, which raises PoolLockedError."""
    if not os.path.exists(path):
        return
    lock_fd = _lock(path, writable=True)  # refuses while its builder is alive
    try:
        os.unlink(path)  # under the lock: a builder that starts now creates a new file
    finally:
        os.close(lock_fd)


def publish(pool: Pool, path: str) -> None:
    """Move a pool built under a side name to `path`, durably (the directory entry is synced)."""
    try:
        os.link(pool.path, path)  # never replaces: a pool that appeared meanwhile is kept
    except FileExistsError:
        raise PoolError(f"{path}: appeared while this pool was being created") from None
    os.unlink(pool.path)
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    pool.path = path


# ---------------------------------------------------------------------------------------------
# File helpers.
# ---------------------------------------------------------------------------------------------
class _open_fd:
    """Open a pool file for validation: context manager yielding (fd, size); closes on error
    (and on exit, unless keep=True)."""

    def __init__(self, path: str, writable: bool, keep: bool = False):
        self.path, self.writable, self.keep = path, writable, keep

    def __enter__(self) -> tuple[int, int]:
        flags = os.O_RDWR if self.writable else os.O_RDONLY
        try:
            st = os.stat(self.path)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
                # opening a FIFO or socket would block or fail obscurely
                raise NotAPoolError(f"{self.path}: not a regular file or DAX device")
            self.fd = os.open(self.path, flags)
        except FileNotFoundError:
            raise PoolError(f"{self.path}: no such pool") from None
        except IsADirectoryError:
            raise NotAPoolError(f"{self.path}: is a directory, not a pool") from None
        except PermissionError:
            how = "read-write" if self.writable else "reading"
            raise PoolError(f"{self.path}: permission denied opening for {how}") from None
        except OSError as e:
            raise PoolError(f"{self.path}: cannot open: {e.strerror}") from None
        try:
            return self.fd, device_size(self.fd, self.path)
        except BaseException:
            os.close(self.fd)
            raise

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None or not self.keep:
            os.close(self.fd)


def _reader(fd: int) -> Reader:
    def read(offset: int, length: int) -> bytes:
        return os.pread(fd, length, offset)
    return read


def _lock(path: str, writable: bool) -> int:
    """Take the pool's advisory lock on a descriptor of its own; returns it (close it to unlock).

    flock belongs to an open file description. mmap dup()s the data descriptor, so a lock taken on
    that one would live on for as long as any view of the mapping does; a separate descriptor is
    released exactly when the pool is closed.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if writable else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise PoolLockedError(f"{path}: pool is in use by another process") from None
        raise DeviceError(f"{path}: cannot lock: {e.strerror}") from None
    return fd
