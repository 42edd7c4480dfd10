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

from cxltrain.runtime import manifest as run_dir
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


CASES = ["row-wise table said table-wise", "another run's id", "rank pools swapped", "an old copy of rank 1"]


# two of the four in the default suite (the suite's 10 minutes); -m slow runs all four
@pytest.mark.parametrize("case", [case if case in ("row-wise table said table-wise", "rank pools swapped")
                                  else pytest.param(case, marks=pytest.mark.slow) for case in CASES])
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
