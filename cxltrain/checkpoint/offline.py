"""`cxltrain recover` and `pool check` on a pool path, without importing torch.

Recovery is byte copying: the root, the live undo records and the dense slot's checksum are all it
reads, and restoring rows is numpy over the mapping. The dense snapshot is checked (header, batch,
checksum) but not decoded: that needs torch, and only a run that loads it into a model needs it
(the Runtime recovers in-process and decodes it there). Everything this module imports is
torch-free at module level; tests/test_offline.py keeps it so.

    report = recover_pool("/dev/shm/ctr.pool")   # RecoveryReport
    check_checkpoint("/dev/shm/ctr.pool")        # "checkpoint at batch 12, 1 undo record(s) to roll back"
"""

from __future__ import annotations

import os

from ..pool.handle import Pool
from .recovery import RecoveryReport, has_checkpoint, pending_words, recover, verify


def recover_pool(path: str) -> RecoveryReport:
    """Recover the pool at `path` in place; returns the RecoveryReport."""
    with Pool.open(path) as pool:
        report, _ = recover(pool, decode=False)
    return report


def check_checkpoint(path: str) -> str | None:
    """Recovery's checks on the pool at `path`, opened read-only (nothing written): the commit
    fields, every live undo record and the dense snapshot's slot. Returns a one-line summary, or
    None when the pool holds no committed checkpoint; raises a PoolError subclass on a problem."""
    with Pool.open(path, writable=False) as pool:
        if not has_checkpoint(pool):
            return None
        live, _ = verify(pool, decode=False)
        return f"checkpoint at batch {pool.root.batches_done}, {pending_words(live, pool.root.batches_done)}"


def process_seconds() -> float | None:
    """Wall seconds since this process started (interpreter start-up and imports included), from
    /proc (clock-tick resolution); None where /proc is not there."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


