"""Row kernels, installed as `cxltrain.kernels` (DESIGN §2).

The CPU row operations of the foundation — gather, fused sparse update, scatter — are torch
primitives chosen by measurement (see cxltrain/tables.py). Native C kernels (GIL released, one
call per table per batch, non-temporal undo capture) and CuPy GPU kernels belong here.
"""
