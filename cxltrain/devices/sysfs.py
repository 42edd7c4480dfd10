"""Reading device attributes from sysfs: one small integer per file, absent on machines without them."""

from __future__ import annotations

import os


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
