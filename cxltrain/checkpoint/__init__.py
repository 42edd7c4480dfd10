"""The checkpointer (docs/architecture.md §4): undo ring, dense snapshot slots, commits, recovery.

    layout.py        on-media structures (undo records, dense slot headers, region names)
    ring.py          the undo ring: append (U1), reclaim (U3), scan, restore
    dense.py         dense snapshots: what they hold, the two slots
    codec.py         the snapshot encoding (no pickle: restorable from untrusted bytes)
    seam.py          the typed seam with the tables: what a table tells its guard, what a guard needs
    guard.py         batch guards: the state machine both share, and NoCheckpoint (checkpoint "off")
    checkpointer.py  the coordinator: what happens at each batch boundary (strict and relaxed modes)
    commit.py        the commit pipeline: the steps one commit takes on the worker
    ordering.py      the protocol's orderings as a strategy (a planted bug is another strategy)
    stats.py         the checkpointer's running totals
    worker.py        where its jobs run: one background thread (the pipeline), or inline
    recovery.py      rolling a pool back to its last committed batch
"""

from .checkpointer import Checkpointer
from .guard import BatchGuard, GuardState, NoCheckpoint
from .recovery import RecoveryReport, has_checkpoint, recover, verify
from .seam import LoggedTable, TableGuard
from .stats import CheckpointStats

__all__ = ["BatchGuard", "Checkpointer", "CheckpointStats", "GuardState", "LoggedTable", "NoCheckpoint",
           "RecoveryReport", "TableGuard", "has_checkpoint", "recover", "verify"]
