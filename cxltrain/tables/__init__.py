"""Model pieces that hold rows: the persistent embedding bag, its collection, the hot-row cache, the
fused sparse optimizers.

    bag.py         `PersistentEmbeddingBag`: a table whose rows live in a pool
    collection.py  `PersistentEmbeddingBagCollection`, TorchRec's EmbeddingBagCollection shape
    cache.py       the persistent hot-row cache (docs/tiers.md)
    renorm.py      max_norm: forward's in-place renorm of the looked-up rows, undo-logged
    optim.py       the fused sparse optimizers (SGD, row-wise Adagrad) and per-table learning rates
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PersistentEmbeddingBag": "bag",
    "EmbeddingBagConfig": "collection", "PersistentEmbeddingBagCollection": "collection",
    "SGD": "optim", "RowWiseAdagrad": "optim", "TableLR": "optim",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The public names, imported on first use (a package __init__ that imports its modules would
    run them whenever any one of them is imported)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
