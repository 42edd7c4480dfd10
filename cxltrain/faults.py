"""Named crash points and planted faults, for crash tests. Inert unless their variables are set.

    CXLTRAIN_CRASH_AT=NAME[:N]   the process SIGKILLs itself the N-th time (default 1st) it reaches
                                 crash_point(NAME): a crash at an exact place in a protocol.
    CXLTRAIN_FAULT=NAME[,NAME]   planted bugs (an ordering rule broken on purpose), so a crash test
                                 can show it catches them. Never set outside tests.

Both are read once, at import (or set by `arm`, for a child forked from a process that imported
this module already); a process that sets neither pays one `is None` check per point.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "CXLTRAIN_CRASH_AT"
FAULT_ENV = "CXLTRAIN_FAULT"

# The planted bugs, each breaking one ordering rule where the code enforces it.
PLANTED = (
    "skip-undo-persist",      # U1: the undo record is never persisted (checkpoint/ring.py)
    "commit-before-rows",     # U2: the root is written before the batch's rows are persisted (checkpointer.py)
    "capture-before-update",  # U4: the undo record holds rows from before the previous update (checkpointer.py)
    "root-before-entries",    # pool: a root naming regions whose directory entries are not durable (pool.py)
)


def _parse_crash(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    name, _, count = value.rpartition(":")  # names contain ':' themselves; the count is last
    if count.isdigit() and int(count) > 0 and name:
        return name, int(count)
    return value, 1


_CRASH = _parse_crash(os.environ.get(CRASH_ENV))
_FAULTS = frozenset(f for f in os.environ.get(FAULT_ENV, "").split(",") if f)
_reached = 0


def arm(crash_at: str | None, faults: str = "") -> None:
    """Set the crash point and planted faults as the variables would: for a process forked after
    import (cxltrain crashtest's children), where the variables were read before they were set."""
    global _CRASH, _FAULTS, _reached
    _CRASH, _FAULTS, _reached = _parse_crash(crash_at), frozenset(f for f in faults.split(",") if f), 0


def crash_point(name: str) -> None:
    """Die here, as a power cut or kill -9 would, if CXLTRAIN_CRASH_AT names this point."""
    global _reached
    if _CRASH is None or _CRASH[0] != name:
        return
    _reached += 1
    if _reached == _CRASH[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def reached() -> int:
    """How many times the armed crash point has been reached so far (it dies at the count asked)."""
    return _reached


def crash_armed(name: str) -> bool:
    """True when CXLTRAIN_CRASH_AT names this point: for a write that must be split to crash inside it."""
    return _CRASH is not None and _CRASH[0] == name


def planted(name: str) -> bool:
    """True when the test-only fault `name` is planted (CXLTRAIN_FAULT)."""
    return name in _FAULTS
