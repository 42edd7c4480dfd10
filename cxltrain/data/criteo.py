"""Raw Criteo click logs as batches: `CriteoFile`.

Two layouts, told apart by the first line:
  - raw (Kaggle `train.txt`, `dac_sample.txt`, Terabyte `day_0`..`day_23`): tab-separated, no
    header, 40 fields `label, I1..I13, C1..C26`, integers (may be negative), missing = empty;
  - CSV (e.g. the DeepCTR sample): comma-separated, optional header `label,I1..I13,C1..C26`,
    integers may be written as floats (`260.0`), missing = empty.

Per sample: dense = log1p(max(I, 0)) with missing = 0, float32 [13]; categorical C_f, an
8-hex-digit hash, becomes row splitmix64(C_f xor key(seed, f)) mod rows_f of table f (missing →
row 0, a bucket it shares with whatever hashes there); label 0 or 1. Pooling is 1: one id per
table per sample. `num_tables` = T keeps C1..CT.

Opening a file reads it once to note the byte offset of every batch_size-th line, so `batch(b)`
seeks straight to its lines. Only full batches are served: the last num_lines mod batch_size lines
are dropped. A line is checked when its batch is read (the first line also on open), and a
malformed one raises ConfigError naming the file and line. Parsing is plain Python and numpy,
about 16 µs a line (about 33 ms for 2,048 lines of the raw layout, one core).

Shape letters: B = batch size, F = tables kept (T), D = 13 dense features.

Example (B = 4, F = 2; the sample file has 200 lines, so 50 batches):

    src = CriteoFile("criteo_sample.csv", batch_size=4, rows=[1000, 500], num_tables=2)
    batch = src.batch(49)        # lines 198..201 of the file (line 1 is the header)
    batch.dense.shape            # torch.Size([4, 13])
    batch.values                 # (tensor of 4 row ids in [0, 1000), tensor of 4 in [0, 500))
    batch.offsets[0]             # tensor([0, 1, 2, 3])
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from .batch import Batch
from .common import (
    MAX_SEED,
    batch_indices,
    check_index,
    check_int,
    hash_key,
    splitmix64,
    table_rows,
)

NUM_DENSE = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
HEADER = (
    "label",
    *(f"I{i}" for i in range(1, NUM_DENSE + 1)),
    *(f"C{i}" for i in range(1, NUM_CATEGORICAL + 1)),
)
MAX_FIRST_LINE = 1 << 20     # a first line longer than this is not a Criteo line
_INDEX_CHUNK = 16 << 20      # bytes read at a time while indexing (tests make it small)
_HEX = re.compile(r"[0-9a-fA-F]*")
_LABELS = {"0": 0.0, "1": 1.0, "0.0": 0.0, "1.0": 1.0}


@dataclasses.dataclass(frozen=True)
class _Layout:
    name: str             # "tsv" (raw Criteo) or "csv"
    sep: str
    header_lines: int     # 0 or 1


class CriteoFile:
    """Batches of a raw Criteo file; `batch(b)` seeks to batch b through an index built on open.

    Args:
        path: the file (raw tab-separated or CSV layout, see the module docstring).
        batch_size: B, lines per batch; the last partial batch is dropped.
        rows: hash buckets per categorical feature (one int for all, or one per table).
        num_tables: T, keep the first T categorical features C1..CT (1..26).
        seed: mixed into the categorical hash; a different seed gives different row ids.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        batch_size: int,
        rows: int | Sequence[int],
        num_tables: int = NUM_CATEGORICAL,
        seed: int = 0,
    ) -> None:
        self.path = Path(path)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.num_tables = check_int("num_tables", num_tables, 1, NUM_CATEGORICAL + 1)
        self.rows = table_rows(rows, self.num_tables)
        self.seed = check_int("seed", seed, 0, MAX_SEED)
        self.num_dense = NUM_DENSE
        self.pooling = 1
        keys = [hash_key(self.seed, t) for t in range(self.num_tables)]
        self._keys = np.array(keys, dtype=np.uint64)
        self._layout, first_line, data_start = self._sniff()
        self._size = self.path.stat().st_size
        self._starts, self.num_lines = self._index(data_start)
        self.num_batches = len(self._starts) - 1
        if self.num_lines == 0:
            raise ConfigError(f"{self.path}: no data lines")
        # A wrong file fails now rather than at its first batch.
        self._parse([first_line], self._layout.header_lines + 1)
        if self.num_batches == 0:
            raise ConfigError(
                f"{self.path}: {self.num_lines} data lines, fewer than batch_size {self.batch_size}"
            )

    @property
    def layout(self) -> str:
        """Which layout the file has: "tsv" (raw Criteo) or "csv"."""
        return self._layout.name

    def __repr__(self) -> str:
        return (
            f"CriteoFile({str(self.path)!r}, batch_size={self.batch_size}, rows={self.rows}, "
            f"num_tables={self.num_tables}, seed={self.seed})"
        )

    def batch(self, b: int) -> Batch:
        """Batch b, data lines b·B+1..(b+1)·B: dense [B, 13] float32, F × values [B], labels [B]."""
        b = check_index(b, self.num_batches)
        start, stop = int(self._starts[b]), int(self._starts[b + 1])
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size != self._size:
                raise ConfigError(f"{self.path}: the file changed size since it was opened")
            f.seek(start)
            raw = f.read(stop - start)
        first_line_no = self._layout.header_lines + b * self.batch_size + 1
        lines = self._split(raw, first_line_no)
        return self._parse(lines, first_line_no, index=b)

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        """Batches start, start+1, ... before stop (None = to the last full batch)."""
        for b in batch_indices(start, stop, self.num_batches):
            yield self.batch(b)

    # -- opening ---------------------------------------------------------------------------------

    def _sniff(self) -> tuple[_Layout, str, int]:
        """The layout, the first data line and the byte offset where data lines start."""
        try:
            with open(self.path, "rb") as f:
                first = f.readline(MAX_FIRST_LINE)
                second = f.readline(MAX_FIRST_LINE) if first.startswith(b"label") else b""
        except FileNotFoundError:
            raise ConfigError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise ConfigError(f"{self.path}: is a directory, not a Criteo file") from None
        except OSError as e:
            raise ConfigError(f"{self.path}: cannot read: {e.strerror}") from None
        if not first:
            raise ConfigError(f"{self.path}: the file is empty")
        if len(first) == MAX_FIRST_LINE and not first.endswith(b"\n"):
            raise self._fail(1, f"longer than {MAX_FIRST_LINE} bytes: not a Criteo file")
        text = self._decode(first, 1).rstrip("\r\n")
        if "\t" in text:
            return _Layout("tsv", "\t", 0), text, 0
        fields = text.split(",")
        if len(fields) == 1:
            raise self._fail(
                1,
                "neither tab- nor comma-separated; expected a raw Criteo line (40 tab-separated "
                "fields) or a CSV with header label,I1..I13,C1..C26",
            )
        if fields[0].strip() != "label":
            return _Layout("csv", ",", 0), text, 0
        if tuple(name.strip() for name in fields) != HEADER:
            raise self._fail(1, "header is not label,I1..I13,C1..C26")
        return _Layout("csv", ",", 1), self._decode(second, 2).rstrip("\r\n"), len(first)

    def _index(self, data_start: int) -> tuple[np.ndarray, int]:
        """Byte offsets where batches 0..N-1 start, plus where batch N-1 ends; and the line count.
        Sets `fingerprint`: the file's size and checksum, which identify the data by its content (a
        resumed run must read the same bytes, wherever the file now is).

        A final line without a newline still counts; lines are counted from data_start.
        """
        b = self.batch_size
        bounds = [data_start]
        count, pos, last = 0, data_start, b"\n"
        digest = hashlib.blake2b(digest_size=16)
        with open(self.path, "rb") as f:
            digest.update(f.read(data_start))
            while chunk := f.read(_INDEX_CHUNK):
                digest.update(chunk)
                newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == ord("\n"))
                # Newline i of this chunk ends data line count + i + 1; keep those ending a batch.
                first = (-count - 1) % b
                bounds.extend((pos + newlines[first::b] + 1).tolist())
                count += len(newlines)
                pos += len(chunk)
                last = chunk[-1:]
        if last != b"\n":
            count += 1
            if count % b == 0:
                bounds.append(pos)
        self.fingerprint = f"{pos:,} bytes, blake2b {digest.hexdigest()}"
        return np.array(bounds, dtype=np.int64), count

    # -- parsing ---------------------------------------------------------------------------------

    def _fail(self, line_no: int, what: str) -> ConfigError:
        return ConfigError(f"{self.path}, line {line_no}: {what}")

    def _decode(self, raw: bytes, first_line_no: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line_no = first_line_no + raw.count(b"\n", 0, e.start)
            raise self._fail(line_no, "not UTF-8 text") from None

    def _split(self, raw: bytes, first_line_no: int) -> list[str]:
        """The B lines of one batch's bytes, without line endings."""
        lines = self._decode(raw, first_line_no).split("\n")
        if lines[-1] == "":
            lines.pop()  # the newline ending the batch's last line
        if len(lines) != self.batch_size:
            raise ConfigError(f"{self.path}: the file changed since it was opened")
        return [line[:-1] if line.endswith("\r") else line for line in lines]

    def _parse(self, lines: list[str], first_line_no: int, index: int = 0) -> Batch:
        """Lines [B] of text → a Batch; ConfigError naming a malformed line.

        Checked in order: field counts, labels, I1..I13, C1..CT, each reporting its earliest line.
        """
        sep = self._layout.sep
        fields = [line.split(sep) for line in lines]
        for i, row in enumerate(fields):
            if row == [""]:
                raise self._fail(first_line_no + i, "empty line")
            if len(row) != NUM_FIELDS:
                kind = "tab" if sep == "\t" else "comma"
                what = f"{len(row)} {kind}-separated fields, expected {NUM_FIELDS}"
                raise self._fail(first_line_no + i, what)
        columns = list(zip(*fields))           # 40 tuples of B strings
        labels = self._labels(columns[0], first_line_no)
        dense = self._dense(columns[1 : 1 + NUM_DENSE], first_line_no)
        ids = self._ids(columns[1 + NUM_DENSE : 1 + NUM_DENSE + self.num_tables], first_line_no)
        size = len(lines)
        return Batch(
            index=index,
            dense=torch.from_numpy(dense),
            values=tuple(torch.from_numpy(ids[:, t].copy()) for t in range(self.num_tables)),
            offsets=tuple(torch.arange(size, dtype=torch.int64) for _ in range(self.num_tables)),
            labels=torch.from_numpy(labels),
        )

    def _labels(self, column: tuple[str, ...], first_line_no: int) -> np.ndarray:
        """[B] label strings → [B] float32 0.0/1.0."""
        try:
            return np.array([_LABELS[v] for v in column], dtype=np.float32)
        except KeyError:
            i = next(i for i, v in enumerate(column) if v not in _LABELS)
            what = f"label is {column[i]!r}, expected 0 or 1"
            raise self._fail(first_line_no + i, what) from None

    def _dense(self, columns: list[tuple[str, ...]], first_line_no: int) -> np.ndarray:
        """13 columns of [B] integer strings → [B, 13] float32 log1p(max(x, 0)), missing = 0."""
        try:
            # float64 holds every Criteo count exactly and also reads the CSV's "260.0"; Python's
            # float() is faster here than numpy's string conversion.
            values = np.array([[float(v) if v else 0.0 for v in column] for column in columns]).T
        except ValueError:  # some field is not a number; NaN marks it for the check below
            values = np.array([[_float_or_nan(v) if v else 0.0 for v in c] for c in columns]).T
        good = np.isfinite(values) & (values == np.floor(values))
        if not good.all():
            i, j = (int(k) for k in np.argwhere(~good)[0])
            what = f"I{j + 1} is {columns[j][i]!r}, not an integer"
            raise self._fail(first_line_no + i, what)
        return np.log1p(np.maximum(values, 0.0)).astype(np.float32)

    def _ids(self, columns: list[tuple[str, ...]], first_line_no: int) -> np.ndarray:
        """T columns of [B] hex strings → [B, T] int64 row ids, missing = 0."""
        size = len(columns[0])
        flat = [v for column in columns for v in column]   # value k is line k % B of C(k // B + 1)
        lengths = np.fromiter(map(len, flat), dtype=np.int64, count=len(flat))
        if not _HEX.fullmatch("".join(flat)) or lengths.max() > 16:
            bad = [k for k, v in enumerate(flat) if not (_HEX.fullmatch(v) and len(v) <= 16)]
            k = min(bad, key=lambda k: (k % size, k // size))    # the earliest line
            what = f"C{k // size + 1} is {flat[k]!r}, not a hex hash of at most 16 digits"
            raise self._fail(first_line_no + k % size, what)
        hashes = np.array([int(v, 16) if v else 0 for v in flat], dtype=np.uint64)
        hashes = hashes.reshape(len(columns), size).T                 # [B, T]
        buckets = np.array(self.rows, dtype=np.uint64)
        ids = (splitmix64(hashes ^ self._keys) % buckets).astype(np.int64)
        ids[(lengths == 0).reshape(len(columns), size).T] = 0
        return ids


def _float_or_nan(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")
