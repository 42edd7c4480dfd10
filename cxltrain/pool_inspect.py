"""Inspection (`pool info`, `pool check`): every check of pool_check, every problem reported, never a
write. The pool is read with pread under a shared lock, never mapped.
"""

from __future__ import annotations

import dataclasses
import os

from .errors import PoolError
from .pool_check import (Reader, SlotStatus, check_regions_disjoint, pick_root, read_region, read_root_slot,
                         validate_superblock)
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

    @property
    def ok(self) -> bool:
        return not self.problems


def inspect(path: str) -> PoolReport:
    """Check a pool without mapping or changing it. Raises PoolError only when the file cannot be
    read at all or a writer holds it (PoolLockedError); every other problem goes in the report."""
    with open_pool_file(path, writable=False) as (fd, file_size):
        lock_fd = lock_pool(path, writable=False)
        try:
            return _inspect(path, pread_reader(fd), file_size)
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
