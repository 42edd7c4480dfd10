"""A stealing set's write-back on its own thread (checkpoint/write_back.py): the commits go on
beside it, and none lets the ring pass the redo records it covers until it has returned (U3c)."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import threading
import time
import types

import pytest
import torch

from cxltrain.checkpoint.commit import CommitPipeline
from cxltrain.checkpoint.ordering import Ordering
from cxltrain.checkpoint.write_back import BackgroundWriteBack
from cxltrain.devices.sysfs import disk_bytes_written
from cxltrain.errors import CheckpointError
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import build_model, build_source, make_runtime, train_step
from helpers import tier_folders

CONFIG = TrainConfig(steps=12, batch_size=64, num_tables=2, rows=3000, dim=16, write_back_every=2)
WAIT = 60  # seconds: a gate never opened fails the test rather than hanging it


def test_a_write_back_is_collected_once_after_it_returns():
    gate = threading.Event()
    write_back = BackgroundWriteBack(lambda: gate.wait(WAIT))
    assert write_back.finished() is None and write_back.join() is None  # none in flight
    write_back.start(4)
    with pytest.raises(CheckpointError, match="already in flight"):
        write_back.start(5)
    assert write_back.in_flight and write_back.finished() is None
    gate.set()
    assert write_back.join() == 4
    assert not write_back.in_flight and write_back.finished() is None and write_back.seconds > 0


def test_a_failed_write_back_raises_where_it_is_collected():
    write_back = BackgroundWriteBack(lambda: os.fdatasync(1 << 20))  # no such descriptor
    write_back.start(2)
    with pytest.raises(CheckpointError, match="the capacity write-back failed: .*Bad file descriptor"):
        write_back.join()
    assert not write_back.in_flight


@pytest.fixture
def folders():
    with tier_folders("cxltrain-write-back-") as both:
        yield both


def test_commits_go_on_beside_a_held_write_back_and_keep_its_records_until_it_returns(folders, monkeypatch):
    """The write-back started by the commit of 2 batches is held at its start; batches 2 to 6
    commit meanwhile (no training step waits for it), each root keeping the ring's start where it
    was; released, it is counted by the next commit, whose root moves the start."""
    gate, held, returned = threading.Event(), threading.Event(), threading.Event()

    def sync(self, pool, real=Ordering.sync_capacity):
        if threading.current_thread().name == "cxltrain-write-back" and not gate.is_set():
            held.set()
            assert gate.wait(WAIT)
            real(self, pool)
            returned.set()
            return
        real(self, pool)

    monkeypatch.setattr(Ordering, "sync_capacity", sync)
    primary = os.path.join(folders[0], "held.pool")
    config = dataclasses.replace(CONFIG, capacity_pool=os.path.join(folders[1], "held.cap"))
    model = build_model(config)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)
    source = build_source(config)
    with make_runtime(config, model, dense_opt, primary) as rt:
        pipeline = rt._guard._commits
        for batch in rt.batches(source, stop=2):
            train_step(model, batch, rt.optimizers, rt.batch)
        rt.wait_durable()  # the commit of 2 batches has started the write-back of batches 0 and 1
        assert held.wait(WAIT) and pipeline.written_back == 0 and pipeline.background.in_flight
        start = pipeline.pool.root.ring_start
        for batch in rt.batches(source, stop=7):
            train_step(model, batch, rt.optimizers, rt.batch)
        rt.wait_durable()
        assert pipeline.durable == 7 and pipeline.written_back == 0
        assert pipeline.pool.root.ring_start == start, "a root passed redo records no write-back had synced"
        gate.set()
        assert returned.wait(WAIT)  # returned; the next commit collects it
        for batch in rt.batches(source, stop=9):
            train_step(model, batch, rt.optimizers, rt.batch)
        rt.wait_durable()
        assert pipeline.written_back >= 2
        assert pipeline.pool.root.ring_start != start
    assert rt.stats.write_backs >= 2 and rt.stats.write_back_seconds > 0


def test_wait_idle_waits_for_the_write_back_in_flight_and_counts_it(folders, monkeypatch):
    """wait_durable leaves the write-back running (it makes no batch durable); wait_idle, where a
    benchmark's block ends, returns only once it has returned, and counts it, so the next commit's
    root may pass the redo records it covers."""
    gate = threading.Event()

    def sync(self, pool, real=Ordering.sync_capacity):
        if threading.current_thread().name == "cxltrain-write-back":
            assert gate.wait(WAIT)
        real(self, pool)

    monkeypatch.setattr(Ordering, "sync_capacity", sync)
    config = dataclasses.replace(CONFIG, capacity_pool=os.path.join(folders[1], "idle.cap"))
    model = build_model(config)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)
    source = build_source(config)
    with make_runtime(config, model, dense_opt, os.path.join(folders[0], "idle.pool")) as rt:
        pipeline = rt._guard._commits
        for batch in rt.batches(source, stop=2):
            train_step(model, batch, rt.optimizers, rt.batch)
        rt.wait_durable()
        assert pipeline.background.in_flight and pipeline.written_back == 0
        threading.Timer(0.2, gate.set).start()
        assert rt.wait_idle() >= 0.15
        assert not pipeline.background.in_flight and pipeline.written_back == 2 and rt.stats.write_backs == 1
        start = pipeline.pool.root.ring_start
        for batch in rt.batches(source, stop=3):
            train_step(model, batch, rt.optimizers, rt.batch)
        rt.wait_durable()
        assert pipeline.pool.root.ring_start != start  # the records of batches 0 and 1 passed


def test_a_write_back_that_fails_beside_the_commits_fails_the_run_at_the_next_commit(folders, monkeypatch):
    """The disk refuses the sync (EIO) on the write-back's thread: the commit that collects it
    fails, and the training thread gets that failure at its next batch end, naming the cause."""
    def sync(self, pool, real=Ordering.sync_capacity):
        if threading.current_thread().name == "cxltrain-write-back":
            raise OSError(errno.EIO, "Input/output error")
        real(self, pool)

    monkeypatch.setattr(Ordering, "sync_capacity", sync)
    config = dataclasses.replace(CONFIG, capacity_pool=os.path.join(folders[1], "eio.cap"))
    model = build_model(config)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)
    with pytest.raises(CheckpointError, match="the capacity write-back failed: .*Input/output error"):
        with make_runtime(config, model, dense_opt, os.path.join(folders[0], "eio.pool")) as rt:
            for batch in rt.batches(build_source(config), stop=config.steps):
                train_step(model, batch, rt.optimizers, rt.batch)
    assert rt._guard._commits.written_back == 0  # never counted


def test_a_ctrl_c_while_closing_is_raised_only_once_the_sync_has_returned():
    """The pools close right after CommitPipeline.close: a sync still running then would write to a
    closed (or reused) descriptor. A SIGINT during the wait is held until the sync returns."""
    gate, returned = threading.Event(), threading.Event()

    def sync():
        assert gate.wait(WAIT)
        returned.set()

    write_back = BackgroundWriteBack(sync)
    write_back.start(2)

    def interrupt_then_release():
        time.sleep(0.2)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.2)
        gate.set()

    # Python's own SIGINT handler, whatever this worker process was left with: the test is of close()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_then_release, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            CommitPipeline.close(types.SimpleNamespace(background=write_back))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert returned.is_set() and not write_back.in_flight


def _trained(config: TrainConfig, primary: str, stop: int):
    """A Runtime of `config` after `stop` batches, their commits durable (a generator: the block stays open)."""
    model = build_model(config)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)
    source = build_source(config)
    with make_runtime(config, model, dense_opt, primary) as rt:
        for batch in rt.batches(source, stop=stop):
            train_step(model, batch, rt.optimizers, rt.batch)
        rt.wait_idle()
        yield rt


def test_the_commits_of_a_stealing_set_force_only_the_member_roots(folders):
    """Between write-backs a commit syncs no capacity page: what it forces on the capacity disk is
    its member root's page (counted from the range); the write-backs beside the commits are counted
    apart, and a set that syncs at every commit forces every page it dirtied."""
    if disk_bytes_written(folders[1]) is None:
        pytest.skip(f"{folders[1]} has no block device of its own: the disk's count is unknown")
    page = os.sysconf("SC_PAGE_SIZE")
    stealing = dataclasses.replace(CONFIG, capacity_pool=os.path.join(folders[1], "steal.cap"), write_back_every=4)
    for rt in _trained(stealing, os.path.join(folders[0], "steal.pool"), stop=6):
        stats = rt.stats
        assert stats.write_backs == 1 and stats.commits == 6
        assert stats.capacity_forced_bytes == 6 * page  # each commit's root, no page of a row
        assert stats.capacity_written_back_bytes > 0  # the write-back of batches 0-3: their rows' pages
    forcing = dataclasses.replace(CONFIG, capacity_pool=os.path.join(folders[1], "force.cap"), write_back_every=1)
    for rt in _trained(forcing, os.path.join(folders[0], "force.pool"), stop=6):
        stats = rt.stats
        assert stats.capacity_written_back_bytes == 0
        assert stats.capacity_forced_bytes >= 6 * 2 * page  # each commit: at least a row's page and the root


def test_a_capacity_pool_on_a_file_system_without_a_disk_counts_nothing(folders):
    config = dataclasses.replace(CONFIG, capacity_pool=os.path.join(folders[0], "shm.cap"), write_back_every=4)
    for rt in _trained(config, os.path.join(folders[0], "shm.pool"), stop=2):
        assert rt.stats.capacity_forced_bytes is None and rt.stats.capacity_written_back_bytes is None


def test_the_disk_count_grows_by_what_a_sync_writes(folders):
    written = disk_bytes_written(folders[1])
    if written is None:
        pytest.skip(f"{folders[1]} has no block device of its own: the disk's count is unknown")
    assert disk_bytes_written(folders[0]) is None  # /dev/shm: tmpfs
    path = os.path.join(folders[1], "probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        before = written()
        os.write(fd, os.urandom(1 << 20))
        os.fdatasync(fd)
        assert written() - before >= 1 << 20
    finally:
        os.close(fd)
