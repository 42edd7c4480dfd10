"""PersistentEmbeddingBagCollection: TorchRec's EmbeddingBagCollection, its tables in a pool.

Configured by EmbeddingBagConfigs (torchrec's own, or the dataclass below with the same fields), fed
a KeyedJaggedTensor (torchrec's, or its tensors: keys, values, lengths or offsets, weights), it
returns the pooled embeddings of every feature as torchrec's KeyedTensor when torchrec is installed,
or as PooledEmbeddings (the same layout and accessors) otherwise. torchrec stays optional.

Shape letters: K features, B bags per feature, N lookups in all, D_k the dim of feature k's table.

    configs = [EmbeddingBagConfig(name="t_user", num_embeddings=1000, embedding_dim=8,
                                  feature_names=["user"]),
               EmbeddingBagConfig(name="t_item", num_embeddings=500, embedding_dim=8,
                                  feature_names=["item", "item_history"])]
    ebc = PersistentEmbeddingBagCollection(configs)
    pooled = ebc(keys=["user", "item", "item_history"], values=ids [N], lengths=[K * B])
    pooled.values()              # [B, 24]: user, item, item_history side by side (KeyedTensor layout)
    pooled["item"]               # [B, 8]

The KJT layout: values of feature 0's bags, then feature 1's, ...; lengths [K * B] (or offsets
[K * B + 1]) in the same order; weights [N] per lookup (sum pooling only). The tables are
`embedding_bags.<name>` modules, so their state-dict keys are TorchRec's
(`embedding_bags.<name>.weight`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .bag import PersistentEmbeddingBag
from .optim import SparseOptimizer


@dataclasses.dataclass
class EmbeddingBagConfig:
    """One table of a collection, as torchrec.modules.embedding_configs.EmbeddingBagConfig names it."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: list[str] = dataclasses.field(default_factory=list)
    pooling: str = "sum"  # "sum" or "mean" (torchrec's PoolingType.SUM / MEAN also accepted)


def pooling_mode(pooling) -> str:
    """"sum"/"mean" of a pooling given as a string or as torchrec's PoolingType."""
    mode = str(getattr(pooling, "name", pooling)).lower()
    if mode not in ("sum", "mean"):
        raise ConfigError(f"pooling must be sum or mean, got {pooling!r}")
    return mode


class PooledEmbeddings:
    """torchrec's KeyedTensor layout without torchrec: values [B, sum D_k], one column block per key."""

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor) -> None:
        self._keys, self._lengths, self._values = list(keys), list(length_per_key), values

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._lengths

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self._keys, self._values.split(self._lengths, dim=1)))

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.to_dict()[key]


class PersistentEmbeddingBagCollection(nn.Module):
    """TorchRec-style collection of PersistentEmbeddingBags (see the module docstring).

    Args:
        tables: EmbeddingBagConfigs (ours or torchrec's); a table with no feature_names serves the
            feature named as the table.
        optimizer: the fused sparse optimizer of every table (default RowWiseAdagrad(0.01)).
        seed: table i's initial values are drawn from seed * 1_000_003 + i alone.
        is_weighted: accepted for torchrec's signature; weights are used whenever given.
        device: cpu only (the rows live in a host-memory pool).
    """

    def __init__(self, tables: Sequence, *, is_weighted: bool = False, device=None,
                 optimizer: SparseOptimizer | None = None, seed: int = 0) -> None:
        super().__init__()
        if not tables:
            raise ConfigError("an embedding bag collection needs at least one table")
        if device is not None and torch.device(device).type not in ("cpu", "meta"):
            raise ConfigError(f"the tables live in a host-memory pool; device must be cpu, got {device}")
        self.is_weighted = is_weighted
        self.embedding_bags = nn.ModuleDict()
        self._feature_tables: list[tuple[str, str]] = []  # (feature, table name), output order
        for i, config in enumerate(tables):
            features = list(getattr(config, "feature_names", None) or [config.name])
            if config.name in self.embedding_bags:
                raise ConfigError(f"table name {config.name!r} appears twice in the collection")
            self.embedding_bags[config.name] = PersistentEmbeddingBag(
                config.num_embeddings, config.embedding_dim, name=config.name,
                mode=pooling_mode(getattr(config, "pooling", "sum")), optimizer=optimizer,
                seed=seed * 1_000_003 + i, feature_names=tuple(features))
            self._feature_tables += [(feature, config.name) for feature in features]
        features = [f for f, _ in self._feature_tables]
        if len(set(features)) != len(features):
            raise ConfigError(f"a feature may feed one table only, got {features}")

    def tables(self) -> list[PersistentEmbeddingBag]:
        return list(self.embedding_bags.values())

    def feature_names(self) -> list[str]:
        """The features in output order: each table's, in table order."""
        return [f for f, _ in self._feature_tables]

    def pooled(self, values: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
               weights: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Each feature's pooled embeddings [B, D_k], in feature_names() order, from its lookups
        values[k] [N_k] and bag starts offsets[k] [B] (per-lookup weights[k] [N_k] or None)."""
        if len(values) != len(self._feature_tables) or len(offsets) != len(values):
            raise ConfigError(f"got {len(values)} features, the collection has {len(self._feature_tables)}")
        weights = weights if weights is not None else [None] * len(values)
        return [self.embedding_bags[table](v, o, w)
                for (_, table), v, o, w in zip(self._feature_tables, values, offsets, weights)]

    def forward(self, features=None, *, keys: Sequence[str] | None = None, values: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                weights: torch.Tensor | None = None):
        """Pooled embeddings of a KeyedJaggedTensor `features` (torchrec's), or of its tensors
        given by name; a KeyedTensor (torchrec installed) or PooledEmbeddings."""
        if features is not None:
            keys, values = list(features.keys()), features.values()
            offsets, weights = features.offsets(), features.weights_or_none()
        per_key = split_jagged(keys, values, lengths, offsets, weights)
        wanted = self.feature_names()
        missing = [f for f in wanted if f not in per_key]
        if missing:
            raise ConfigError(f"the features lack {', '.join(missing)} (got keys {list(per_key)})")
        pooled = self.pooled(*zip(*(per_key[f] for f in wanted)))
        return keyed_tensor(wanted, [p.shape[1] for p in pooled], torch.cat(pooled, dim=1))


def split_jagged(keys, values, lengths, offsets, weights) -> dict[str, tuple]:
    """{key: (values [N_k], bag starts [B] from 0, weights [N_k] or None)} of a KJT's tensors."""
    if keys is None or values is None or (lengths is None) == (offsets is None):
        raise ConfigError("give a KeyedJaggedTensor, or keys, values and one of lengths/offsets")
    keys = list(keys)
    if offsets is None:
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.as_tensor(lengths).to(torch.int64).cumsum(0)])
    offsets = torch.as_tensor(offsets).to(torch.int64)
    if not keys or (offsets.numel() - 1) % len(keys) or int(offsets[-1]) != values.numel():
        raise ConfigError(f"lengths/offsets do not fit {len(keys)} keys and {values.numel()} values")
    bags = (offsets.numel() - 1) // len(keys)
    split = {}
    for k, key in enumerate(keys):
        starts = offsets[k * bags: (k + 1) * bags + 1]
        first, last = int(starts[0]), int(starts[-1])
        split[key] = (values[first:last], starts[:-1] - first, None if weights is None else weights[first:last])
    return split


def keyed_tensor(keys: list[str], length_per_key: list[int], values: torch.Tensor):
    """torchrec's KeyedTensor when torchrec is installed, else PooledEmbeddings (same accessors)."""
    return _keyed_tensor_class()(keys=keys, length_per_key=length_per_key, values=values)


@functools.lru_cache(maxsize=1)
def _keyed_tensor_class():
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except ImportError:
        return PooledEmbeddings
    return KeyedTensor
