"""PersistentEmbeddingBagCollection: TorchRec's configs and KeyedJaggedTensor layout, the DLRM on it,
and `cxltrain export --format torchrec` loaded into a real torchrec EmbeddingBagCollection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cxltrain
from cxltrain.cli import main as cli_main
from cxltrain.data import SyntheticCriteo
from cxltrain.errors import ConfigError
from cxltrain.models import DLRM
from cxltrain.runtime.interop import from_torchrec, to_torchrec
from cxltrain.tables.collection import EmbeddingBagConfig, PersistentEmbeddingBagCollection

CONFIGS = [EmbeddingBagConfig("t_user", 60, 8, ["user"], "sum"),
           EmbeddingBagConfig("t_item", 40, 8, ["item", "history"], "mean")]
KEYS = ["user", "item", "history"]
# 3 features x 2 bags, key-major: user's bags, then item's, then history's
VALUES = torch.tensor([5, 7, 59, 1, 2, 3, 39, 0, 0, 4])
LENGTHS = torch.tensor([2, 1, 1, 2, 0, 4])

RING = 1 << 20  # a small undo ring: a test pool is created in milliseconds


def collection() -> PersistentEmbeddingBagCollection:
    ebc = PersistentEmbeddingBagCollection(CONFIGS, seed=4)
    for table in ebc.tables():
        table.materialize()
    return ebc


def expected(ebc) -> torch.Tensor:
    """[2, 24]: each feature's bags pooled by F.embedding_bag over its table's weights."""
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), LENGTHS.cumsum(0)])
    blocks = []
    for k, (key, table) in enumerate(zip(KEYS, ["t_user", "t_item", "t_item"])):
        bag = ebc.embedding_bags[table]
        start, end = int(offsets[2 * k]), int(offsets[2 * k + 2])
        blocks.append(F.embedding_bag(VALUES[start:end], bag.weight, offsets[2 * k: 2 * k + 2] - start, mode=bag.mode))
    return torch.cat(blocks, dim=1)


def test_keyed_jagged_tensors_pool_per_feature():
    ebc = collection()
    assert ebc.feature_names() == KEYS
    with torch.no_grad():
        out = ebc(keys=KEYS, values=VALUES, lengths=LENGTHS)
        by_offsets = ebc(keys=KEYS, values=VALUES,
                         offsets=torch.cat([torch.zeros(1, dtype=torch.int64), LENGTHS.cumsum(0)]))
    assert out.keys() == KEYS and out.length_per_key() == [8, 8, 8]
    assert torch.equal(out.values(), expected(ebc)) and torch.equal(by_offsets.values(), out.values())
    assert torch.equal(out["history"], out.values()[:, 16:])


def test_state_dict_keys_are_torchrecs():
    assert {k.rsplit(".", 1)[0] for k in collection().state_dict()} == {"embedding_bags.t_user",
                                                                         "embedding_bags.t_item"}


@pytest.mark.parametrize("kwargs, message", [
    ({"keys": ["user", "item"], "values": VALUES[:6], "lengths": LENGTHS[:4]}, "lack history"),
    ({"keys": KEYS, "values": VALUES, "lengths": LENGTHS[:5]}, "do not fit"),
    ({"keys": KEYS, "values": VALUES}, "one of lengths/offsets"),
])
def test_bad_features_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        collection()(**kwargs)


def test_a_feature_feeds_one_table():
    with pytest.raises(ConfigError, match="one table only"):
        PersistentEmbeddingBagCollection([EmbeddingBagConfig("a", 5, 2, ["f"]), EmbeddingBagConfig("b", 5, 2, ["f"])])


def test_dlrm_tables_are_the_collections():
    model = DLRM(embedding_rows=[10, 20], embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,))
    assert [t.name for t in model.tables] == ["t0", "t1"]
    assert model.tables[1] is model.embedding_bag_collection.embedding_bags["t1"]


def test_torchrec_format_round_trips_through_ours():
    export = {"batch": 3, "model": {"bottom.0.weight": torch.ones(2), "c.embedding_bags.t.weight": torch.zeros(3, 2),
                                    "c.embedding_bags.t.optimizer_state": torch.zeros(3, 1)},
              "optimizers": [], "schedulers": [], "tables": {"c.embedding_bags.t": "t"}, "metadata": {}}
    flat = to_torchrec(export)
    assert sorted(flat) == ["bottom.0.weight", "embedding_bags.t.weight"]
    back = from_torchrec(flat, collection_path="c")
    assert back["tables"] == {"c.embedding_bags.t": "t"} and sorted(back["model"]) == ["bottom.0.weight",
                                                                                       "c.embedding_bags.t.weight"]


def test_export_loads_into_torchrecs_embedding_bag_collection(pool_path, tmp_path):
    torchrec = pytest.importorskip("torchrec", reason="torchrec is not installed (`make bench-extras` installs it)")
    from torchrec.modules.embedding_configs import PoolingType

    def model():
        return DLRM(embedding_rows=[50, 30], embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,), pooling="mean")

    trained = model()
    data = SyntheticCriteo(num_tables=2, rows=[50, 30], batch_size=32, seed=1)
    with cxltrain.Runtime(pool_path, trained, [], undo_ring_bytes=RING) as rt:
        for batch in rt.batches(data, stop=3):
            trained.loss(batch).backward()
    out = str(tmp_path / "ebc.pt")
    assert cli_main(["export", pool_path, out, "--format", "torchrec"]) == 0
    state = torch.load(out, weights_only=True)
    ebc = torchrec.EmbeddingBagCollection(tables=[
        torchrec.EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=8, feature_names=[name],
                                    pooling=PoolingType.MEAN)
        for name, rows in [("t0", 50), ("t1", 30)]], device=torch.device("cpu"))
    ebc.load_state_dict({k: v for k, v in state.items() if k.startswith("embedding_bags.")})  # strict
    assert {k for k in state if not k.startswith("embedding_bags.")} == set(trained.state_dict())
    features = torchrec.KeyedJaggedTensor(keys=["t0", "t1"], values=torch.tensor([3, 49, 0, 7, 29, 29, 1]),
                                          lengths=torch.tensor([2, 1, 0, 1, 3, 0]))
    ours = model()
    with cxltrain.Runtime(pool_path, ours, [], undo_ring_bytes=RING) as rt, torch.no_grad():
        assert rt.start_batch == 3
        mine = ours.embedding_bag_collection(features)
        assert type(mine).__name__ == "KeyedTensor"
        assert torch.equal(mine.values(), ebc(features).values())


def test_torchrec_interaction_order_is_a_column_permutation():
    """The top MLP's first layer, its columns permuted, gives the same logits on TorchRec's order."""
    from cxltrain.runtime.interop import torchrec_interaction_order

    net = DLRM(embedding_rows=[10, 10, 10], embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,))
    net.materialize()
    batch = SyntheticCriteo(num_tables=3, rows=10, batch_size=5, seed=0).batch(0)
    with torch.no_grad():
        x = net.bottom(batch.dense)
        embedded = net.embedding_bag_collection.pooled(batch.values, batch.offsets)
        stacked = torch.stack([x, *embedded], dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))
        upper = torch.triu_indices(4, 4, offset=1)
        theirs = torch.cat([x, dots[:, upper[0], upper[1]]], dim=1)  # TorchRec's InteractionArch
        order = torchrec_interaction_order(3)
        first = net.top[0]
        permuted = torch.nn.Linear(first.in_features, first.out_features)
        permuted.weight.copy_(first.weight[:, [*range(4), *(4 + order).tolist()]])
        permuted.bias.copy_(first.bias)
        top = torch.nn.Sequential(permuted, *net.top[1:])
        torch.testing.assert_close(top(theirs).squeeze(1), net(batch), rtol=1e-6, atol=1e-6)
