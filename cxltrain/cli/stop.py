"""SIGTERM: a one-process run stops training at a batch boundary once it runs, at once before that;
a rank under torchrun ends at once (end_rank_on_signal)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import NoReturn

from ..jobs.lifeline import launcher_reports, stopped_by

# A rank that a SIGTERM finds blocked in a collective ends after this long (torchrun's agent waits
# longer, then SIGKILLs: every worker it stops would otherwise cost the group that wait).
RANK_GRACE_S = 5.0
_wakeup: tuple[socket.socket, socket.socket] | None = None  # kept open for the process: the wakeup fd


class Terminated(KeyboardInterrupt):
    """SIGTERM, where it stops the process at once: cleaned up after as Ctrl-C is."""


class StopOnSigterm:
    """SIGTERM handler. Once training runs (`arm`), it asks the loop to stop at the next batch
    boundary, where the pool is committed; before that, or on a second SIGTERM, it stops at once."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def __call__(self, signum, frame) -> None:
        if self.armed and not self.requested.is_set():
            self.requested.set()
            return
        raise Terminated()


current = StopOnSigterm()


def install() -> StopOnSigterm:
    """A fresh handler for one `main` call (a test may call main many times in one process)."""
    global current
    current = StopOnSigterm()
    return current


def end_rank_on_signal(grace_s: float = RANK_GRACE_S) -> None:
    """For a rank under torchrun: a SIGTERM (its agent stopping the group after a rank failed, or
    passing on the launcher's) or a SIGINT (a Ctrl-C passed on) ends the rank with 128 + the
    signal's number: at once where its Python handler runs, `grace_s` later where it is blocked in
    a collective. For the pool either is a kill: every committed batch stays, and the group
    recovers to its last agreed point.

    At once, by os._exit, wherever the signal finds the rank: the agent's SIGTERM often comes as the
    rank is already ending (its peer lost, its line being written), and an exception raised there
    put a traceback beside the launcher's line, or let the interpreter finalize beside gloo threads
    still running (an abort, SIGABRT, which the launcher then named as the run's cause).

    Blocked in C++, the main thread never returns to the interpreter, so that handler never runs;
    the interpreter's C-level handler still writes the signal's number to the wakeup fd, which a
    thread of this process reads."""
    global _wakeup
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda number, frame: _end_rank(number))
    read_end, write_end = _wakeup = socket.socketpair()
    write_end.setblocking(False)
    signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            got = read_end.recv(64)
            if not got:
                return
            number = next((s for s in (signal.SIGTERM, signal.SIGINT) if s in got), None)
            if number is not None:
                time.sleep(grace_s)
                _end_rank(number, " while blocked in a collective; the rank ends now")

    threading.Thread(target=watch, name="cxltrain-sigterm-watch", daemon=True).start()


def _end_rank(number: int, where: str = "") -> NoReturn:
    """End this rank with 128 + `number`, saying so where no launcher says how the run ended."""
    if not launcher_reports():
        try:
            sys.stdout.flush()
        except (OSError, ValueError, RuntimeError):  # RuntimeError: the signal came inside a write
            pass
        os.write(2, f"cxltrain: {stopped_by(number)}{where}\n".encode())
    os._exit(128 + number)
