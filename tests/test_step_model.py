"""The capacity tier's step model and `cxltrain plan`'s choice (docs/planner.md): the model's arithmetic
on hand-made batches, and a plan whose printed choice is what `train` then runs with."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cxltrain.placement import step_model as sm
from helpers import cxltrain
from test_planner import ARGS, TABLE_BYTES, folders, run_cli  # noqa: F401 (folders: a fixture)

# a table of 64 rows, 256-byte weights (16 a page) and 4 bytes of state (1,024 a page)
SHAPE = sm.TableShape("t", 64, (256, 4), 4)
SPEEDS = sm.TierSpeeds(fast_row_us=1.0, capacity_row_us=3.0, page_write_back_us=10.0, sync_ms=2.0, copy_mb_s=1000.0)


def batches(*ids) -> list[dict]:
    return [{"t": np.array(b, np.int64)} for b in ids]


def test_traffic_counts_misses_and_the_pages_a_window_dirties():
    # rows 0 and 1 cached; 17 and 18 share a weight page (16 rows a page), 40 has its own
    seen = sm.traffic([SHAPE], {"t"}, batches([0, 1, 17, 17], [18, 40], [0, 40]), {"t": np.array([0, 1])})
    assert (seen.lookups, seen.hits, seen.miss_lookups) == (8 / 3, 3 / 3, 5 / 3)
    # one batch: weight pages {1}, {1, 2}, {2}; the state's page 0 each time
    assert seen.pages_dirtied(1) == (2 + 3 + 2) / 3
    assert seen.pages_dirtied(3) == 2 + 1  # weight pages 1 and 2, and the state's, once each: a window coalesces
    assert seen.redo_bytes > 0


def test_an_uncached_table_misses_every_lookup_and_a_fast_one_none():
    fast = sm.TableShape("f", 64, (256,), 0)
    both = [{"t": np.array([3, 3]), "f": np.array([5])}]
    seen = sm.traffic([SHAPE, fast], {"t"}, both, {})
    assert (seen.lookups, seen.miss_lookups) == (0, 2)  # no cache: no hit rate, every lookup a miss
    assert len(seen.pages[0]) == 2  # the capacity table's two regions; the fast table dirties none


def test_the_ring_bounds_the_interval_and_a_sync_every_batch_writes_no_redo():
    seen = sm.traffic([SHAPE], {"t"}, batches(*[[i] for i in range(40, 56)]), {})
    roomy = sm.predict(SPEEDS, 50.0, None, {}, 0, seen, 8, ring_bytes=1 << 30)
    assert (roomy.batches_per_write_back, roomy.write_back_every) == (8, 8)
    tight = sm.predict(SPEEDS, 50.0, None, {}, 0, seen, 8, ring_bytes=int(4 * seen.ring_bytes))
    assert tight.batches_per_write_back == 3  # written back once the ring is half full
    every = sm.predict(SPEEDS, 50.0, None, {}, 0, seen, 1, ring_bytes=1 << 30)
    assert every.redo_bytes_per_batch == every.redo_ms == 0
    # one row a batch, each on a page of its own (rows 40..55 span pages 2 and 3): a sync each
    assert every.write_back_ms == pytest.approx(2.0 + 2 * 10.0 / 1e3)
    assert every.misses_ms == pytest.approx(1 * 2.0 / 1e3)
    assert every.step_ms == pytest.approx(50.0 + every.misses_ms + every.write_back_ms)


def prediction(cache_bytes: int, every: int, step: float) -> sm.Prediction:
    return sm.Prediction(cache_rows_option=cache_bytes, cache_bytes=cache_bytes, write_back_every=every,
                         batches_per_write_back=every, cache_rows={}, cache_hit_rate=None, miss_lookups_per_batch=0,
                         disk_bytes_written_per_batch=0, redo_bytes_per_batch=0, fast_step_ms=step, misses_ms=0,
                         write_back_ms=0, redo_ms=0)


def test_the_choice_is_the_smallest_cache_then_interval_within_the_slack():
    priced = [prediction(0, 1, 200.0), prediction(10, 16, 104.0), prediction(10, 4, 104.5),
              prediction(20, 1, 100.0), prediction(5, 64, 120.0)]
    chosen = sm.choose(priced)
    assert (chosen.cache_bytes, chosen.write_back_every) == (10, 4)  # 104.5 <= 105% of 100; 5 bytes' 120 is not
    assert sm.choose([prediction(0, 1, 1.0)]).cache_bytes == 0


def test_cache_candidates_fit_the_room():
    assert sm.cache_candidates(1000, 10, 10**9) == [None, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert sm.cache_candidates(1000, 10, 1234) == [None, 5, 10, 20, 50, 100, 123]  # the most that fits
    assert sm.cache_candidates(1000, 10, 5) == [None]  # not one row fits: the planner's (none)


def test_plan_chooses_and_train_runs_with_its_choice(folders, capsys):  # noqa: F811
    """`plan --json` prices the configurations and prints the train options of its choice; `train`
    with them caches what the plan said and writes back at its interval, and `--profile --json`
    reports the run under the names the plan predicts."""
    fast, disk = folders
    pool, cap = f"{fast}/c.pool", f"{disk}/c.cap"
    # one table in the fast tier, and room for every other's cache size priced
    args = ["--pool", pool, "--capacity-pool", cap, *ARGS[:-1], "--fast-bytes", str(TABLE_BYTES + 60_000)]
    code, out, err = run_cli(capsys, "plan", *args, "--fast-step-ms", "20", "--json")
    assert code == 0, err
    choice = json.loads(out.splitlines()[-1])["choice"]
    predicted = choice["predicted"]
    assert "fast-tier step 20.0 ms (given)" in out and "<- chosen" in out
    assert predicted in choice["priced"]
    told = [line for line in out.splitlines() if line.startswith("to train with it: cxltrain train ")]
    assert len(told) == 1
    train_args = told[0].removeprefix("to train with it: cxltrain train ").split()
    assert train_args[train_args.index("--write-back-every") + 1] == str(choice["write_back_every"])
    assert predicted["cache_rows"]  # every size priced caches rows

    done = cxltrain("train", *train_args, "--steps", "4", "--no-progress", "--profile", "--json")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    report = json.loads(out.splitlines()[-1])
    measured = report["measured"]
    assert set(measured) == set(sm.COMPARABLE) <= set(predicted)
    assert measured["cache_rows"] == predicted["cache_rows"] == report["tiers"]["cache_rows"]
    assert measured["write_back_every"] == predicted["write_back_every"]
    assert report["tiers"]["capacity_tables"] == ["t1", "t2"]  # t0 whole in the fast tier, as planned
    assert 0 < measured["miss_lookups_per_batch"] < 2 * 64  # two cached tables of 64 lookups a batch
    assert "miss lookups per batch" in out


@pytest.mark.slow
def test_plan_measures_the_fast_tier_step_and_leaves_nothing_behind(folders, capsys):  # noqa: F811
    fast, disk = folders
    pool, cap = f"{fast}/m.pool", f"{disk}/m.cap"
    code, out, err = run_cli(capsys, "plan", "--pool", pool, "--capacity-pool", cap, *ARGS[:-1], "--json")
    assert code == 0, err
    assert "measured: 5 steps of this model" in json.loads(out.splitlines()[-1])["choice"]["fast_step"]
    assert os.listdir(fast) == [] and os.listdir(disk) == []  # the probes' files and pool removed


@pytest.mark.parametrize("extra, says", [(["--capacity-pool", "X", "--fast-step-ms", "0"], "--fast-step-ms"),
                                         (["--capacity-pool", "X", "--fast-step-ms", "abc"], "is not a number"),
                                         (["--capacity-pool", "/nonexistent/x.cap", *ARGS[:-1]], "no such folder")])
def test_bad_step_model_input_is_refused_in_one_line(extra, says, capsys, tmp_path):
    # a pool of its own: the default one, named after the working folder, may be another run's
    code, _, err = run_cli(capsys, "plan", "--pool", str(tmp_path / "m.pool"), *extra)
    assert code not in (0, None) and says in err and len(err.strip().splitlines()) == 1, err
