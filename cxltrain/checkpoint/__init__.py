"""The checkpointer (docs/architecture.md §4): undo ring, dense snapshot slots, commits, recovery.

    layout.py        on-media structures (undo records, dense slot headers, region names)
    ring.py          the undo ring: append (U1), reclaim (U3), scan, restore
    dense.py         dense snapshots: what they hold, the two slots
    slots.py         a dense slot's header and checksum, checked without decoding (no torch)
    codec.py         the snapshot encoding (no pickle: restorable from untrusted bytes)
    seam.py          the typed seam with the tables: what a table tells its guard, what a guard needs
    guard.py         batch guards: the state machine both share, and NoCheckpoint (checkpoint "off")
    options.py       how a checkpointer runs: mode, dense_every, pipeline, capture (one value)
    checkpointer.py  the coordinator: what happens at each batch boundary (strict and relaxed modes)
    commit.py        the commit pipeline: the steps one commit takes on the worker
    ordering.py      the protocol's orderings as a strategy (a planted bug is another strategy)
    stats.py         the checkpointer's running totals
    worker.py        where its jobs run: one background thread (the pipeline), or inline
    recovery.py      the one roll-back of every recovery: a pool back to a committed batch
    new_pool.py      the first commit of a pool whose tables were just written
    offline.py       `recover` and `pool check` on a pool path, without importing torch

The public names are imported lazily: recovery's modules (recovery, ring, slots, layout, offline)
import no torch at module level, so `cxltrain recover` and `pool check` start without it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Checkpointer": "checkpointer", "CheckpointOptions": "options",
    "BatchGuard": "guard", "GuardState": "guard", "NoCheckpoint": "guard",
    "RecoveryReport": "recovery", "has_checkpoint": "recovery", "recover": "recovery", "roll_back": "recovery",
    "verify": "recovery", "pending": "recovery", "pending_words": "recovery",
    "LoggedTable": "seam", "TableGuard": "seam",
    "CheckpointStats": "stats",
    "first_commit": "new_pool",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
