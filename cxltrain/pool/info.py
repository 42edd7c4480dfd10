"""Inspection (`pool info`, `pool check`): every check of pool_check, every problem reported, never a
write. The pool is read with pread under a shared lock, never mapped.

A pool a writer holds is still inspected, without the lock, as LMDB's readers run beside its
writer: a commit writes the root slot the current root does not use, so the valid root with the
higher sequence number is always a whole commit (a slot torn mid-write fails its checksum), and the
directory entries a root counts were durable before it.
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import PoolError, PoolLockedError
from . import set_format as pool_set
from .check import (
    Reader,
    SlotStatus,
    check_regions_disjoint,
    check_set_regions,
    pick_root,
    read_region,
    read_root_slot,
    validate_superblock,
)
from .files import lock_pool, open_pool_file, pread_reader, unlock_pool
from .format import Region, Root, Superblock
from .rows import non_finite_rows


@dataclasses.dataclass
class PoolReport:
    path: str
    file_size: int
    superblock: Superblock | None = None
    slots: list[SlotStatus] = dataclasses.field(default_factory=list)
    root: Root | None = None
    regions: list[Region] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    in_use: bool = False  # a writer held the pool: this is its last committed root, read beside it
    members: list["PoolReport"] = dataclasses.field(default_factory=list)  # a pool set's capacity pools

    @property
    def ok(self) -> bool:
        return not self.problems


def inspect(path: str, member: bool = False) -> PoolReport:
    """Check a pool without mapping or changing it. Raises PoolError only when the file cannot be
    read at all; every other problem goes in the report. A pool a writer holds is read without the
    lock (`in_use` says so). A set's capacity pool is inspected through its primary (member=True);
    named alone, its report says so."""
    with open_pool_file(path, writable=False) as (fd, file_size):
        try:
            lock_fd = lock_pool(path, writable=False)
        except PoolLockedError:
            lock_fd = None
        try:
            report = _inspect(path, pread_reader(fd), file_size, member)
        finally:
            if lock_fd is not None:
                unlock_pool(lock_fd)
        report.in_use = lock_fd is None
        return report


def _inspect(path: str, read: Reader, file_size: int, member: bool) -> PoolReport:
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
    named = next((r for r in report.regions if r.name == pool_set.MEMBER_REGION), None)
    if named is not None and not member and not report.problems:
        report.problems.append(pool_set.named_instead_of_primary(read(named.offset, named.size), sb.uuid))
        return report
    slots = [next((r for r in report.regions if r.name == name), None) for name in pool_set.SET_REGIONS]
    if slots[0] is not None and not report.problems:
        _inspect_members(report, [None if r is None else read(r.offset, r.size) for r in slots])
    if not report.problems:
        _check_set_regions(report, read)
    return report


def _check_set_regions(report: PoolReport, read: Reader) -> None:
    """The plan and cache map checks of `Pool.open`, over the primary's and its members' regions."""
    regions = {r.name: (r, read) for r in report.regions}
    for member in report.members:
        member_read = _file_reader(member.path)
        regions.update((r.name, (r, member_read)) for r in member.regions if r.name not in regions)
    try:
        check_set_regions({name: r for name, (r, _) in regions.items()},
                          lambda r: regions[r.name][1](r.offset, r.size), report.superblock.uuid)
    except PoolError as e:
        report.problems.append(str(e))


def check_rows(report: PoolReport) -> None:
    """`pool check`'s scan of every table row, in the set's capacity pools too (rows.py); its
    problems go in the report. Nothing is scanned in a report with problems already."""
    if not report.ok:
        return
    for pool in (report, *report.members):
        where = "" if pool is report else f"capacity pool {pool.path}: "
        report.problems.extend(where + p for p in non_finite_rows(pool.regions, _file_reader(pool.path)))


def _file_reader(path: str) -> Reader:
    def read(offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    return read


def _inspect_members(report: PoolReport, slots: list[bytes | None]) -> None:
    """Inspect the capacity pools a primary names (its set record's `slots`: pool_set.current_record),
    and check each belongs to it, now (problems go in the primary's report, one line each)."""
    try:
        entries = pool_set.current_record(slots, report.superblock.uuid, "its list of capacity pools").entries
    except PoolError as e:
        report.problems.append(str(e))
        return
    for entry in entries:
        where = f"capacity pool {entry.path}"
        if not os.path.exists(entry.path):
            report.problems.append(pool_set.missing_member(entry.path, report.path))
            continue
        try:
            member = inspect(entry.path, member=True)
        except PoolError as e:
            report.problems.append(f"{where}: {e}")
            continue
        report.problems.extend(f"{where}: {problem}" for problem in member.problems)
        if member.superblock is None or member.root is None:
            continue  # nothing of it can be listed
        report.members.append(member)
        if member.problems:
            continue
        region = next((r for r in member.regions if r.name == pool_set.MEMBER_REGION), None)
        try:
            pool_set.check_identity(entry, member.superblock.uuid, where)
            if region is None:
                raise PoolError(f"{where}: is not a capacity pool of a pool set")
            with open(entry.path, "rb") as f:
                f.seek(region.offset)
                pool_set.check_member(f.read(region.size), entry, report.superblock.uuid, member.superblock.uuid,
                                      where)
            pool_set.check_epoch(member.root, report.root, where)
        except PoolError as e:
            report.problems.append(str(e))
