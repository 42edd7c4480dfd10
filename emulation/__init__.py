"""Emulated CXL/PMEM memory for any Linux box (DESIGN §5), installed as `cxltrain.emulation`."""

from .cxl import EmulatedCXLDevice, default_pool_dir, default_pool_path

__all__ = ["EmulatedCXLDevice", "default_pool_dir", "default_pool_path"]
