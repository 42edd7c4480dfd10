"""Imported by the bench's fork server only: warms the imports every job would otherwise pay for
inside its measurement (worker.warm_imports)."""

from .worker import warm_imports

warm_imports()
