"""Opening and locking a pool file, for `Pool` and for inspection alike.

A pool is opened by one process at a time: an exclusive flock on the file (shared for read-only
inspection); a second opener gets PoolLockedError.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from ..devices import device_size
from ..errors import DeviceError, NotAPoolError, PoolError, PoolLockedError
from .check import Reader


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
            raise PoolError(f"{self.path}: no such pool") from None
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


def lock_pool(path: str, writable: bool) -> int:
    """Take the pool's advisory lock on a descriptor of its own; returns it (close it to unlock).

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
    return fd
