"""Re-pointing a pool set at a capacity pool that was moved (docs/tiers.md, "Moving a capacity pool").

    said = repoint("/dev/shm/ctr.pool", "/data/ctr.cap")   # after `mv /var/tmp/ctr.cap /data/ctr.cap`
    # "re-pointed pool set /dev/shm/ctr.pool: capacity pool /var/tmp/ctr.cap -> /data/ctr.cap (uuid ...)"

The file at the new place must be the member the primary records (its UUID), belong to this
primary and be at its epoch, all checked before anything is written; the primary's set record is
then rewritten into its other slot with the next generation (set_format.current_record), so a
crash leaves the old path or the new one, never a torn record.
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import PoolError, PoolFullError
from ..faults import CrashPoint, crash_armed, crash_point
from . import set_format as pool_set
from .check import validate_superblock
from .files import open_pool_file, pread_reader
from .format import RegionKind
from .handle import Pool


def recorded_paths(primary_path: str) -> list[str]:
    """The capacity pools' paths the primary records ([] for a single pool), read without opening them."""
    with Pool.open(primary_path, writable=False, with_members=False) as primary:
        if pool_set.SET_REGION not in primary.regions:
            return []
        return [entry.path for entry in primary.set_record().entries]


def repoint(primary_path: str, new_path: str) -> str | None:
    """Make the set of `primary_path` find its capacity pool at `new_path`, durably; returns the one
    line that says so, or None when there is nothing to do (a single pool, the path already
    recorded, or nothing at `new_path`: the open that follows says what is wrong then).
    Raises PoolError, having written nothing, when the file at `new_path` is not the member the set
    records, or not at the set's epoch."""
    new_path = os.path.abspath(new_path)
    if not os.path.exists(new_path):
        return None
    with Pool.open(primary_path, with_members=False) as primary:
        if pool_set.SET_REGION not in primary.regions:
            return None
        record = primary.set_record()
        if any(entry.path == new_path for entry in record.entries):
            return None
        uuid = _pool_uuid(new_path, primary_path, record)
        entry = next((e for e in record.entries if e.uuid == uuid), None)
        if entry is None:
            raise PoolError(f"{new_path} is not the capacity pool of set {primary_path} "
                            f"(uuid {uuid.hex()}, expected {_expected(record)})")
        _check_member(primary, entry, new_path)
        entries = [dataclasses.replace(e, path=new_path) if e is entry else e for e in record.entries]
        _write_record(primary, record, entries)
    return (f"re-pointed pool set {primary_path}: capacity pool {entry.path} -> {new_path} "
            f"(uuid {uuid.hex()})")


def _expected(record: pool_set.SetRecord) -> str:
    return " or ".join(entry.uuid.hex() for entry in record.entries)


def _pool_uuid(path: str, primary_path: str, record: pool_set.SetRecord) -> bytes:
    """The UUID in the superblock of the pool at `path`; PoolError when it is no valid pool."""
    try:
        with open_pool_file(path, writable=False) as (fd, size):
            return validate_superblock(pread_reader(fd), size).uuid
    except PoolError as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise PoolError(f"{path} is not the capacity pool of set {primary_path} ({reason}; "
                        f"expected uuid {_expected(record)})") from None


def _check_member(primary: Pool, entry: pool_set.MemberEntry, path: str) -> None:
    """The pool at `path` names this primary and is at its epoch (Pool.open_members' checks)."""
    where = f"{primary.path}: capacity pool {path}"
    try:
        member = Pool.open(path, writable=False, member=True)
    except PoolError as e:
        raise type(e)(f"{primary.path}: capacity pool {e}") from None
    with member:
        if pool_set.MEMBER_REGION not in member.regions:
            raise PoolError(f"{where}: is not a capacity pool of a pool set")
        pool_set.check_member(member.array(pool_set.MEMBER_REGION).tobytes(), entry, primary.superblock.uuid,
                              member.superblock.uuid, where)
        pool_set.check_epoch(member.root, primary.root, where)


def _write_record(primary: Pool, record: pool_set.SetRecord, entries: list[pool_set.MemberEntry]) -> None:
    """Write `entries` as the set's next record, into the slot that does not hold `record`."""
    name = pool_set.SET_REGIONS[1 - record.slot]
    if name not in primary.regions:  # the first re-point: the second slot is added (one root commit)
        try:
            primary.add_region(name, RegionKind.BLOB, "uint8", (pool_set.SET_BYTES,))
        except PoolFullError as e:  # a set made before the slot had room saved for it; refused before writing
            raise PoolFullError(f"{e}: no room for a second copy of its list of capacity pools, which a "
                                "re-point writes; move the capacity pool back") from None
    offset = primary.region(name).offset
    packed = pool_set.pack_set(entries, primary.superblock.uuid, record.generation + 1)
    if crash_armed(CrashPoint.REPOINT_TORN_RECORD):  # a crash half-way: the slot's checksum must catch it
        primary.device.copy_persist(offset, packed[: len(packed) // 2])
        crash_point(CrashPoint.REPOINT_TORN_RECORD)
    # ORDERING: the new record becomes current only once it is durable and sealed whole: until then
    # the other slot's (older generation) stays the one every opener reads.
    primary.device.copy_persist(offset, packed)
    crash_point(CrashPoint.REPOINT_AFTER_RECORD)
