"""Data sources: deterministic synthetic Criteo-like batches and raw Criteo readers.

Every source can jump to batch b: `source.batch(b)` depends only on the source's configuration
and b, so a run resumed at batch b sees exactly the batches an uninterrupted run saw.
"""

from .batch import Batch

__all__ = ["Batch"]
