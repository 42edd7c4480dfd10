"""Where a pool lives: which backend maps a path, and opening the file or DAX device for a new pool.

Nothing here maps memory or knows a backend's class; the registry (devices/registry.py) does that.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat

from ..errors import DeviceError
from ..knobs import DEVICE_BACKENDS, KNOBS
from .libpmem import load as load_libpmem
from .mounts import mount_of
from .sysfs import char_device_size, device_dir


def is_char_device(path: str) -> bool:
    """True for an existing character device (device DAX, /dev/dax*)."""
    return os.path.exists(path) and stat.S_ISCHR(os.stat(path).st_mode)


def resolve_backend(path: str, requested: str | None = None) -> str:
    """The backend `auto` (or the `device` knob) maps `path` with."""
    kind = requested or KNOBS.device
    if kind not in DEVICE_BACKENDS:
        raise DeviceError(f"unknown device backend {kind!r}; choose one of {', '.join(DEVICE_BACKENDS)}")
    if kind != "auto":
        return kind
    if is_char_device(path):
        return "pmem"
    mount = mount_of(path)
    if mount is not None and mount.is_memory_backed:
        return "emulated"
    return "pmem" if load_libpmem() is not None else "msync"


def device_size(fd: int, path: str) -> int:
    """Size in bytes of a regular file, or of a device DAX character device (from sysfs)."""
    st = os.fstat(fd)
    if stat.S_ISCHR(st.st_mode):
        size = char_device_size(st.st_rdev)
        if size is None:
            raise DeviceError(f"{path}: character device, but its size is not in "
                              f"{device_dir(st.st_rdev, block=False)}/size")
        return size
    if not stat.S_ISREG(st.st_mode):
        raise DeviceError(f"{path}: neither a regular file nor a DAX character device")
    return st.st_size


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a new pool goes: an open descriptor, its size, and whether it existed before."""

    fd: int
    size: int
    existing: bool  # a DAX character device: never unlinked on failure


# The largest pool we accept: offsets are stored as u64, and posix_fallocate takes an off_t.
MAX_POOL_SIZE = (1 << 63) - 1


def open_target(path: str, size: int | None) -> Target:
    """Open the place for a new pool: a DAX character device as it is, or a new file of `size` bytes.

    A new file gets every block reserved up front (posix_fallocate), so a full disk fails here
    with a clear message instead of as SIGBUS in the middle of training.
    """
    if is_char_device(path):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise DeviceError(f"{path}: cannot open: {e.strerror}") from None
        try:
            available = device_size(fd, path)
            if size is not None and size > available:
                raise DeviceError(f"{path}: device holds {available:,} bytes, {size:,} asked for")
        except BaseException:
            os.close(fd)
            raise
        return Target(fd, size or available, existing=True)
    if size is None:
        raise DeviceError(f"{path}: a new pool file needs a size")
    if not 0 < size <= MAX_POOL_SIZE:
        raise DeviceError(f"{path}: pool size {size} is out of range")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise DeviceError(f"{path}: already exists") from None
    except OSError as e:
        raise DeviceError(f"{path}: cannot create: {e.strerror}") from None
    try:
        os.posix_fallocate(fd, 0, size)  # long for a big pool: Ctrl-C or SIGTERM may land in it
    except BaseException as e:
        os.close(fd)
        os.unlink(path)  # ours: created above with O_EXCL
        if not isinstance(e, (OSError, OverflowError)):
            raise
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DeviceError(f"{path}: not enough space for a {size:,}-byte pool") from None
        raise DeviceError(f"{path}: cannot allocate {size:,} bytes: {getattr(e, 'strerror', e)}") from None
    return Target(fd, size, existing=False)
