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

from .errors import PoolError, PoolLockedError
from .pool_check import (
    Reader,
    SlotStatus,
    check_regions_disjoint,
    pick_root,
    read_region,
    read_root_slot,
    validate_superblock,
)
from .pool_files import lock_pool, open_pool_file, pread_reader
from .pool_format import Region, Root, Superblock


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

    @property
    def ok(self) -> bool:
        return not self.problems


def inspect(path: str) -> PoolReport:
    """Check a pool without mapping or changing it. Raises PoolError only when the file cannot be
    read at all; every other problem goes in the report. A pool a writer holds is read without the
    lock (`in_use` says so)."""
    with open_pool_file(path, writable=False) as (fd, file_size):
        try:
            lock_fd = lock_pool(path, writable=False)
        except PoolLockedError:
            lock_fd = None
        try:
            report = _inspect(path, pread_reader(fd), file_size)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        report.in_use = lock_fd is None
        return report


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
