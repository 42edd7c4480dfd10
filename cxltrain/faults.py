"""Named crash points and planted faults, for crash tests. Inert unless their variables are set.

    CXLTRAIN_CRASH_AT=NAME[:N]   the process SIGKILLs itself the N-th time (default 1st) it reaches
                                 crash_point(NAME): a crash at an exact place in a protocol.
    CXLTRAIN_FAULT=NAME[,NAME]   planted bugs (an ordering rule broken on purpose), so a crash test
                                 can show it catches them. Never set outside tests.

Both are read once, at import; a process that sets neither pays one `is None` check per point.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "CXLTRAIN_CRASH_AT"
FAULT_ENV = "CXLTRAIN_FAULT"


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


def crash_point(name: str) -> None:
    """Die here, as a power cut or kill -9 would, if CXLTRAIN_CRASH_AT names this point."""
    global _reached
    if _CRASH is None or _CRASH[0] != name:
        return
    _reached += 1
    if _reached == _CRASH[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def crash_armed(name: str) -> bool:
    """True when CXLTRAIN_CRASH_AT names this point: for a write that must be split to crash inside it."""
    return _CRASH is not None and _CRASH[0] == name


def planted(name: str) -> bool:
    """True when the test-only fault `name` is planted (CXLTRAIN_FAULT)."""
    return name in _FAULTS
