"""SIGTERM: stop training at a batch boundary once it runs, at once before that."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

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


def end_blocked_rank_on_sigterm(grace_s: float = RANK_GRACE_S) -> None:
    """For a rank under torchrun: a SIGTERM (or the SIGINT its agent passes on from a Ctrl-C) that
    finds the rank blocked in a collective (a peer gone) ends it `grace_s` later with 128 + the
    signal's number, unless it has ended by then.

    Blocked in C++, the main thread never returns to the interpreter, so the Python handler above
    never runs; the interpreter's C-level handler still writes the signal's number to the wakeup fd,
    which a thread of this process reads. Ending the rank there is a kill as far as the pool goes:
    every committed batch stays, and the group recovers to its last agreed point."""
    global _wakeup
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
                if not launcher_reports():  # else the launcher says how the run ended, in one line
                    os.write(2, f"cxltrain: {stopped_by(number)} while blocked in a collective; the rank ends "
                                "now\n".encode())
                os._exit(128 + number)

    threading.Thread(target=watch, name="cxltrain-sigterm-watch", daemon=True).start()
