"""The batch every data source yields.

Shape letters: B = batch size, F = sparse features (one embedding table each), N_f = lookups of
feature f in the batch (B × pooling factor L for fixed-length bags), D = dense features (13 for
Criteo).

Example, B = 2, F = 1, bags [[3, 7], [7]]:
    Batch(index=0, dense=<[2, 13]>, values=(tensor([3, 7, 7]),), offsets=(tensor([0, 2]),),
          labels=tensor([1., 0.]))
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Protocol

import torch


@dataclasses.dataclass(frozen=True)
class Batch:
    index: int                         # batch number b: the source regenerates it from (seed, b)
    dense: torch.Tensor                # [B, D] float32 dense features
    values: tuple[torch.Tensor, ...]   # F tensors, [N_f] int64 row ids of feature f (torchrec: values)
    offsets: tuple[torch.Tensor, ...]  # F tensors, [B] int64 start of each sample's bag in values
    labels: torch.Tensor               # [B] float32, 0.0 or 1.0

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])


class BatchSource(Protocol):
    """What the training loop needs of a data source: any batch by number, and a range of them."""

    num_tables: int
    num_dense: int
    num_batches: int | None            # None: endless

    def batch(self, b: int) -> Batch: ...

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]: ...
