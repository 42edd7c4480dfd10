"""One rank's part of the model: the table shards the plan gives it, and the dense part (the
bottom and top MLPs of DLRM, replicated on every rank and trained under DDP).

Every value starts as in a single-process `DLRM` with the same settings: the dense part is taken
from such a model (its MLPs are drawn from the seed before its tables, which hold no storage until
attached), table-wise and data-parallel tables are the same PersistentEmbeddingBag, and a row-wise
shard holds rows [lo, hi) of the table a single process would initialise.

Shape letters: B samples of this rank's slice of the batch, D embedding dim, F tables.
"""

from __future__ import annotations

import torch
from torch import nn

from ..placement.sharding import ROW_WISE, ShardingPlan
from ..tables.bag import PersistentEmbeddingBag, _table_seed
from ..tables.optim import RowWiseAdagrad
from . import DLRM


class RowShardBag(PersistentEmbeddingBag):
    """Rows [lo, hi) of a `full_rows`-row table, named as the table: its initial values are the
    single-process table's rows lo..hi-1 (the full table is drawn once, at creation only)."""

    def __init__(self, full_rows: int, lo: int, hi: int, embedding_dim: int, **kwargs) -> None:
        super().__init__(hi - lo, embedding_dim, **kwargs)
        self.full_rows, self.lo = full_rows, lo

    def reset_parameters(self) -> None:
        rows = self._require_storage()
        generator = torch.Generator().manual_seed(_table_seed(self.seed, self.name))
        bound = self.full_rows ** -0.5
        full = torch.zeros(self.full_rows, rows.shape[1])  # padded as the pool's rows are: the same draws
        full[:, : self.embedding_dim].uniform_(-bound, bound, generator=generator)
        with torch.no_grad():
            rows.copy_(full[self.lo : self.lo + self.num_embeddings])
            if self._state is not None:
                self._state.fill_(self.optimizer.initial_state())


class DenseDLRM(nn.Module):
    """DLRM without its tables: bottom MLP, pairwise interaction of [x, e_1..e_F], top MLP.
    State-dict keys are DLRM's (`bottom.*`, `top.*`), so exports match a single process's."""

    def __init__(self, reference: DLRM) -> None:
        super().__init__()
        self.bottom, self.top = reference.bottom, reference.top
        self.embedding_dim = reference.embedding_dim
        self._pairs = reference.interaction_pairs

    def forward(self, dense: torch.Tensor, embedded: list[torch.Tensor]) -> torch.Tensor:
        """dense [B, 13], embedded F x [B, D] -> logits [B]."""
        x = self.bottom(dense)
        stacked = torch.stack([x, *embedded], dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))
        return self.top(torch.cat([x, dots[:, self._pairs[0], self._pairs[1]]], dim=1)).squeeze(1)


class RankModel(nn.Module):
    """What one rank holds: `dense` (replicated) and `shards` (the tables, or rows of them, the
    plan gives this rank; shard i is table `table_index[i]`). A Runtime finds the shards as the
    model's PersistentEmbeddingBags and the dense parameters in its state dict."""

    def __init__(self, plan: ShardingPlan, rank: int, *, dim: int, bottom_mlp, top_mlp, sparse_lr: float,
                 seed: int) -> None:
        super().__init__()
        reference = DLRM(embedding_rows=[t.rows for t in plan.tables], embedding_dim=dim, bottom_mlp=bottom_mlp,
                         top_mlp=top_mlp, sparse_optimizer=RowWiseAdagrad(lr=sparse_lr), seed=seed)
        self.dense = DenseDLRM(reference)
        self.table_index = plan.held_by(rank)
        shards = []
        for t in self.table_index:
            table, full = plan.tables[t], reference.tables[t]
            common = dict(name=full.name, mode=full.mode, optimizer=full.optimizer, seed=full.seed)
            if table.kind == ROW_WISE:
                lo, hi = table.rows_of(rank)
                shards.append(RowShardBag(table.rows, lo, hi, dim, **common))
            else:
                shards.append(PersistentEmbeddingBag(table.rows, dim, **common))
        self.shards = nn.ModuleList(shards)

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.dense.parameters())

    def shard(self, t: int) -> PersistentEmbeddingBag:
        return self.shards[self.table_index.index(t)]
