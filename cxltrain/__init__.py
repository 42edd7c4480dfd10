"""cxltrain: train recommendation models whose embedding tables live in persistent memory.

Layers (docs/architecture.md §1), each calling only layers below it: cli → jobs (trainer, crashtest,
bench) → runtime → models/tables/optim → data → checkpoint → pool → devices (cxltrain.devices,
cxltrain.emulation) → kernels and the on-media format; tests/test_layers.py keeps the order and keeps
import circles out.

The public names are imported lazily, so `cxltrain pool info` does not pay for importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CxlTrainError": "cxltrain.errors",
    "Pool": "cxltrain.pool.handle",
    "Runtime": "cxltrain.runtime.runtime",
    "PersistentEmbeddingBag": "cxltrain.tables.bag",
    "PersistentEmbeddingBagCollection": "cxltrain.tables.collection",
    "EmbeddingBagConfig": "cxltrain.tables.collection",
    "SGD": "cxltrain.tables.optim",
    "RowWiseAdagrad": "cxltrain.tables.optim",
    "TableLR": "cxltrain.tables.optim",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cxltrain' has no attribute {name!r}")
