"""Capture once per commit window: which rows of each table already have an undo record since the
last commit was handed over.

Recovery restores the live records newest first, so when several batches of one window touched a
row, the oldest record's value wins and the later ones are overwritten: only the row's value at its
first touch in the window is ever restored. A record is needed from the window's first batch on
(every batch of the window is >= the target of the commit that opened it) until a commit past the
window is durable, which also opens the next window: so a row needs one record per window, made
before its first in-place store of the window (U1, U4 as for any record), and none after.

A window is named by the batch count its opening commit names (Checkpointer.committed); a capture
of another window clears the marks. Shapes: U rows of one capture, R rows in the table.
"""

from __future__ import annotations

import numpy as np


class WindowCaptures:
    """The rows captured in the current window, per table (one bool mark per table row)."""

    def __init__(self) -> None:
        self._window: int | None = None
        self._marks: dict[str, np.ndarray] = {}      # table -> bool [R]: captured in this window
        self._marked: dict[str, list[np.ndarray]] = {}  # table -> the rows marked, to clear them cheaply

    def first_touches(self, window: int, table: str, rows: np.ndarray, table_rows: int) -> np.ndarray:
        """Of `rows` [U] int64 (sorted, unique), those not captured yet in `window`, in order; they
        count as captured from now on (the caller records them before any in-place store)."""
        if window != self._window:
            self._clear()
            self._window = window
        marks = self._marks.get(table)
        if marks is None or marks.size != table_rows:
            marks = self._marks[table] = np.zeros(table_rows, dtype=bool)
            self._marked[table] = []
        fresh = rows[~marks[rows]]
        marks[fresh] = True
        self._marked[table].append(fresh)
        return fresh

    def _clear(self) -> None:
        for table, marks in self._marks.items():
            for rows in self._marked[table]:
                marks[rows] = False
            self._marked[table] = []
