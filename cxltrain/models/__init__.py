"""Reference models whose embedding tables are PersistentEmbeddingBag modules."""

from .dlrm import DLRM

__all__ = ["DLRM"]
