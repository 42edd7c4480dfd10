"""File data at speed: the native parser against the Python one, gzipped files, converted folders,
prefetching, epochs. All on generated files (helpers.write_criteo), in this process.

The native parser must give the Python parser's values bit for bit and its one-line errors; a
gzipped file and a converted folder must give the plain file's batches (one conversion at any
rows and seed); every bad input is one line naming the file (and line), never a shorter epoch."""

from __future__ import annotations

import gzip
import json
import shutil
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from cxltrain.data import CriteoFile
from cxltrain.data import converted as conv
from cxltrain.data.files import Epochs, open_criteo
from cxltrain.data.lines import LineParser, native_built
from cxltrain.data.prefetch import Prefetcher
from cxltrain.errors import ConfigError
from helpers import CRITEO_HEADER, assert_same_batch, criteo_rows, write_criteo

LINES = 300
ROWS = [1000 + 7 * t for t in range(26)]   # a different bucket count per table

needs_native = pytest.mark.skipif(not native_built(), reason="the C parser (kernels/criteo.c) was not built")


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    return write_criteo(tmp_path_factory.mktemp("files") / "day_0", LINES, seed=5)


def parsers(sep: str = "\t", num_tables: int = 26, seed: int = 3, hashes: bool = False) -> tuple[LineParser, LineParser]:
    rows = None if hashes else ROWS[:num_tables]
    return (LineParser("f", sep, num_tables, rows, seed, native=True),
            LineParser("f", sep, num_tables, rows, seed, native=False))


def assert_same_columns(a, b) -> None:
    for x, y in ((a.dense, b.dense), (a.ids, b.ids), (a.labels, b.labels), (a.present, b.present)):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


# -- the native parser ------------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("num_tables,hashes", [(1, False), (13, False), (26, False), (26, True), (5, True)])
def test_native_parser_gives_the_python_parsers_values(raw, num_tables, hashes):
    """Row ids, or (rows=None, what `data convert` stores) the hashes and which fields were present."""
    data = raw.read_bytes()
    native, python = parsers(num_tables=num_tables, hashes=hashes)
    (a, end_a), (b, end_b) = native.parse_bytes(data, 1, LINES), python.parse_bytes(data, 1, LINES)
    assert len(a) == LINES and end_a == end_b == len(data)
    assert_same_columns(a, b)


@needs_native
def test_forms_only_python_reads_go_to_python_with_the_same_result():
    """Counts as "2.6e2", "+5", " 7", "-0", huge numbers, CRLF endings, labels "1.0", upper-case hex,
    16-digit hashes, non-ASCII in a column the run does not keep: each line gives Python's values."""
    rows = criteo_rows(30, seed=2)[:12]
    forms = ["2.6e2", "+5", " 7", "-0", "-0.0", "123456789012345678901", "260.000", "007", "-3.0", "0.0", "", "9"]
    for i, form in enumerate(forms):
        rows[i][1 + i] = form
    rows[1][0], rows[2][14], rows[3][15] = "1.0", "ABCDEF01", "ffffffffffffffff"
    lines = ["\t".join(r) for r in rows]
    lines[4] += "\r"
    data = ("\n".join(lines) + "\n").encode()
    for hashes in (False, True):
        native, python = parsers(hashes=hashes)
        assert_same_columns(native.parse_bytes(data, 1, 12)[0], python.parse_bytes(data, 1, 12)[0])
    rows[5][39] = "é"   # C26: not kept with 25 tables; still checked as UTF-8 by both
    data = ("\n".join("\t".join(r) for r in rows) + "\n").encode()
    native, python = parsers(num_tables=25)
    assert_same_columns(native.parse_bytes(data, 1, 12)[0], python.parse_bytes(data, 1, 12)[0])


@needs_native
@pytest.mark.parametrize("column,value,message", [
    (None, None, "39 tab-separated fields"), (0, "2", "label is '2'"), (3, "x", "I3 is 'x', not an integer"),
    (3, "1.5", "I3 is '1.5'"), (14, "zz", "C1 is 'zz', not a hex hash"), (20, "1" * 17, "C7 is '1{17}'"),
    (22, b"\xff", "not UTF-8 text"),
])
def test_native_and_python_name_the_same_bad_line(column, value, message):
    rows = criteo_rows(40, seed=4)
    lines = ["\t".join(r).encode() for r in rows]
    if column is None:
        lines[29] = b"\t".join(lines[29].split(b"\t")[:-1])
    else:
        fields = lines[29].split(b"\t")
        fields[column] = value if isinstance(value, bytes) else value.encode()
        lines[29] = b"\t".join(fields)
    data = b"\n".join(lines) + b"\n"
    for parser in parsers():
        with pytest.raises(ConfigError, match=f"^f, line 40: {message}"):
            parser.parse_bytes(data, 11, 40)


# -- gzipped files and the raw layout's header ---------------------------------------------------------

def test_a_gzipped_file_gives_the_plain_files_batches_in_any_order(raw, tmp_path):
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(raw.read_bytes()))
    plain, packed = (CriteoFile(p, batch_size=16, rows=ROWS, seed=1) for p in (raw, gz))
    assert packed.gzipped and packed.num_batches == plain.num_batches == LINES // 16
    assert packed.fingerprint == plain.fingerprint        # the content, not the compression
    for b in [0, 1, 2, 17, 5, 6, 0]:                       # on, forward with a gap, back to the start
        assert_same_batch(packed.batch(b), plain.batch(b))


def test_concatenated_gzip_members_are_one_stream(raw, tmp_path):
    data = raw.read_bytes()
    half = data.index(b"\n", len(data) // 2) + 1
    gz = tmp_path / "two_members"
    gz.write_bytes(gzip.compress(data[:half]) + gzip.compress(data[half:]))
    packed = CriteoFile(gz, batch_size=16, rows=ROWS)
    assert packed.num_lines == LINES
    assert_same_batch(packed.batch(10), CriteoFile(raw, batch_size=16, rows=ROWS).batch(10))


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[: len(b) // 2], "truncated .gz file"),
    (lambda b: b[:40] + bytes(x ^ 0x55 for x in b[40:80]) + b[80:], "corrupt .gz file"),
    (lambda b: b[:-8] + (zlib.crc32(b"x") ^ 1).to_bytes(4, "little") + b[-4:], "corrupt .gz file"),
    (lambda b: b + b"junk", "corrupt .gz file"),
])
def test_a_damaged_gzip_file_is_one_line_naming_it(raw, tmp_path, damage, message):
    gz = tmp_path / "bad.gz"
    gz.write_bytes(damage(gzip.compress(raw.read_bytes())))
    with pytest.raises(ConfigError, match=message) as caught:
        CriteoFile(gz, batch_size=16, rows=ROWS)
    assert str(gz) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=message):
        conv.convert([gz], tmp_path / "out")
    assert not (tmp_path / "out" / conv.MANIFEST).exists()


def test_the_raw_layout_may_carry_a_header_line(raw, tmp_path):
    headed = tmp_path / "headed.tsv"
    headed.write_bytes("\t".join(CRITEO_HEADER).encode() + b"\n" + raw.read_bytes())
    src = CriteoFile(headed, batch_size=16, rows=ROWS)
    assert src.num_lines == LINES
    assert_same_batch(src.batch(3), CriteoFile(raw, batch_size=16, rows=ROWS).batch(3))
    lines = headed.read_text().splitlines()
    lines[20] = lines[20].replace("\t", "\tx\t", 1)
    headed.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="headed.tsv, line 21: 41 tab-separated fields"):
        CriteoFile(headed, batch_size=16, rows=ROWS).batch(1)


# -- converted folders ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(raw, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "out"
    gz = out.parent / "day_0.gz"
    gz.write_bytes(gzip.compress(raw.read_bytes()))
    seen = []
    manifest = conv.convert([gz], out, progress=seen.append)
    assert manifest["lines"] == LINES and sum(seen) == gz.stat().st_size
    assert manifest["exceptions"] == 0          # 8-hex-digit hashes, none 0: sparse.npy holds them all
    return out


@pytest.mark.parametrize("rows,tables,seed", [(ROWS, 26, 1), (ROWS[:4], 4, 1), (37, 26, 1), (2**32, 26, 0)])
def test_one_converted_folder_gives_the_sources_batches_at_any_rows_and_seed(raw, converted, rows, tables, seed):
    plain = CriteoFile(raw, batch_size=16, rows=rows, num_tables=tables, seed=seed)
    folder = conv.ConvertedCriteo(converted, batch_size=16, rows=rows, num_tables=tables, seed=seed)
    assert folder.num_batches == plain.num_batches and folder.fingerprint == plain.fingerprint
    for b in range(plain.num_batches):
        assert_same_batch(folder.batch(b), plain.batch(b))


def test_the_folder_holds_the_raw_values_as_numpy_reads_them(raw, converted):
    """sparse.npy is the integers of C1..C26's hex digits (missing 0), TorchRec's form of them."""
    sparse = np.load(converted / "sparse.npy")
    fields = [line.split("\t") for line in raw.read_text().splitlines()]
    assert sparse.dtype == np.uint32 and sparse.shape == (LINES, 26)
    assert sparse.tolist() == [[int(v or "0", 16) for v in f[14:]] for f in fields]


def test_values_sparse_npy_cannot_hold_are_kept_exactly(raw, tmp_path):
    """A hash of 0 (sparse.npy's 0 means missing) and hashes of more than 32 bits go to the exception
    files, and the folder still gives the raw file's batches, for tables kept or not."""
    lines = [line.split("\t") for line in raw.read_text().splitlines()]
    odd = {(3, 14): "00000000", (3, 15): "0", (40, 16): "ffffffffffffffff", (41, 39): "123456789",
           (299, 14): "100000000", (120, 30): "0000000000000000"}
    for (line, field), value in odd.items():
        lines[line][field] = value
    edited = tmp_path / "edited"
    edited.write_text("".join("\t".join(f) + "\n" for f in lines))
    manifest = conv.convert([edited], tmp_path / "out")
    assert manifest["exceptions"] == len(odd)
    cells = np.load(tmp_path / "out" / "exception_cells.npy")
    assert cells.tolist() == sorted(line * 26 + field - 14 for line, field in odd)
    for rows, tables in ((ROWS, 26), (ROWS[:3], 3), (5, 26)):
        plain = CriteoFile(edited, batch_size=20, rows=rows, num_tables=tables, seed=7)
        folder = conv.ConvertedCriteo(tmp_path / "out", batch_size=20, rows=rows, num_tables=tables, seed=7)
        for b in range(plain.num_batches):
            assert_same_batch(folder.batch(b), plain.batch(b))


def test_converting_several_sources_appends_them_in_order(raw, tmp_path):
    csv = write_criteo(tmp_path / "sample.csv", 100, seed=9, layout="csv")
    conv.convert([raw, csv], tmp_path / "both")
    both = conv.ConvertedCriteo(tmp_path / "both", batch_size=50, rows=ROWS)
    assert both.num_lines == LINES + 100 and both.num_batches == (LINES + 100) // 50
    assert_same_batch(both.batch(1), CriteoFile(raw, batch_size=50, rows=ROWS).batch(1))
    tail = CriteoFile(csv, batch_size=50, rows=ROWS).batch(1)
    assert np.array_equal(both.batch(7).labels.numpy(), tail.labels.numpy())
    for x, y in zip(both.batch(7).values, tail.values):
        assert np.array_equal(x.numpy(), y.numpy())


def test_convert_names_a_malformed_line(raw, tmp_path):
    lines = raw.read_text().splitlines()
    lines[122] = lines[122].replace("\t", "\t\t", 1)
    bad = tmp_path / "day_1"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="day_1, line 123: 41 tab-separated fields"):
        conv.convert([raw, bad], tmp_path / "out")
    with pytest.raises(ConfigError, match="manifest.json is missing"):   # never read half-done
        conv.ConvertedCriteo(tmp_path / "out", batch_size=16, rows=ROWS)
    with pytest.raises(ConfigError, match="not empty"):
        conv.convert([raw], tmp_path / "out")


def _copy(converted: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(converted, tmp_path / "copy"))


@pytest.mark.parametrize("spoil,message", [
    (lambda d: (d / "sparse.npy").unlink(), "sparse.npy: missing from the converted folder"),
    (lambda d: (d / "exception_cells.npy").unlink(), "exception_cells.npy: missing from the converted folder"),
    (lambda d: _edit_manifest(d, version=3), "format version 3, this cxltrain reads versions 1 and 2"),
    (lambda d: _edit_manifest(d, format="other"), "format 'other'"),
    (lambda d: _edit_manifest(d, lines=LINES + 1), "dense.npy: holds float32 .300, 13., the manifest says float32 .301, 13."),
    (lambda d: _edit_manifest(d, exceptions=2), "exception_cells.npy: holds uint64 .0,., the manifest says uint64 .2,."),
    (lambda d: _edit_manifest(d, exceptions=None), "not a readable manifest"),
    (lambda d: (d / "dense.npy").write_bytes((d / "dense.npy").read_bytes()[:1000]), "dense.npy: not a readable"),
    (lambda d: (d / conv.MANIFEST).write_text("{"), "not a readable manifest"),
])
def test_a_spoilt_converted_folder_is_one_line(converted, tmp_path, spoil, message):
    folder = _copy(converted, tmp_path)
    spoil(folder)
    with pytest.raises(ConfigError, match=message) as caught:
        conv.ConvertedCriteo(folder, batch_size=16, rows=ROWS, seed=1)
    assert "\n" not in str(caught.value)


def _edit_manifest(folder: Path, **changes) -> None:
    manifest = json.loads((folder / conv.MANIFEST).read_text())
    manifest.update(changes)
    (folder / conv.MANIFEST).write_text(json.dumps(manifest))


def _version_1_folder(raw: Path, out: Path, rows: list[int], seed: int) -> Path:
    """A folder as cxltrain wrote it before version 2: row ids for `rows` and `seed` in sparse.npy."""
    columns = LineParser(raw, "\t", 26, rows, seed).parse_bytes(raw.read_bytes(), 1, LINES)[0]
    out.mkdir()
    np.save(out / "dense.npy", columns.dense)
    np.save(out / "sparse.npy", columns.ids.astype(np.uint32))
    np.save(out / "labels.npy", columns.labels)
    source = CriteoFile(raw, batch_size=16, rows=rows, seed=seed)
    (out / conv.MANIFEST).write_text(json.dumps({
        "format": conv.FORMAT, "version": 1, "lines": LINES, "rows": rows, "seed": seed,
        "sources": [{"name": raw.name, "lines": LINES, "fingerprint": source.fingerprint}],
        "fingerprint": source.fingerprint}))
    return out


def test_a_version_1_folder_trains_at_its_own_rows_and_says_convert_again_at_others(raw, tmp_path):
    old = _version_1_folder(raw, tmp_path / "old", ROWS, seed=1)
    plain = CriteoFile(raw, batch_size=16, rows=ROWS[:3], num_tables=3, seed=1)
    folder = open_criteo(old, batch_size=16, rows=ROWS[:3], num_tables=3, seed=1)
    assert isinstance(folder, conv.ConvertedCriteo) and folder.fingerprint == plain.fingerprint
    for b in (0, 5, plain.num_batches - 1):
        assert_same_batch(folder.batch(b), plain.batch(b))
    with pytest.raises(ConfigError, match="row ids fixed for rows 1000,1007,1014 per table, but this run asks for "
                                          "1000 .convert again: a folder converted now serves any --rows.$"):
        conv.ConvertedCriteo(old, batch_size=16, rows=1000, num_tables=3, seed=1)
    with pytest.raises(ConfigError, match="row ids fixed for seed 1, but this run has seed 0 .convert again"):
        conv.ConvertedCriteo(old, batch_size=16, rows=ROWS, seed=0)


# -- prefetching and epochs -------------------------------------------------------------------------

def test_prefetched_batches_are_the_sources_in_order_and_after_jumps(converted):
    src = conv.ConvertedCriteo(converted, batch_size=16, rows=ROWS, seed=1)
    with Prefetcher(src, start=2, stop=src.num_batches, depth=2) as ahead:
        for b in [2, 3, 4, 9, 10, 1, 2, src.num_batches - 1]:
            assert_same_batch(ahead.get(b), src.batch(b))
        assert ahead._queue.maxsize == 2    # bounded: at most depth batches wait


class _Failing:
    num_batches = 10

    def __init__(self, source, bad: int) -> None:
        self.source, self.bad, self.threads = source, bad, set()

    def batch(self, b: int):
        self.threads.add(threading.current_thread().name)
        if b == self.bad:
            raise ConfigError(f"batch {b} is bad")
        return self.source.batch(b)


def test_a_prefetch_error_is_raised_for_its_batch_on_the_callers_thread(converted):
    source = _Failing(conv.ConvertedCriteo(converted, batch_size=16, rows=ROWS, seed=1), bad=3)
    ahead = Prefetcher(source, start=0, stop=10)
    for b in range(3):
        ahead.get(b)
    with pytest.raises(ConfigError, match="batch 3 is bad"):
        ahead.get(3)
    ahead.close()
    assert "cxltrain-prefetch" in source.threads


def test_epochs_renumber_the_training_batches(converted):
    src = conv.ConvertedCriteo(converted, batch_size=16, rows=ROWS, seed=1)
    epochs = Epochs(src, range(0, src.num_batches - 4), 3)
    per_epoch = src.num_batches - 4
    assert epochs.num_batches == 3 * per_epoch and epochs.position(per_epoch + 2) == (1, 2)
    again = epochs.batch(2 * per_epoch + 5)
    assert again.index == 2 * per_epoch + 5
    assert np.array_equal(again.dense.numpy(), src.batch(5).dense.numpy())
    with pytest.raises(IndexError):
        epochs.batch(3 * per_epoch)
