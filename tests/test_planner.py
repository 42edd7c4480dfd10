"""The placement planner (docs/planner.md): its arithmetic on hand-made profiles, `cxltrain plan`,
and a pool set that keeps its plan: a restart whose options would plan differently is refused with
one line and nothing written, and one without them resumes on the stored plan."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cxltrain.cli import main
from cxltrain.errors import ConfigError, PoolError
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import build_model, train
from cxltrain.placement import planner
from cxltrain.placement.planner import CAPACITY, FAST, make_plan, profile_ids
from cxltrain.runtime.runtime import Runtime
from helpers import shm_tempdir
from test_pool_set import digest


def profile(name: str, ranked: list[int], held: list[int] | None = None, rows: int = 100, row_bytes: int = 10):
    held = ranked if held is None else held
    return profile_ids(name, rows, row_bytes, np.array(ranked, np.int64), np.array(held, np.int64), 2)


# (profiles, fast budget) -> {table: (tier, cached rows)}
CASES = [
    # nothing in the fast tier: every table on the capacity tier, nothing cached
    ([profile("a", [1, 1, 2]), profile("b", [3])], 0, {"a": (CAPACITY, 0), "b": (CAPACITY, 0)}),
    # room for everything: whole tables in the fast tier
    ([profile("a", [1, 1, 2]), profile("b", [3])], 2000, {"a": (FAST, 0), "b": (FAST, 0)}),
    # room for one table: the one with more lookups per byte, the other's hot rows in what is left
    ([profile("a", [1, 1, 2]), profile("b", [3, 4, 4, 4, 5])], 1030, {"a": (CAPACITY, 2), "b": (FAST, 0)}),
    # equal density: the name decides, never the input order
    ([profile("b", [1]), profile("a", [1])], 1000, {"a": (FAST, 0), "b": (CAPACITY, 0)}),
    # cached rows across tables, most lookups first: a's 5, b's 4, a's 3 (30 bytes)
    ([profile("a", [1] * 5 + [2] * 3 + [3]), profile("b", [7] * 4 + [8] * 2)], 35, {"a": (CAPACITY, 2), "b": (CAPACITY, 1)}),
    # lookups per byte, not per row: b's rows are 4x wider
    ([profile("a", [1] * 3 + [2] * 2), profile("b", [7] * 4, row_bytes=40)], 40, {"a": (CAPACITY, 2), "b": (CAPACITY, 0)}),
]


@pytest.mark.parametrize("profiles, budget, expected", CASES)
def test_placement(profiles, budget, expected):
    plan = make_plan(profiles, budget)
    assert {t.name: (t.tier, t.cached_rows) for t in plan.tables} == expected
    assert [t.name for t in plan.tables] == [p.name for p in profiles]  # the model's order


def test_hit_rate_is_measured_on_held_out_batches():
    # rows ranked 1, 2, 3 by the even batches; the odd ones look up 1 twice, 2 once, and 9 (never seen)
    p = profile("a", [1, 1, 1, 2, 2, 3], held=[1, 1, 2, 9])
    assert [p.hit_rate(n) for n in range(4)] == [0.0, 0.5, 0.75, 0.75]
    plan = make_plan([p], 20)
    assert (plan.tables[0].cached_rows, plan.tables[0].hit_rate) == (2, 0.75)
    assert planner.miss_reads_per_batch(plan) == pytest.approx(p.lookups / 2 * 0.25)


counts = st.lists(st.integers(0, 30), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None)
@given(tables=st.lists(st.tuples(counts, counts, st.integers(1, 64)), min_size=1, max_size=5),
       budget=st.integers(0, 20_000))
def test_the_plan_fits_its_budget_and_ignores_input_order(tables, budget):
    profiles = [profile(f"t{i}", ranked, held, rows=50, row_bytes=row_bytes)
                for i, (ranked, held, row_bytes) in enumerate(tables)]
    plan = make_plan(profiles, budget)
    by_name = {p.name: p for p in profiles}
    used = sum(t.bytes if t.tier == FAST else t.cached_rows * by_name[t.name].row_bytes for t in plan.tables)
    assert used <= budget
    for t in plan.tables:
        assert 0.0 <= t.hit_rate <= 1.0 and (t.tier == CAPACITY or t.cached_rows == 0)
        assert t.cached_rows <= by_name[t.name].counts.size  # only rows the profile saw
    assert make_plan(profiles[::-1], budget).placement() == plan.placement()[::-1]
    assert make_plan(profiles, budget) == plan


def test_a_stored_plan_reads_back_and_a_damaged_one_is_refused():
    plan = make_plan([profile("a", [1, 1, 2]), profile("b", [3])], 25)
    uuid = bytes(range(16))
    raw = planner.pack_plan(plan, uuid)
    assert len(raw) == planner.PLAN_BYTES and planner.unpack_plan(raw, uuid, "p") == plan
    damaged = bytearray(raw)
    damaged[40] ^= 1
    with pytest.raises(PoolError, match="plan .* is damaged"):
        planner.unpack_plan(bytes(damaged), uuid, "p")
    with pytest.raises(PoolError, match="damaged"):
        planner.unpack_plan(raw, bytes(16), "p")  # another pool's


ARGS = ["--steps", "2", "--batch-size", "64", "--num-tables", "3", "--rows", "3000", "--dim", "16", "--no-progress"]
TABLE_BYTES = 3000 * (16 + 1) * 4   # rows x (weights + row-wise Adagrad's state), fp32


@pytest.fixture
def folders():
    disk = tempfile.mkdtemp(prefix="cxltrain-plan-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    with shm_tempdir("cxltrain-plan-") as fast:
        yield fast, disk
    shutil.rmtree(disk, ignore_errors=True)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`cxltrain ARGS` in this process (no torch import to wait for): (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:  # the argument parser's errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_a_table_and_json(folders, capsys):
    fast, disk = folders
    pool, cap = f"{fast}/p.pool", f"{disk}/p.cap"
    args = ["plan", "--pool", pool, "--capacity-pool", cap, *ARGS[:-1], "--fast-bytes", str(TABLE_BYTES + 8000),
            "--fast-step-ms", "20"]  # given: the choice's short training run is test_step_model's
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["table", "rows", "bytes", "tier", "cached", "rows", "hit", "rate"]
    assert [line.split()[3] for line in lines[2:5]] == [FAST, CAPACITY, CAPACITY]
    assert "capacity tier:" in out and "MB/s measured" in out
    report = json.loads(lines[-1])
    tables = report["plan"]["tables"]
    assert [t["tier"] for t in tables] == [FAST, CAPACITY, CAPACITY]
    assert sum(t["cached_rows"] for t in tables) * 68 <= 8000 and tables[1]["cached_rows"] > 0
    assert not os.path.exists(pool) and os.listdir(disk) == []  # nothing written, the probe removed
    code, out, _ = run_cli(capsys, *args, "--json", "--no-measure")
    assert json.loads(out.splitlines()[-1])["plan"] == report["plan"]  # deterministic


@pytest.mark.parametrize("args, says", [
    (["plan"], "give --capacity-pool"),
    (["plan", "--capacity-pool", "X", "--fast-bytes", "12Q"], "is not a size"),
    (["plan", "--capacity-pool", "X", "--profile-batches", "0"], "--profile-batches"),
    (["train", "--fast-bytes", "1M", *ARGS], "need --capacity-pool"),
])
def test_bad_planning_input_is_refused_in_one_line(args, says, capsys):
    code, _, err = run_cli(capsys, *args)
    assert code not in (0, None) and says in err and len(err.strip().splitlines()) == 1, err


def test_a_set_keeps_its_plan(folders, capsys):
    """Made with one table in the fast tier; a restart with another --fast-bytes is refused and
    writes nothing; one without resumes on the stored plan; a Runtime given another plan is refused."""
    fast, disk = folders
    pool, cap = f"{fast}/s.pool", f"{disk}/s.cap"
    config = TrainConfig(steps=2, batch_size=64, num_tables=3, rows=3000, dim=16, capacity_pool=cap)
    train(dataclasses.replace(config, fast_bytes=TABLE_BYTES), pool_path=pool, progress=False)
    before = digest(pool, cap)
    code, _, err = run_cli(capsys, "train", "--pool", pool, "--capacity-pool", cap, *ARGS, "--fast-bytes", "1M")
    assert code == 1 and "stored plan was made with --fast-bytes" in err, err
    assert len(err.strip().splitlines()) == 1 and digest(pool, cap) == before

    result = train(dataclasses.replace(config, steps=3), pool_path=pool, progress=False)  # no --fast-bytes: the stored plan
    assert (result.progress.start_batch, result.progress.batch) == (2, 3)
    model = build_model(config)
    with Runtime(pool, model, torch.optim.Adam(model.dense_parameters()), capacity_pool=cap) as rt:
        assert [t.tier for t in rt.plan.tables] == [FAST, CAPACITY, CAPACITY]
        assert rt.plan.cached_rows == {"t1": 0, "t2": 0}  # where the hot-row cache reads its sizes
        assert rt.pool.region("t0.weight").index < 1 << 16  # the fast table lives in the primary
        stored = rt.plan
    after = digest(pool, cap)
    other = dataclasses.replace(stored, tables=tuple(dataclasses.replace(t, tier=CAPACITY) for t in stored.tables))
    with pytest.raises(ConfigError, match="stored plan differs"):
        with Runtime(pool, model, torch.optim.Adam(model.dense_parameters()), capacity_pool=cap, plan=other):
            pass
    assert digest(pool, cap) == after


def test_a_pool_is_sized_without_ranking_the_hot_rows():
    """`train` sizes the pool before it makes it: the hot lists' lengths are all that takes, so
    only the run itself reads the batches that rank them (planning.hot_list_batches)."""
    from cxltrain.jobs.train import make_runtime, pool_bytes

    config = TrainConfig(batch_size=64, num_tables=2, rows=3000, dim=8, cache_rows=300, capacity_pool="/var/tmp/sized.cap")
    ranked = make_runtime(config, build_model(config), None, "")
    assert all(rows.size == 300 for rows in ranked._hot.values()) and len(ranked._hot) == 2
    assert pool_bytes(config) == ranked.pool_bytes()


def test_hot_lists_rank_a_bounded_number_of_lookups():
    """The ranked ids are held in memory: a big batch is ranked on fewer batches, a small one on at
    most HOT_LIST_BATCHES."""
    from cxltrain.jobs.planning import HOT_LIST_BATCHES, HOT_LIST_LOOKUPS, hot_list_batches

    assert hot_list_batches(TrainConfig()) == HOT_LIST_LOOKUPS // 2048 == HOT_LIST_BATCHES  # the default model
    assert hot_list_batches(TrainConfig(batch_size=65536)) == 16
    assert hot_list_batches(TrainConfig(batch_size=4096, pooling=20)) == 13  # 81,920 lookups a batch
    assert hot_list_batches(TrainConfig(batch_size=64)) == HOT_LIST_BATCHES
