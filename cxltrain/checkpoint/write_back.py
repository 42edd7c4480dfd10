"""A stealing pool set's write-back, on a thread of its own beside the commits.

Between write-backs a batch's cold rows are durable through their redo records (U2f); a write-back
(every capacity pool's dirty pages synced) makes no batch durable. It only lets the ring's live start
move past those records, and only once it has returned (U3c). So the commit it falls due at starts
it after that commit's rows are flushed (it then covers every batch before that commit), and training
goes on beside it: the first commit to find it returned counts it, and from then on may pass the
records of the batches it covers. Those who need it done join it, and count it: the run's last
commit, a ring short of room, and Runtime.wait_idle (a benchmark's block end).

    write_back = BackgroundWriteBack(sync)   # sync(): the capacity pools' pages synced
    write_back.start(done)                   # covers the batches < done
    write_back.finished()                    # done, once it has returned (None until then); raises its error
    write_back.join()                        # waits for it first
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..errors import CheckpointError
from ..faults import CrashPoint, crash_armed


class BackgroundWriteBack:
    """At most one write-back in flight, on a daemon thread; `seconds` sums the time they took."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._thread: threading.Thread | None = None
        self._done = -1
        self._error: BaseException | None = None
        # A crash test armed at COMMIT_WHILE_WRITING_BACK holds the sync until a join (a slow disk):
        # the commits after the start run, and the crash lands, while it is still in flight.
        self._held = crash_armed(CrashPoint.COMMIT_WHILE_WRITING_BACK)
        # A crash test armed at a point inside the write-back (or at a page write, which the commits
        # reach too) needs those points reached in one order, run after run: the commit that starts
        # the write-back then waits for it before its root, as when it ran in the commit.
        self.serial = any(crash_armed(point) for point in CrashPoint.WRITE_BACK)
        self._release = threading.Event()
        # set by the thread as it ends: an Event's wait can be interrupted (Ctrl-C) and waited
        # again, where Thread.join interrupted takes a live thread for ended (CPython 3.11)
        self._returned = threading.Event()
        self.seconds = 0.0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, done: int) -> None:
        """Sync the capacity pools now, beside the caller: the write-back of the batches < done."""
        if self._thread is not None:
            raise CheckpointError("a capacity write-back is already in flight")
        self._done, self._error = done, None
        self._release.clear()
        self._returned.clear()
        self._thread = threading.Thread(target=self._run, name="cxltrain-write-back", daemon=True)
        self._thread.start()

    def finished(self) -> int | None:
        """The batch count the write-back in flight covers, if it has returned (once); else None."""
        if self._thread is None or not self._returned.is_set():
            return None
        return self._collect()

    def join(self) -> int | None:
        """Wait for the write-back in flight, if any; returns what finished() would then."""
        if self._thread is None:
            return None
        self._release.set()
        self._returned.wait()
        return self._collect()

    def _collect(self) -> int:
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise CheckpointError(f"the capacity write-back failed: {self._error}") from self._error
        return self._done

    def _run(self) -> None:
        if self._held:
            self._release.wait()
        started = time.perf_counter()
        try:
            self._sync()
        except BaseException as e:  # noqa: BLE001 — raised by the commit that collects it
            self._error = e
        finally:
            self.seconds += time.perf_counter() - started
            self._returned.set()
