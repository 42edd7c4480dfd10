"""The DLRM reference model: shapes, parameters, determinism, and pool vs DRAM tables alike."""

from __future__ import annotations

import math

import pytest
import torch

from cxltrain.data import SyntheticCriteo
from cxltrain.errors import ConfigError
from cxltrain.models import DLRM
from cxltrain.models.metrics import logloss, roc_auc
from cxltrain.pool.handle import Pool
from cxltrain.tables.optim import RowWiseAdagrad

ROWS = [300, 500, 200]


def small_model(seed=0):
    return DLRM(embedding_rows=ROWS, embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,),
                sparse_optimizer=RowWiseAdagrad(lr=0.1), seed=seed)


def source():
    return SyntheticCriteo(num_tables=len(ROWS), rows=ROWS, batch_size=64, seed=5, pooling=2)


def train_steps(model, steps=6):
    opt = torch.optim.Adam(model.dense_parameters(), lr=1e-2)
    losses = []
    for b in range(steps):
        loss = model.loss(source().batch(b))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_shapes_and_parameters():
    model = small_model()
    model.materialize()
    batch = source().batch(0)
    assert model(batch).shape == (64,)
    # 4 vectors (bottom output + 3 tables) → 6 pairwise dots, plus the bottom output (8)
    assert model.top[0].in_features == 8 + 6
    assert [p.shape for p in model.parameters()] == [p.shape for p in model.dense_parameters()]
    assert len(model.dense_parameters()) == 8  # 2 linear layers per MLP x (weight, bias)


def test_initialisation_depends_on_the_seed_alone():
    a, b, c = small_model(1), small_model(1), small_model(2)
    for m in (a, b, c):
        m.materialize()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert torch.equal(a.tables[0].weight, b.tables[0].weight)
    assert not torch.equal(a.tables[0].weight, c.tables[0].weight)
    assert not torch.equal(a.tables[0].weight[:, :4], a.tables[1].weight[:200, :4])  # tables differ


def test_training_in_a_pool_equals_training_in_dram(shm_dir):
    in_dram = small_model()
    in_dram.materialize()
    in_pool = small_model()
    with Pool.create(str(shm_dir / "m.pool"), 8 << 20) as pool:
        assert in_pool.attach(pool)
        assert train_steps(in_pool) == train_steps(in_dram)
        for p, d in zip(in_pool.tables, in_dram.tables):
            assert torch.equal(p.weight, d.weight) and torch.equal(p.optimizer_state, d.optimizer_state)


def test_loss_falls_and_auc_is_sane():
    model = small_model()
    model.materialize()
    losses = train_steps(model, steps=30)
    assert sum(losses[-5:]) < sum(losses[:5])
    batch = source().batch(10_000)
    with torch.no_grad():
        logits = model(batch)
    assert 0.5 < roc_auc(logits, batch.labels) <= 1.0
    assert logloss(logits, batch.labels) < 0.69


def test_attach_is_all_or_nothing(shm_dir):
    with Pool.create(str(shm_dir / "a.pool"), 8 << 20) as pool:
        partial = DLRM(embedding_rows=ROWS[:1], embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,))
        partial.attach(pool)
        before = dict(pool.regions)
        with pytest.raises(ConfigError, match="but not t1, t2"):
            small_model().attach(pool)
        assert pool.regions == before
    with Pool.create(str(shm_dir / "tiny.pool"), 1 << 20) as pool:
        big = DLRM(embedding_rows=[10_000] * 3, embedding_dim=64, bottom_mlp=(16,), top_mlp=(16,))
        with pytest.raises(Exception, match="are free"):
            big.attach(pool)
        assert pool.regions == {}


def test_batch_and_model_must_agree():
    model = DLRM(embedding_rows=ROWS[:2], embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,))
    model.materialize()
    with pytest.raises(ConfigError, match="3 sparse features, model has 2 tables"):
        model(source().batch(0))


def test_auc_handles_ties_and_one_class():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == 0.75
    assert roc_auc(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.5
    assert math.isnan(roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])))  # one class: undefined
