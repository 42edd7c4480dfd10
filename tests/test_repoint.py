"""A moved capacity pool re-pointed (issue 36, item 6; docs/tiers.md, "Moving a capacity pool"):
`train --pool P --capacity-pool NEW` accepts the file at NEW when it is the member the set records
(its UUID), rewrites the primary's set record crash-safely, and the run resumes bit-exactly; any
other file is refused in one line with nothing written; a kill (or power loss) inside the rewrite
leaves the old path or the new one, and the set opens either way.

The primary lives on /dev/shm (the emulated device), the capacity pool on the disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil

import pytest

from cxltrain.devices.capacity import open_capacity
from cxltrain.errors import PoolError, PoolFullError
from cxltrain.faults import CRASH_ENV, CrashPoint
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import train
from cxltrain.knobs import KNOBS
from cxltrain.pool import set_format as pool_set
from cxltrain.pool.format import pool_size_for
from cxltrain.pool.handle import Pool
from cxltrain.pool.info import inspect
from cxltrain.pool.repoint import recorded_paths, repoint
from cxltrain.runtime.runtime import export_state
from helpers import assert_same_export, bare_set, cxltrain, tier_folders

CONFIG = TrainConfig(steps=2, batch_size=64, num_tables=2, rows=3000, dim=16)
STEPS = 4  # the resumed runs' length


@pytest.fixture(scope="module")
def folders():
    with tier_folders("cxltrain-repoint-") as found:
        yield found


@pytest.fixture(scope="module")
def reference(folders):
    """The export of a set trained to STEPS without being moved."""
    fast, disk = folders
    primary = os.path.join(fast, "ref.pool")
    train(dataclasses.replace(CONFIG, steps=STEPS, capacity_pool=os.path.join(disk, "ref.cap")), pool_path=primary,
          progress=False)
    return export_state(primary)


def moved_set(folders, name: str) -> tuple[str, str, str]:
    """A set trained to batch 2 whose capacity pool was then moved: (primary, old path, new path)."""
    fast, disk = folders
    primary, old = os.path.join(fast, f"{name}.pool"), os.path.join(disk, f"{name}.cap")
    new = os.path.join(disk, "moved", f"{name}.cap")
    for path in (primary, old, new):
        if os.path.exists(path):
            os.unlink(path)
    train(dataclasses.replace(CONFIG, capacity_pool=old), pool_path=primary, progress=False)
    os.makedirs(os.path.dirname(new), exist_ok=True)
    shutil.move(old, new)
    return primary, old, new


def digest(*paths: str) -> list[str]:
    return [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]


def test_a_moved_capacity_pool_is_re_pointed_and_the_run_resumes_bit_exactly(folders, reference):
    primary, old, new = moved_set(folders, "m")
    before = digest(primary, new)
    says = f"capacity pool {old} is missing; .* cxltrain recover {primary} --capacity-pool NEW\\)$"
    with pytest.raises(PoolError, match=says):
        Pool.open(primary, writable=False)
    assert [p for p in inspect(primary).problems if "is missing" in p] == [pool_set.missing_member(old, primary)]
    assert digest(primary, new) == before

    done = cxltrain("train", "--pool", primary, "--capacity-pool", new, "--steps", STEPS, "--no-progress")
    assert done.returncode == 0, done.stderr
    uuid = inspect(new, member=True).superblock.uuid.hex()
    assert done.stdout.splitlines()[0] == f"re-pointed pool set {primary}: capacity pool {old} -> {new} (uuid {uuid})"
    assert recorded_paths(primary) == [new]
    assert_same_export(export_state(primary), reference)


def test_recover_re_points_without_training(folders):
    """`recover P --capacity-pool NEW`: the re-point, then the recovery, each said in one line; the
    set then passes `pool check` at its new place."""
    primary, old, new = moved_set(folders, "r")
    done = cxltrain("recover", primary, "--capacity-pool", new)
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert said[0].startswith(f"re-pointed pool set {primary}: capacity pool {old} -> {new} (uuid ")
    assert said[1].startswith(f"recovered {primary} to batch 2") and len(said) == 2, said
    done = cxltrain("pool", "check", primary)
    assert done.returncode == 0 and done.stdout.startswith(f"ok: {primary}"), done
    assert recorded_paths(primary) == [new]


@pytest.fixture(scope="module")
def wrong_files(folders):
    """{case: (a file that is not the set's capacity pool, what the refusal says)}."""
    fast, disk = folders
    plain = os.path.join(disk, "plain.pool")
    Pool.create(plain, 1 << 20).close()
    junk = os.path.join(disk, "junk.bin")
    with open(junk, "wb") as f:
        f.write(os.urandom(1 << 16))
    return {"another set's capacity pool": (bare_set(fast, disk, "other"), "expected "),
            "a plain pool": (plain, "expected "),
            "not a pool": (junk, "not a cxltrain pool")}


def test_another_sets_capacity_pool_is_refused_in_one_line_with_nothing_written(folders, wrong_files):
    """By `recover` (no torch: quick); `train` runs the same re-point first (the killed tests)."""
    primary, _, new = moved_set(folders, "w")
    other, _ = wrong_files["another set's capacity pool"]
    before = digest(primary, new, other)
    done = cxltrain("recover", primary, "--capacity-pool", other)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1 and not done.stdout, done
    expected = inspect(new, member=True).superblock.uuid.hex()
    uuid = inspect(other, member=True).superblock.uuid.hex()
    assert (f"{other} is not the capacity pool of set {primary} (uuid {uuid}, expected {expected})"
            in done.stderr), done.stderr
    assert digest(primary, new, other) == before


@pytest.mark.parametrize("case", ["another set's capacity pool", "a plain pool", "not a pool"])
def test_a_wrong_file_is_refused_by_uuid_and_nothing_is_written(folders, wrong_files, case):
    primary, old, new = moved_set(folders, "u")
    wrong, says = wrong_files[case]
    before = digest(primary, new, wrong)
    with pytest.raises(PoolError, match=f"{wrong} is not the capacity pool of set {primary} .*{says}"):
        repoint(primary, wrong)
    assert digest(primary, new, wrong) == before and recorded_paths(primary) == [old]


def test_an_old_copy_of_the_capacity_pool_is_refused_and_nothing_is_written(folders):
    """The right UUID, from another epoch (a backup): refused before the record is rewritten."""
    primary, old, new = moved_set(folders, "e")
    stale = new + ".at2"
    shutil.copy(new, stale)
    shutil.move(new, old)
    with Pool.open(primary) as pool:  # the set moves on without the copy
        pool.commit(batches_done=3)
    before = digest(primary, old, stale)
    with pytest.raises(PoolError, match="another epoch"):
        repoint(primary, stale)
    assert digest(primary, old, stale) == before and recorded_paths(primary) == [old]


def test_the_record_flips_between_its_slots_and_names_no_path_it_was_not_given(folders):
    """Three moves: the record goes to slot 1, back to slot 0, to slot 1, each newer generation winning."""
    primary, old, new = moved_set(folders, "f")
    places = [new, new + ".2", new + ".3"]
    for i, place in enumerate(places):
        if i:
            shutil.move(places[i - 1], place)
        assert repoint(primary, place) is not None
        assert repoint(primary, place) is None  # already there: nothing written
        with Pool.open(primary) as pool:
            record = pool.set_record()
            assert (record.slot, record.generation) == ((i + 1) % 2, i + 1)
            assert [m.path for m in pool.members] == [place]


def test_a_set_with_no_room_for_the_second_slot_is_refused_with_nothing_written(folders):
    """A primary sized to the byte for one record (as sets were before the second slot had room)."""
    fast, disk = folders
    primary = os.path.join(fast, "tight.pool")
    with Pool.create(primary, pool_size_for([pool_set.SET_BYTES], KNOBS.dir_capacity, KNOBS.region_align)) as pool:
        old = os.path.join(disk, "tight.cap")
        pool.add_member(Pool.create(old, 1 << 20, mapper=open_capacity))
    new = os.path.join(disk, "moved", "tight.cap")
    os.makedirs(os.path.dirname(new), exist_ok=True)
    shutil.move(old, new)
    before = digest(primary, new)
    with pytest.raises(PoolFullError, match="no room for a second copy of its list of capacity pools"):
        repoint(primary, new)
    assert digest(primary, new) == before and recorded_paths(primary) == [old]


def test_a_torn_or_damaged_slot_is_never_current():
    uuid = bytes(range(16))
    entries = [pool_set.MemberEntry(0, b"m" * 16, "/a.cap")]
    older, newer = pool_set.pack_set(entries, uuid, 4), pool_set.pack_set([dataclasses.replace(entries[0],
                                                                                               path="/b.cap")], uuid, 5)
    assert pool_set.current_record([older, newer], uuid, "p").entries[0].path == "/b.cap"
    assert pool_set.current_record([newer, older], uuid, "p").slot == 0
    torn = newer[: len(newer) // 2] + older[len(newer) // 2:]
    assert pool_set.current_record([older, torn], uuid, "p").entries[0].path == "/a.cap"
    assert pool_set.current_record([older, None], uuid, "p").generation == 4
    with pytest.raises(PoolError, match="is damaged"):
        pool_set.current_record([torn, bytes(len(older))], uuid, "p")


def killed_re_point(folders, point: str, *options: str) -> tuple[str, str, str]:
    """A moved set whose `train --capacity-pool NEW` was killed at `point`: (primary, old, new)."""
    primary, old, new = moved_set(folders, "k")
    done = cxltrain("train", "--pool", primary, "--capacity-pool", new, "--steps", STEPS, "--no-progress", *options,
                    env={CRASH_ENV: point})
    assert done.returncode == -9, done.stderr  # killed at the point
    return primary, old, new


@pytest.mark.parametrize("options", [(), pytest.param(("--power-loss",), marks=pytest.mark.slow)])
def test_a_re_point_killed_inside_the_record_leaves_the_old_path(folders, reference, options):
    """Killed with half the new record durable (and with the device's power-loss model: every
    store not persisted lost): the old record stands, and re-pointing again works."""
    primary, old, new = killed_re_point(folders, CrashPoint.REPOINT_TORN_RECORD, *options)
    assert recorded_paths(primary) == [old]
    assert repoint(primary, new) is not None
    train(dataclasses.replace(CONFIG, steps=STEPS, capacity_pool=new), pool_path=primary, progress=False)
    assert_same_export(export_state(primary), reference)


@pytest.mark.slow
def test_a_re_point_killed_after_the_record_leaves_the_new_path_and_resumes_alone(folders, reference):
    """Killed once the new record is durable, before any commit: the set opens at the new place,
    and `train --pool P` alone resumes there (its snapshot's remembered settings still name the old)."""
    primary, _, new = killed_re_point(folders, CrashPoint.REPOINT_AFTER_RECORD)
    with Pool.open(primary, writable=False) as pool:
        assert [m.path for m in pool.members] == [new]
    done = cxltrain("train", "--pool", primary, "--steps", STEPS, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert_same_export(export_state(primary), reference)
