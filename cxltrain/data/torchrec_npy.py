"""A folder in TorchRec's preprocessed Criteo layout, read as it is: `TorchRecFolder`.

TorchRec's Criteo preprocessing (its npy_preproc_criteo.py script) turns each day file of the raw
logs into three numpy files, which this reads with no conversion:

    day_N_dense.npy   [n, 13] float32  TorchRec's log(I + 3), missing I = 0
    day_N_sparse.npy  [n, 26] int32    C1..C26 as the integers of their hex digits (their 32 bits),
                                       missing = 0
    day_N_labels.npy  [n, 1]  int32    0 or 1

Every day_N triple in the folder is read, in N's order, as one run of lines; batch b is lines
b·B..(b+1)·B-1 (it may span two days), only full batches. Dense values are TorchRec's as stored
(not CriteoFile's log1p(max(I, 0))); labels become float32. A categorical value v goes to a row by
CriteoFile's rule (lines.hashed_rows), splitmix64(v xor key(seed, t)) mod rows_t, with v = 0 —
TorchRec's missing — at row 0: so a line's row ids are those of the raw line it came from, for any
--rows and --seed (a value written "00000000" excepted: TorchRec stores it as missing).

Nothing is written into the folder. Its fingerprint (what a resumed run must match) hashes every
file's name, dtype and shape and its bytes — whole up to _WHOLE_BYTES, else _SAMPLES evenly spaced
blocks of _SAMPLE_BYTES — so a different day, preprocessing or shuffle is caught without reading
hundreds of GB on every start.

Shape letters: B = batch size, T = tables kept.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ConfigError
from .batch import Batch
from .common import check_index
from .converted import MANIFEST
from .criteo import CriteoSource, columns_to_batch
from .lines import NUM_CATEGORICAL, NUM_DENSE, Columns, hashed_rows, table_keys

_NAME = re.compile(r"day_(\d+)_(dense|sparse|labels)\.npy")
PARTS = ("dense", "sparse", "labels")
_SPARSE_DTYPES = {np.dtype(t): np.dtype(u) for t, u in ((np.int32, np.uint32), (np.uint32, np.uint32),
                                                          (np.int64, np.uint64), (np.uint64, np.uint64))}
_WHOLE_BYTES = 16 << 20
_SAMPLES, _SAMPLE_BYTES = 64, 64 << 10


def is_torchrec_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder with TorchRec's day_N_*.npy files and no converted manifest."""
    path = Path(path)
    try:
        return (path.is_dir() and not (path / MANIFEST).exists()
                and any(_NAME.fullmatch(p.name) for p in path.iterdir()))
    except OSError:     # unreadable: ConvertedCriteo, asked next, says what is wrong in one line
        return False


class TorchRecFolder(CriteoSource):
    """Batches of a folder in TorchRec's day_N_{dense,sparse,labels}.npy layout.

    Args:
        path: the folder.
        batch_size: B; the last partial batch is dropped.
        rows: hash buckets per categorical feature (one int for all, or one per table).
        num_tables: T, keep C1..CT (1..26).
        seed: mixed into the categorical hash, as CriteoFile's.
    """

    def __init__(self, path: str | os.PathLike, *, batch_size: int, rows: int | Sequence[int],
                 num_tables: int = NUM_CATEGORICAL, seed: int = 0) -> None:
        self._settings(path, batch_size, rows, num_tables, seed)
        self.days = self._find_days()
        self._arrays = [self._open_day(day) for day in self.days]     # per day: {part: memmap}
        counts = [len(arrays["labels"]) for arrays in self._arrays]
        self._starts = np.cumsum([0, *counts])                        # the first line of each day
        self.num_lines = int(self._starts[-1])
        self.num_batches = self.num_lines // self.batch_size
        if self.num_batches == 0:
            raise ConfigError(f"{self.path}: {self.num_lines} lines, fewer than batch_size {self.batch_size}")
        self.fingerprint = self._fingerprint()
        self._keys = table_keys(self.seed, self.num_tables)
        self._table_rows = np.array(self.rows, dtype=np.uint64)

    def __repr__(self) -> str:
        return (f"TorchRecFolder({str(self.path)!r}, batch_size={self.batch_size}, rows={self.rows}, "
                f"num_tables={self.num_tables}, seed={self.seed})")

    def batch(self, b: int) -> Batch:
        """Batch b, lines b·B..(b+1)·B-1: dense [B, 13] float32, T × values [B] int64, labels [B]."""
        b = check_index(b, self.num_batches)
        start = b * self.batch_size
        dense, sparse, labels = (self._lines(part, start, start + self.batch_size) for part in PARTS)
        self._check_values(start, dense, labels)
        hashes = sparse[:, : self.num_tables].view(_SPARSE_DTYPES[sparse.dtype]).astype(np.uint64)
        ids = hashed_rows(hashes, hashes != 0, self._keys, self._table_rows)
        columns = Columns(dense=np.ascontiguousarray(dense, dtype=np.float32), ids=ids,
                          labels=labels.reshape(-1).astype(np.float32))
        return columns_to_batch(columns, b)

    # -- reading -------------------------------------------------------------------------------------

    def _lines(self, part: str, start: int, stop: int) -> np.ndarray:
        """Lines [start, stop) of one part, gathered from the days they lie in."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces, day = [], first
        while start < stop:
            begin, end = int(self._starts[day]), int(self._starts[day + 1])
            take = min(stop, end) - start
            pieces.append(np.array(self._arrays[day][part][start - begin : start - begin + take]))
            start, day = start + take, day + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _check_values(self, start: int, dense: np.ndarray, labels: np.ndarray) -> None:
        """A non-finite dense value or a label other than 0/1 is one line naming its file and row."""
        bad_dense, bad_label = ~np.isfinite(dense).all(axis=1), ~np.isin(labels.reshape(-1), (0, 1))
        for bad, part, what in ((bad_label, "labels", "label is not 0 or 1"),
                                (bad_dense, "dense", "a dense value is not finite")):
            if bad.any():
                line = start + int(np.argmax(bad))
                day = int(np.searchsorted(self._starts, line, side="right")) - 1
                raise ConfigError(f"{self._file(self.days[day], part)}, row {line - int(self._starts[day])}: {what}")

    # -- opening -------------------------------------------------------------------------------------

    def _file(self, day: int, part: str) -> Path:
        return self.path / f"day_{day}_{part}.npy"

    def _find_days(self) -> list[int]:
        if not self.path.is_dir():
            raise ConfigError(f"{self.path}: no such folder")
        days = sorted({int(m.group(1)) for p in self.path.iterdir() if (m := _NAME.fullmatch(p.name))})
        if not days:
            raise ConfigError(f"{self.path}: no day_N_dense.npy, day_N_sparse.npy, day_N_labels.npy files")
        for day in days:
            for part in PARTS:
                if not self._file(day, part).is_file():
                    raise ConfigError(f"{self._file(day, part)}: missing (TorchRec's layout has day_N_dense.npy, "
                                      "day_N_sparse.npy and day_N_labels.npy for every day N)")
        return days

    def _open_day(self, day: int) -> dict[str, np.ndarray]:
        arrays = {part: self._load(self._file(day, part)) for part in PARTS}
        dense, sparse, labels = (arrays[part] for part in PARTS)
        n = len(dense) if dense.ndim else 0
        expected = {"dense": (dense.dtype == np.float32 and dense.shape == (n, NUM_DENSE), f"float32 [n, {NUM_DENSE}]"),
                    "sparse": (sparse.dtype in _SPARSE_DTYPES and sparse.shape == (n, NUM_CATEGORICAL),
                               f"int32 [n, {NUM_CATEGORICAL}]"),
                    "labels": (labels.dtype.kind in "iuf" and labels.shape in ((n, 1), (n,)), "int32 [n, 1]")}
        for part, (good, what) in expected.items():
            if not good:
                raise ConfigError(f"{self._file(day, part)}: holds {arrays[part].dtype} {list(arrays[part].shape)}, "
                                  f"expected TorchRec's {what} with n = {n}, the rows of day_{day}_dense.npy")
        return arrays

    @staticmethod
    def _load(path: Path) -> np.ndarray:
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not a readable .npy file ({e})") from None

    def _fingerprint(self) -> str:
        digest = hashlib.blake2b(digest_size=16)
        for day, arrays in zip(self.days, self._arrays):
            for part in PARTS:
                path, array = self._file(day, part), arrays[part]
                digest.update(f"{path.name} {array.dtype.str} {array.shape}\n".encode())
                digest.update(_sampled_bytes(path))
        return f"TorchRec npy, {len(self.days)} day(s), {self.num_lines:,} lines, blake2b {digest.hexdigest()}"


def _sampled_bytes(path: Path) -> bytes:
    """The file whole if it is small, else _SAMPLES blocks evenly spaced from its start to its end."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= _WHOLE_BYTES:
            return f.read()
        blocks = []
        for offset in np.linspace(0, size - _SAMPLE_BYTES, _SAMPLES).astype(np.int64):
            f.seek(int(offset))
            blocks.append(f.read(_SAMPLE_BYTES))
        return b"".join(blocks)
