"""Criteo converted once to columns (`cxltrain data convert`), read by batch with no parsing.

A converted folder holds numpy files, one row per line of the sources, in order:

    dense.npy             [N, 13] float32  log1p(max(I, 0)), missing = 0 (exactly what CriteoFile yields)
    sparse.npy            [N, 26] uint32   the hashes h of C1..C26 as written (8 hex digits), missing = 0
    labels.npy            [N]     float32  0.0 or 1.0
    exception_cells.npy   [K]     uint64   line·26 + t of each field sparse.npy cannot hold: a hash
    exception_hashes.npy  [K]     uint64     of 0 (sparse.npy's 0 means missing) or of more than 32 bits
    manifest.json         format name and version, N, K, the sources and a fingerprint

No table size or seed is baked in: `ConvertedCriteo(folder, batch_size=B, rows=..., seed=...)`
hashes each batch's values to row ids as it reads them, by CriteoFile's rule (lines.hashed_rows),
so one conversion serves every --rows and --seed and trains bit for bit like the raw file.
`batch(b)` slices lines b·B..(b+1)·B out of the memory-mapped files; like CriteoFile, only full
batches are served. A single source's folder carries that file's fingerprint, so a pool trained on
the raw file resumes on its conversion (the run's rows and seed are checked beside it).

A folder of format version 1 (written before this one) holds row ids fixed for the --rows and
--seed it was converted with; it is still read at exactly those, and refused at any others with a
line that says to convert again.

The manifest is written last: a folder whose conversion did not finish has none and is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError
from . import stream
from .batch import Batch
from .common import check_index
from .criteo import CriteoSource, columns_to_batch, sniff
from .lines import NUM_CATEGORICAL, NUM_DENSE, Columns, LineParser, hashed_rows, table_keys

FORMAT = "cxltrain-criteo-columns"
VERSION = 2
BAKED_VERSION = 1        # sparse.npy held row ids for the manifest's rows and seed
MANIFEST = "manifest.json"
FILES = {"dense": ("dense.npy", np.float32, (NUM_DENSE,)),
         "sparse": ("sparse.npy", np.uint32, (NUM_CATEGORICAL,)),
         "labels": ("labels.npy", np.float32, ())}
EXCEPTIONS = {"cells": ("exception_cells.npy", np.uint64, ()),
              "hashes": ("exception_hashes.npy", np.uint64, ())}
_NARROW = np.uint64(1 << 32)   # sparse.npy holds hashes below this
_HEADER_BYTES = 128          # a fixed .npy header, rewritten with the final line count at the end
_LINES_PER_PARSE = 1 << 16


def is_converted(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder (converted data, or meant to be) rather than a raw file."""
    return Path(path).is_dir()


# -------------------------------------------------------------------------------------------------
# Writing


def _npy_header(dtype, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header padded to exactly _HEADER_BYTES."""
    text = f"{{'descr': '{np.dtype(dtype).str}', 'fortran_order': False, 'shape': {shape!r}, }}"
    pad = _HEADER_BYTES - 10 - len(text) - 1
    return b"\x93NUMPY\x01\x00" + (_HEADER_BYTES - 10).to_bytes(2, "little") + text.encode() + b" " * pad + b"\n"


class _ColumnWriter:
    """Appends rows to one .npy file whose header gets the final count on close."""

    def __init__(self, path: Path, dtype, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape, self.rows = path, dtype, row_shape, 0
        self.file = open(path, "wb")
        self.file.write(_npy_header(dtype, (0, *row_shape)))

    def append(self, values: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.rows += len(values)

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(_npy_header(self.dtype, (self.rows, *self.row_shape)))
        self.file.close()


def convert(sources: Sequence[str | os.PathLike], out: str | os.PathLike, *,
            progress: Callable[[int], None] | None = None) -> dict:
    """Parse `sources` (raw or CSV layout, plain or gzipped) in one pass into the folder `out`
    (created; it must not hold files already). `progress(n)` is told each n source bytes read.
    Returns the manifest. A malformed line or a bad .gz stops it with a ConfigError naming the
    file (and line); the folder then has no manifest, so nothing can read it by mistake."""
    if not sources:
        raise ConfigError("data convert: no source files given")
    paths = [Path(s) for s in sources]
    for path in paths:
        if path.is_dir():
            raise ConfigError(f"{path}: is a directory, not a Criteo file")
        stream.file_size(path)
    out = Path(out)
    _make_empty_folder(out)
    try:
        return _write_folder(paths, out, progress)
    except OSError as e:  # a full disk, say: what was written is of no use, and no traceback
        for written in out.iterdir():
            with contextlib.suppress(OSError):
                written.unlink()
        raise ConfigError(f"{out}: cannot write the converted data: {e.strerror or e}; the files written so far "
                          "are removed") from None


def _write_folder(paths: list[Path], out: Path, progress) -> dict:
    """convert's writing, into the empty folder `out`; returns the manifest, written last."""
    writers = {}
    done = []
    try:
        for name, (file, dtype, shape) in {**FILES, **EXCEPTIONS}.items():
            writers[name] = _ColumnWriter(out / file, dtype, shape)
        for path in paths:
            lines, fingerprint = _convert_one(path, writers, progress)
            done.append({"name": path.name, "lines": lines, "fingerprint": fingerprint})
    finally:
        _close_all(writers.values())
    fingerprint = done[0]["fingerprint"] if len(done) == 1 else \
        "converted " + hashlib.blake2b("\n".join(d["fingerprint"] for d in done).encode(), digest_size=16).hexdigest()
    manifest = {"format": FORMAT, "version": VERSION, "lines": writers["labels"].rows,
                "exceptions": writers["cells"].rows, "sources": done, "fingerprint": fingerprint}
    temporary = out / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(temporary, out / MANIFEST)
    return manifest


def _close_all(writers) -> None:
    """Close every writer, each even when another's close failed; then raise the first failure."""
    failed = None
    for writer in writers:
        try:
            writer.close()
        except OSError as e:
            failed = failed or e
            with contextlib.suppress(OSError):
                writer.file.close()
    if failed is not None:
        raise failed


def _make_empty_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{out}: exists and is not a folder") from None
    except OSError as e:
        raise ConfigError(f"{out}: cannot create the folder: {e.strerror}") from None
    if any(out.iterdir()):
        raise ConfigError(f"{out}: the folder is not empty; convert into a new or empty folder")


def _convert_one(path: Path, writers: dict, progress) -> tuple[int, str]:
    """Append one source's lines; returns (lines, fingerprint as CriteoFile computes it)."""
    layout, _, data_start = sniff(path)
    parser = LineParser(path, layout.sep, NUM_CATEGORICAL, None, 0)   # rows None: keep the hashes
    digest = hashlib.blake2b(digest_size=16)
    pending, position, line_no, size = b"", 0, layout.header_lines + 1, 0
    for block in stream.blocks(path, progress=progress):
        digest.update(block)
        size += len(block)
        pending += block
        if position < data_start:                   # the header line
            cut = min(len(pending), data_start - position)
            pending, position = pending[cut:], position + cut
        whole = pending.rfind(b"\n") + 1
        line_no = _append_lines(parser, pending[:whole], line_no, writers)
        position += whole
        pending = pending[whole:]
    if pending:                                     # a last line without a newline
        line_no = _append_lines(parser, pending, line_no, writers)
    return line_no - layout.header_lines - 1, f"{size:,} bytes, blake2b {digest.hexdigest()}"


def _append_lines(parser: LineParser, raw: bytes, line_no: int, writers: dict) -> int:
    """Parse whole lines `raw` (the first is line `line_no`) and append them; the next line number."""
    offset = 0
    while offset < len(raw):
        columns, offset = parser.parse_bytes(raw, line_no, _LINES_PER_PARSE, start=offset)
        hashes, present = columns.ids, columns.present
        odd = present & ((hashes == 0) | (hashes >= _NARROW))    # fields sparse.npy alone would misread
        if odd.any():
            lines, tables = np.nonzero(odd)                        # row-major: the cells ascend
            first = writers["labels"].rows                         # the folder's line of columns' line 0
            writers["cells"].append((first + lines.astype(np.uint64)) * NUM_CATEGORICAL + tables.astype(np.uint64))
            writers["hashes"].append(hashes[odd])
        writers["dense"].append(columns.dense)
        writers["sparse"].append(np.where(hashes < _NARROW, hashes, 0))
        writers["labels"].append(columns.labels)
        line_no += len(columns)
    return line_no


# -------------------------------------------------------------------------------------------------
# Reading


class ConvertedCriteo(CriteoSource):
    """Batches of a converted folder; `batch(b)` is a slice of memory-mapped columns, hashed to rows.

    Args:
        path: the folder `cxltrain data convert` wrote.
        batch_size: B; the last partial batch is dropped.
        rows: hash buckets per table (one int or one per table); any, for a folder of this format
            (a version 1 folder: the rows it was converted with, for the tables kept).
        num_tables: T, keep C1..CT (1..26).
        seed: mixed into the categorical hash, as CriteoFile's (a version 1 folder: its own).
    """

    def __init__(self, path: str | os.PathLike, *, batch_size: int, rows: int | Sequence[int],
                 num_tables: int = NUM_CATEGORICAL, seed: int = 0) -> None:
        self._settings(path, batch_size, rows, num_tables, seed)
        manifest = self._manifest()
        self.version = int(manifest["version"])
        self.num_lines = int(manifest["lines"])
        self.fingerprint = str(manifest["fingerprint"])
        self._columns = {name: self._open(FILES[name], self.num_lines) for name in FILES}
        if self.version == BAKED_VERSION:
            self._check_baked_options(manifest)
        else:
            count = int(manifest["exceptions"])
            self._exceptions = {name: self._open(EXCEPTIONS[name], count) for name in EXCEPTIONS}
            self._keys = table_keys(self.seed, self.num_tables)
            self._table_rows = np.array(self.rows, dtype=np.uint64)
        self.num_batches = self.num_lines // self.batch_size
        if self.num_batches == 0:
            raise ConfigError(f"{self.path}: {self.num_lines} lines, fewer than batch_size {self.batch_size}")

    def __repr__(self) -> str:
        return (f"ConvertedCriteo({str(self.path)!r}, batch_size={self.batch_size}, rows={self.rows}, "
                f"num_tables={self.num_tables}, seed={self.seed})")

    def batch(self, b: int) -> Batch:
        """Batch b, lines b·B..(b+1)·B-1: dense [B, 13] float32, F × values [B] int64, labels [B]."""
        b = check_index(b, self.num_batches)
        lines = slice(b * self.batch_size, (b + 1) * self.batch_size)
        sparse = self._columns["sparse"][lines, : self.num_tables]
        ids = sparse.astype(np.int64) if self.version == BAKED_VERSION else self._rows_of(lines, sparse)
        columns = Columns(dense=np.array(self._columns["dense"][lines]), ids=ids,
                          labels=np.array(self._columns["labels"][lines]))
        return columns_to_batch(columns, b)

    def _rows_of(self, lines: slice, sparse: np.ndarray) -> np.ndarray:
        """sparse.npy's hashes [B, T] of `lines`, with the exceptions in those lines put back,
        → row ids [B, T] int64."""
        hashes, present = sparse.astype(np.uint64), sparse != 0
        cells = self._exceptions["cells"]
        first, stop = (np.uint64(n * NUM_CATEGORICAL) for n in (lines.start, lines.stop))
        lo, hi = np.searchsorted(cells, [first, stop])
        if hi > lo:
            line, table = np.divmod(np.array(cells[lo:hi]) - first, np.uint64(NUM_CATEGORICAL))
            kept = table < self.num_tables
            line, table = line[kept].astype(np.int64), table[kept].astype(np.int64)
            hashes[line, table] = np.array(self._exceptions["hashes"][lo:hi])[kept]
            present[line, table] = True
        return hashed_rows(hashes, present, self._keys, self._table_rows)

    # -- opening -------------------------------------------------------------------------------------

    def _manifest(self) -> dict:
        if not self.path.is_dir():
            raise ConfigError(f"{self.path}: no such folder")
        file = self.path / MANIFEST
        if not file.is_file():
            raise ConfigError(f"{self.path}: not converted Criteo data ({MANIFEST} is missing; "
                              "did `cxltrain data convert` finish?)")
        try:
            manifest = json.loads(file.read_text())
            kind, version = manifest["format"], manifest["version"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{file}: not a readable manifest ({type(e).__name__}: {e})") from None
        if kind != FORMAT:
            raise ConfigError(f"{file}: format {kind!r}, expected {FORMAT!r}")
        if version not in (BAKED_VERSION, VERSION):
            raise ConfigError(f"{file}: format version {version}, this cxltrain reads versions {BAKED_VERSION} "
                              f"and {VERSION} (convert the sources again)")
        try:
            int(manifest["lines"]), str(manifest["fingerprint"])
            if version == BAKED_VERSION:
                list(manifest["rows"]), int(manifest["seed"])
            else:
                int(manifest["exceptions"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{file}: not a readable manifest ({type(e).__name__}: {e})") from None
        return manifest

    def _check_baked_options(self, manifest: dict) -> None:
        made_rows = tuple(int(r) for r in manifest["rows"])[: self.num_tables]
        if made_rows != self.rows:
            raise ConfigError(f"{self.path}: converted by an earlier cxltrain with row ids fixed for rows "
                              f"{_short(made_rows)} per table, but this run asks for {_short(self.rows)} "
                              "(convert again: a folder converted now serves any --rows)")
        if int(manifest["seed"]) != self.seed:
            raise ConfigError(f"{self.path}: converted by an earlier cxltrain with row ids fixed for seed "
                              f"{manifest['seed']}, but this run has seed {self.seed} (convert again: a folder "
                              "converted now serves any --seed)")

    def _open(self, spec: tuple, count: int) -> np.ndarray:
        """The memory-mapped column `spec` = (file, dtype, row shape), checked to hold `count` rows."""
        file, dtype, shape = spec
        path = self.path / file
        if not path.is_file():
            raise ConfigError(f"{path}: missing from the converted folder (convert the sources again)")
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not a readable .npy file ({e})") from None
        expected = (count, *shape)
        if array.dtype != np.dtype(dtype) or array.shape != expected:
            raise ConfigError(f"{path}: holds {array.dtype} {array.shape}, the manifest says {np.dtype(dtype)} "
                              f"{expected} (convert the sources again)")
        return array


def _short(rows: Sequence[int]) -> str:
    return str(rows[0]) if len(set(rows)) == 1 else ",".join(map(str, rows))
