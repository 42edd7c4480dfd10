"""Raw Criteo click logs as batches: `CriteoFile`.

Two layouts, told apart by the first line:
  - raw (Kaggle `train.txt`, `dac_sample.txt`, Terabyte `day_0`..`day_23`): tab-separated, 40
    fields `label, I1..I13, C1..C26`, integers (may be negative), missing = empty; an optional
    header line `label<TAB>I1..` is skipped;
  - CSV (e.g. the DeepCTR sample): comma-separated, optional header `label,I1..I13,C1..C26`,
    integers may be written as floats (`260.0`), missing = empty.
Either may be gzipped (told by its magic bytes, so `day_0.gz` and a gzipped `day_0` alike).

Per sample: dense = log1p(max(I, 0)) with missing = 0, float32 [13]; categorical C_f, an
8-hex-digit hash, becomes row splitmix64(C_f xor key(seed, f)) mod rows_f of table f (missing →
row 0, a bucket it shares with whatever hashes there); label 0 or 1. Pooling is 1: one id per
table per sample. `num_tables` = T keeps C1..CT.

Opening a file reads it once to note the byte offset of every batch_size-th line, so `batch(b)`
seeks straight to its lines (a gzipped file is inflated from the start to the batch asked for,
then read on in order: resuming is exact but not instant; convert big files with `cxltrain data
convert`). Only full batches are served: the last num_lines mod batch_size lines are dropped. A
line is checked when its batch is read (the first line also on open), and a malformed one raises
ConfigError naming the file and line. Lines are parsed by the native parser (lines.py).

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
import threading
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from . import stream
from .batch import Batch
from .common import MAX_SEED, batch_indices, check_index, check_int, table_rows
from .lines import NUM_CATEGORICAL, NUM_DENSE, NUM_FIELDS, Columns, LineParser, decode_lines, line_error

__all__ = ["CriteoFile", "HEADER", "NUM_CATEGORICAL", "NUM_DENSE", "NUM_FIELDS", "columns_to_batch"]

HEADER = (
    "label",
    *(f"I{i}" for i in range(1, NUM_DENSE + 1)),
    *(f"C{i}" for i in range(1, NUM_CATEGORICAL + 1)),
)
MAX_FIRST_LINE = 1 << 20     # a first line longer than this is not a Criteo line
_INDEX_CHUNK = 16 << 20      # bytes read at a time while indexing (tests make it small)


@dataclasses.dataclass(frozen=True)
class _Layout:
    name: str             # "tsv" (raw Criteo) or "csv"
    sep: str
    header_lines: int     # 0 or 1


def columns_to_batch(columns: Columns, index: int) -> Batch:
    """Parsed lines [B] → the Batch of number `index` (one id per table per sample)."""
    size, tables = len(columns), columns.ids.shape[1]
    ids = torch.from_numpy(np.ascontiguousarray(columns.ids.T))          # [T, B]
    offsets = torch.arange(size, dtype=torch.int64)
    return Batch(index=index, dense=torch.from_numpy(columns.dense), values=tuple(ids.unbind(0)),
                 offsets=(offsets,) * tables, labels=torch.from_numpy(columns.labels))


class CriteoSource:
    """What every Criteo source checks and keeps: its path, B, T tables and their rows, the hash
    seed; one id per table per sample. Subclasses set num_batches and define batch(b)."""

    num_batches: int

    def _settings(self, path: str | os.PathLike, batch_size: int, rows: int | Sequence[int], num_tables: int,
                  seed: int) -> None:
        self.path = Path(path)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.num_tables = check_int("num_tables", num_tables, 1, NUM_CATEGORICAL + 1)
        self.rows = table_rows(rows, self.num_tables)
        self.seed = check_int("seed", seed, 0, MAX_SEED)
        self.num_dense = NUM_DENSE
        self.pooling = 1

    def batch(self, b: int) -> Batch:
        raise NotImplementedError

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        """Batches start, start+1, ... before stop (None = to the last full batch)."""
        for b in batch_indices(start, stop, self.num_batches):
            yield self.batch(b)


class CriteoFile(CriteoSource):
    """Batches of a raw Criteo file; `batch(b)` seeks to batch b through an index built on open.

    Args:
        path: the file (raw tab-separated or CSV layout, plain or gzipped; see the module docstring).
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
        self._settings(path, batch_size, rows, num_tables, seed)
        self.gzipped = stream.is_gzip(self.path)
        self._layout, first_line, data_start = self._sniff()
        self._lines = LineParser(self.path, self._layout.sep, self.num_tables, self.rows, self.seed)
        self._size = stream.file_size(self.path)
        self._starts, self.num_lines = self._index(data_start)
        self.num_batches = len(self._starts) - 1
        self._cursor: tuple[int, Iterator[bytes], bytes] | None = None   # gzipped: (position, blocks, pending)
        self._cursor_lock = threading.Lock()   # a prefetch thread and an evaluation may both read
        if self.num_lines == 0:
            raise ConfigError(f"{self.path}: no data lines")
        # A wrong file fails now rather than at its first batch.
        self._lines.parse_text([first_line], self._layout.header_lines + 1)
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
        raw = self._read_gzipped(start, stop) if self.gzipped else self._read_plain(start, stop)
        first_line_no = self._layout.header_lines + b * self.batch_size + 1
        columns, end = self._lines.parse_bytes(raw, first_line_no, self.batch_size)
        if len(columns) != self.batch_size or end != len(raw):
            raise ConfigError(f"{self.path}: the file changed since it was opened")
        return columns_to_batch(columns, b)

    # -- reading ---------------------------------------------------------------------------------

    def _check_size(self, f) -> None:
        if os.fstat(f.fileno()).st_size != self._size:
            raise ConfigError(f"{self.path}: the file changed size since it was opened")

    def _read_plain(self, start: int, stop: int) -> bytes:
        with stream.open_binary(self.path) as f:
            self._check_size(f)
            f.seek(start)
            return f.read(stop - start)

    def _read_gzipped(self, start: int, stop: int) -> bytes:
        """Inflated bytes [start, stop): read on from the last batch, or inflate again from the start."""
        with self._cursor_lock:
            return self._read_gzipped_locked(start, stop)

    def _read_gzipped_locked(self, start: int, stop: int) -> bytes:
        if self._cursor is None or self._cursor[0] > start:
            with stream.open_binary(self.path) as f:
                self._check_size(f)
            self._cursor = (0, stream.blocks(self.path), b"")
        position, blocks, pending = self._cursor      # pending: inflated bytes from `position` on
        while position + len(pending) < stop:
            if position + len(pending) <= start:
                position, pending = position + len(pending), b""
            block = next(blocks, None)
            if block is None:
                raise ConfigError(f"{self.path}: the file changed since it was opened")
            pending += block
        raw = pending[start - position:stop - position]
        self._cursor = (stop, blocks, pending[stop - position:])
        return raw

    # -- opening ---------------------------------------------------------------------------------

    def _sniff(self) -> tuple[_Layout, str, int]:
        return sniff(self.path)

    def _index(self, data_start: int) -> tuple[np.ndarray, int]:
        """Byte offsets (of the inflated bytes, for a gzipped file) where batches 0..N-1 start, plus
        where batch N-1 ends; and the line count. Sets `fingerprint`: the file's size and checksum,
        which identify the data by its content (a resumed run must read the same bytes, wherever
        the file now is).

        A final line without a newline still counts; lines are counted from data_start.
        """
        b = self.batch_size
        bounds = [data_start]
        count, pos, last = 0, 0, b"\n"
        digest = hashlib.blake2b(digest_size=16)
        for chunk in stream.blocks(self.path, read_bytes=_INDEX_CHUNK):
            digest.update(chunk)
            skip = max(0, min(len(chunk), data_start - pos))    # the header's bytes hold no data line
            newlines = skip + np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8)[skip:] == ord("\n"))
            # Newline i of this chunk ends data line count + i + 1; keep those ending a batch.
            first = (-count - 1) % b
            bounds.extend((pos + newlines[first::b] + 1).tolist())
            count += len(newlines)
            pos += len(chunk)
            last = chunk[-1:]
        if last != b"\n" and pos > data_start:
            count += 1
            if count % b == 0:
                bounds.append(pos)
        self.fingerprint = f"{pos:,} bytes, blake2b {digest.hexdigest()}"
        return np.array(bounds, dtype=np.int64), count


def sniff(path: Path) -> tuple[_Layout, str, int]:
    """A Criteo file's layout, its first data line and the byte offset where data lines start."""
    first, second = _first_lines(path)
    if not first:
        raise ConfigError(f"{path}: the file is empty")
    if len(first) == MAX_FIRST_LINE and not first.endswith(b"\n"):
        raise line_error(path, 1, f"longer than {MAX_FIRST_LINE} bytes: not a Criteo file")
    text = decode_lines(path, first, 1).rstrip("\r\n")
    sep = "\t" if "\t" in text else ","
    fields = text.split(sep)
    if len(fields) == 1:
        raise line_error(
            path, 1,
            "neither tab- nor comma-separated; expected a raw Criteo line (40 tab-separated "
            "fields) or a CSV with header label,I1..I13,C1..C26",
        )
    name = "tsv" if sep == "\t" else "csv"
    if fields[0].strip() != "label":
        return _Layout(name, sep, 0), text, 0
    if tuple(field.strip() for field in fields) != HEADER:
        raise line_error(path, 1, "header is not label,I1..I13,C1..C26")
    return _Layout(name, sep, 1), decode_lines(path, second, 2).rstrip("\r\n"), len(first)


def _first_lines(path: Path) -> tuple[bytes, bytes]:
    """The first two lines (with their newlines; b"" where there is none)."""
    head = b""
    for block in stream.blocks(path, read_bytes=1 << 16):
        head += block
        if head.count(b"\n") >= 2 or len(head) >= 2 * MAX_FIRST_LINE:
            break
    first_end = head.find(b"\n", 0, MAX_FIRST_LINE)
    if first_end < 0:
        return head[:MAX_FIRST_LINE], b""
    second_end = head.find(b"\n", first_end + 1, first_end + 1 + MAX_FIRST_LINE)
    rest = head[first_end + 1:] if second_end < 0 else head[first_end + 1:second_end + 1]
    return head[:first_end + 1], rest
