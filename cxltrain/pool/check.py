"""Validation of a pool's metadata (docs/architecture.md §2): pure functions over a reader, one distinct, one-line
error per failure. `Pool.open` runs them before it maps anything; `pool_inspect.inspect` runs the
same ones and collects every problem instead of raising on the first.

Nothing read from a pool is trusted before it is checked: the superblock (magic, version, feature
bits, checksum, bounds, in LMDB's order), both root slots, and the live directory entries.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid as uuidlib
from typing import Callable

from ..errors import ConfigError, NotAPoolError, PoolCorruptError, PoolVersionError
from . import cache_format
from . import format as fmt
from .format import SLOT_NAMES, DType, Region, RegionKind, Root, Superblock
from .plan_format import PLAN_REGION, plan_json
from .shard_format import SHARD_REGION, shard_json

Reader = Callable[[int, int], bytes]  # (offset, length) -> the bytes there


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
    if magic == fmt.BUILDING_MAGIC:
        raise NotAPoolError("not a cxltrain pool (its creation was interrupted; delete it to start over)")
    if magic != fmt.MAGIC:
        raise NotAPoolError("not a cxltrain pool (bad magic)")
    if len(raw) < fmt.SUPERBLOCK.size or file_size < fmt.DIR_OFFSET:
        raise PoolCorruptError(f"pool is truncated: {file_size} bytes is shorter than its own header")
    sb, _, sb_size, entry_size, reserved, _ = fmt.unpack_superblock(raw)
    if sb.version > fmt.FORMAT_VERSION:
        raise PoolVersionError(f"pool format v{sb.version} is newer than this cxltrain supports "
                               f"(v{fmt.FORMAT_VERSION}); upgrade cxltrain")
    if sb.version == 0:
        raise PoolCorruptError("superblock is corrupt (format version 0)")
    if sb.incompat & ~fmt.KNOWN_INCOMPAT_FEATURES:
        raise PoolVersionError(f"pool uses features this cxltrain does not know "
                               f"(incompat bits {sb.incompat:#x}); upgrade cxltrain")
    if not fmt.is_sealed(raw):
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


def new_superblock(size: int, dir_capacity: int, region_align: int, row_align: int, incompat: int = 0) -> Superblock:
    """The superblock of a new pool, held to the same bounds `open` checks (as a ConfigError)."""
    data_off = fmt.data_offset(max(dir_capacity, 1), max(region_align, 1))
    sb = Superblock(fmt.FORMAT_VERSION, incompat, 0, uuidlib.uuid4().bytes, size, time.time_ns(), fmt.ROOT_OFFSETS,
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
    root, reserved, _, pad = fmt.unpack_root(raw)
    if not fmt.is_sealed(raw, sb.uuid, slot, trailer=fmt.ROOT_TRAILER):
        return SlotStatus(slot, "corrupt", None, "checksum mismatch (torn or damaged)")
    problem = ("seq is 0" if root.seq == 0 else
               f"seq {root.seq} belongs in slot {SLOT_NAMES[root.seq % 2]}" if root.seq % 2 != slot else
               "reserved bytes are not zero" if any(reserved) or any(pad) else
               f"unknown flags {root.flags:#x}" if root.flags & ~fmt.ROOT_KNOWN_FLAGS else
               f"dir_count {root.dir_count} exceeds capacity {sb.dir_capacity}" if root.dir_count > sb.dir_capacity else
               f"batch {root.batches_done} is below -1" if root.batches_done < -1 else
               f"dense slot {root.dense_slot} is not 0, 1, 2 or 3" if root.dense_slot > 3 else
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
    name_b, kind, dtype, ndim, flags, offset, size, stride, shape4, reserved, _ = fmt.unpack_entry(raw)

    def bad(what: str) -> PoolCorruptError:
        return PoolCorruptError(f"region directory entry {index} is corrupt: {what}")

    if not fmt.is_sealed(raw, sb.uuid, index):
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


def check_set_regions(regions: dict[str, Region], read: Callable[[Region], bytes], uuid: bytes) -> None:
    """Refuse (PoolCorruptError) a pool set whose primary holds a damaged placement plan or a
    hot-row cache map naming a row outside its table or a row twice, and a rank pool whose record
    of its own shard is damaged. regions: every region of the
    set by name (primary and capacity pools); read: the bytes of one; uuid: the primary's."""
    if PLAN_REGION in regions:
        plan_json(read(regions[PLAN_REGION]), uuid, "the set")
    if SHARD_REGION in regions:  # a rank pool's (runtime/shard_record.py compares it with the manifest)
        shard_json(read(regions[SHARD_REGION]), uuid)
    for name in regions:
        table = cache_format.table_of(name)
        if table is None:
            continue
        where = f"the hot-row cache of table {table!r}"
        state = regions.get(cache_format.region_names(table)[1])
        weights = regions.get(f"{table}.weight")
        if state is None or weights is None or state.shape[1] < cache_format.MAP_COLUMNS:
            raise PoolCorruptError(f"{where}: its row map or its table's rows are missing")
        cache_format.check_map(cache_format.map_of(state, read(state)), weights.shape[0], where)
