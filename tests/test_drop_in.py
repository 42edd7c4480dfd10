"""What code written for nn.EmbeddingBag can rely on with PersistentEmbeddingBag (docs/torchrec.md):
its default mode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cxltrain.models import DLRM
from cxltrain.tables.bag import PersistentEmbeddingBag
from cxltrain.tables.collection import EmbeddingBagConfig, PersistentEmbeddingBagCollection

ROWS, DIM = 50, 4
IDS, OFFSETS = torch.tensor([3, 7, 7, 49, 0]), torch.tensor([0, 2, 3])
RING = 1 << 20


def test_the_default_mode_is_nn_embedding_bag_s_and_the_collection_keeps_torchrec_s():
    table = PersistentEmbeddingBag(ROWS, DIM, name="t")
    table.materialize()
    assert table.mode == nn.EmbeddingBag(ROWS, DIM).mode == "mean"
    assert torch.equal(table(IDS, OFFSETS), F.embedding_bag(IDS, table.weight.clone(), OFFSETS, mode="mean"))
    collection = PersistentEmbeddingBagCollection([EmbeddingBagConfig("t", ROWS, DIM, ["f"])])
    assert collection.embedding_bags["t"].mode == "sum"  # TorchRec's EmbeddingBagConfig pools by sum
    assert {t.mode for t in DLRM(embedding_rows=[ROWS, ROWS], embedding_dim=DIM).tables} == {"sum"}
