"""The pool: one file or DAX device, mapped whole, holding named regions (docs/architecture.md §2).

    pool = Pool.create("/dev/shm/ctr.pool", size=1 << 30)
    w = pool.add_region("t0.weight", RegionKind.TABLE_WEIGHTS, "float32", (1000, 64), aligned_rows=True)
    pool.array("t0.weight")[:] = 0.0                  # zero-copy numpy view, shape [1000, 64]
    pool.persist_region("t0.weight")
    pool.commit(batches_done=0)
    pool.close()

Nothing read from a pool is trusted before it is checked: `Pool.open` reads the superblock, both
root slots and the live directory entries with pread, validates all of them (pool_check.py), and
only then maps the pool. A pool that fails any check is never mapped writable, so a refused pool is
left byte-for-byte untouched. `pool_inspect.inspect()` runs the same checks and reports every
problem instead of raising on the first.

A pool is opened by one process at a time (pool_files.lock_pool); a second opener gets PoolLockedError.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from typing import Callable

import numpy as np

from ..devices import Device, open_target
from ..devices.registry import map_device
from ..errors import ConfigError, NotAPoolError, PoolError, PoolFullError
from ..faults import CrashPoint, crash_armed, crash_point, planted
from ..knobs import KNOBS
from . import format as fmt
from . import set_format as pool_set
from .check import (
    check_regions_disjoint,
    check_set_regions,
    new_superblock,
    pick_root,
    read_region,
    read_root_slot,
    validate_superblock,
)
from .files import lock_pool, open_pool_file, pread_reader, remove_stale, unlock_pool  # noqa: F401 (re-exported)
from .format import DType, Region, RegionKind, Root, Superblock


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
        self.members: list[Pool] = []  # a pool set's capacity pools, opened with it (pool_set.py)
        self._set_regions_cache: tuple[tuple, dict[str, Region]] | None = None

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, size: int | None = None, *, backend: str | None = None,
               dir_capacity: int | None = None, region_align: int | None = None, mapper=None,
               incompat: int = 0) -> "Pool":
        """Create a new pool at `path`: a new file of `size` bytes, or a DAX character device
        (all of it when size is None) that holds no cxltrain pool yet. incompat: its feature bits
        (format.INCOMPAT_*), which a build that does not know one refuses.

        The superblock is written last: a crash during creation leaves a file that is refused as
        "not a cxltrain pool", never one that looks valid and is not.
        """
        layout = (dir_capacity or KNOBS.dir_capacity, region_align or KNOBS.region_align, KNOBS.row_align)
        # a file's size is known: refuse a bad layout before the file exists (a device's, once opened)
        sb = new_superblock(size, *layout, incompat) if size is not None else None
        target = open_target(path, size)
        lock_fd = -1
        try:
            if not target.existing:  # marks the file as ours and unfinished until the superblock lands
                os.pwrite(target.fd, fmt.BUILDING_MAGIC.to_bytes(8, "little"), fmt.SUPERBLOCK_OFFSET)
            lock_fd = lock_pool(path, writable=True)
            if target.existing and int.from_bytes(os.pread(target.fd, 8, 0), "little") == fmt.MAGIC:
                raise PoolError(f"{path}: already holds a cxltrain pool")
            sb = sb or new_superblock(target.size, *layout, incompat)
            device = (mapper(path, target.fd, target.size) if mapper is not None
                      else map_device(path, target.fd, target.size, writable=True, backend=backend))
            pool = cls(path, target.fd, lock_fd, device, sb, Root(seq=0, dir_count=0, batches_done=-1), [])
            pool._write_root(Root(seq=1, dir_count=0, batches_done=-1))
            crash_point("create:before-superblock")
            # ORDERING: root durable before the superblock that makes the file a pool.
            device.copy_persist(fmt.SUPERBLOCK_OFFSET, sb.pack())
            return pool
        except BaseException:
            if not target.existing:
                os.unlink(path)  # never leave a half-made pool file behind
            os.close(target.fd)
            if lock_fd >= 0:
                unlock_pool(lock_fd)
            raise

    @classmethod
    def open(cls, path: str, *, writable: bool = True, backend: str | None = None, mapper=None,
             member: bool = False, with_members: bool = True) -> "Pool":
        """Open and validate an existing pool. Nothing is mapped until every check has passed.

        A pool set's primary opens its capacity pools too (open_members, with member=True), each
        checked before anything is written; a capacity pool named alone is refused (PoolError).
        mapper: maps a writable pool instead of the backend (capacity pools). with_members=False:
        the primary alone, its set record readable, its members' regions absent (pool/repoint.py)."""
        with open_pool_file(path, writable, keep=True) as (fd, file_size):
            lock_fd = lock_pool(path, writable)
            read = pread_reader(fd)
            try:
                sb = validate_superblock(read, file_size)
                root = pick_root([read_root_slot(read, sb, slot) for slot in (0, 1)]).root
                regions = [read_region(read, sb, i) for i in range(root.dir_count)]
                check_regions_disjoint(regions)
                named = next((r for r in regions if r.name == pool_set.MEMBER_REGION), None)
                if named is not None and not member:
                    raise PoolError(f"{path}: {pool_set.named_instead_of_primary(read(named.offset, named.size), sb.uuid)}")
                device = (mapper(path, fd, sb.pool_size) if mapper is not None and writable
                          else map_device(path, fd, sb.pool_size, writable=writable, backend=backend))
            except BaseException as e:
                unlock_pool(lock_fd)
                if isinstance(e, NotAPoolError) and stat.S_ISCHR(os.fstat(fd).st_mode):
                    raise NotAPoolError(f"{path}: not a cxltrain pool; format the device with "
                                        f"`cxltrain pool create {path}`") from None
                if isinstance(e, PoolError) and not str(e).startswith(path):
                    raise type(e)(f"{path}: {e}") from None
                raise
            pool = cls(path, fd, lock_fd, device, sb, root, regions)
        try:
            if pool_set.SET_REGION in pool._regions and with_members:
                pool.open_members()
            if with_members:
                check_set_regions(pool.regions, pool._region_bytes, sb.uuid)
        except PoolError as e:
            pool.close()
            raise type(e)(e if str(e).startswith(path) else f"{path}: {e}") from None
        except BaseException:
            pool.close()
            raise
        return pool

    def _region_bytes(self, region: Region) -> bytes:
        device = self.device_for(region)
        return device.array[region.offset : region.offset + region.size].tobytes()

    # -- regions ----------------------------------------------------------------------------
    @property
    def regions(self) -> dict[str, Region]:
        """Every region of the pool, and of its set's capacity pools (with set-wide indices)."""
        if not self.members:
            return dict(self._regions)
        return {**self._set_regions(), **self._regions}

    def region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            if self.members and name in (found := self._set_regions()):
                return found[name]
            raise PoolError(f"{self.path}: no region named {name!r}") from None

    def _set_regions(self) -> dict[str, Region]:
        # kept while the members and their region counts stay: the hot path asks for these every batch
        key = tuple((id(member), len(member._regions)) for member in self.members)
        if self._set_regions_cache is None or self._set_regions_cache[0] != key:
            self._set_regions_cache = key, {
                r.name: dataclasses.replace(r, index=pool_set.set_index(k, r.index))
                for k, member in enumerate(self.members) for r in member._regions.values()
                if r.name != pool_set.MEMBER_REGION}
        return self._set_regions_cache[1]

    def device_for(self, region: Region) -> Device:
        """The device that holds `region` (a region of this pool, or of a member of its set)."""
        member = pool_set.member_of_index(region.index)
        return self.device if member < 0 else self.members[member].device

    def drain_members(self) -> None:
        """Wait until every flush issued to the set's capacity pools has completed (fdatasync)."""
        for member in self.members:
            member.device.drain()

    def open_members(self) -> None:
        """Open the capacity pools this primary names, each checked (membership, identity, epoch)
        before anything is written; refused ones raise PoolError and leave every file as it was."""
        from ..devices.capacity import open_capacity

        for entry in self.set_record().entries:
            where = f"{self.path}: capacity pool {entry.path}"
            if not os.path.exists(entry.path):
                raise PoolError(f"{self.path}: {pool_set.missing_member(entry.path, self.path)}")
            try:
                member = Pool.open(entry.path, writable=self.device.writable, mapper=open_capacity, member=True)
            except PoolError as e:
                raise type(e)(f"{self.path}: capacity pool {e}") from None
            self.members.append(member)
            pool_set.check_identity(entry, member.superblock.uuid, where)
            if pool_set.MEMBER_REGION not in member._regions:
                raise PoolError(f"{where}: is not a capacity pool of a pool set")
            pool_set.check_member(member.array(pool_set.MEMBER_REGION).tobytes(), entry, self.superblock.uuid,
                                  member.superblock.uuid, where)
            pool_set.check_epoch(member.root, self.root, where)

    def set_record(self) -> pool_set.SetRecord:
        """The primary's current list of its members (the newer valid slot of SET_REGIONS)."""
        slots = [self._regions[name] if name in self._regions else None for name in pool_set.SET_REGIONS]
        return pool_set.current_record([None if r is None else self._region_bytes(r) for r in slots],
                                       self.superblock.uuid, self.path)

    def add_member(self, member: "Pool", path: str | None = None) -> None:
        """Make `member` (a new, empty capacity pool) part of this primary's set, durably: the
        member names the primary first, then the primary's list names the member. path: where
        the member will be found (default: where it is now)."""
        number = len(self.members)
        member.add_region(pool_set.MEMBER_REGION, RegionKind.BLOB, "uint8", (pool_set.MEMBER_BYTES,))
        member.device.copy_persist(member.region(pool_set.MEMBER_REGION).offset,
                                   pool_set.pack_member(number, self.superblock.uuid, member.superblock.uuid))
        member.device.drain()
        entries = [pool_set.MemberEntry(i, m.superblock.uuid, os.path.abspath(m.path))
                   for i, m in enumerate(self.members)]
        entries.append(pool_set.MemberEntry(number, member.superblock.uuid, os.path.abspath(path or member.path)))
        if pool_set.SET_REGION not in self._regions:
            self.add_region(pool_set.SET_REGION, RegionKind.BLOB, "uint8", (pool_set.SET_BYTES,))
        # ORDERING: the member names this primary (durable above) before the primary's list names it.
        self.device.copy_persist(self._regions[pool_set.SET_REGION].offset,
                                 pool_set.pack_set(entries, self.superblock.uuid))
        self.members.append(member)
        # the member starts at the set's epoch
        member._write_root(dataclasses.replace(member.root, seq=member.root.seq + 1,
                                               batches_done=self.root.batches_done,
                                               dense_batch=self.root.batches_done + 1))
        member.device.drain()

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
        device = self.device_for(r) if self.members else self.device
        flat = device.array[r.offset : r.offset + r.size].view(r.dtype.numpy)
        if padded:
            return flat.reshape(r.shape[0], r.row_stride // itemsize)
        inner = r.shape[1:]
        strides = [r.row_stride] + [math.prod(inner[i + 1:]) * itemsize for i in range(len(inner))]
        return np.lib.stride_tricks.as_strided(flat, shape=r.shape, strides=tuple(strides),
                                               writeable=device.writable)

    def persist_region(self, name: str) -> None:
        r = self.region(name)
        if self.members:
            self.device_for(r).persist(r.offset, r.size)
            return
        self.device.persist(r.offset, r.size)

    # -- commits ----------------------------------------------------------------------------
    def commit(self, *, batches_done: int, flags: int | None = None, ring_generation: int | None = None,
               ring_start: int | None = None, ring_start_seq: int | None = None, dense_slot: int | None = None,
               dense_batch: int | None = None) -> Root:
        """Write the next root (seq + 1) into the other slot and persist it.

        batches_done: batches whose updates the pool now holds (-1: no consistent state). The others
        are the checkpointer's commit fields of Root (docs/architecture.md §4); None keeps the current value.
        """
        self._check_open(writable=True)
        if batches_done < -1:
            raise ValueError(f"batch {batches_done} must be >= -1")
        given = {"flags": flags, "ring_generation": ring_generation, "ring_start": ring_start,
                 "ring_start_seq": ring_start_seq, "dense_slot": dense_slot, "dense_batch": dense_batch}
        kept = {name: value for name, value in given.items() if value is not None}
        for member in self.members:
            # ORDERING: a member's root moves to the new epoch after its pages are durable (the
            # caller drained them) and before the primary's root: a member is never behind its primary.
            member._write_root(dataclasses.replace(member.root, seq=member.root.seq + 1, batches_done=batches_done,
                                                   dense_batch=self.root.batches_done + 1))
        if self.members:
            crash_point(CrashPoint.COMMIT_BETWEEN_ROOTS)
        self._write_root(dataclasses.replace(self.root, seq=self.root.seq + 1, batches_done=batches_done, **kept))
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
            for member in self.members:
                member.close()
            self.device.close()
            os.close(self._fd)
            unlock_pool(self._lock_fd)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Pool {self.path} {self.device.kind} seq={self.root.seq} regions={len(self._regions)}>"


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
