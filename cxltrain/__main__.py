"""`python -m cxltrain` is the `cxltrain` command."""

import sys

from .cli import main

sys.exit(main())
