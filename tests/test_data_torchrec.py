"""A folder in TorchRec's preprocessed Criteo layout (day_N_{dense,sparse,labels}.npy), read as it is.

The folders are made here with numpy from the shared sample's 200 real lines, in the dtypes and
shapes TorchRec's preprocessing writes (helpers.write_torchrec_days). A line's row ids and label
must be those of the raw line at any rows and seed, its dense values TorchRec's own; days are read
in N's order, a batch may span days; every bad file is one line naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from cxltrain.data import CriteoFile, TorchRecFolder, torchrec_npy
from cxltrain.data.files import open_criteo
from cxltrain.errors import ConfigError
from helpers import shared_criteo_sample, shared_sample_rows, write_torchrec_days

LINES = 200
ROWS = [1000 + 7 * t for t in range(26)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The 200 lines as 11 days (day_10 after day_9, so N's order is not the names' order)."""
    return write_torchrec_days(tmp_path_factory.mktemp("torchrec") / "days", shared_sample_rows(),
                               [18] * 10 + [20])


def _stored(folder: Path, part: str) -> np.ndarray:
    return np.concatenate([np.load(folder / f"day_{d}_{part}.npy") for d in range(11)])


@pytest.mark.parametrize("rows,tables,seed", [(ROWS, 26, 0), (ROWS[:5], 5, 3), (97, 26, 1)])
def test_a_line_has_the_raw_lines_rows_and_label_and_torchrecs_dense(folder, rows, tables, seed):
    src = open_criteo(folder, batch_size=16, rows=rows, num_tables=tables, seed=seed)
    raw = CriteoFile(shared_criteo_sample(), batch_size=16, rows=rows, num_tables=tables, seed=seed)
    assert isinstance(src, TorchRecFolder) and src.days == list(range(11))
    assert src.num_lines == LINES and src.num_batches == raw.num_batches == LINES // 16
    dense = _stored(folder, "dense")
    for b in range(src.num_batches):          # batch 1 (lines 16..31) spans day_0 and day_1
        ours, theirs = src.batch(b), raw.batch(b)
        assert ours.index == b and len(ours.values) == tables
        for x, y in zip(ours.values + ours.offsets, theirs.values + theirs.offsets):
            assert np.array_equal(x.numpy(), y.numpy())
        assert np.array_equal(ours.labels.numpy(), theirs.labels.numpy())
        assert ours.dense.numpy().tobytes() == dense[b * 16:(b + 1) * 16].tobytes()


def test_the_fingerprint_follows_the_content(folder, tmp_path, monkeypatch):
    first = TorchRecFolder(folder, batch_size=16, rows=ROWS)
    assert TorchRecFolder(folder, batch_size=50, rows=3, num_tables=2, seed=4).fingerprint == first.fingerprint
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    assert TorchRecFolder(copy, batch_size=16, rows=ROWS).fingerprint == first.fingerprint
    sparse = np.load(copy / "day_9_sparse.npy")
    sparse[17, 25] ^= 1
    np.save(copy / "day_9_sparse.npy", sparse)
    assert TorchRecFolder(copy, batch_size=16, rows=ROWS).fingerprint != first.fingerprint
    # a big file is sampled: its first block still counts
    monkeypatch.setattr(torchrec_npy, "_WHOLE_BYTES", 256)
    monkeypatch.setattr(torchrec_npy, "_SAMPLE_BYTES", 64)
    sampled = TorchRecFolder(copy, batch_size=16, rows=ROWS).fingerprint
    dense = np.load(copy / "day_0_dense.npy")
    dense[0, 0] += 1
    np.save(copy / "day_0_dense.npy", dense)
    assert TorchRecFolder(copy, batch_size=16, rows=ROWS).fingerprint != sampled


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def _rewrite(path: Path, change) -> None:
    np.save(path, change(np.load(path)))


@pytest.mark.parametrize("spoil,message", [
    (lambda d: (d / "day_4_labels.npy").unlink(), r"day_4_labels.npy: missing \(TorchRec's layout has"),
    (lambda d: _rewrite(d / "day_2_dense.npy", lambda a: a.astype(np.float64)),
     r"day_2_dense.npy: holds float64 \[18, 13\], expected TorchRec's float32 \[n, 13\] with n = 18"),
    (lambda d: _rewrite(d / "day_3_sparse.npy", lambda a: a[:, :25]),
     r"day_3_sparse.npy: holds int32 \[18, 25\], expected TorchRec's int32 \[n, 26\]"),
    (lambda d: _rewrite(d / "day_5_labels.npy", lambda a: a[:-1]),
     r"day_5_labels.npy: holds int32 \[17, 1\], expected TorchRec's int32 \[n, 1\] with n = 18"),
    (lambda d: (d / "day_1_sparse.npy").write_bytes(b"not numpy"), "day_1_sparse.npy: not a readable .npy file"),
])
def test_a_spoilt_folder_is_one_line_on_open(folder, tmp_path, spoil, message):
    spoilt = _copy(folder, tmp_path)
    spoil(spoilt)
    with pytest.raises(ConfigError, match=message) as caught:
        open_criteo(spoilt, batch_size=16, rows=ROWS, num_tables=26, seed=0)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("part,change,message", [
    ("labels", lambda a: np.where(np.arange(len(a))[:, None] == 5, 2, a), "day_1_labels.npy, row 5: label is not 0 or 1"),
    ("dense", lambda a: np.where(np.arange(len(a))[:, None] == 5, -np.inf, a).astype(np.float32),
     "day_1_dense.npy, row 5: a dense value is not finite"),   # log(I + 3) of an I of -3
])
def test_a_bad_value_is_one_line_naming_file_and_row_when_its_batch_is_read(folder, tmp_path, part, change, message):
    spoilt = _copy(folder, tmp_path)
    _rewrite(spoilt / f"day_1_{part}.npy", change)
    src = TorchRecFolder(spoilt, batch_size=16, rows=ROWS)
    src.batch(0)                                  # lines 0..15: all in day_0
    with pytest.raises(ConfigError, match=message):
        src.batch(1)                              # line 23 = day_1's row 5


def test_what_is_not_a_torchrec_folder(folder, tmp_path):
    assert not torchrec_npy.is_torchrec_folder(tmp_path)                          # no day files
    (tmp_path / "manifest.json").write_text("{}")
    shutil.copy(folder / "day_0_dense.npy", tmp_path)
    assert not torchrec_npy.is_torchrec_folder(tmp_path)                          # a converted folder's
    with pytest.raises(ConfigError, match="18 lines, fewer than batch_size 64"):
        TorchRecFolder(write_torchrec_days(tmp_path / "one", shared_sample_rows()[:18], [18]), batch_size=64, rows=9)
