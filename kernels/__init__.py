"""Row kernels, installed as `cxltrain.kernels` (docs/architecture.md §1).

    ops.py         what the rest of cxltrain calls: gather rows, the fused sparse update,
                   undo capture; the C kernels when built (knob native_kernels), else torch
    rows.py        the torch kernels: the reference the C kernels are tested against, and the fallback
    native.py      the C extension (`_rows`, built by setup.py), NativePersistence and the row-set flushes
                   the devices use (flush_rows, copy_lines)
    rows.c         the C row kernels: one call per table per batch, GIL released, rows bounds-checked
    lookups.py     the unique-row exchange's per-table work on a rank's lookups (distinct ids asked of
                   their holders, bag gradients laid out per row): lookups.c when built, else torch
    persist.c      generic persistence primitives (copy, write back, fence) over a NativePersistence
    undo.c         the fused capture's undo-record writer (layout and driver: cxltrain/checkpoint/fused.py)
    crc32.c        zlib's CRC-32, folded with carry-less multiply
    cpu_threads.py torch's CPU threads for a process, with oneMKL VML's kernels chosen before any op can split

CuPy GPU kernels belong here too.
"""
