"""The pool layer: on-media formats, opening and locking a pool file, checking and listing it.

    format.py        superblock, region directory, root slots: one pool's on-media format
    set_format.py    the set region of a primary pool: its capacity members (docs/tiers.md)
    cache_format.py  the hot-row cache's row map region
    files.py         opening, sizing and locking a pool file or device
    check.py         reading and checking a pool's structures without mapping it (no torch)
    info.py          `cxltrain pool info`: what a pool or pool set holds
    report_text.py   how that report reads: `pool info`'s lines, its JSON
    handle.py        `Pool`: a mapped pool, its regions as tensors, publish and remove
"""
