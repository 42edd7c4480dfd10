"""Reading device attributes from sysfs: one small integer per file, absent on machines without them."""

from __future__ import annotations

import os
from typing import Callable


def read_int(path: str) -> int | None:
    """The integer in a sysfs attribute file, or None when it is missing or not an integer."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def device_dir(rdev: int, *, block: bool, sys_root: str = "/sys") -> str:
    """The sysfs folder of a device node's device, /sys/dev/{char|block}/MAJOR:MINOR."""
    kind = "block" if block else "char"
    return os.path.join(sys_root, "dev", kind, f"{os.major(rdev)}:{os.minor(rdev)}")


def char_device_size(rdev: int, sys_root: str = "/sys") -> int | None:
    """Bytes of a device DAX character device (its `size` attribute), or None."""
    return read_int(os.path.join(device_dir(rdev, block=False, sys_root=sys_root), "size"))


SECTOR_BYTES = 512  # the block layer's stat file counts 512-byte sectors, whatever the device's own


def disk_bytes_written(path: str, sys_root: str = "/sys") -> Callable[[], int | None] | None:
    """A function giving the bytes written so far to the block device that holds `path` (the
    sectors written of /sys/dev/block/MAJOR:MINOR/stat), or None where the file system has no block
    device of its own (tmpfs, overlay) or sysfs says nothing. Every writer to that device counts."""
    stat = os.path.join(device_dir(os.stat(path).st_dev, block=True, sys_root=sys_root), "stat")

    def written() -> int | None:
        try:
            with open(stat) as f:
                return int(f.read().split()[6]) * SECTOR_BYTES
        except (OSError, ValueError, IndexError):
            return None
    return written if written() is not None else None
