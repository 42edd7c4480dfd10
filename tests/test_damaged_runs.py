"""Damaged run directories (issue 35, item 2): `pool check DIR` checks a healthy 2-rank run and
refuses one whose manifest no longer fits its rank pools (a table's sharding edited, another run's
id) or whose rank pools were swapped or put back from an older copy; `pool info DIR`, `recover DIR`
and `export DIR` refuse the same, in one line, exit 1, before anything is written."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid

import pytest

from cxltrain.errors import PoolCorruptError
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import train as train_here
from cxltrain.pool.info import inspect
from cxltrain.pool.shard_format import SHARD_BYTES, SHARD_REGION, pack_shard, shard_json
from cxltrain.runtime import manifest as run_dir
from cxltrain.runtime import shard_record
from helpers import cxltrain, shm_tempdir

OPTIONS = ["--batch-size", "96", "--num-tables", "3", "--rows", "2000", "--dim", "16", "--sharding",
           "table-wise,row-wise,data-parallel", "--no-progress", "--dist-timeout", "30"]


def train(run: str, steps: int) -> None:
    done = cxltrain("train", "--nproc-per-node", "2", "--pool", run, "--steps", steps, *OPTIONS, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def run():
    """A 2-rank run trained to batch 6, with a copy of rank 1's pool at batch 2."""
    with shm_tempdir("cxltrain-runs-") as folder:
        path = os.path.join(folder, "run")
        train(path, 2)
        shutil.copy(run_dir.pool_path(path, 1), os.path.join(folder, "rank-1.at2"))
        train(path, 6)
        yield path


def digest(run: str) -> list[str]:
    return [hashlib.sha256(open(os.path.join(run, name), "rb").read()).hexdigest() for name in sorted(os.listdir(run))]


@contextlib.contextmanager
def damaged(case: str, run: str):
    """The run directory damaged `case`'s way, put back afterwards; yields what the refusal says."""
    saved = run + ".saved"
    shutil.copytree(run, saved)
    manifest_path = os.path.join(run, run_dir.MANIFEST)
    m = json.load(open(manifest_path))
    try:
        if case == "row-wise table said table-wise":
            m["plan"]["tables"][1].update(kind="table-wise", ranks=[0], bounds=[])
            json.dump(m, open(manifest_path, "w"))
            yield "manifest's plan"
        elif case == "another run's id":
            m["run"] = str(uuid.uuid4())
            json.dump(m, open(manifest_path, "w"))
            yield "is not rank 0's pool of this run"
        elif case == "a row-wise table's ranks in another order":  # fuzzer image 1195: the halves swap
            m["plan"]["tables"][1]["ranks"] = [1, 0]
            json.dump(m, open(manifest_path, "w"))
            yield "the manifest gives rank 0 rows 1,000-1,999 (row-wise)"
        elif case == "rank 0's record of its shard damaged":
            region = next(r for r in inspect(run_dir.pool_path(run, 0)).regions if r.name == SHARD_REGION)
            with open(run_dir.pool_path(run, 0), "r+b") as f:
                f.seek(region.offset + 40)
                f.write(b"\xff")
            yield "record of its own shard"
        elif case == "rank pools swapped":
            a, b = run_dir.pool_path(run, 0), run_dir.pool_path(run, 1)
            os.rename(a, a + ".tmp")
            os.rename(b, a)
            os.rename(a + ".tmp", b)
            yield "manifest's plan"
        elif case == "an old copy of rank 1":
            shutil.copy(os.path.join(os.path.dirname(run), "rank-1.at2"), run_dir.pool_path(run, 1))
            yield "cannot reach batch"
    finally:
        shutil.rmtree(run)
        os.rename(saved, run)


def test_pool_check_takes_a_healthy_run_directory(run):
    done = cxltrain("pool", "check", run)
    assert done.returncode == 0 and "2 rank(s)" in done.stdout and "batch 6" in done.stdout, done
    assert cxltrain("pool", "info", run).returncode == 0


CASES = ["row-wise table said table-wise", "another run's id", "rank pools swapped", "an old copy of rank 1",
         "a row-wise table's ranks in another order", "rank 0's record of its shard damaged"]
QUICK = ("row-wise table said table-wise", "rank pools swapped", "a row-wise table's ranks in another order")


# three of the six in the default suite (the suite's 10 minutes); -m slow runs all six
@pytest.mark.parametrize("case", [case if case in QUICK else pytest.param(case, marks=pytest.mark.slow)
                                  for case in CASES])
def test_a_damaged_run_directory_is_refused_by_every_command(run, case, tmp_path):
    with damaged(case, run) as expected:
        before = digest(run)
        for command in (("pool", "check", run), ("pool", "info", run), ("recover", run),
                        ("export", run, tmp_path / "out.pt")):
            done = cxltrain(*command)
            assert done.returncode == 1 and expected in done.stderr and "Traceback" not in done.stderr, done
            if command[:2] != ("pool", "check"):  # `pool check` lists every problem, one line each
                assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == "", done
        assert not (tmp_path / "out.pt").exists()
        assert digest(run) == before


def test_a_pool_without_a_record_of_its_shard_is_refused_only_in_a_run_that_records_one(run, tmp_path):
    """A rank pool of a cxltrain-dist/1 run folder (made before the record) is still read, checked by
    shape and snapshot; in a /2 folder the record is missing only from a pool put there from elsewhere."""
    single = str(tmp_path / "single.pool")
    train_here(TrainConfig(steps=1, batch_size=32, num_tables=1, rows=100, dim=8), pool_path=single, progress=False)
    m = run_dir.read(run)
    assert m["format"] == run_dir.FORMAT
    missing = shard_record.problems(single, inspect(single), m, 0)
    assert len(missing) == 1 and "holds no record of its own shard" in missing[0], missing
    assert shard_record.problems(single, inspect(single), {**m, "format": "cxltrain-dist/1"}, 0) == []


def test_an_older_run_folder_is_still_read(run):
    """A cxltrain-dist/1 manifest is read (its pools' records, where they have one, still checked)."""
    manifest_path = os.path.join(run, run_dir.MANIFEST)
    saved = open(manifest_path).read()
    try:
        json.dump({**json.loads(saved), "format": "cxltrain-dist/1"}, open(manifest_path, "w"))
        done = cxltrain("pool", "check", run)
        assert done.returncode == 0 and "batch 6" in done.stdout, done
    finally:
        open(manifest_path, "w").write(saved)


def test_a_record_of_a_shard_reads_back_and_a_damaged_or_foreign_one_is_refused():
    record = {"run": "r", "rank": 1, "world_size": 2, "tables": [{"name": "t1", "kind": "row-wise", "rows": [5, 9]}]}
    uuid = bytes(range(16))
    raw = pack_shard(record, uuid)
    assert len(raw) == SHARD_BYTES and shard_json(raw, uuid) == record
    damaged = bytearray(raw)
    damaged[30] ^= 1
    with pytest.raises(PoolCorruptError, match="record of its own shard .* is damaged"):
        shard_json(bytes(damaged), uuid)
    with pytest.raises(PoolCorruptError, match="is damaged"):
        shard_json(raw, bytes(16))  # another pool's
