"""Where the checkpointer's jobs run: on one background thread (the pipeline of docs/architecture.md §4), or
inline on the training thread (the synchronous baseline). Both take the same two kinds of job:

    capture   a function: one table's undo record of the batch in flight. Short, and the training
              thread will soon wait for it (U1), so a pending capture always runs first.
    commit    an iterator of steps (persist rows, write the snapshot, write the root, reclaim): one
              batch's commit. The thread runs one step at a time and serves pending captures in
              between, so b+1's captures never wait behind b's whole commit.

At most one commit is in flight: the checkpointer waits for the previous one before submitting
the next, which bounds the commit lag to one batch. A capture that finds the undo ring full calls
finish_commit() to run the in-flight commit to its end (its reclaim frees the ring) and tries again.

A job that raises poisons the worker: every later submit or wait raises CheckpointError naming
the cause, on the training thread, so the failure surfaces at its next sync point and nothing is
written on top of an unknown state. Crash points (faults.crash_point) SIGKILL the whole process
from either thread.

    worker = BackgroundWorker()
    ticket = worker.submit_capture(lambda: ring.append(...))
    worker.wait(ticket)            # seconds waited; raises CheckpointError if the worker failed
    worker.close()                 # runs what is queued, stops the thread
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Iterator

from ..errors import CheckpointError


class Ticket:
    """One submitted job; done once it has run (or the worker failed)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()


class InlineWorker:
    """Runs each job at once on the caller's thread: undo logging on the critical path."""

    def submit_capture(self, job: Callable[[], None]) -> Ticket:
        job()
        return _DONE

    def submit_commit(self, steps: Iterator[None]) -> Ticket:
        for _ in steps:
            pass
        return _DONE

    def finish_commit(self) -> bool:
        return False  # a commit is never left in flight here

    def wait(self, ticket: Ticket) -> float:
        return 0.0

    def close(self) -> None:
        pass


_DONE = Ticket()
_DONE._done.set()


class BackgroundWorker:
    """One daemon thread running captures first, then commit steps (see the module docstring)."""

    def __init__(self, name: str = "cxltrain-checkpoint") -> None:
        self._cond = threading.Condition()
        self._captures: collections.deque[tuple[Callable[[], None], Ticket]] = collections.deque()
        self._commit: tuple[Iterator[None], Ticket] | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- training thread ----------------------------------------------------------------------
    def submit_capture(self, job: Callable[[], None]) -> Ticket:
        ticket = Ticket()
        with self._cond:
            self._raise_if_failed()
            self._captures.append((job, ticket))
            self._cond.notify()
        return ticket

    def submit_commit(self, steps: Iterator[None]) -> Ticket:
        ticket = Ticket()
        with self._cond:
            self._raise_if_failed()
            if self._commit is not None:
                raise CheckpointError("a commit is already in flight: wait for it before submitting the next")
            self._commit = (steps, ticket)
            self._cond.notify()
        return ticket

    def wait(self, ticket: Ticket) -> float:
        """Block until `ticket` has run; returns the seconds spent waiting."""
        if ticket.done:
            with self._cond:
                self._raise_if_failed()
            return 0.0
        started = time.perf_counter()
        ticket._done.wait()
        with self._cond:
            self._raise_if_failed()
        return time.perf_counter() - started

    def close(self) -> None:
        """Run what is queued, then stop the thread. Raises if a job failed (also an earlier one)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        with self._cond:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"the checkpoint worker failed: {self._error}") from self._error

    # -- worker thread ------------------------------------------------------------------------
    def finish_commit(self) -> bool:
        """Called by a job on the worker thread: run the in-flight commit to its end now. Returns
        False when there was none."""
        with self._cond:
            commit = self._commit
        if commit is None:
            return False
        steps, ticket = commit
        for _ in steps:
            pass
        self._commit_done(ticket)
        return True

    def _commit_done(self, ticket: Ticket) -> None:
        with self._cond:
            self._commit = None
        ticket._done.set()

    def _next_job(self) -> tuple[Callable[[], None], Ticket | None] | None:
        """The job to run next and the ticket it completes (None: stop), waiting for one."""
        with self._cond:
            while not (self._captures or self._commit or self._stopping):
                self._cond.wait()
            if self._captures:
                return self._captures.popleft()
            if self._commit is not None:
                return self._commit_step, None
            return None

    def _commit_step(self) -> None:
        steps, ticket = self._commit
        if next(steps, StopIteration) is StopIteration:
            self._commit_done(ticket)

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            run, ticket = job
            try:
                run()
            except BaseException as e:  # noqa: BLE001 — handed to the training thread, never lost
                self._fail(e, ticket)
                return
            if ticket is not None:
                ticket._done.set()

    def _fail(self, error: BaseException, running: Ticket | None) -> None:
        """Poison the worker, then release everyone waiting: the error is set before any of them
        wakes, so none takes a failed job for a finished one."""
        with self._cond:
            self._error = error
            waiting = [t for _, t in self._captures] + ([self._commit[1]] if self._commit else [])
            self._captures.clear()
            self._commit = None
        for ticket in waiting + ([running] if running is not None else []):
            ticket._done.set()
