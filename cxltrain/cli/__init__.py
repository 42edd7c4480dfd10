"""The command line: parsing and printing only, one module per command group.

    main.py            `cxltrain`: the top parser, `main`, exit codes on errors and signals
    common.py          the one-line-error parser, exit codes, option value types
    train.py           `train` (one rank) and `plan`, which takes train's options
    emulation.py       the emulated device's options (`train`, `crashtest`)
    recover_export.py  `recover`, `export` and `import`
    pool.py            `pool create | info | check`
    devices.py         `devices`
    bench.py           `bench`
    crashtest.py       `crashtest`
    data.py            `data convert`, `eval`, `plot` and the data options of `train`
    dist.py            the many-rank side of `train`, `recover`, `export`, `pool info` and `import`
    stop.py            SIGTERM: stop at a batch boundary
"""

from .main import main

__all__ = ["main"]
