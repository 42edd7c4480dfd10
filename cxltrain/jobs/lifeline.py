"""A rank ends with its launcher: torchrun starts each rank in a session of its own, so killing the
launcher (or its process group) would leave the ranks training unsupervised, holding their pools.

    mark_launcher()        # in the launcher, before torchrun starts the ranks
    end_with_launcher()    # in each rank, first thing

The kernel kills the rank (PR_SET_PDEATHSIG, SIGKILL) when the launcher dies; a rank whose launcher
died before that was armed sees itself re-parented and exits at once. SIGKILL: a rank blocked in a
collective could not act on a catchable signal, and recovery makes a kill at any moment exact.
"""

from __future__ import annotations

import ctypes
import os
import signal

from ..errors import CxlTrainError

LAUNCHER_ENV = "CXLTRAIN_LAUNCHER_PID"
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"   # set by torchrun in every rank it starts
PEER_LOST = "a peer died or hangs"  # in a rank's line when a collective failed: an echo of another's end
RANK_ERROR_ENV = "CXLTRAIN_RANK_ERRORS"  # a file of the launcher's: the ranks' error lines, the first one shown
PR_SET_PDEATHSIG = 1


class LauncherGone(CxlTrainError):
    """The process that launched this rank is no longer its parent."""


def launcher_reports() -> bool:
    """True in a rank whose launcher collects its ranks' errors and says how the run ended: such a
    rank's own lines on stderr would come between that one line and the user."""
    return RANK_ERROR_ENV in os.environ and TORCHRUN_ENV in os.environ


def rank_error(line: str) -> bool:
    """In a rank of a launcher that collects its ranks' errors: append `line` to its file (whole
    lines: O_APPEND) and return True; else False (the caller prints it)."""
    if not launcher_reports():
        return False
    fd = os.open(os.environ[RANK_ERROR_ENV], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode())
    finally:
        os.close(fd)
    return True


def stopped_by(number: int) -> str:
    """How a line says the process was stopped by signal `number`: "interrupted" for SIGINT (Ctrl-C),
    "terminated (SIGTERM)" and the like for the others."""
    return "interrupted" if number == signal.SIGINT else f"terminated ({signal.Signals(number).name})"


def restarts_left() -> int:
    """In a rank started by torchrun: how many more times its agent restarts the group (0 elsewhere)."""
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - done


def failure_line(exit_codes: dict[int, int], rank_lines: list[str], max_restarts: int) -> str:
    """The one line a launcher shows for a run its ranks ended, once no restart is left.
    exit_codes: rank -> exit status of the last attempt's failed ranks (negative: the signal that
    killed it); rank_lines: the error lines the ranks wrote (rank_error), in order, of every attempt.

    By what it tells of the cause: a rank killed by a signal (it wrote nothing, and its peers' lines
    say only that they lost it); a rank's own error; a peer lost; ranks all SIGTERMed (exit 143, or
    -15 before their handler was in place) from outside, the agent's own SIGTERM coming only after
    another failure; else a rank's status."""
    stopped = (-signal.SIGTERM, 128 + signal.SIGTERM)
    no_restart = (f", and no restart was left (--max-restarts {max_restarts}); the same command resumes from the "
                  "batch every rank committed")
    killed = sorted(rank for rank, code in exit_codes.items() if code < 0 and code not in stopped)
    if killed:
        rank, number = killed[0], -exit_codes[killed[0]]
        name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
        oom = number == signal.SIGKILL
        why = " (the kernel's out-of-memory killer sends it: `dmesg` says whether it did)" if oom else ""
        return f"cxltrain: error: rank {rank} was killed by {name}{why}{no_restart}"
    own = [line for line in rank_lines if PEER_LOST not in line]
    if own or rank_lines:
        return (own or rank_lines)[0]
    failed = sorted(rank for rank, code in exit_codes.items() if code not in stopped)
    if not failed:
        return f"cxltrain: error: the ranks were terminated (SIGTERM) from outside their launcher{no_restart}"
    rank = failed[0]
    return (f"cxltrain: error: rank {rank} exited with status {exit_codes[rank]} ({len(exit_codes)} rank(s) failed, "
            f"after {max_restarts} restart(s) at most)")


def mark_launcher() -> None:
    """Name this process as the launcher of the ranks it starts (they inherit the environment)."""
    os.environ[LAUNCHER_ENV] = str(os.getpid())


def end_with_launcher() -> None:
    """In a rank started by torchrun: die with the launcher; LauncherGone if it is gone already."""
    if TORCHRUN_ENV not in os.environ:
        return  # one rank in the launcher's own process: nothing to outlive
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl (not Linux): the parent check below still runs once
    # after arming: a launcher that dies from here on kills this rank; one that died before shows here
    parent, launcher = os.getppid(), os.environ.get(LAUNCHER_ENV)
    if parent == 1 or (launcher is not None and int(launcher) != parent):
        raise LauncherGone(f"rank {os.environ.get('RANK', '?')}: its launcher exited before it started; not "
                           "training unsupervised")
