"""What every data source shares: integer hashing, argument checks, batch-index arithmetic."""

from __future__ import annotations

import itertools
import numbers
from typing import Iterator, Sequence

import numpy as np

from ..errors import ConfigError

MAX_ROWS = 2**32         # keeps a·k + c below 2^64 in the uint64 bijection of the synthetic ids
MAX_SEED = 2**64

_M64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function, a uint64 bijection with full avalanche. [N] → [N] uint64."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_key(*parts: int) -> int:
    """Hash a few non-negative integers (< 2^64) into one 64-bit key, order-sensitive."""
    h = np.zeros(1, dtype=np.uint64)
    for part in parts:
        h = splitmix64(h ^ np.uint64(part & _M64))
    return int(h[0])


# ---------------------------------------------------------------------------------------------
# Argument checks (also used by the Criteo reader)


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """`value` as an int in [low, high), or a ConfigError saying what was wrong."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"between {low} and {high - 1}"
        raise ConfigError(f"{name} must be {bound}, got {value}")
    return value


def table_rows(rows: int | Sequence[int], num_tables: int) -> tuple[int, ...]:
    """Rows per table: one int for all tables, or one per table. → F-tuple of ints."""
    if isinstance(rows, numbers.Integral) and not isinstance(rows, bool):
        return (check_int("rows", rows, 1, MAX_ROWS + 1),) * num_tables
    if not isinstance(rows, (Sequence, np.ndarray)) or isinstance(rows, str):
        raise ConfigError(f"rows must be an integer or a sequence of integers, got {rows!r}")
    if len(rows) != num_tables:
        raise ConfigError(f"rows has {len(rows)} entries but there are {num_tables} tables")
    return tuple(check_int(f"rows[{t}]", r, 1, MAX_ROWS + 1) for t, r in enumerate(rows))


def check_index(b: object, num_batches: int | None) -> int:
    """A batch index in [0, num_batches); IndexError otherwise (a caller's bug, not a setting)."""
    if isinstance(b, bool) or not isinstance(b, numbers.Integral):
        raise TypeError(f"batch index must be an integer, got {b!r}")
    b = int(b)
    if b < 0 or b >= 2**63 or (num_batches is not None and b >= num_batches):
        raise IndexError(f"batch {b} is out of range: the source has {num_batches} batches")
    return b


def batch_indices(start: int, stop: int | None, num_batches: int | None) -> Iterator[int]:
    """The batch numbers start, start+1, ... up to stop, clipped to the source's length."""
    start = check_index(start, None)
    if stop is None:
        stop = num_batches
    elif num_batches is not None:
        stop = min(stop, num_batches)
    return itertools.count(start) if stop is None else iter(range(start, stop))
