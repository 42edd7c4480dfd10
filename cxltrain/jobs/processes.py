"""A process's children and whether a process lives, read from /proc (Linux): what a torture of
`train --nproc-per-node N` needs to kill one rank, both, or the launcher, and to see that no rank
outlives its launcher."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The ids of `pid`'s child processes (empty when it has none, or is gone)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def rank_of(pid: int) -> int | None:
    """The RANK in `pid`'s environment (torchrun sets it for each rank), or None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"RANK=")]
    return found[0] if found else None
