"""CriteoFile: both layouts, random access, values as documented, malformed input.

The tests read a file they generate (helpers.write_criteo: LINES rows in the layout of the shared
sample, with its properties: negatives, missing values, 27 distinct C1 values), so a plain clone
runs them. The real sample, ../shared/data/criteo_sample.csv, is read by the last two tests, which
skip where it is absent."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cxltrain.data import CriteoFile, criteo
from cxltrain.data.synthetic import hash_key, splitmix64
from cxltrain.errors import ConfigError
from helpers import assert_same_batch, shared_criteo_sample, write_criteo

LINES = 200   # data lines in the sample (the shared one and the generated one alike)


def read_rows(sample: Path) -> list[list[str]]:
    """The sample's data lines as fields (header dropped)."""
    with open(sample, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(criteo.HEADER) and len(rows) == LINES + 1
    return rows[1:]


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """A generated sample in the shared sample's layout (CSV, with header): LINES rows."""
    return write_criteo(tmp_path_factory.mktemp("criteo") / "criteo_sample.csv", LINES, layout="csv")


@pytest.fixture(scope="module")
def sample_rows(sample) -> list[list[str]]:
    """The sample's data lines as fields (header dropped)."""
    return read_rows(sample)


@pytest.fixture(scope="module")
def shared_sample() -> Path:
    """The real shared sample (CSV layout, with header)."""
    return shared_criteo_sample()


def raw_fields(fields: list[str]) -> list[str]:
    """A sample line's fields as the raw Criteo layout writes them: integers as integers."""
    return [fields[0], *(str(int(float(v))) if v else "" for v in fields[1:14]), *fields[14:]]


def write_raw(
    path: Path, rows: list[list[str]], ending: str = "\n", final_newline: bool = True
) -> Path:
    """Write rows in the raw layout (tab-separated) with the given line ending."""
    text = ending.join("\t".join(raw_fields(r)) for r in rows) + (ending if final_newline else "")
    path.write_bytes(text.encode())
    return path


@pytest.fixture()
def raw_file(tmp_path, sample_rows) -> Path:
    return write_raw(tmp_path / "day_0", sample_rows)


# -- both layouts, values ---------------------------------------------------------------------


def test_raw_and_csv_layouts_give_the_same_batches(raw_file, sample):
    assert_raw_and_csv_layouts_give_the_same_batches(raw_file, sample)


def assert_raw_and_csv_layouts_give_the_same_batches(raw_file: Path, sample: Path) -> None:
    """The sample and its raw-layout copy read as the same batches."""
    raw = CriteoFile(raw_file, batch_size=16, rows=1000)
    sample = CriteoFile(sample, batch_size=16, rows=1000)
    assert (raw.layout, sample.layout) == ("tsv", "csv")
    assert raw.num_batches == sample.num_batches == LINES // 16
    for b in range(raw.num_batches):
        assert_same_batch(raw.batch(b), sample.batch(b))


def test_values_are_as_documented(sample, sample_rows):
    assert_values_are_as_documented(sample, sample_rows)


def assert_values_are_as_documented(sample: Path, sample_rows: list[list[str]]) -> None:
    """Every dense value, label and id of the sample, read as one batch, is what the docs say."""
    src = CriteoFile(sample, batch_size=LINES, rows=10**6, seed=3)
    batch = src.batch(0)
    assert batch.dense.shape == (LINES, 13) and batch.dense.dtype == torch.float32
    assert batch.labels.tolist() == [float(r[0]) for r in sample_rows]
    expected = [[math.log1p(max(float(v), 0)) if v else 0.0 for v in r[1:14]] for r in sample_rows]
    assert torch.allclose(batch.dense, torch.tensor(expected, dtype=torch.float32))
    # The sample exercises negatives (→ 0) and missing values (→ 0).
    assert any(v.startswith("-") for r in sample_rows for v in r[1:14])
    assert any(v == "" for r in sample_rows for v in r[1:14])
    for t in range(26):
        column = [r[14 + t] for r in sample_rows]
        ids = batch.values[t].numpy()
        assert batch.values[t].dtype == torch.int64
        assert torch.equal(batch.offsets[t], torch.arange(LINES))
        present = np.array([v != "" for v in column])
        assert (ids[~present] == 0).all()
        hashes = np.array([int(v, 16) for v in column if v], dtype=np.uint64)
        expect = splitmix64(hashes ^ np.uint64(hash_key(3, t))) % np.uint64(10**6)
        assert (ids[present] == expect.astype(np.int64)).all()
    # Equal hashes give equal ids: C1 has 27 distinct values over the 200 lines.
    assert len(set(batch.values[0].tolist())) == len({r[14] for r in sample_rows}) == 27


def test_seed_changes_ids_only(sample):
    a = CriteoFile(sample, batch_size=50, rows=10**6, seed=0).batch(1)
    b = CriteoFile(sample, batch_size=50, rows=10**6, seed=1).batch(1)
    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert all(not torch.equal(x, y) for x, y in zip(a.values, b.values))


def test_num_tables_keeps_the_first_features(sample):
    rows = [10, 20, 30]
    few = CriteoFile(sample, batch_size=40, rows=rows, num_tables=3).batch(2)
    many = CriteoFile(sample, batch_size=40, rows=rows + [99] * 23).batch(2)
    assert len(few.values) == len(few.offsets) == 3
    for t in range(3):
        assert torch.equal(few.values[t], many.values[t])
        assert int(few.values[t].max()) < rows[t]


# -- random access and the index ------------------------------------------------------------


def test_jumping_to_a_batch_equals_reading_in_order(raw_file):
    src = CriteoFile(raw_file, batch_size=7, rows=500)
    in_order = list(src.batches())
    assert [b.index for b in in_order] == list(range(LINES // 7))
    for b in reversed(range(src.num_batches)):
        assert_same_batch(src.batch(b), in_order[b])
    assert [b.index for b in src.batches(3, 6)] == [3, 4, 5]
    again = CriteoFile(raw_file, batch_size=7, rows=500)
    assert_same_batch(again.batch(17), in_order[17])


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("batch_size", [1, 3, 64, 200])
def test_index_is_right_across_read_chunks(raw_file, monkeypatch, chunk, batch_size):
    whole = CriteoFile(raw_file, batch_size=batch_size, rows=100)
    monkeypatch.setattr(criteo, "_INDEX_CHUNK", chunk)
    chunked = CriteoFile(raw_file, batch_size=batch_size, rows=100)
    assert chunked.num_batches == whole.num_batches == LINES // batch_size
    for b in {0, whole.num_batches // 2, whole.num_batches - 1}:
        assert_same_batch(chunked.batch(b), whole.batch(b))


def test_last_partial_batch_is_dropped(raw_file, sample_rows):
    src = CriteoFile(raw_file, batch_size=64, rows=100)
    assert (src.num_lines, src.num_batches) == (LINES, 3)
    assert [float(r[0]) for r in sample_rows[128:192]] == src.batch(2).labels.tolist()
    with pytest.raises(IndexError, match="batch 3"):
        src.batch(3)


@pytest.mark.parametrize("ending, final_newline", [("\n", False), ("\r\n", True), ("\r\n", False)])
def test_line_endings(tmp_path, raw_file, sample_rows, ending, final_newline):
    other = write_raw(tmp_path / "other", sample_rows, ending, final_newline)
    for batch_size in (40, 200):
        reference = CriteoFile(raw_file, batch_size=batch_size, rows=100)
        src = CriteoFile(other, batch_size=batch_size, rows=100)
        assert src.num_batches == reference.num_batches
        for b in range(src.num_batches):
            assert_same_batch(src.batch(b), reference.batch(b))


# -- malformed input ------------------------------------------------------------------------


def corrupt(rows: list[list[str]], line: int, column: int, value: str | None) -> list[str]:
    """Raw-layout text lines of rows; data line `line` (1-based) has one field set or dropped."""
    fields = [raw_fields(r) for r in rows]
    if value is None:
        del fields[line - 1][column]
    else:
        fields[line - 1][column] = value
    return ["\t".join(f) for f in fields]


@pytest.mark.parametrize(
    "column, value, message",
    [
        (20, None, "39 tab-separated fields, expected 40"),
        (3, "abc", "I3 is 'abc', not an integer"),
        (3, "2.5", "I3 is '2.5', not an integer"),
        (0, "2", "label is '2', expected 0 or 1"),
        (0, "", "label is '', expected 0 or 1"),
        (14, "zz12", "C1 is 'zz12', not a hex hash"),
        (39, "-1f", "C26 is '-1f', not a hex hash"),
        (15, "1" * 17, "C2 is '1{17}', not a hex hash"),
    ],
)
def test_a_malformed_line_is_named_when_its_batch_is_read(
    tmp_path, sample_rows, column, value, message
):
    path = tmp_path / "bad.txt"
    path.write_text("\n".join(corrupt(sample_rows, 37, column, value)) + "\n")
    src = CriteoFile(path, batch_size=16, rows=100)   # line 37 is in batch 2 (lines 33..48)
    src.batch(1)
    with pytest.raises(ConfigError, match=f"bad.txt, line 37: {message}") as caught:
        src.batch(2)
    assert "\n" not in str(caught.value)


def test_an_empty_line_is_malformed(tmp_path, sample_rows):
    lines = ["\t".join(raw_fields(r)) for r in sample_rows]
    lines[9] = ""
    path = tmp_path / "gap.txt"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="gap.txt, line 10: empty line"):
        CriteoFile(path, batch_size=16, rows=100).batch(0)


def test_csv_line_numbers_count_the_header(tmp_path, sample):
    lines = sample.read_text().splitlines()
    lines[5] = lines[5].replace(",", ",x,", 1)   # data line 5 gets an extra field
    path = tmp_path / "sample.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="sample.csv, line 6: 41 comma-separated fields"):
        CriteoFile(path, batch_size=10, rows=100).batch(0)


def test_a_bad_first_line_fails_on_open(tmp_path, sample_rows):
    path = tmp_path / "bad_first.txt"
    path.write_text("\n".join(corrupt(sample_rows, 1, 0, "yes")) + "\n")
    with pytest.raises(ConfigError, match="bad_first.txt, line 1: label is 'yes'"):
        CriteoFile(path, batch_size=16, rows=100)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "the file is empty"),
        (",".join(criteo.HEADER).encode() + b"\n", "no data lines"),
        (b"hello world\n", "line 1: neither tab- nor comma-separated"),
        (b"label,I1,I2\n1,2,3\n", "line 1: header is not label,I1..I13,C1..C26"),
        (b"\xff\xfe\x00\x01\t\n", "line 1: not UTF-8 text"),
    ],
)
def test_files_that_are_not_criteo_are_refused(tmp_path, content, message):
    path = tmp_path / "input"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as caught:
        CriteoFile(path, batch_size=4, rows=100)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        CriteoFile(tmp_path / "nope.txt", batch_size=4, rows=100)
    with pytest.raises(ConfigError, match="is a directory"):
        CriteoFile(tmp_path, batch_size=4, rows=100)


def test_fewer_lines_than_a_batch(raw_file):
    assert CriteoFile(raw_file, batch_size=LINES, rows=100).num_batches == 1
    with pytest.raises(ConfigError, match=f"200 data lines, fewer than batch_size {LINES + 1}"):
        CriteoFile(raw_file, batch_size=LINES + 1, rows=100)


def test_a_file_changed_after_opening_is_refused(raw_file):
    src = CriteoFile(raw_file, batch_size=16, rows=100)
    with open(raw_file, "a") as f:
        f.write(raw_file.read_text().splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match="changed"):
        src.batch(0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0, rows=10), "batch_size must be >= 1"),
        (dict(batch_size=4, rows=0), "rows must be between"),
        (dict(batch_size=4, rows=[10] * 25), "rows has 25 entries but there are 26 tables"),
        (dict(batch_size=4, rows=10, num_tables=0), "num_tables must be between"),
        (dict(batch_size=4, rows=10, num_tables=27), "num_tables must be between"),
        (dict(batch_size=4, rows=10, seed=-1), "seed must be between"),
    ],
)
def test_bad_settings_are_refused(tmp_path, kwargs, message):
    # Settings are checked before the file is opened: this file need not exist.
    with pytest.raises(ConfigError, match=message):
        CriteoFile(tmp_path / "day_0", **kwargs)


# -- the real sample ------------------------------------------------------------------------


def test_the_shared_sample_values_are_as_documented(shared_sample):
    assert_values_are_as_documented(shared_sample, read_rows(shared_sample))


def test_the_shared_sample_reads_the_same_in_the_raw_layout(tmp_path, shared_sample):
    raw_file = write_raw(tmp_path / "day_0", read_rows(shared_sample))
    assert_raw_and_csv_layouts_give_the_same_batches(raw_file, shared_sample)
