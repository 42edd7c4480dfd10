"""The checkpoint worker (cxltrain.checkpoint.worker) on its own: job order, back-pressure, errors,
draining. Jobs here are plain functions and generators; the checkpointer's use of it is tested
through the Runtime (test_runtime.py) and with real kills (test_checkpoint_crash.py)."""

from __future__ import annotations

import threading

import pytest

from cxltrain.checkpoint.worker import BackgroundWorker, InlineWorker
from cxltrain.errors import CheckpointError

TIMEOUT = 30  # seconds: a hung worker fails the test instead of hanging the suite


def gated_commit(events: list, gate: threading.Event, steps: int = 3, started: threading.Event | None = None):
    """A commit whose first step waits for `gate` (setting `started` first), so a test can queue
    work behind it while it runs."""
    for i in range(steps):
        if i == 0:
            if started is not None:
                started.set()
            assert gate.wait(TIMEOUT)
        events.append(f"commit {i}")
        yield
    events.append("commit done")


def test_a_capture_runs_between_the_steps_of_a_commit():
    worker, events, gate, started = BackgroundWorker(), [], threading.Event(), threading.Event()
    commit = worker.submit_commit(gated_commit(events, gate, started=started))
    assert started.wait(TIMEOUT)
    capture = worker.submit_capture(lambda: events.append("capture"))
    gate.set()
    worker.wait(capture)
    worker.wait(commit)
    worker.close()
    assert events == ["commit 0", "capture", "commit 1", "commit 2", "commit done"]


def test_one_commit_in_flight_at_most():
    worker, gate = BackgroundWorker(), threading.Event()
    first = worker.submit_commit(gated_commit([], gate))
    with pytest.raises(CheckpointError, match="already in flight"):
        worker.submit_commit(iter(()))
    gate.set()
    worker.wait(first)
    worker.wait(worker.submit_commit(iter(())))
    worker.close()


def test_a_capture_can_run_the_commit_in_flight_to_its_end():
    """Back-pressure: a capture that needs the ring space a commit frees finishes that commit first."""
    worker, events, gate, started = BackgroundWorker(), [], threading.Event(), threading.Event()
    commit = worker.submit_commit(gated_commit(events, gate, started=started))
    assert started.wait(TIMEOUT)
    ran = []
    capture = worker.submit_capture(lambda: ran.append(worker.finish_commit()) or events.append("capture"))
    gate.set()
    worker.wait(capture)
    assert commit.done and ran == [True]
    assert events == ["commit 0", "commit 1", "commit 2", "commit done", "capture"]
    worker.wait(worker.submit_capture(lambda: ran.append(worker.finish_commit())))
    assert ran == [True, False]  # nothing in flight any more
    worker.close()


def test_a_failed_job_surfaces_at_the_next_sync_point_with_its_cause():
    worker = BackgroundWorker()

    def broken():
        raise OSError("media error")

    failed = worker.submit_capture(broken)
    with pytest.raises(CheckpointError, match="checkpoint worker failed: media error") as caught:
        worker.wait(failed)
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(CheckpointError, match="media error"):  # poisoned: nothing more runs
        worker.submit_capture(lambda: None)
    with pytest.raises(CheckpointError, match="media error"):
        worker.close()


def test_a_failed_commit_step_releases_its_waiters():
    worker = BackgroundWorker()

    def steps():
        yield
        raise ValueError("slot too small")

    ticket = worker.submit_commit(steps())
    with pytest.raises(CheckpointError, match="slot too small"):
        worker.wait(ticket)


def test_close_runs_what_is_queued():
    worker, events, gate, started = BackgroundWorker(), [], threading.Event(), threading.Event()
    worker.submit_commit(gated_commit(events, gate, started=started))
    assert started.wait(TIMEOUT)
    worker.submit_capture(lambda: events.append("capture"))
    gate.set()
    worker.close()
    assert events == ["commit 0", "capture", "commit 1", "commit 2", "commit done"]


def test_inline_runs_everything_at_once_and_raises_directly():
    worker, events = InlineWorker(), []
    worker.submit_commit(gated_commit(events, _set_event()))
    worker.submit_capture(lambda: events.append("capture"))
    assert events == ["commit 0", "commit 1", "commit 2", "commit done", "capture"]
    assert worker.wait(worker.submit_capture(lambda: None)) == 0.0 and not worker.finish_commit()

    def broken():
        raise OSError("direct")

    with pytest.raises(OSError, match="direct"):
        worker.submit_capture(broken)


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event
