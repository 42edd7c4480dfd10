"""Devices: how a pool's bytes are mapped and made durable (docs/architecture.md §3).

One backend per file, behind the interface in base.py, chosen once when a pool is opened:

  pmem      PMDK's libpmem (devices/pmem.py): DAX devices, fsdax files, any file libpmem maps
  msync     mmap + msync (devices/msync.py): plain files when libpmem is missing
  emulated  a memory-backed file standing in for CXL memory (cxltrain.emulation)

`auto` picks: a character device (device DAX) → pmem; a file on tmpfs/hugetlbfs → emulated;
anything else → pmem when libpmem is installed, else msync (targets.resolve_backend).

`map_device` lives in devices/registry.py, the one table of backends: it reaches the emulated
device, which builds on this package, so this package must not import it.
"""

from __future__ import annotations

from ..knobs import DEVICE_BACKENDS as BACKENDS
from .base import Device, DeviceCounters
from .targets import MAX_POOL_SIZE, Target, device_size, is_char_device, open_target, resolve_backend

__all__ = ["BACKENDS", "MAX_POOL_SIZE", "Device", "DeviceCounters", "Target", "device_size", "is_char_device",
           "open_target", "resolve_backend"]
