"""SIGTERM: stop training at a batch boundary once it runs, at once before that."""

from __future__ import annotations

import threading


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
