"""The seam between the tables and the checkpointer, typed both ways (structural: neither side
imports the other's classes).

What a table tells its guard (TableGuard), per lookup with gradients — shapes: N lookups, U rows:

    batch = guard.capture(table, indices)     forward: indices [N] int64 will be updated in backward
    batch = guard.capture(table, indices, cache)  ... where a hot-row cache (CachedSlots) maps a row,
                                              in its slot instead of the table row
    guard.before_update(table, batch, fusable) backward, before the table's first in-place store
    <the table's fused update, in place>      stores into its unique rows [U]
    guard.after_update(table, batch, rows)    backward, right after: rows [U] int64, sorted
    guard.fail_batch(table)                   instead, when the update raised: nothing commits after
    guard.log_before_write(table, rows)       before a store outside the update (cache admission,
                                              max_norm's renorm in forward); then after_update

What the checkpointer needs of a table (LoggedTable): its name, the pool regions of its weights
and optimizer state, how many state columns its optimizer keeps, and its storage to gather from.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Protocol

import torch


class LoggedTable(Protocol):
    """A table whose in-place updates a guard keeps inside batches and a checkpointer undo-logs
    (cxltrain.tables.bag.PersistentEmbeddingBag)."""

    name: str
    checkpointer: TableGuard | None   # the guard it reports to; set by the guard, None when detached

    @property
    def weight_region(self) -> str: ...

    @property
    def state_region(self) -> str: ...

    @property
    def optimizer(self) -> _StatefulOptimizer: ...

    def storage(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows [R, P] padded, optimizer state [R, K] or None): zero-copy views of the pool."""
        ...

    def persist(self) -> None:
        """Make every row and the optimizer state durable (whole regions)."""
        ...


class CachedSlots(Protocol):
    """A table's hot-row cache as its guard sees it (cxltrain.tables.cache.HotRowCache): its slots,
    a logged table of their own, and the row map."""

    slots: LoggedTable
    slot_of: torch.Tensor  # int32 [R]: each table row's slot, -1 where the table row is its own copy


class _StatefulOptimizer(Protocol):
    @property
    def state_columns(self) -> int: ...


class TableGuard(Protocol):
    """What a table calls at its lookups and updates (see the module docstring)."""

    def capture(self, table: LoggedTable, indices: torch.Tensor, cache: CachedSlots | None = None) -> int:
        """A lookup with gradients of rows `indices` [N]; returns the batch, handed back below.
        cache: the table's hot-row cache: the update stores a row it maps into its slot."""
        ...

    def before_update(self, table: LoggedTable, batch: int | None, fusable: bool = False):
        """Returns once the table may store into the rows it looked up in `batch` (U1); or, when
        fusable (the update is the fused kernel over those lookups), the undo records that kernel is
        to write itself, each durable before its rows are stored (kernels/ops.UndoChunks; None: none)."""
        ...

    def after_update(self, table: LoggedTable, batch: int | None, rows: torch.Tensor) -> None:
        """The table has stored into `rows` [U] (sorted, unique)."""
        ...

    def fail_batch(self, table: LoggedTable) -> None:
        """The table's update raised after before_update: the batch must never commit."""
        ...

    def log_before_write(self, table: LoggedTable, rows: torch.Tensor) -> int:
        """Rows [U] are about to be stored into outside the table's update (a cache admission, a
        max_norm renorm): returns the batch once they may be (U1); report the stores with after_update."""
        ...

    @property
    def in_flight(self) -> int | None:
        """The batch begun and not yet ended, if any: outside one, nothing may store into the rows."""
        ...


_scope = threading.local()


@contextlib.contextmanager
def dense_only() -> Iterator[None]:
    """Within it, on this thread, a model's state_dict()/load_state_dict() leave the tables out: the
    dense snapshot is the state the tables do not hold (their rows are logged row by row instead)."""
    before = getattr(_scope, "dense_only", False)
    _scope.dense_only = True
    try:
        yield
    finally:
        _scope.dense_only = before


def in_dense_only() -> bool:
    return getattr(_scope, "dense_only", False)
