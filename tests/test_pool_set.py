"""Pool sets (docs/tiers.md): a primary in the fast tier and a capacity pool on the disk, committed
as one. Hostile sets are refused with one line and nothing written; a run killed at the set's
crash points resumes bit-exactly, and the crash test catches a planted ordering bug.

The primary lives on /dev/shm (the emulated fast tier), the capacity pool in a temporary folder on
the real disk (block storage), as `train --pool P --capacity-pool C` puts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from cxltrain import knobs
from cxltrain.checkpoint import verify
from cxltrain.checkpoint.recovery import to_redo
from cxltrain.checkpoint.stats import summary_line
from cxltrain.devices.capacity import CapacityDevice
from cxltrain.errors import CxlTrainError, PoolError
from cxltrain.faults import CRASH_ENV, FAULT_ENV, CrashPoint, Planted
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import build_model, build_source, train, train_step
from cxltrain.placement.sharding import make_plan
from cxltrain.pool.handle import Pool
from cxltrain.pool.info import inspect
from cxltrain.runtime import manifest as run_dir
from cxltrain.runtime.group import join_group
from cxltrain.runtime.group_recovery import roll_back_rank
from cxltrain.runtime.recovery_point import AgreedMinimum
from cxltrain.runtime.runtime import Runtime, export_state
from cxltrain.tables.bag import PersistentEmbeddingBag
from helpers import assert_same_export, bare_set, cxltrain, tier_folders

CONFIG = TrainConfig(steps=4, batch_size=64, num_tables=2, rows=3000, dim=16)
TABLE = "embedding_bag_collection.embedding_bags.t0.weight"


@pytest.fixture(scope="module")
def folders():
    """(fast-tier folder on /dev/shm, capacity-tier folder on the disk), both removed afterwards."""
    with tier_folders("cxltrain-set-") as found:
        yield found


def make_set(fast: str, disk: str, name: str, steps: int) -> tuple[str, str]:
    primary, capacity = os.path.join(fast, f"{name}.pool"), os.path.join(disk, f"{name}.cap")
    train(dataclasses.replace(CONFIG, steps=steps, capacity_pool=capacity), pool_path=primary, progress=False)
    return primary, capacity


def digest(*paths: str) -> list[str]:
    return [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]


@pytest.fixture(scope="module")
def sets(folders):
    """Set "a" trained to batch 2, then committed on to batch 3, with a copy of its capacity pool
    from batch 2; and the capacity pool of another set, "b"."""
    primary, capacity = make_set(*folders, "a", steps=2)
    shutil.copy(capacity, capacity + ".at2")
    with Pool.open(primary) as pool:  # the set moves on (its members' roots with it)
        pool.commit(batches_done=3)
    return primary, capacity, bare_set(*folders, "b")


def test_a_set_opens_whole_and_holds_the_tables_on_the_disk(sets):
    primary, capacity, _ = sets
    with Pool.open(primary) as pool:
        assert [m.path for m in pool.members] == [capacity]
        assert "t0.weight" in pool.regions and "t0.weight" in pool.members[0].regions
        assert pool.device_for(pool.region("t0.weight")) is pool.members[0].device
        assert pool.members[0].device.kind == "capacity"
        assert pool.members[0].root.batches_done == pool.root.batches_done == 3
    report = inspect(primary)
    assert report.ok and [m.path for m in report.members] == [capacity]


def test_the_update_writes_cold_rows_to_the_capacity_file_not_the_mapping(folders, monkeypatch):
    """A capacity table's fused update, undo-logged by the checkpointer, writes each row to the file
    the device names (Device.row_file, docs/tiers.md "Rows written to the file"): given a descriptor
    that cannot write, the first update fails with EBADF, where stores through the mapping would
    succeed. The crash model names none: its stores go to its private view."""
    opened = []

    def read_only(device):  # the same file, opened again for reading only
        opened.append(os.open(f"/proc/self/fd/{device._fd}", os.O_RDONLY))
        return opened[-1]

    monkeypatch.setattr(CapacityDevice, "row_file", read_only)
    try:
        with pytest.raises(OSError) as refused:
            make_set(*folders, "w", steps=2)
        assert refused.value.errno == errno.EBADF
    finally:
        for fd in opened:
            os.close(fd)
    monkeypatch.undo()
    primary, _ = make_set(*folders, "x", steps=1)
    with knobs.override(capacity_crash=1), Pool.open(primary) as pool:
        assert pool.members[0].device.row_file() is None


@pytest.mark.slow
def test_pool_info_and_check_show_the_whole_set(folders):
    primary, capacity = make_set(*folders, "c", steps=2)  # "a" was committed on without its snapshot
    info = cxltrain("pool", "info", primary)
    assert info.returncode == 0 and capacity in info.stdout and "t0.weight" in info.stdout, info.stderr
    assert cxltrain("pool", "check", primary).returncode == 0


@contextlib.contextmanager
def damaged(case: str, primary: str, capacity: str, other: str):
    """The set damaged `case`'s way, put back afterwards; yields what the refusal must say."""
    saved = capacity + ".saved"
    shutil.copy(capacity, saved)
    try:
        if case == "missing":
            os.unlink(capacity)
            yield "is missing"
        elif case == "swapped":  # another set's capacity pool under this set's name
            shutil.copy(other, capacity)
            yield "swapped or replaced"
        elif case == "other epoch":  # an old copy of the member put back after the set moved on
            shutil.copy(capacity + ".at2", capacity)
            yield "another epoch"
        elif case == "truncated":
            os.truncate(capacity, os.path.getsize(capacity) // 2)
            yield "truncated"
    finally:
        os.replace(saved, capacity)


CASES = ["missing", "swapped", "other epoch", "truncated"]


@pytest.mark.parametrize("case", CASES)
def test_hostile_sets_are_refused_and_nothing_written(sets, case):
    primary, capacity, other = sets
    with damaged(case, primary, capacity, other) as expected:
        present = [p for p in (primary, capacity) if os.path.exists(p)]
        before = digest(*present)
        with pytest.raises(PoolError, match=expected):
            Pool.open(primary)
        report = inspect(primary)  # `pool info|check`
        assert not report.ok and any(expected in problem for problem in report.problems), report.problems
        assert digest(*present) == before


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_hostile_sets_are_refused_by_the_command_line_in_one_line(sets, case):
    primary, capacity, other = sets
    with damaged(case, primary, capacity, other) as expected:
        for command in (("recover", primary), ("pool", "check", primary), ("export", primary, primary + ".pt")):
            done = cxltrain(*command)
            assert done.returncode == 1 and expected in done.stderr, done
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_a_set_resumed_without_its_capacity_pool_is_refused(sets):
    """Through the jobs API: `cxltrain train --pool P` alone takes the capacity pool the set's
    snapshot remembers (TrainConfig.run_settings), so the command line meets this refusal only for a set whose
    snapshot does not name it."""
    primary, capacity, _ = sets
    before = digest(primary, capacity)
    with pytest.raises(CxlTrainError, match="--capacity-pool"):
        train(dataclasses.replace(CONFIG, steps=3), pool_path=primary, progress=False)
    assert digest(primary, capacity) == before


def killed_and_resumed(fast: str, disk: str, point: str, fault: str = "", write_back_every: int = 1) -> dict:
    """A `train` child with the capacity crash model (its capacity pages written back every
    `write_back_every` batches), killed at `point`; then resumed here to CONFIG.steps and exported."""
    return resumed(*killed(fast, disk, point, fault, write_back_every), write_back_every=write_back_every)


def killed(fast: str, disk: str, point: str, fault: str = "", write_back_every: int = 1) -> tuple[str, str]:
    """killed_and_resumed's `train` child, killed at `point`: (primary, capacity) of its set."""
    primary, capacity = os.path.join(fast, "k.pool"), os.path.join(disk, "k.cap")
    for path in (primary, capacity):
        if os.path.exists(path):
            os.unlink(path)
    args = ["train", "--pool", primary, "--capacity-pool", capacity, "--steps", CONFIG.steps, "--num-tables", "2",
            "--rows", CONFIG.rows, "--dim", CONFIG.dim, "--batch-size", CONFIG.batch_size, "--no-progress",
            "--write-back-every", write_back_every]
    env = {"CXLTRAIN_CAPACITY_CRASH": "1", CRASH_ENV: point, FAULT_ENV: fault}
    done = cxltrain(*args, env=env, timeout=120)
    assert done.returncode == -9, done.stderr  # killed at the point
    return primary, capacity


def resumed(primary: str, capacity: str, write_back_every: int = 1) -> dict:
    """The set resumed here (recovered first) to CONFIG.steps, and exported."""
    with knobs.override(capacity_crash=1):
        train(dataclasses.replace(CONFIG, capacity_pool=capacity, write_back_every=write_back_every),
              pool_path=primary, progress=False)
    return export_state(primary)


@pytest.fixture(scope="module")
def reference(folders):
    primary, _ = make_set(*folders, "ref", steps=CONFIG.steps)
    return export_state(primary)


@pytest.mark.parametrize("point", [
    f"{CrashPoint.COMMIT_BEFORE_CAPACITY_SYNC}:2",
    pytest.param(f"{CrashPoint.COMMIT_BETWEEN_ROOTS}:2", marks=pytest.mark.slow),
    pytest.param(f"{CrashPoint.COMMIT_AFTER_ROOT}:2", marks=pytest.mark.slow),
    pytest.param(f"{CrashPoint.CAPACITY_PAGE_WRITE}:9", marks=pytest.mark.slow)])
def test_a_set_killed_at_its_crash_points_resumes_bit_exactly(folders, reference, point):
    assert_same_export(killed_and_resumed(*folders, point), reference)


def test_the_crash_test_catches_cold_pages_never_synced(folders, reference):
    """Planted: the root names cold rows whose pages were never synced (U2 across the set). The
    crash model loses those page writes, and the resumed run differs from the reference."""
    resumed = killed_and_resumed(*folders, f"{CrashPoint.COMMIT_AFTER_ROOT}:2", Planted.SKIP_CAPACITY_SYNC)
    with pytest.raises(AssertionError):
        assert_same_export(resumed, reference)


@pytest.mark.parametrize("point", [f"{CrashPoint.COMMIT_AFTER_ROOT}:3",
                                   pytest.param(f"{CrashPoint.UPDATE_ROWS_FLUSHED}:7", marks=pytest.mark.slow)])
def test_a_stealing_set_killed_between_write_backs_is_redone_bit_exactly(folders, reference, point):
    """Steal, no force: with the capacity pages written back every 8 batches, none is before the
    kill (batch 2 committed, or batch 3 half-updated); the crash model has lost every cold row's page
    write, and recovery redoes the committed batches from their redo records."""
    assert_same_export(killed_and_resumed(*folders, point, write_back_every=8), reference)


def test_a_new_set_s_ring_has_room_for_each_capacity_table_s_redo_record(tmp_path):
    """A cold row's redo record (its new values) sits in the ring beside its undo record."""
    def ring(capacity_tables) -> int:
        tables = {name: PersistentEmbeddingBag(1_000_000, 64, name=name) for name in ("a", "b")}
        return Runtime(str(tmp_path / "p.pool"), torch.nn.ModuleDict(tables), [], rows_per_batch=100_000,
                       capacity_pool=str(tmp_path / "p.cap"), capacity_tables=capacity_tables).ring_bytes()

    one_pool = ring([])
    assert ring(["a"]) == one_pool * 3 // 2 and ring(["a", "b"]) == 2 * one_pool


def test_a_stealing_run_counts_its_last_write_back(folders):
    """Written back at batch 4 (every 4) and by the run's last commit at 6, which the block's exit
    makes after the timed batches: both counted in the summary, and named in its line."""
    primary, capacity = os.path.join(folders[0], "counted.pool"), os.path.join(folders[1], "counted.cap")
    result = train(dataclasses.replace(CONFIG, steps=6, capacity_pool=capacity, write_back_every=4),
                   pool_path=primary, progress=False)
    stats = result.checkpoint.stats
    assert stats["write_backs"] == 2 and stats["commits"] == 7, stats
    assert summary_line(stats).endswith(", 2 capacity write-backs")


# every 2 batches: the commit naming batch 2 writes back (its 2nd sync: the 1st is the new set's)
@pytest.mark.parametrize("point", [f"{CrashPoint.CAPACITY_MID_WRITE_BACK}:2",
                                   f"{CrashPoint.CAPACITY_BEFORE_SYNC}:2",
                                   f"{CrashPoint.COMMIT_AFTER_WRITE_BACK}:1",
                                   f"{CrashPoint.COMMIT_AFTER_ROOT}:2",
                                   f"{CrashPoint.COMMIT_WHILE_WRITING_BACK}:2"])
def test_a_stealing_set_killed_inside_a_write_back_resumes_bit_exactly(folders, reference, point):
    """Killed half-way through the write-back's page writes, with every page written and none
    synced, synced with the root still keeping the redo records, right after the root of the
    commit that started it, and after the next commit's root with the write-back held back (a slow
    disk): recovery redoes what is live (absolute values: pages that did reach the file are written
    again with the same bytes)."""
    assert_same_export(killed_and_resumed(*folders, point, write_back_every=2), reference)


def test_a_stealing_set_killed_inside_its_redo_recovers_again_bit_exactly(folders, reference):
    """Recovery killed after its first redo record (of several) is repaired by recovering again.
    `pool check` counts the redo records apart from the undo records (of batch 3, where its capture
    ran before the worker that wrote the root naming 3 batches was killed: the pipeline's timing)."""
    primary, capacity = killed(*folders, f"{CrashPoint.COMMIT_AFTER_ROOT}:3", write_back_every=8)
    check = cxltrain("pool", "check", primary)
    assert check.returncode == 0, check
    assert re.search(r" \d+ undo record\(s\) to roll back and [1-9]\d* redo record\(s\) to apply", check.stdout), check
    env = {"CXLTRAIN_CAPACITY_CRASH": "1", CRASH_ENV: f"{CrashPoint.RECOVER_MID_REDO}:1"}
    done = cxltrain("recover", primary, env=env, timeout=120)
    assert done.returncode == -9, done  # killed inside the redo
    assert_same_export(resumed(primary, capacity, write_back_every=8), reference)


@pytest.mark.parametrize("fault, point, every", [
    (Planted.RECLAIM_BEFORE_WRITE_BACK, f"{CrashPoint.COMMIT_WHILE_WRITING_BACK}:2", 2),
    (Planted.REDO_AFTER_COMMIT, f"{CrashPoint.COMMIT_AFTER_ROOT}:3", 8)])
def test_the_crash_test_catches_a_stealing_set_s_planted_bugs(folders, reference, fault, point, every):
    """Planted: a write-back counted from its start, so the next root frees the redo records while
    the capacity pools are not yet synced (U3c, the write-back held back until the kill); a batch's redo records are written after its commit (U2f). Either way the crash model
    loses cold rows no durable record holds, and the resumed run differs from the reference."""
    resumed = killed_and_resumed(*folders, point, fault, write_back_every=every)
    with pytest.raises(AssertionError):
        assert_same_export(resumed, reference)


def _rank_pool(fast: str, disk: str, name: str, steps: int) -> str:
    """A one-rank group's pool set trained to `steps`, its ring keeping every batch since 0 (the
    test never lets G move past the start)."""
    model = build_model(CONFIG)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=CONFIG.dense_lr)
    directory = os.path.join(fast, name)
    join_group()
    try:
        manifest = {**run_dir.new(1, make_plan([CONFIG.rows] * CONFIG.num_tables, 1), {}), "run": name}
        point = AgreedMinimum(directory, 0, 1, manifest, fresh=True)
        os.makedirs(directory)
        with Runtime(point.pool_path, model, dense_opt, capacity_pool=os.path.join(disk, f"{name}.cap"),
                     recovery_point=point) as rt:
            for batch in rt.batches(build_source(CONFIG).batch, stop=steps):
                train_step(model, batch, [dense_opt], rt.batch)
    finally:
        dist.destroy_process_group()
    return point.pool_path


def test_a_rank_rolled_back_to_g_syncs_its_capacity_pools_before_the_root(folders, monkeypatch):
    """The group's roll-back (a rank ahead of G takes its own dense slice of G) is the one
    roll-back: the restored cold rows are synced in the capacity pool before the root names G.
    A rank's set steals as one process's does: the roll-back redoes batch 0's redo records, then
    undoes batch 1. (`ahead` is never exported before its roll-back: an export recovers a pool with
    redo records to apply in place, to its own batch, which leaves nothing to roll back to G.)"""
    behind, ahead = _rank_pool(*folders, "behind", steps=1), _rank_pool(*folders, "ahead", steps=2)
    before = export_state(_rank_pool(*folders, "twin", steps=2))  # ahead's double
    with Pool.open(ahead, writable=False) as pool:
        live, _ = verify(pool)
    assert [r.header.batch for r in to_redo(live, 1)] == [0, 0], "a rank's set synced at every commit"
    events = []
    monkeypatch.setattr(Pool, "drain_members", lambda pool, real=Pool.drain_members: (events.append("sync"),
                                                                                         real(pool))[1])
    monkeypatch.setattr(Pool, "commit", lambda pool, real=Pool.commit, **kw: (events.append("root"),
                                                                                real(pool, **kw))[1])
    target, restored = roll_back_rank(ahead, 1)
    monkeypatch.undo()
    assert (target, restored) == (2, 2)  # two tables, batch 1
    assert "sync" in events and events.index("sync") < events.index("root"), events
    after, reference = export_state(ahead), export_state(behind)
    assert after["batch"] == 1
    assert not torch.equal(before["model"][TABLE], reference["model"][TABLE])
    assert torch.equal(after["model"][TABLE], reference["model"][TABLE])
