"""Opening and locking a pool file, for `Pool` and for inspection alike.

A pool is opened by one process at a time: an exclusive flock on the file (shared for read-only
inspection); a second opener gets PoolLockedError. The lock dies with the process that took it:
a forked child (a DataLoader worker) would otherwise share the locked descriptor and keep the pool
locked after a SIGKILL of its parent, refusing the restart a supervisor makes at once.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from ..devices import device_size
from ..errors import DeviceError, NotAPoolError, PoolError, PoolLockedError
from . import format as fmt
from .check import Reader

CREATING = ".creating"  # the side name a pool is built under until its first commit (Runtime, import)


class open_pool_file:
    """Open a pool file for validation: context manager yielding (fd, size); closes on error
    (and on exit, unless keep=True)."""

    def __init__(self, path: str, writable: bool, keep: bool = False):
        self.path, self.writable, self.keep = path, writable, keep

    def __enter__(self) -> tuple[int, int]:
        flags = os.O_RDWR if self.writable else os.O_RDONLY
        try:
            st = os.stat(self.path)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
                # opening a FIFO or socket would block or fail obscurely
                raise NotAPoolError(f"{self.path}: not a regular file or DAX device")
            self.fd = os.open(self.path, flags)
        except FileNotFoundError:
            raise PoolError(f"{self.path}: no such pool{_creation_left_behind(self.path)}") from None
        except IsADirectoryError:
            raise NotAPoolError(f"{self.path}: is a directory, not a pool") from None
        except PermissionError:
            how = "read-write" if self.writable else "reading"
            raise PoolError(f"{self.path}: permission denied opening for {how}") from None
        except OSError as e:
            raise PoolError(f"{self.path}: cannot open: {e.strerror}") from None
        try:
            return self.fd, device_size(self.fd, self.path)
        except BaseException:
            os.close(self.fd)
            raise

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None or not self.keep:
            os.close(self.fd)


def pread_reader(fd: int) -> Reader:
    def read(offset: int, length: int) -> bytes:
        return os.pread(fd, length, offset)
    return read


_LOCKS: set[int] = set()  # the lock descriptors this process holds


def _drop_inherited_locks() -> None:
    """In a forked child: let go of the parent's locks. flock belongs to the open file description,
    which fork shares (as it does an OFD lock; only O_CLOEXEC-style closing at exec is automatic),
    so the child's copies are pointed at /dev/null: the numbers stay valid for whatever closes
    them later, and the lock goes with the last descriptor of the parent."""
    if not _LOCKS:
        return
    null = os.open(os.devnull, os.O_RDONLY)
    for fd in _LOCKS:
        os.dup2(null, fd)
    os.close(null)
    _LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def unlock_pool(fd: int) -> None:
    """Release a lock lock_pool took (closes its descriptor)."""
    _LOCKS.discard(fd)
    os.close(fd)


def lock_pool(path: str, writable: bool) -> int:
    """Take the pool's advisory lock on a descriptor of its own; returns it (unlock_pool releases it).

    flock belongs to an open file description. mmap dup()s the data descriptor, so a lock taken on
    that one would live on for as long as any view of the mapping does; a separate descriptor is
    released exactly when the pool is closed.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if writable else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise PoolLockedError(f"{path}: pool is in use by another process") from None
        raise DeviceError(f"{path}: cannot lock: {e.strerror}") from None
    _LOCKS.add(fd)
    return fd


def _creation_left_behind(path: str) -> str:
    """What to add to "no such pool" when PATH.creating exists: a creation still running, or one
    that was killed, whose file is removed here (remove_stale: only once its creator is dead)."""
    building = path + CREATING
    if not os.path.lexists(building):
        return ""
    try:
        remove_stale(building)
    except PoolLockedError:
        return f" yet ({building} is being created by a running process)"
    except PoolError as e:
        return f" ({e})"
    return f" (removed {building}, left behind by a creation that was killed)"


def remove_stale(path: str) -> None:
    """Delete `path` (a pool a crashed process was building under a side name), unless another
    process holds it open, which raises PoolLockedError, or it is not provably a pool of ours (our
    magic, or the mark of an unfinished one, at offset 0), which raises PoolError."""
    if not os.path.lexists(path):
        return
    if not os.path.isfile(path) or os.path.islink(path):
        raise PoolError(f"{path}: is in the way and is not a pool left unfinished by cxltrain; move it away")
    lock_fd = lock_pool(path, writable=True)  # refuses while its builder is alive
    try:
        with open(path, "rb") as f:
            magic = int.from_bytes(f.read(8), "little")
        if magic not in (fmt.MAGIC, fmt.BUILDING_MAGIC):
            raise PoolError(f"{path}: is in the way and is not a pool left unfinished by cxltrain; move it away")
        os.unlink(path)  # under the lock: a builder that starts now creates a new file
    finally:
        unlock_pool(lock_fd)
