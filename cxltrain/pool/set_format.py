"""Pool sets: one primary pool in the fast tier and capacity pools on block storage, committed as
one (docs/tiers.md). This module is the on-media part: what the primary says about its
members, what a member says about its primary, and the checks an opener runs before it trusts a
member. `Pool.open` uses it to open a whole set from the primary's path.

BLOB regions, each sealed with a CRC-32 seeded with its own pool's UUID:

  cxltrain.set     in the primary: a count and a generation, then per member its number, UUID and path
  cxltrain.set.1   in the primary: the same record's second slot, added by the first re-point
  cxltrain.member  in each member: its number and the primary's UUID

The primary's record is rewritten (a moved capacity pool re-pointed: pool/repoint.py) as a root is:
into the slot that does not hold the current record, with the next generation; the valid slot of
the highest generation is current, so a crash leaves the old record or the new one, never a torn one.

A member's root is rewritten by every commit of the set, after its pages are durable and before
the primary's root (pool.Pool.commit): batches_done = the commit's target, dense_batch = 1 + the
target the primary's root held before it (roots keep dense_batch >= 0). So a member is current when
its batches_done equals the primary's, or one commit ahead when its dense_batch - 1 does (a crash
between the two roots); any
other member is from another epoch (an old copy, a file restored from a backup) and is refused.

Set-wide region indices: a member's region i is known to the primary (undo records, recovery)
as (member + 1) << MEMBER_SHIFT | i, so one u32 names any region of the set.
"""

from __future__ import annotations

import dataclasses
import os
import struct

from ..errors import PoolError
from . import format as fmt

SET_REGION = "cxltrain.set"
SET_REGIONS = (SET_REGION, SET_REGION + ".1")  # the record's two slots
MEMBER_REGION = "cxltrain.member"
MEMBER_SHIFT = 16           # directories hold at most 65536 entries (knobs.dir_capacity)
MAX_MEMBERS = 8
PATH_BYTES = 480

SET_HEADER = struct.Struct("<IIII")      # magic, version, member count, generation (0 first)
SET_ENTRY = struct.Struct(f"<I16sH{PATH_BYTES}s")  # number, member UUID, path length, path (UTF-8)
MEMBER_BODY = struct.Struct("<III16s")   # magic, version, member number, the primary's UUID
SET_MAGIC = int.from_bytes(b"CXST", "little")
MEMBER_MAGIC = int.from_bytes(b"CXMB", "little")
VERSION = 1
SET_BYTES = SET_HEADER.size + MAX_MEMBERS * SET_ENTRY.size + fmt.CHECKSUM_FIELD.size
MEMBER_BYTES = MEMBER_BODY.size + fmt.CHECKSUM_FIELD.size


@dataclasses.dataclass(frozen=True)
class MemberEntry:
    """What the primary records about one member."""

    number: int
    uuid: bytes
    path: str


@dataclasses.dataclass(frozen=True)
class SetRecord:
    """The primary's current list of members: which slot holds it, and its generation."""

    slot: int
    generation: int
    entries: list[MemberEntry]


def pack_set(entries: list[MemberEntry], primary_uuid: bytes, generation: int = 0) -> bytes:
    if len(entries) > MAX_MEMBERS:
        raise PoolError(f"a pool set holds at most {MAX_MEMBERS} capacity pools, {len(entries)} given")
    body = SET_HEADER.pack(SET_MAGIC, VERSION, len(entries), generation)
    for entry in entries:
        path = entry.path.encode()
        if len(path) > PATH_BYTES:
            raise PoolError(f"{entry.path}: a capacity pool's path may have at most {PATH_BYTES} bytes")
        body += SET_ENTRY.pack(entry.number, entry.uuid, len(path), path)
    body += bytes(SET_BYTES - fmt.CHECKSUM_FIELD.size - len(body)) + bytes(fmt.CHECKSUM_FIELD.size)
    return fmt.seal(body, primary_uuid)


def current_record(slots: list[bytes | None], primary_uuid: bytes, where: str) -> SetRecord:
    """The record in the valid slot of the highest generation (`slots`: the bytes of each region
    of SET_REGIONS, None where the primary has none); raises PoolError when no slot is valid."""
    valid = []
    for slot, raw in enumerate(slots):
        if raw is not None and _is_valid(raw, primary_uuid):
            valid.append(SetRecord(slot, SET_HEADER.unpack_from(raw)[3], unpack_set(raw, primary_uuid, where)))
    if not valid:
        raise PoolError(f"{where}: its list of capacity pools ({SET_REGION}) is damaged")
    return max(valid, key=lambda record: record.generation)


def _is_valid(raw: bytes, primary_uuid: bytes) -> bool:
    magic, version, count, _ = SET_HEADER.unpack_from(raw)
    return magic == SET_MAGIC and version == VERSION and count <= MAX_MEMBERS and fmt.is_sealed(raw, primary_uuid)


def unpack_set(raw: bytes, primary_uuid: bytes, where: str) -> list[MemberEntry]:
    """The members one slot of the primary's set record names; raises PoolError when it is damaged."""
    if not _is_valid(raw, primary_uuid):
        raise PoolError(f"{where}: its list of capacity pools ({SET_REGION}) is damaged")
    count = SET_HEADER.unpack_from(raw)[2]
    entries = []
    for i in range(count):
        number, uuid, length, path = SET_ENTRY.unpack_from(raw, SET_HEADER.size + i * SET_ENTRY.size)
        entries.append(MemberEntry(number, uuid, path[:length].decode(errors="replace")))
    return entries


def named_instead_of_primary(raw: bytes, member_uuid: bytes) -> str:
    """What to say when a set's member (its member region `raw`) is named where the set is meant:
    a member opens only through its primary, which knows every member and commits them as one."""
    magic, version, number, primary = MEMBER_BODY.unpack_from(raw)
    which = f"capacity pool {number} of a pool set (its primary pool's UUID {primary.hex()})" \
        if magic == MEMBER_MAGIC and version == VERSION and fmt.is_sealed(raw, member_uuid) else \
        "a capacity pool of a pool set"
    return f"is {which}: name the set's primary pool instead, the --pool it was trained with"


def missing_member(path: str, primary: str) -> str:
    """What to say when the capacity pool at `path` (as the primary records it) is not there."""
    return (f"capacity pool {path} is missing; a pool set needs all its pools (moved? re-point the set: "
            f"cxltrain recover {primary} --capacity-pool NEW)")


def pack_member(number: int, primary_uuid: bytes, member_uuid: bytes) -> bytes:
    return fmt.seal(MEMBER_BODY.pack(MEMBER_MAGIC, VERSION, number, primary_uuid) + bytes(4), member_uuid)


def check_member(raw: bytes, entry: MemberEntry, primary_uuid: bytes, member_uuid: bytes, where: str) -> None:
    """Raise PoolError unless the member region `raw` says it is member `entry.number` of this primary."""
    magic, version, number, primary = MEMBER_BODY.unpack_from(raw)
    if magic != MEMBER_MAGIC or version != VERSION or not fmt.is_sealed(raw, member_uuid):
        raise PoolError(f"{where}: is not a capacity pool of a pool set (no valid {MEMBER_REGION} region)")
    if primary != primary_uuid or number != entry.number:
        raise PoolError(f"{where}: belongs to another pool set (its primary's UUID {primary.hex()} is not "
                        f"{primary_uuid.hex()}); refusing to mix it in")


def check_identity(entry: MemberEntry, member_uuid: bytes, where: str) -> None:
    if member_uuid != entry.uuid:
        raise PoolError(f"{where}: is not the capacity pool this set was made with (UUID {member_uuid.hex()}, "
                        f"the set names {entry.uuid.hex()}): swapped or replaced; refusing to mix it in")


def check_epoch(member_root: fmt.Root, primary_root: fmt.Root, where: str) -> None:
    """A member is current (same target) or one commit ahead (crash between the roots); else refused."""
    target = primary_root.batches_done
    if member_root.batches_done == target or member_root.dense_batch - 1 == target:
        return
    raise PoolError(f"{where}: is from another epoch (committed at batch {member_root.batches_done}, the set's "
                    f"primary at batch {target}): an old or newer copy; refusing to mix it in")


def member_path(entry: MemberEntry) -> str:
    return entry.path


def set_index(member: int, index: int) -> int:
    """The set-wide index of region `index` of member `member` (0-based)."""
    return (member + 1) << MEMBER_SHIFT | index


def member_of_index(index: int) -> int:
    """-1 for a primary region, else the member (0-based) a set-wide index points into."""
    return (index >> MEMBER_SHIFT) - 1


def describe(entries: list[MemberEntry]) -> list[dict]:
    return [{"number": e.number, "uuid": e.uuid.hex(), "path": e.path, "exists": os.path.exists(e.path)}
            for e in entries]
