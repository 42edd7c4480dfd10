"""Model pieces that hold rows: the persistent embedding bag, its collection, the hot-row cache, the
fused sparse optimizers.

    bag.py         `PersistentEmbeddingBag`: a table whose rows live in a pool
    collection.py  `PersistentEmbeddingBagCollection`, TorchRec's EmbeddingBagCollection shape
    cache.py       the persistent hot-row cache (docs/tiers.md)
    optim.py       the fused sparse optimizers (SGD, row-wise Adagrad) and per-table learning rates
"""
