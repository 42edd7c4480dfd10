"""Which file system a path lives on, from /proc/self/mounts."""

from __future__ import annotations

import dataclasses
import os

MEMORY_BACKED = frozenset({"tmpfs", "hugetlbfs", "ramfs"})


@dataclasses.dataclass(frozen=True)
class Mount:
    device: str
    mount_point: str
    fs_type: str
    options: tuple[str, ...]

    @property
    def is_memory_backed(self) -> bool:
        return self.fs_type in MEMORY_BACKED

    @property
    def dax_mode(self) -> str | None:
        """How the file system maps its files: "always" (every file is DAX: ext4/xfs `dax` or
        `dax=always`), "inode" (files flagged FS_XFLAG_DAX only), or None (through the page cache)."""
        for option in self.options:
            if option in ("dax", "dax=always"):
                return "always"
            if option == "dax=inode":
                return "inode"
        return None


def _unescape(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def read_mounts(path: str = "/proc/self/mounts") -> list[Mount]:
    mounts = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4:
                    mounts.append(Mount(_unescape(parts[0]), _unescape(parts[1]), parts[2],
                                        tuple(parts[3].split(","))))
    except OSError:
        pass
    return mounts


def mount_of(path: str) -> Mount | None:
    """The mount holding `path` (or, for a path not yet created, its folder)."""
    target = os.path.realpath(path)
    while not os.path.exists(target) and target != "/":
        target = os.path.dirname(target)
    best = None
    for mount in read_mounts():
        mp = mount.mount_point.rstrip("/") or "/"
        if target == mp or target.startswith(mp + "/") or mp == "/":
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                best = mount
    return best
