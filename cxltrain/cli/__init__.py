"""The command line: parsing and printing only.

    main.py  `cxltrain` and its commands
    data.py  `cxltrain data` and the data options of `train`
    dist.py  the many-rank side of `train`, `recover`, `export` and `import`
"""

from .main import main

__all__ = ["main"]
