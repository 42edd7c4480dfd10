"""Batch guards: what keeps the tables' in-place updates inside batches, with or without a
checkpointer. The Runtime holds one of two, with the same interface:

    Checkpointer (checkpointer.py)  every batch durable (docs/architecture.md §4)
    NoCheckpoint                    checkpoint="off": the null object — no undo log, no per-batch
                                    commit; the pool is made consistent only by finish()

A guard's state (GuardState) is checked at every transition, as PMDK checks an operation's:

    IDLE --begin_batch--> IN_BATCH --end_batch / abort_batch--> IDLE
    IN_BATCH --fail_batch--> FAILED  (a table's update raised: the batch is never committed)
    any  --detach-------> DETACHED  (the tables are let go; nothing else is allowed after)
"""

from __future__ import annotations

import abc
import enum

import torch

from ..errors import CheckpointError
from ..pool.handle import Pool
from . import dense
from .new_pool import first_commit
from .seam import CachedSlots, LoggedTable
from .stats import CheckpointStats


class GuardState(enum.Enum):
    IDLE = "between batches"
    IN_BATCH = "in a batch"
    FAILED = "stopped by a failed update (the pool recovers its last commit when opened again)"
    DETACHED = "detached from its tables"


class BatchGuard(abc.ABC):
    """Keeps in-place table updates inside batches: a table looked up with gradients outside a
    batch, or updated in a batch other than the one that looked it up, is refused before any store.
    Attaches itself to `tables` (their `checkpointer`) until detach()."""

    stats: CheckpointStats | None = None  # the checkpointer's totals; None without one
    agreed: int | None = None             # a group's last agreed recovery point G; None in one process

    def __init__(self, pool: Pool, tables: list[LoggedTable]) -> None:
        self.pool, self.tables = pool, tables
        self.state = GuardState.IDLE
        self._batch: int | None = None   # the batch in flight (set exactly while IN_BATCH)
        self._next = pool.root.batches_done  # the batch expected next
        self.touched = False             # the batch in flight has looked up a table with gradients
        for table in tables:
            table.checkpointer = self

    def _move(self, expected: GuardState, to: GuardState, action: str) -> None:
        """The transition `action` from `expected` to `to`; any other state is a caller's bug."""
        if self.state is not expected:
            raise CheckpointError(f"cannot {action}: the checkpoint guard is {self.state.value}, "
                                  f"not {expected.value}")
        self.state = to

    @property
    def in_flight(self) -> int | None:
        """The batch begun and not yet ended, if any."""
        return self._batch

    @property
    def next_batch(self) -> int:
        """The batch that begins next: batches done so far."""
        return self._next

    @property
    def durable(self) -> int:
        """The batch count the durable root names: what this process offers when a group agrees on
        G. Without an undo log nothing is durable before finish(), so the batch it is at: it never
        holds the group's G back."""
        return self._batch if self._batch is not None else self._next

    def agree(self, target: int) -> None:
        """G, agreed by every rank of a group: commits handed over from now on keep the undo records
        of batches >= G (U3b); a guard without an undo log keeps none."""
        self.agreed = target

    def begin_batch(self, batch: int) -> None:
        if self.state is GuardState.IDLE and batch != self._next:
            raise CheckpointError(f"batch {batch} out of order: the next batch is {self._next}")
        self._move(GuardState.IDLE, GuardState.IN_BATCH, f"begin batch {batch}")
        self._batch = batch
        self.touched = False

    def abort_batch(self) -> None:
        """The batch in flight did nothing (no table looked up with gradients): forget it."""
        if self.touched:
            raise CheckpointError(f"batch {self._batch} has already changed the tables")
        self._move(GuardState.IN_BATCH, GuardState.IDLE, "abort a batch")
        self._batch = None

    def end_batch(self, batch: int) -> None:
        if self.state is GuardState.IN_BATCH and batch != self._batch:
            raise CheckpointError(f"end of batch {batch}, but batch {self._batch} is in flight")
        self._move(GuardState.IN_BATCH, GuardState.IDLE, f"end batch {batch}")
        self._batch = None
        self._next = batch + 1

    def fail_batch(self, table: LoggedTable) -> None:
        """`table`'s update raised in the batch in flight: it may have stored some rows, or marked
        rows as recorded whose records were never written, so neither this batch nor any later one
        may commit (the next open recovers the last commit). Every transition but detach is
        refused from here, even when the caller catches the error and goes on."""
        self.state = GuardState.FAILED

    def detach(self) -> None:
        """Let go of the tables; a guard already detached stays so."""
        self.state = GuardState.DETACHED
        for table in self.tables:
            table.checkpointer = None

    def _check_finish(self, done: int) -> None:
        if self.state is not GuardState.IDLE or done != self._next:
            raise CheckpointError(f"cannot commit at batch {done}: the pool is at batch {self._next}"
                                  + (f", batch {self._batch} in flight" if self._batch is not None else "")
                                  + (", the guard is detached" if self.state is GuardState.DETACHED else ""))

    # -- what a table calls (seam.TableGuard) ---------------------------------------------------
    def _check_in_batch(self, table: LoggedTable) -> int:
        if self._batch is None:
            raise CheckpointError(f"table {table.name!r} was looked up with gradients outside a batch of "
                                  "rt.batches(): its update could not be undone after a crash "
                                  "(use torch.no_grad() for evaluation)")
        self.touched = True
        return self._batch

    @abc.abstractmethod
    def capture(self, table: LoggedTable, indices: torch.Tensor, cache: CachedSlots | None = None) -> int:
        """A lookup with gradients of `indices` [N], the rows `cache` maps stored in its slots
        (None: no cache); returns the batch (seam.TableGuard)."""

    def before_update(self, table: LoggedTable, batch: int | None, fusable: bool = False) -> None:
        """Called by a table's backward before it stores into its rows; `batch` is what capture returned.
        Returns the undo records a fusable update is to write (None here: no undo log)."""
        if batch != self._batch:
            raise CheckpointError(f"table {table.name!r}: backward of a lookup made in batch {batch} ran in "
                                  + (f"batch {self._batch}" if self._batch is not None else "no batch")
                                  + ": call backward inside the batch that did the forward")

    def after_update(self, table: LoggedTable, batch: int | None, rows: torch.Tensor) -> None:
        """Called by a table's backward after it stored into `rows` [U]; nothing to do here."""

    def log_before_write(self, table: LoggedTable, rows: torch.Tensor) -> int:
        """Rows `rows` [U] of `table` are about to be stored into outside its fused update (the
        hot-row cache's admission): returns the batch once they may be (their undo record durable,
        U1). Report the stores with after_update, as an update's."""
        batch = self.capture(table, rows)
        self.before_update(table, batch)
        return batch

    # -- what the Runtime calls at the end ------------------------------------------------------
    @abc.abstractmethod
    def finish(self, done: int) -> None:
        """The run ends at `done` batches: make everything durable and committed there."""

    def wait_durable(self) -> float:
        """Wait for the commit in flight, if any; returns the seconds waited."""
        return 0.0

    def wait_idle(self) -> float:
        """wait_durable, then whatever else runs beside the training thread; returns the seconds."""
        return self.wait_durable()


class NoCheckpoint(BatchGuard):
    """checkpoint="off": the guard alone. The first in-place change makes the pool's root stop
    vouching for the tables (batch -1), so a crash before finish() means starting over."""

    def __init__(self, pool: Pool, tables: list[LoggedTable], state: dense.DenseState) -> None:
        super().__init__(pool, tables)
        self.dense_state = state

    def capture(self, table: LoggedTable, indices: torch.Tensor, cache: CachedSlots | None = None) -> int:
        batch = self._check_in_batch(table)
        if self.pool.root.batches_done != -1:
            # ORDERING: nothing can roll the tables back once they change in place: the root stops
            # vouching for them first
            self.pool.commit(batches_done=-1, dense_slot=0)
        return batch

    def finish(self, done: int) -> None:
        """Every table region and a dense snapshot durable, then a root naming `done`."""
        self._check_finish(done)
        pool = self.pool
        if pool.root.batches_done == done:
            return
        for table in self.tables:
            table.persist()
        first_commit(pool, done, self.dense_state.capture(done))
