"""Emulated CXL/PMEM memory for any Linux box (docs/emulation.md), installed as `cxltrain.emulation`."""

from .cxl import EmulatedCXLDevice, default_pool_dir, default_pool_path

__all__ = ["EmulatedCXLDevice", "default_pool_dir", "default_pool_path"]
