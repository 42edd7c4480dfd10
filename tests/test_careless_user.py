"""Every bad invocation a careless user types keeps the promise — a non-zero exit, one
line on stderr naming the problem, no traceback, no file left behind, an existing pool unchanged.

The command line runs in this process (cli.main), so the whole table takes seconds: every case is
refused by validation before any real work starts.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from cxltrain.cli import main
from helpers import write_criteo

SMALL = ["--steps", "3", "--rows", "500", "--num-tables", "2", "--dim", "8", "--batch-size", "32", "--no-progress"]
HUGE = str(10**30)

# (option, the word its error line must contain)
NUMERIC_TRAIN_OPTIONS = [("--steps", "steps"), ("--batch-size", "batch"), ("--num-tables", "tables"),
                         ("--rows", "rows"), ("--dim", "dim"), ("--seed", "seed"), ("--pooling", "pooling"),
                         ("--zipf", "zipf"), ("--dense-every", "dense"), ("--evict-rate", "evict"),
                         ("--persist-bandwidth", "persist-bandwidth")]
BAD_NUMBERS = ["0", "-1", HUGE, "1e400", "abc"]  # 1e400: not an integer, an infinite float
# in range, so not bad invocations: seed 0, steps 0 (set up, train nothing), no early write-back, a
# bandwidth cap too high to bind
ACCEPTED = {("--seed", "0"), ("--steps", "0"), ("--evict-rate", "0"), ("--persist-bandwidth", HUGE)}

CASES = [pytest.param(["train", "--pool", "{pool}", *SMALL, option, value], word, id=f"train {option} {value[:8]}")
         for option, word in NUMERIC_TRAIN_OPTIONS for value in BAD_NUMBERS if (option, value) not in ACCEPTED]
CASES += [
    pytest.param(["train", "--pool", "{pool}", *SMALL, "--persist-bandwidth", "-1G"], "persist-bandwidth", id="-1G"),
    pytest.param(["train", "--pool", "{pool}", *SMALL, "--checkpoint", "off"], "--discard-checkpoint", id="off"),
    pytest.param(["train", "--pool", "{pool}", *SMALL, "--seed", "9"], "other settings", id="other seed"),
    pytest.param(["train", "--pool", "{pool}", *SMALL, "--dim", "16"], "--dim 16 (the pool's: ", id="other model"),
    pytest.param(["train", "--pool", "{folder}/new.pool", "--batch-size", "100000000", "--no-progress"], "memory",
                 id="huge batch"),
    pytest.param(["train", "--pool", "{folder}/new.pool", "--num-tables", "100000", "--no-progress"], "memory",
                 id="huge model"),
    pytest.param(["train", "--pool", "{folder}/new.pool", "--rows", "1000000000", "--num-tables", "64",
                  "--no-progress"], "not enough space", id="huge pool"),
    pytest.param(["train", "--pool", "{folder}/new.pool", *SMALL, "--data", "{folder}/nope"], "nope", id="no data"),
    pytest.param(["train", "--pool", "{folder}", *SMALL], "directory", id="pool is a folder"),
    pytest.param(["train", "--bogus"], "unrecognized", id="bogus option"),
    pytest.param(["recover", "{folder}/missing.pool"], "no such pool", id="recover missing"),
    pytest.param(["export", "{pool}", "{pool}"], "already exists", id="export onto the pool"),
    pytest.param(["export", "{pool}", "{folder}/no/such/dir/x.pt"], "cannot write into", id="export nowhere"),
    pytest.param(["export", "{pool}", "{folder}/x.pt", "--format", "onnx"], "invalid choice", id="export onnx"),
    pytest.param(["import", "{folder}/missing.pt", "{folder}/n.pool"], "no such file", id="import missing"),
    pytest.param(["import", "{pool}", "{folder}/n.pool"], "not a torch export", id="import a pool"),
    pytest.param(["pool", "info", "{folder}/missing.pool"], "no such pool", id="info missing"),
    pytest.param(["pool", "check", "{folder}"], "directory", id="check a folder"),
    pytest.param(["pool", "create", "{pool}", "--size", "2M"], "already", id="create over the pool"),
    pytest.param(["pool", "create", "{folder}/c.pool", "--size", "-1M"], "size", id="create negative size"),
    pytest.param(["pool", "create", "{folder}/c.pool", "--size", "4K"], "too small", id="create tiny"),
    pytest.param(["crashtest", "--trials", "0"], "trials", id="crashtest no trials"),
    pytest.param([], "required", id="no command"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder on the memory-backed file system with one small trained pool in it."""
    import os
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="cxltrain-careless-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    pool = folder / "e.pool"
    assert main(["train", "--pool", str(pool), *SMALL]) == 0
    yield folder, pool
    shutil.rmtree(folder, ignore_errors=True)


def run(args: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,word", CASES)
def test_a_bad_invocation_is_one_line_and_changes_nothing(trained, capsys, args, word):
    folder, pool = trained
    args = [a.format(folder=folder, pool=pool) for a in args]
    listing, before = sorted(folder.iterdir()), pool.read_bytes()
    code, out, err = run(args, capsys)
    lines = err.strip().splitlines()
    assert code not in (0, None) and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert lines[0].startswith("cxltrain") and word in lines[0], lines[0]
    assert sorted(folder.iterdir()) == listing
    assert pool.read_bytes() == before


@contextlib.contextmanager
def small_file_system(folder: Path, options: str):
    """A tmpfs of its own mounted on `folder` (root only: the test skips elsewhere), unmounted after."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_folder_is_not_called_full(tmp_path, capsys):
    """A pool in a folder on a read-only file system is refused for that, not as "not enough
    space" (which a small read-only mount also is)."""
    with small_file_system(tmp_path / "ro", "ro,size=1m") as folder:
        assert main(["train", "--pool", str(folder / "x.pool"), *SMALL]) == 1
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "is not writable (a read-only file system" in err, err
        assert "not enough space" not in err and not (folder / "x.pool").exists()


def test_data_convert_onto_a_full_disk_is_one_line_and_leaves_no_files(tmp_path, capsys):
    """Before: a traceback (`OSError: [Errno 28] No space left on device`) and half-written columns."""
    with small_file_system(tmp_path / "full", "size=64k") as folder:
        (folder / "fill").write_bytes(bytes(60_000))
        out = folder / "converted"
        source = write_criteo(tmp_path / "day_0", 480, seed=11)
        assert main(["data", "convert", str(source), str(out), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "cannot write the converted data: No space left on device" in err, err
        assert not any(out.iterdir())


def test_train_metrics_onto_a_full_disk_is_one_line_and_the_pool_resumes(tmp_path, capsys):
    """Before: an OSError traceback. Now one line, the batch whose line failed is not committed, and
    the pool checks clean (its last commit the batch before)."""
    from cxltrain.pool.info import inspect

    pool = tmp_path / "m.pool"
    with small_file_system(tmp_path / "full", "size=64k") as folder:
        (folder / "fill").write_bytes(bytes(64 << 10))  # every page taken
        assert main(["train", "--pool", str(pool), *SMALL, "--metrics", str(folder / "m.jsonl"),
                     "--eval-every", "1"]) == 1
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        assert "m.jsonl: cannot write the metrics file: No space left on device; stopped before batch 1 committed" in err
    report = inspect(str(pool))
    assert report.ok and report.root.batches_done == 0, report.problems
