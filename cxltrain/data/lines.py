"""Criteo lines → columns: the native parser (kernels/criteo.c) with the Python parser behind it.

Per line: label 0 or 1; dense = log1p(max(I, 0)) with missing = 0, float32 [13]; categorical C_t,
a hex hash of at most 16 digits, becomes row splitmix64(C_t xor key(seed, t)) mod rows_t of table
t (missing → row 0); only C1..CT are read (T = num_tables). A parser made with rows=None keeps
the hashes themselves (missing = 0) and which fields were present: what `data convert` stores.

`parse_bytes` runs the C parser over a block of lines; the first line it does not accept goes to
the Python parser alone (`parse_text`), which either reads it (forms only Python accepts, such as
a count written "2.6e2") or raises the one-line ConfigError naming file and line. Both give the
same values bit for bit (the C side hands back float64 counts; log1p is numpy's on both paths).
Without the extension, whole blocks go to the Python parser.

Shapes: n = lines parsed, T = num_tables; Columns = dense [n, 13] float32, ids [n, T] int64 (with
rows=None: hashes [n, T] uint64 and present [n, T] bool), labels [n] float32.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ConfigError
from .common import hash_key, splitmix64

try:
    from ..kernels import _criteo as _native
except ImportError:  # not built: the Python parser does all the work (slower, same results)
    _native = None

NUM_DENSE = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
_HEX = re.compile(r"[0-9a-fA-F]*")
_LABELS = {"0": 0.0, "1": 1.0, "0.0": 0.0, "1.0": 1.0}


def native_built() -> bool:
    """Whether the C parser (cxltrain.kernels._criteo) was built."""
    return _native is not None


@dataclasses.dataclass(frozen=True)
class Columns:
    dense: np.ndarray    # [n, 13] float32
    ids: np.ndarray      # [n, T] int64 row ids; a rows=None parser's: uint64 hashes, missing = 0
    labels: np.ndarray   # [n] float32
    present: np.ndarray | None = None   # [n, T] bool, a rows=None parser's only: the field had a value

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class LineParser:
    """Parses lines of one file's layout. `path` names the file in errors; `sep` is "\\t" or ",";
    `rows` None keeps the categorical hashes rather than row ids (`seed` then plays no part)."""

    def __init__(self, path: str | Path, sep: str, num_tables: int, rows: Sequence[int] | None, seed: int,
                 native: bool = True) -> None:
        self.path, self.sep, self.num_tables = path, sep, num_tables
        self.rows = None if rows is None else np.array(rows, dtype=np.uint64)
        self.keys = table_keys(seed, num_tables)
        self.native = native and _native is not None

    def fail(self, line_no: int, what: str) -> ConfigError:
        return line_error(self.path, line_no, what)

    def decode(self, raw: bytes, first_line_no: int) -> str:
        return decode_lines(self.path, raw, first_line_no)

    # -- bytes ---------------------------------------------------------------------------------------

    def parse_bytes(self, raw: bytes, first_line_no: int, count: int, start: int = 0) -> tuple[Columns, int]:
        """Up to `count` lines of `raw` from byte `start` (whole lines; a final one without newline
        counts; the first is line `first_line_no`) → their columns and the byte offset after the
        last line read."""
        if not self.native:
            return self._parse_bytes_python(raw, first_line_no, count, start)
        t, hashes = self.num_tables, self.rows is None
        dense = np.empty((count, NUM_DENSE), dtype=np.float64)
        ids = np.empty((count, t), dtype=np.uint64 if hashes else np.int64)
        labels = np.empty(count, dtype=np.float32)
        present = np.empty((count, t), dtype=np.bool_) if hashes else None   # C writes bytes 0/1
        rows_at = 0 if hashes else self.rows.ctypes.data      # 0 tells C to keep the hashes
        done, pos, size = 0, start, len(raw)
        by_python: list[tuple[int, np.ndarray]] = []   # (line, its dense row) read by the Python parser
        while done < count and pos < size:
            n, pos, status = _native.parse_lines(
                raw, pos, self.sep, t, self.keys.ctypes.data, rows_at, count - done,
                dense[done:].ctypes.data, ids[done:].ctypes.data, labels[done:].ctypes.data,
                present[done:].ctypes.data if hashes else 0)
            done += n
            if status:  # the C parser does not accept this line: Python reads it or says why not
                stop = raw.find(b"\n", pos)
                stop = size if stop < 0 else stop
                line_no = first_line_no + done
                one = self.parse_text([self._strip(self.decode(raw[pos:stop], line_no))], line_no)
                by_python.append((done, one.dense[0]))
                ids[done], labels[done] = one.ids[0], one.labels[0]
                if hashes:
                    present[done] = one.present[0]
                done += 1
                pos = stop + 1
        out = counts_to_dense(dense[:done])
        for i, row in by_python:
            out[i] = row
        return Columns(out, ids[:done], labels[:done], None if present is None else present[:done]), min(pos, size)

    def _parse_bytes_python(self, raw: bytes, first_line_no: int, count: int, start: int) -> tuple[Columns, int]:
        pos, lines = start, []
        while len(lines) < count and pos < len(raw):
            stop = raw.find(b"\n", pos)
            stop = len(raw) if stop < 0 else stop
            lines.append(raw[pos:stop])
            pos = stop + 1
        text = self.decode(b"\n".join(lines), first_line_no).split("\n") if lines else []
        return self.parse_text([self._strip(line) for line in text], first_line_no), min(pos, len(raw))

    @staticmethod
    def _strip(line: str) -> str:
        return line[:-1] if line.endswith("\r") else line

    # -- text ----------------------------------------------------------------------------------------

    def parse_text(self, lines: list[str], first_line_no: int) -> Columns:
        """Lines [n] of text (no line endings) → columns; ConfigError naming a malformed line.

        Checked in order: field counts, labels, I1..I13, C1..CT, each reporting its earliest line.
        """
        sep = self.sep
        fields = [line.split(sep) for line in lines]
        for i, row in enumerate(fields):
            if row == [""]:
                raise self.fail(first_line_no + i, "empty line")
            if len(row) != NUM_FIELDS:
                kind = "tab" if sep == "\t" else "comma"
                raise self.fail(first_line_no + i, f"{len(row)} {kind}-separated fields, expected {NUM_FIELDS}")
        if not fields:
            empty = np.empty((0, self.num_tables), np.int64 if self.rows is not None else np.uint64)
            present = None if self.rows is not None else np.empty((0, self.num_tables), np.bool_)
            return Columns(np.empty((0, NUM_DENSE), np.float32), empty, np.empty(0, np.float32), present)
        columns = list(zip(*fields))           # 40 tuples of n strings
        labels = self._labels(columns[0], first_line_no)
        dense = self._dense(columns[1 : 1 + NUM_DENSE], first_line_no)
        hashes, present = self._hashes(columns[1 + NUM_DENSE : 1 + NUM_DENSE + self.num_tables], first_line_no)
        if self.rows is None:
            return Columns(dense, hashes, labels, present)
        return Columns(dense, hashed_rows(hashes, present, self.keys, self.rows), labels)

    def _labels(self, column: tuple[str, ...], first_line_no: int) -> np.ndarray:
        """[n] label strings → [n] float32 0.0/1.0."""
        try:
            return np.array([_LABELS[v] for v in column], dtype=np.float32)
        except KeyError:
            i = next(i for i, v in enumerate(column) if v not in _LABELS)
            raise self.fail(first_line_no + i, f"label is {column[i]!r}, expected 0 or 1") from None

    def _dense(self, columns: list[tuple[str, ...]], first_line_no: int) -> np.ndarray:
        """13 columns of [n] integer strings → [n, 13] float32 log1p(max(x, 0)), missing = 0."""
        try:
            # float64 holds every Criteo count exactly and also reads the CSV's "260.0"; Python's
            # float() is faster here than numpy's string conversion.
            values = np.array([[float(v) if v else 0.0 for v in column] for column in columns]).T
        except ValueError:  # some field is not a number; NaN marks it for the check below
            values = np.array([[_float_or_nan(v) if v else 0.0 for v in c] for c in columns]).T
        good = np.isfinite(values) & (values == np.floor(values))
        if not good.all():
            i, j = (int(k) for k in np.argwhere(~good)[0])
            raise self.fail(first_line_no + i, f"I{j + 1} is {columns[j][i]!r}, not an integer")
        return counts_to_dense(values)

    def _hashes(self, columns: list[tuple[str, ...]], first_line_no: int) -> tuple[np.ndarray, np.ndarray]:
        """T columns of [n] hex strings → hashes [n, T] uint64 (missing = 0), present [n, T] bool."""
        size = len(columns[0])
        flat = [v for column in columns for v in column]   # value k is line k % n of C(k // n + 1)
        lengths = np.fromiter(map(len, flat), dtype=np.int64, count=len(flat))
        if not _HEX.fullmatch("".join(flat)) or lengths.max() > 16:
            bad = [k for k, v in enumerate(flat) if not (_HEX.fullmatch(v) and len(v) <= 16)]
            k = min(bad, key=lambda k: (k % size, k // size))    # the earliest line
            what = f"C{k // size + 1} is {flat[k]!r}, not a hex hash of at most 16 digits"
            raise self.fail(first_line_no + k % size, what)
        hashes = np.array([int(v, 16) if v else 0 for v in flat], dtype=np.uint64)
        return hashes.reshape(len(columns), size).T, (lengths > 0).reshape(len(columns), size).T   # [n, T]


def table_keys(seed: int, num_tables: int) -> np.ndarray:
    """key(seed, t) of tables t = 0..T-1, the keys the categorical hash mixes in. → [T] uint64."""
    return np.array([hash_key(seed, t) for t in range(num_tables)], dtype=np.uint64)


def hashed_rows(hashes: np.ndarray, present: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The hashing rule: hashes [n, T] (uint64) → row ids [n, T] int64,
    splitmix64(h xor keys[t]) mod rows[t], and row 0 where `present` [n, T] is False."""
    ids = (splitmix64(hashes ^ keys) % np.asarray(rows, dtype=np.uint64)).astype(np.int64)
    ids[~present] = 0
    return ids


def line_error(path: str | Path, line_no: int, what: str) -> ConfigError:
    """The one-line error for a bad line: "FILE, line N: what"."""
    return ConfigError(f"{path}, line {line_no}: {what}")


def decode_lines(path: str | Path, raw: bytes, first_line_no: int) -> str:
    """UTF-8 bytes of lines → text; a ConfigError naming the first line that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = first_line_no + raw.count(b"\n", 0, e.start)
        raise line_error(path, line_no, "not UTF-8 text") from None


def counts_to_dense(values: np.ndarray) -> np.ndarray:
    """float64 counts [n, 13] → float32 log1p(max(x, 0)) [n, 13]."""
    return np.log1p(np.maximum(values, 0.0)).astype(np.float32)


def _float_or_nan(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")
