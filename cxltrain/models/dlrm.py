"""DLRM (Naumov et al., 2019): bottom MLP, embedding bags, pairwise dot interaction, top MLP.

Shape letters: B batch, F sparse features (one table each), D embedding dim, 13 dense features.

    dense [B, 13] ─ bottom MLP ─▶ x [B, D] ─┐
    sparse f ─ table f ─▶ e_f [B, D] ───────┼─ stack [B, F+1, D] ─ pairwise dots [B, (F+1)F/2]
                                            └─ concat [x, dots] ─ top MLP ─▶ logit [B]

Example (F = 2 tables of 1000 rows, D = 16):

    model = DLRM(embedding_rows=[1000, 1000], embedding_dim=16, bottom_mlp=(64,), top_mlp=(64,))
    model.attach(pool)                      # tables created (or adopted) in the pool
    loss = model.loss(batch)                # batch: cxltrain.data.Batch with B samples
    loss.backward()                         # table rows updated in place by the fused optimizer
    dense_opt = torch.optim.Adam(model.dense_parameters())

The tables hold no nn.Parameter (their rows live in the pool and are updated in backward), so
`model.parameters()` and `model.dense_parameters()` are the same: the MLPs'.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from ..data.batch import Batch
from ..errors import ConfigError
from ..pool.handle import Pool
from ..tables.bag import PersistentEmbeddingBag, pool_holds
from ..tables.collection import EmbeddingBagConfig, PersistentEmbeddingBagCollection
from ..tables.optim import RowWiseAdagrad, SparseOptimizer


class DLRM(nn.Module):
    """DLRM with one PersistentEmbeddingBag per sparse feature.

    Args:
        embedding_rows: rows of each table, [F].
        embedding_dim: D, shared by all tables and the bottom MLP's output.
        num_dense_features: width of the dense input (13 for Criteo).
        bottom_mlp: hidden widths of the bottom MLP (its output layer, of width D, is added).
        top_mlp: hidden widths of the top MLP (its output layer, of width 1, is added).
        sparse_optimizer: fused optimizer of every table.
        seed: every initial value (MLPs and tables) is drawn from this seed alone.
        table_names: names of the tables (default t0, t1, ...); also their pool region prefixes.
    """

    def __init__(self, *, embedding_rows: Sequence[int], embedding_dim: int = 64, num_dense_features: int = 13,
                 bottom_mlp: Sequence[int] = (512, 256), top_mlp: Sequence[int] = (512, 256),
                 sparse_optimizer: SparseOptimizer | None = None, seed: int = 0,
                 table_names: Sequence[str] | None = None, pooling: str = "sum") -> None:
        super().__init__()
        if not embedding_rows:
            raise ConfigError("DLRM needs at least one embedding table")
        names = list(table_names) if table_names is not None else [f"t{i}" for i in range(len(embedding_rows))]
        if len(names) != len(embedding_rows) or len(set(names)) != len(names):
            raise ConfigError("table_names must be unique and one per table")
        optimizer = sparse_optimizer if sparse_optimizer is not None else RowWiseAdagrad()
        self.embedding_dim = embedding_dim
        self.num_dense_features = num_dense_features
        generator = torch.Generator().manual_seed(seed)
        self.bottom = _mlp([num_dense_features, *bottom_mlp, embedding_dim], generator, final_activation=True)
        # TorchRec's collection: the tables are embedding_bag_collection.embedding_bags.<name>
        self.embedding_bag_collection = PersistentEmbeddingBagCollection(
            [EmbeddingBagConfig(name, rows, embedding_dim, [name], pooling) for rows, name in zip(embedding_rows, names)],
            optimizer=optimizer, seed=seed)
        vectors = len(embedding_rows) + 1
        self._pairs = torch.tril_indices(vectors, vectors, offset=-1)
        interactions = vectors * (vectors - 1) // 2
        self.top = _mlp([embedding_dim + interactions, *top_mlp, 1], generator, final_activation=False)
        # wall-clock seconds spent in table lookups (forward), for the step breakdown `train` prints
        self.embedding_forward_seconds = 0.0

    @property
    def tables(self) -> list[PersistentEmbeddingBag]:
        """The tables [F], in feature order."""
        return self.embedding_bag_collection.tables()

    @property
    def interaction_pairs(self) -> torch.Tensor:
        """[2, (F+1)F/2]: the (row, column) of each pairwise dot product the top MLP takes."""
        return self._pairs

    def dense_parameters(self) -> list[nn.Parameter]:
        """The parameters a torch optimizer should train: the bottom and top MLPs."""
        return [*self.bottom.parameters(), *self.top.parameters()]

    def attach(self, pool: Pool) -> bool:
        """Attach every table to `pool`: all created (one atomic allocation) or all adopted.

        Every table is checked before anything is written, so a pool that holds another model is
        refused untouched. Returns True if the tables were created (and initialised).
        """
        if pool_holds(pool, self.tables):
            for table in self.tables:
                table.attach(pool)
            return False
        pool.add_regions([spec for table in self.tables for spec in table.region_specs()])
        for table in self.tables:
            table.attach(pool, initialize=True)
        return True

    def materialize(self) -> None:
        """Volatile DRAM tables (no pool): for tests and comparisons."""
        for table in self.tables:
            table.materialize()

    @property
    def device(self) -> torch.device:
        """Where the MLPs are (and placed tables pool their bags): the batch's dense part goes there."""
        return self.top[0].weight.device

    def place_tables(self, device, cached_ids: dict[str, torch.Tensor] | None = None) -> None:
        """Run every table's lookups and updates on `device` over the pool (tables.bag.place), with
        cached_ids[name] [C] of each table held in device memory. The MLPs move with model.to(device)."""
        cached_ids = cached_ids or {}
        for table in self.tables:
            table.place(device, cached_ids.get(table.name))

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B] of a batch (on the model's device; the batch may stay on the CPU)."""
        if len(batch.values) != len(self.tables):
            raise ConfigError(f"batch has {len(batch.values)} sparse features, model has {len(self.tables)} tables")
        x = self.bottom(batch.dense.to(self.device, non_blocking=True))
        started = time.perf_counter()
        embedded = self.embedding_bag_collection.pooled(batch.values, batch.offsets)
        self.embedding_forward_seconds += time.perf_counter() - started
        return self.top(torch.cat([x, self._interact(x, embedded)], dim=1)).squeeze(1)

    def _interact(self, x: torch.Tensor, embedded: list[torch.Tensor]) -> torch.Tensor:
        """Pairwise dot products of [x, e_1..e_F]: [B, (F+1)F/2], lower triangle without diagonal."""
        stacked = torch.stack([x, *embedded], dim=1)              # [B, F+1, D]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))        # [B, F+1, F+1]
        return dots[:, self._pairs[0], self._pairs[1]]

    def loss(self, batch: Batch) -> torch.Tensor:
        """Mean binary cross-entropy of the batch (a scalar)."""
        logits = self(batch)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.device))


def _mlp(widths: list[int], generator: torch.Generator, *, final_activation: bool) -> nn.Sequential:
    """Linear+ReLU layers, initialised as the DLRM reference does, from `generator` alone."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        if n_in < 1 or n_out < 1:
            raise ConfigError(f"MLP widths must be positive, got {widths}")
        linear = nn.Linear(n_in, n_out)
        with torch.no_grad():
            linear.weight.normal_(0.0, (2.0 / (n_in + n_out)) ** 0.5, generator=generator)
            linear.bias.normal_(0.0, (1.0 / n_out) ** 0.5, generator=generator)
        layers.append(linear)
        if i < len(widths) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
