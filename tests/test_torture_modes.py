"""`cxltrain crashtest --mode set|ranks` and tools/fuzz_images.py (issue 35, tortures at scale).

The set mode kills a pool set (primary on /dev/shm, capacity pool on the disk under the capacity
crash model, a hot-row cache) through the same trial loop as one pool; a trial is exact, and with a
bug planted that breaks the capacity tier's ordering the same trial is not. The ranks mode launches
`train --nproc-per-node 2` for every trial (seconds each: behind -m slow), and a planted
distributed bug fails it. The fuzzer's findings are kept as unit tests of the stored sharding plan.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from cxltrain import knobs
from cxltrain.errors import ConfigError, RecoveryError
from cxltrain.faults import CrashPoint, Planted, PlantedDist
from cxltrain.jobs.crashtest import KINDS, TRIAL_CONFIG, DeviceModel, Torture, TrialPlan
from cxltrain.jobs.crashtest_ranks import RANK_KINDS, RankTorture
from cxltrain.placement.sharding import ShardingPlan, make_plan, parse_kinds
from helpers import cxltrain

SEED = 5


# killed right after the root of batch 3 (the third commit): every capacity page of batches 1-3 must
# be on the disk by then; a run of 4 batches, so that a trial takes seconds
AFTER_ROOT = f"{CrashPoint.COMMIT_AFTER_ROOT}:3"
SHORT = dataclasses.replace(TRIAL_CONFIG, steps=4)


@pytest.fixture(scope="module")
def set_references():
    return []


@pytest.fixture
def set_trial(set_references, tmp_path):
    """run(plant) -> the result of one set trial killed at AFTER_ROOT (the references made once)."""
    made = []

    def run(plant: str = ""):
        with knobs.override(threads=1):
            torture = Torture(trials=1, device=DeviceModel(power_loss=True), seed=SEED, plant=plant, pool_set=True,
                              config=SHORT, keep_dir=str(tmp_path / "kept"))
            made.append(torture)
            if set_references:
                torture.references = set_references[0]
            set_references[:] = [torture.references]
            # synced at every commit (forcing): a stealing set's redo records would cover a skipped sync
            torture.plan = lambda n: TrialPlan(n, "point", AFTER_ROOT, 0.0, None, 1, False,
                                               {**torture.device.knobs(0), "threads": 1, "capacity_crash": 1,
                                                "write_back_every": 1})
            return torture.run_trial(0)

    yield run
    for torture in made:
        torture.close()


def test_a_set_trial_killed_after_a_root_recovers_exactly(set_trial):
    result = set_trial()
    assert result.killed and result.recovered_batch == 3 and result.problems == [], result.to_json()


def test_the_set_mode_catches_capacity_pages_never_synced(set_trial):
    """Planted: the set's commit writes its root without syncing the capacity pool's pages (U2 across
    pools). The same trial as above: the rows the root names are lost with the unsynced pages."""
    result = set_trial(Planted.SKIP_CAPACITY_SYNC)
    assert not result.exact and "t0.weight" in result.problems[0], result.to_json()


def test_modes_plan_every_kind_and_their_own_points():
    with knobs.override(threads=1):
        pool_set = Torture(trials=8, device=DeviceModel(), seed=SEED, pool_set=True)
        ranks = RankTorture(trials=8, device=DeviceModel(), seed=SEED)
    try:
        assert pool_set.config.capacity_pool.startswith(pool_set.disk_work) and pool_set.config.cache_rows
        assert {pool_set.plan(n).kind for n in range(8)} == set(KINDS)
        points = {pool_set.plan(n).crash_at.rpartition(":")[0] for n in range(400) if pool_set.plan(n).crash_at}
        assert {CrashPoint.CACHE_MID_ADMISSION, CrashPoint.COMMIT_BETWEEN_ROOTS} <= points
        assert all(pool_set.plan(n).knobs["capacity_crash"] == 1 for n in range(8))
        assert {ranks.plan(n).kind for n in range(8)} == set(RANK_KINDS)
        assert ranks.plan(3) == ranks.plan(3) and ranks.plan(3).rank in (0, 1)
        with pytest.raises(ConfigError, match="for --mode ranks"):
            RankTorture(trials=1, device=DeviceModel(), seed=SEED, plant="no-such-bug")
        with pytest.raises(ConfigError, match="for --mode set"):
            Torture(trials=1, device=DeviceModel(), seed=SEED, plant=PlantedDist.COMMIT_WITHOUT_AGREEMENT,
                    pool_set=True)
    finally:
        pool_set.close()
        ranks.close()


# -- the fuzzer's findings: a run folder's stored plan is checked before any pool is read ----------
PLAN = make_plan([500] * 3, 2, parse_kinds("table-wise,row-wise,data-parallel", 3)).to_json()


def _edited(t: int, **fields) -> dict:
    tables = [dict(table) for table in PLAN["tables"]]
    tables[t].update(fields)
    return {**PLAN, "tables": tables}


@pytest.mark.parametrize("plan, says", [
    # before: `export DIR` exported table t2 from both ranks' copies stacked, and exited 0
    (_edited(2, kind="table-wise", bounds=[]), "table-wise on 2 ranks"),
    # before: `pool info|check DIR` ended in IndexError: tuple index out of range
    (_edited(1, bounds=[]), "row-wise bounds [] do not split 500 rows over 2 ranks"),
    (_edited(1, bounds=[0, 400, 300]), "do not split"),
    (_edited(0, ranks=[2]), "on ranks [2] of 2"),
    (_edited(2, ranks=[0]), "not every rank"),
    (_edited(0, kind="sideways"), "unknown kind"),
])
def test_a_stored_sharding_plan_that_cannot_hold_is_refused(plan, says):
    with pytest.raises(ConfigError, match=f"not a sharding plan .*{says.replace('[', '.').replace(']', '.')}"):
        ShardingPlan.from_json(plan)
    assert ShardingPlan.from_json(PLAN).to_json() == PLAN


def test_a_manifest_whose_plan_cannot_hold_is_refused_by_the_read_only_commands(shm_dir, tmp_path, capsys):
    from cxltrain.cli.main import main
    from cxltrain.runtime import manifest as run_dir

    run = shm_dir / "run"
    m = {**run_dir.new(2, ShardingPlan.from_json(PLAN), {}), "state": run_dir.CREATED}
    run_dir.write(str(run), m)
    m["plan"] = _edited(1, bounds=[])
    (run / run_dir.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(RecoveryError, match="manifest.json: not a sharding plan"):
        run_dir.read(str(run))
    for command in (("pool", "info", run), ("pool", "check", run), ("recover", run), ("export", run, tmp_path / "x")):
        assert main([str(c) for c in command]) == 1
        err = capsys.readouterr().err
        assert "not a sharding plan" in err and len(err.strip().splitlines()) == 1, err


def test_a_kept_trial_replaces_the_one_a_run_of_the_same_seed_kept(tmp_path):
    """A failed trial is kept under the seed's folder; a second run of that seed keeping the same
    trial replaces it (before: the folder's copy raised FileExistsError and ended the torture)."""
    torture = RankTorture(trials=1, device=DeviceModel(), seed=SEED, keep_dir=str(tmp_path / "kept"))
    try:
        for run in ("first", "second"):
            folder, log = tmp_path / run, tmp_path / f"{run}.log"
            folder.mkdir()
            (folder / "rank-0.pool").write_text(run)
            log.write_text(run)
            torture._keep(torture.plan(0), [str(folder)], str(log))
    finally:
        torture.close()
    kept = tmp_path / "kept"
    assert [(kept / "trial-0.run" / "rank-0.pool").read_text(), (kept / "trial-0.log").read_text()] == ["second"] * 2


# -- ranks: a launch per trial (seconds): behind -m slow ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("root, plant", [(5, ""), (5, PlantedDist.COMMIT_WITHOUT_AGREEMENT), (1, "")])
def test_a_rank_killed_between_the_ranks_commits(root, plant, tmp_path):
    """Rank 1 killed before its root of batch `root` while rank 0 commits it: recovered to G =
    root - 1 and resumed, exact; with commit-without-agreement planted, the trial fails. G = 0 is
    compared with a folder set up by `train --steps 0` (before: the torture stopped, that command
    refused)."""
    with knobs.override(threads=1):
        torture = RankTorture(trials=1, device=DeviceModel(power_loss=True), seed=SEED, plant=plant,
                              keep_dir=str(tmp_path / "kept"))
    torture.plan = lambda n: TrialPlan(n, "point", f"{CrashPoint.COMMIT_BEFORE_ROOT}:{root}", 0.0, None, 1, False,
                                       {**torture.device.knobs(0), "threads": 1}, rank=1)
    try:
        result = torture.run_trial(0)
    finally:
        torture.close()
    if plant:
        assert not result.exact, result.to_json()
    else:
        assert result.killed and result.recovered_batch == root - 1 and result.exact, result.to_json()


# -- bigger samples: the figures of docs/testing.md come from the same commands, run longer --------
def _crashtest(*args: str) -> dict:
    done = cxltrain("crashtest", "--no-progress", "--json", *args, timeout=3000)
    assert "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 0 and report["exact"] == report["trials"] == report["asked"], done.stdout[-3000:]
    return report


@pytest.mark.slow
@pytest.mark.parametrize("mode, trials, model", [
    ("single", 100, ["--power-loss", "--evict-rate", "50000"]),
    ("set", 40, ["--power-loss"]),
    ("ranks", 8, ["--power-loss"]),
])
def test_many_trials_per_mode_are_all_exact(mode, trials, model):
    report = _crashtest("--mode", mode, "--trials", str(trials), *model)
    assert report["killed"] >= trials // 3 and len(report["by_kind"]) == 4


def _fuzz_images():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_images

    return fuzz_images


@pytest.mark.slow
def test_fuzzed_images_give_no_traceback_and_no_silent_acceptance(capsys):
    assert _fuzz_images().main(["200", "--json"]) == 0
    tally = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert tally["images"] == 200 and tally["tracebacks"] == tally["silent"] == tally["several"] == 0, tally
    assert tally["refused"] and tally["exact"] and all(tally["by_seed"].values())


@pytest.mark.slow
def test_the_fuzzers_finds_replayed(capsys):
    """Seed 3504's two silent acceptances (before: `silent 2`): image 1195, a row-wise table's ranks
    named in another order by the manifest, now refused (each rank pool's own record of its shard);
    image 1062, a capacity pool truncated in its last table's rows and extended by zeros, counted as
    the row damage it is (docs/testing.md)."""
    assert _fuzz_images().main(["10000", "--seed", "3504", "--image", "1195", "--image", "1062", "--json"]) == 0
    tally = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert tally["images"] == 2 and tally["silent"] == tally["tracebacks"] == 0, tally
    assert tally["refused"] == 1 and tally["rows"] == 1, tally
