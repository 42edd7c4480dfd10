"""`cxltrain crashtest --enumerate` (jobs/crash_states.py): every crash state of one commit.

The recorder sees each fence of the crash-model devices and what a crash since the previous one
may keep or lose; a small enumeration of one pool and of a pool set recovers exactly, and a planted
ordering bug makes it fail (slow: bigger bounds, and every planted bug a commit can show).
"""

from __future__ import annotations

import contextlib
import json
import os
import random

import numpy as np
import pytest

from cxltrain.emulation.cxl import PowerLossCXLDevice
from cxltrain.faults import Planted
from cxltrain.jobs.crash_states import Recorder, adjacent_runs, choose_states, enumerate_commit
from cxltrain.kernels import native
from helpers import cxltrain

SMALL = dict(samples=3, exhaustive_atoms=2, seed=5)


def test_small_intervals_are_enumerated_whole_and_big_ones_within_the_bound():
    rng = random.Random(1)
    every = choose_states([np.array([3, 4]), np.array([9])], rng, exhaustive_atoms=3, samples=2)
    assert len(every) == 8 and len({m.tobytes() for m in every}) == 8
    atoms = [np.array([1, 2, 3, 10, 11, 40]), np.array([0, 1])]
    assert adjacent_runs(atoms) == [(0, 3), (3, 5), (5, 6), (6, 8)]
    some = choose_states(atoms, rng, exhaustive_atoms=3, samples=10)
    assert len(some) == 10 and all(m.shape == (8,) for m in some)
    assert not some[0].any() and some[1].all()  # nothing kept, everything kept
    run = some[2]  # a run alone, then all but it
    assert run.sum() in (1, 2, 3) and np.array_equal(some[3], ~run)


@contextlib.contextmanager
def recorded_device(folder, name: str):
    """(a 4 KiB power-loss device over a new file, its Recorder); the device closed after (its close
    is the recorder's last interval)."""
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(bytes(4096))
    fd = os.open(path, os.O_RDWR)
    device = PowerLossCXLDevice(path, fd, 4096)
    try:
        yield device, Recorder([device])
    finally:
        device.close()
        os.close(fd)


def test_the_recorder_sees_stores_as_dirty_until_a_fence_makes_them_durable(shm_dir):
    with recorded_device(shm_dir, "recorded.bin") as (device, recorder):
        words = device.array.view(np.uint64)
        words[[0, 1, 100]] = 7
        device.flush(0, 16)            # words 0 and 1 written back, not yet fenced: still dirty
        device.drain()
        words[100] = 8                 # a store never written back
        device.persist(512, 8)         # word 64, unchanged: a fence with nothing new
    first, second, closed = recorder.intervals
    assert first.dirty[0].atoms.tolist() == [0, 1, 100] and first.advanced[0].atoms.tolist() == [0, 1]
    assert second.dirty[0].atoms.tolist() == [100] and second.advanced[0].atoms.size == 0
    assert second.dirty[0].values.view(np.uint64)[0, 0] == 8
    assert closed.what.startswith("close") and closed.dirty[0].atoms.tolist() == [100]


@pytest.mark.skipif(not native.built(), reason="the native kernels are not built")
def test_the_recorder_sees_a_native_kernels_own_persists(shm_dir):
    """A kernel that persists by itself (here the dense payload's stream_pieces, one fence) calls the
    observer through the domain's on_fence, holding the media lock, and the fence is recorded."""
    with recorded_device(shm_dir, "native.bin") as (device, recorder):
        persistence = device.native_persistence()
        assert persistence.on_fence != 0
        lib = native.lib()
        piece = np.arange(64, dtype=np.uint8)
        sources = np.array(lib.addresses(piece), dtype=np.int64)
        lengths = np.array([64], dtype=np.int64)
        with persistence.lock:
            lib.stream_pieces(native.address(device.array) + 128, 4096 - 128, persistence,
                              *lib.addresses(sources, lengths), 1, 0)
    assert recorder.errors == [] and recorder.intervals[0].what.startswith("fence")
    assert recorder.intervals[0].advanced[0].atoms.tolist() == list(range(16, 24))  # the 64 bytes at 128


@pytest.mark.parametrize("pool_set", [False, True], ids=["one pool", "pool set"])
def test_every_chosen_state_recovers_exactly(shm_dir, pool_set):
    outcome = enumerate_commit(pool_set=pool_set, folder=shm_dir, **SMALL)
    assert outcome.inexact == [], outcome.inexact[:3]
    assert outcome.tried > outcome.intervals > 10 and outcome.after >= 1 and outcome.exhaustive >= 1


def test_a_root_written_before_the_rows_fails_it(shm_dir):
    # the root of batch 2 (where the recording starts) came before its rows too: states of either batch
    outcome = enumerate_commit(pool_set=False, plant=Planted.COMMIT_BEFORE_ROWS, folder=shm_dir, **SMALL)
    assert outcome.inexact and all("differ: /model/embedding_bag" in p for p in outcome.inexact), \
        outcome.inexact[:3]


def test_enumerate_refuses_the_trials_options_in_one_line():
    done = cxltrain("crashtest", "--enumerate", "--power-loss")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["cxltrain: error: --enumerate runs no trials and chooses its own "
                                                "device models: drop --power-loss"]


@pytest.mark.slow
@pytest.mark.parametrize("pool_set, plant", [
    (False, Planted.SKIP_UNDO_PERSIST), (False, Planted.CAPTURE_BEFORE_UPDATE), (True, Planted.COMMIT_BEFORE_ROWS),
    (True, Planted.SKIP_CAPACITY_SYNC), (False, Planted.HEADER_BEFORE_PAYLOAD), (False, Planted.UPDATE_BEFORE_HEADER),
    (False, Planted.KERNEL_SKIPS_ROW_FLUSH)])
def test_each_planted_bug_a_commit_shows_fails_it(shm_dir, pool_set, plant):
    assert enumerate_commit(pool_set=pool_set, plant=plant, folder=shm_dir, **SMALL).inexact


@pytest.mark.slow
def test_the_command_enumerates_with_its_default_bounds():
    done = cxltrain("crashtest", "--enumerate", "--seed", "3", "--json", timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert [c["name"] for c in report["commits"]] == ["one pool", "pool set"]
    for commit in report["commits"]:
        assert commit["inexact"] == 0 and commit["tried"] > 300 and commit["after"] >= 1
        assert f"{commit['tried']} crash states tried" in done.stdout
