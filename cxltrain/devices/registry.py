"""The device backends, by name: how `map_device` opens a pool with each (docs/architecture.md §3).

The names are the `device` knob's values (knobs.DEVICE_BACKENDS: the knob is checked where knobs
are, below every layer); this table says what each name opens. It sits on top of the devices
layer: it reaches the emulated device (cxltrain.emulation), which builds on devices/base.py, so
the devices package itself (devices/__init__.py) never imports it — that would be a circle.
"""

from __future__ import annotations

from typing import Callable

from ..emulation.cxl import open_device as open_emulated
from ..errors import DeviceError
from ..knobs import DEVICE_BACKENDS, KNOBS
from .base import Device
from .libpmem import load as load_libpmem
from .msync import MsyncDevice
from .pmem import PmemDevice
from .targets import resolve_backend


def open_pmem(path: str, fd: int, size: int) -> Device:
    """PMDK's libpmem maps the path itself (the descriptor is for the other backends)."""
    pmem = load_libpmem()
    if pmem is None:
        raise DeviceError(f"{path}: the pmem backend needs PMDK's libpmem (package libpmem1)")
    return PmemDevice(pmem, path, size)


def open_emulated_checked(path: str, fd: int, size: int) -> Device:
    """The emulated device, once the knobs that decide which one it is have been checked."""
    KNOBS.validate()
    return open_emulated(path, fd, size)


def open_msync(path: str, fd: int, size: int) -> Device:
    return MsyncDevice(path, fd, size, writable=True)


# Every backend a writable pool can be mapped with; "auto" is resolved to one of them first.
OPENERS: dict[str, Callable[[str, int, int], Device]] = {
    "pmem": open_pmem,
    "msync": open_msync,
    "emulated": open_emulated_checked,
}
if set(OPENERS) != set(DEVICE_BACKENDS) - {"auto"}:  # a knob value without an opener, or the reverse
    raise ImportError(f"device backends {sorted(OPENERS)} do not match the device knob's {DEVICE_BACKENDS}")


def map_device(path: str, fd: int, size: int, *, writable: bool, backend: str | None = None) -> Device:
    """Map an open pool file or device. Read-only mappings always use plain mmap."""
    if not writable:
        return MsyncDevice(path, fd, size, writable=False)
    return OPENERS[resolve_backend(path, backend)](path, fd, size)
