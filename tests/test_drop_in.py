"""What code written for nn.EmbeddingBag can rely on with PersistentEmbeddingBag (docs/torchrec.md):
its default mode; a table not yet attached works in memory (forward, backward, state_dict), and a
pool created for it starts from those rows; a torch optimizer handed a table's rows is refused at
the Runtime's entry rather than silently never stepping them; what max_norm rules out."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cxltrain
from cxltrain.errors import ConfigError
from cxltrain.models import DLRM
from cxltrain.pool.handle import Pool
from cxltrain.tables.bag import PersistentEmbeddingBag
from cxltrain.tables.cache import check_table
from cxltrain.tables.collection import EmbeddingBagConfig, PersistentEmbeddingBagCollection
from cxltrain.tables.optim import SGD, RowWiseAdagrad

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


def test_an_unattached_table_is_an_in_memory_table():
    table = PersistentEmbeddingBag(ROWS, DIM, mode="sum", optimizer=RowWiseAdagrad(lr=0.5))  # unnamed, too
    state = table.state_dict()
    assert list(state) == ["weight", "optimizer_state"] and state["weight"].shape == (ROWS, DIM)
    before = state["weight"].clone()
    out = table(IDS, OFFSETS)
    assert torch.equal(out, F.embedding_bag(IDS, before, OFFSETS, mode="sum"))
    out.sum().backward()  # its own fused optimizer, on the rows in memory
    changed = (table.weight != before).any(dim=1)
    assert changed.nonzero().flatten().tolist() == [0, 3, 7, 49]


def test_rows_trained_in_memory_start_a_new_pool_and_an_existing_checkpoint_refuses_them(shm_dir):
    path = str(shm_dir / "p.pool")

    def trained_in_memory() -> nn.ModuleDict:
        m = nn.ModuleDict({"t": PersistentEmbeddingBag(ROWS, DIM, name="t", optimizer=SGD(lr=0.5))})
        m["t"](IDS, OFFSETS).sum().backward()
        return m

    m = trained_in_memory()
    trained = m["t"].weight.clone()
    with cxltrain.Runtime(path, m, [], undo_ring_bytes=RING):
        assert torch.equal(m["t"].weight, trained)  # not the seeded rows
    with pytest.raises(ConfigError, match="would replace the values load_state_dict \\(or training before"):
        with cxltrain.Runtime(path, trained_in_memory(), [], undo_ring_bytes=RING):
            pass
    looked_up = nn.ModuleDict({"t": PersistentEmbeddingBag(ROWS, DIM, name="t", optimizer=SGD(lr=0.5))})
    with torch.no_grad():
        looked_up["t"](IDS, OFFSETS)  # evaluation only: nothing to lose, the pool's rows win
    with cxltrain.Runtime(path, looked_up, [], undo_ring_bytes=RING) as rt:
        assert rt.start_batch == 0 and torch.equal(looked_up["t"].weight, trained)


def test_a_table_whose_pool_closed_is_never_redrawn_in_memory(shm_dir):
    table = PersistentEmbeddingBag(ROWS, DIM, name="t")
    with Pool.create(str(shm_dir / "p.pool"), 4 << 20) as pool:
        table.attach(pool)
    with pytest.raises(RuntimeError, match="its pool was closed"):
        table(IDS, OFFSETS)
    assert table.state_dict() == {}
    table.materialize()  # asked for: fresh rows in memory
    assert table.state_dict()["weight"].shape == (ROWS, DIM)


@pytest.mark.parametrize("handed", ["weight", "parameter", "optimizer_state"])
def test_a_torch_optimizer_holding_a_table_is_refused_at_entry(shm_dir, handed):
    model = nn.ModuleDict({"t": PersistentEmbeddingBag(ROWS, DIM, name="t"), "head": nn.Linear(DIM, 1)})
    table = model["t"]
    table.materialize()
    assert all(p.shape != (ROWS, DIM) for p in model.parameters())  # never a Parameter: never in there
    tensor = {"weight": table.weight, "parameter": nn.Parameter(table.weight),
              "optimizer_state": table.optimizer_state}[handed]
    optimizer = torch.optim.SGD([{"params": model["head"].parameters()}, {"params": [tensor]}], lr=0.1)
    path = str(shm_dir / "p.pool")
    with pytest.raises(ConfigError, match="optimizer 0 \\(SGD\\) holds table 't'"):
        with cxltrain.Runtime(path, model, optimizer, undo_ring_bytes=RING):
            pass
    assert not os.path.exists(path)
    # the dense parameters alone: accepted, and the table trains with its own optimizer
    with cxltrain.Runtime(path, model, torch.optim.SGD(model.parameters(), lr=0.1), undo_ring_bytes=RING) as rt:
        before = model["t"].weight.clone()
        for _ in rt.batches(lambda b: b, stop=1):
            model["head"](model["t"](IDS, OFFSETS)).sum().backward()
        assert not torch.equal(model["t"].weight, before)


def test_a_max_norm_table_takes_neither_a_cache_nor_a_device(shm_dir):
    table = PersistentEmbeddingBag(ROWS, DIM, name="t", mode="sum", max_norm=1.0)
    with pytest.raises(ConfigError, match="hot-row cache needs a plain sum/mean table"):
        check_table(table, 10)
    with Pool.create(str(shm_dir / "p.pool"), 4 << 20) as pool:
        table.attach(pool)
        with pytest.raises(ConfigError, match="include_last_offset or max_norm"):
            table.place("cpu")
