"""How one checkpointer runs: every setting it takes, in one value given to it when it is built.

    CheckpointOptions(dense_every=4, mode="relaxed", fused_capture=False)

Nothing here is read from the environment: the Runtime builds these from its parameters, so two
checkpointers in one process may run with different options (a side-by-side comparison does).
"""

from __future__ import annotations

import dataclasses

from ..errors import CheckpointError
from ..modes import MODES, STRICT

# Unique rows per chunk of the fused capture: a chunk's old rows stay in cache from their capture
# to their update.
DEFAULT_UNDO_CHUNK_ROWS = 256
MAX_UNDO_CHUNK_ROWS = 1 << 20


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """dense_every: k, the dense snapshot every k batches (strict: the commit too).
    mode: "strict" (recovery exact) or "relaxed" (the dense state may lag the rows by up to k batches).
    pipeline: commits on a background worker (False: on the training thread; same durability).
    background_capture: with the pipeline, the worker takes the undo captures and the row flushes too.
    fused_capture: where the kernels and the device allow it, capture each table's undo record inside
        its update, undo_chunk_rows unique rows at a time (False: the whole record first, then the update).
    write_back_every: a pool set's capacity pages are written back and synced every this many
        batches (or sooner, when the ring fills); in between the commits make the cold rows durable
        with redo records in the fast tier's ring (docs/tiers.md). 1: at every commit, no redo records.
    See checkpointer.py's docstring for what each choice costs and what it can lose."""

    dense_every: int = 1
    mode: str = STRICT
    pipeline: bool = True
    background_capture: bool = False
    fused_capture: bool = True
    undo_chunk_rows: int = DEFAULT_UNDO_CHUNK_ROWS
    write_back_every: int = 1

    def __post_init__(self) -> None:
        if self.dense_every < 1:
            raise CheckpointError(f"dense_every must be >= 1, got {self.dense_every}")
        if self.mode not in MODES:
            raise CheckpointError(f"mode must be one of {MODES}, got {self.mode!r}")
        if type(self.undo_chunk_rows) is not int or not 1 <= self.undo_chunk_rows <= MAX_UNDO_CHUNK_ROWS:
            raise CheckpointError(f"undo_chunk_rows must be in [1, {MAX_UNDO_CHUNK_ROWS}], got {self.undo_chunk_rows!r}")
        if type(self.write_back_every) is not int or self.write_back_every < 1:
            raise CheckpointError(f"write_back_every must be an integer >= 1, got {self.write_back_every!r}")

    @property
    def captures_on_worker(self) -> bool:
        """The worker takes the captures: only where there is a worker (the pipeline)."""
        return self.pipeline and self.background_capture
