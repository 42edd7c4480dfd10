"""The checkpointer (DESIGN §4): undo ring, dense snapshot slots, commits, recovery.

    layout.py        on-media structures (undo records, dense slot headers, region names)
    ring.py          the undo ring: append (U1), reclaim (U3), scan, restore
    dense.py         dense snapshots: what they hold, the two slots
    codec.py         the snapshot encoding (no pickle: restorable from untrusted bytes)
    checkpointer.py  the per-batch protocol (strict and relaxed modes), driven by the Runtime
    worker.py        where its jobs run: one background thread (the pipeline), or inline
    recovery.py      rolling a pool back to its last committed batch
"""

from .checkpointer import MODES, BatchGuard, Checkpointer, CheckpointStats
from .recovery import RecoveryReport, has_checkpoint, recover, verify

__all__ = ["MODES", "BatchGuard", "Checkpointer", "CheckpointStats", "RecoveryReport", "has_checkpoint", "recover",
           "verify"]
