"""Damaged pool sets (issue 35, item 1): a damaged capacity pool, hot-row cache map or stored
placement plan is refused by every read-only command (`pool info`, `pool check`, `recover`,
`export`) with one line and exit 1, and by `train` before it writes anything.

The primary lives on /dev/shm, the capacity pool on the disk, as `train --capacity-pool` puts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil

import numpy as np
import pytest

from cxltrain.errors import PoolError
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import train
from cxltrain.placement.planner import PLAN_REGION
from cxltrain.pool.cache_format import region_names
from cxltrain.pool.handle import Pool
from cxltrain.pool.info import inspect
from helpers import cxltrain, tier_folders

CONFIG = TrainConfig(steps=2, batch_size=64, num_tables=2, rows=3000, dim=16, cache_rows=300)


@pytest.fixture(scope="module")
def cached_set():
    """(primary, capacity pool) of a cached set trained to batch 2."""
    with tier_folders("cxltrain-damaged-") as (fast, disk):
        primary, capacity = os.path.join(fast, "s.pool"), os.path.join(disk, "s.cap")
        train(dataclasses.replace(CONFIG, capacity_pool=capacity), pool_path=primary, progress=False)
        yield primary, capacity


def digest(*paths: str) -> list[str]:
    return [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]


def _region_offset(path: str, name: str) -> tuple[int, tuple]:
    report = inspect(path)
    region = next(r for r in report.regions if r.name == name)
    return region.offset, region


def _map_offsets(primary: str) -> tuple[int, int, int]:
    """(offset of slot 0's map entry, row stride, slots) of table t0's cache map."""
    offset, region = _region_offset(primary, region_names("t0")[1])
    return offset + (region.shape[1] - 1) * 4, region.row_stride, region.shape[0]


@contextlib.contextmanager
def damaged(case: str, primary: str, capacity: str):
    """The set damaged `case`'s way, put back afterwards; yields what the refusal must say."""
    saved = [(p, p + ".saved") for p in (primary, capacity)]
    for path, copy in saved:
        shutil.copy(path, copy)
    try:
        if case == "empty member":
            os.truncate(capacity, 0)
            yield "capacity pool"
        elif case == "bad member superblock":
            with open(capacity, "r+b") as f:
                f.seek(100)
                f.write(b"\xff")
            yield "capacity pool"
        elif case == "map row out of bounds":
            entry, _, _ = _map_offsets(primary)
            with open(primary, "r+b") as f:
                f.seek(entry)
                f.write(np.int32(1 << 30).tobytes())
            yield "row map"
        elif case == "map row twice":
            entry, stride, _ = _map_offsets(primary)
            with open(primary, "r+b") as f:
                f.seek(entry)
                first = f.read(4)
                f.seek(entry + stride)
                f.write(first)
            yield "row map"
        elif case == "plan byte flipped":
            offset, _ = _region_offset(primary, PLAN_REGION)
            with open(primary, "r+b") as f:
                f.seek(offset + 40)
                byte = f.read(1)
                f.seek(offset + 40)
                f.write(bytes([byte[0] ^ 0x20]))
            yield "placement plan"
    finally:
        for path, copy in saved:
            os.replace(copy, path)


CASES = ["empty member", "bad member superblock", "map row out of bounds", "map row twice", "plan byte flipped"]


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_set_is_refused_by_open_and_inspect_and_nothing_written(cached_set, case):
    primary, capacity = cached_set
    with damaged(case, primary, capacity) as expected:
        before = digest(primary, capacity)
        with pytest.raises(PoolError, match=expected):
            Pool.open(primary)  # recover, export, eval and train all open the set this way
        report = inspect(primary)  # `pool info|check`
        assert not report.ok and any(expected in p for p in report.problems), report.problems
        assert digest(primary, capacity) == before


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_set_is_refused_by_every_command_in_one_line(cached_set, case, tmp_path):
    primary, capacity = cached_set
    with damaged(case, primary, capacity) as expected:
        before = digest(primary, capacity)
        for command in (("pool", "info", primary), ("pool", "check", primary), ("recover", primary),
                        ("export", primary, tmp_path / "out.pt")):
            done = cxltrain(*command)
            assert done.returncode == 1 and expected in done.stderr and "Traceback" not in done.stderr, done
            if command[0] != "pool":  # `pool info|check` list every problem, one line each
                assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "out.pt").exists()
        assert digest(primary, capacity) == before


@pytest.mark.parametrize("case", ["map row out of bounds", "map row twice", "plan byte flipped"])
def test_train_refuses_a_damaged_set_before_writing_anything(cached_set, case):
    primary, capacity = cached_set
    with damaged(case, primary, capacity) as expected:
        before = digest(primary, capacity)
        with pytest.raises(PoolError, match=expected):
            train(dataclasses.replace(CONFIG, steps=3, capacity_pool=capacity), pool_path=primary, progress=False)
        assert digest(primary, capacity) == before


def test_a_capacity_pool_named_alone_is_refused_with_what_to_name(cached_set, tmp_path):
    """Naming a set's member where the set is meant: every command says it is a capacity pool of a
    set and to name the primary, in one line, exit 1, and writes nothing (before: `pool info` and
    `pool check` listed it as a pool, `recover`/`export` said it held no checkpoint, `train` that 0
    bytes were free)."""
    primary, capacity = cached_set
    before = digest(primary, capacity)
    says = "is capacity pool 0 of a pool set (its primary pool's UUID "
    for command in (("pool", "info", capacity), ("pool", "check", capacity), ("recover", capacity),
                    ("export", capacity, tmp_path / "out.pt"),
                    ("train", "--pool", capacity, "--steps", "3", "--rows", "3000", "--num-tables", "2",
                     "--no-progress")):
        done = cxltrain(*command)
        assert done.returncode == 1 and says in done.stderr and "name the set's primary pool" in done.stderr, done
        assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout.strip(), done
    assert not (tmp_path / "out.pt").exists() and digest(primary, capacity) == before
    with Pool.open(primary, writable=False) as pool:  # through its primary it opens as before
        assert [m.path for m in pool.members] == [capacity]
