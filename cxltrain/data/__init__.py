"""Data sources: deterministic synthetic Criteo-like batches, raw Criteo readers (plain or gzipped,
native parser), converted Criteo folders and folders in TorchRec's npy layout (docs/criteo.md).

Every source can jump to batch b: `source.batch(b)` depends only on the source's configuration
and b, so a run resumed at batch b sees exactly the batches an uninterrupted run saw. Each has
`batch(b)`, `batches(start, stop)`, `num_batches` (None = endless), `num_dense`, `num_tables`,
`rows` (a tuple, one entry per table) and `pooling`. `rt.batches` also takes lists, iterables and
torch DataLoaders (loader.py: which of them can resume past batch 0).
"""

from .batch import Batch
from .converted import ConvertedCriteo
from .criteo import CriteoFile
from .loader import ResumableSampler
from .synthetic import SyntheticCriteo
from .torchrec_npy import TorchRecFolder

__all__ = ["Batch", "ConvertedCriteo", "CriteoFile", "ResumableSampler", "SyntheticCriteo", "TorchRecFolder"]
