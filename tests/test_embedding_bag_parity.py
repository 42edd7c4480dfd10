"""PersistentEmbeddingBag against PyTorch's own sample inputs for nn.functional.embedding_bag.

The samples come from the OpInfo generator in the installed torch wheel
(torch.testing._internal.common_methods_invocations): every mode, padding_idx, include_last_offset,
per_sample_weights, max_norm, 1-D and 2-D inputs; none refused. For each: forward equal to
F.embedding_bag, bit for bit (max_norm: after the same renorm of the rows, in place), and after
backward each row moved by exactly what SGD / row-wise Adagrad would do with autograd's gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cxltrain.errors import ConfigError
from cxltrain.pool.handle import Pool
from cxltrain.tables.bag import PersistentEmbeddingBag
from cxltrain.tables.optim import SGD, RowWiseAdagrad

opinfo = pytest.importorskip("torch.testing._internal.common_methods_invocations",
                             reason="torch's OpInfo samples need torch's test dependency expecttest")

LR, EPS = 0.5, 1e-8

RING = 1 << 20  # a small undo ring: a test pool is created in milliseconds


def torch_samples():
    """(weight [R, D], indices, offsets, per_sample_weights, kwargs) of every OpInfo sample."""
    (op,) = [o for o in opinfo.op_db if o.name == "nn.functional.embedding_bag"]
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=False):
        kwargs = dict(sample.kwargs)
        offsets, weights = kwargs.pop("offsets", None), kwargs.pop("per_sample_weights", None)
        yield sample.input.detach().clone(), sample.args[0], offsets, weights, kwargs


SAMPLES = list(torch_samples())


def sample_id(sample) -> str:
    _, indices, offsets, weights, kwargs = sample
    extras = ",".join(f"{k}={v}" for k, v in kwargs.items())
    return f"{indices.dim()}d-{'offsets' if offsets is not None else 'no-offsets'}-" \
           f"{'weighted' if weights is not None else 'plain'}-{extras}"


def expected_rows(weight: torch.Tensor, grad: torch.Tensor, optimizer) -> torch.Tensor:
    """weight [R, D] after one dense step of `optimizer`'s rule with autograd's gradient [R, D]."""
    if isinstance(optimizer, SGD):
        return weight - optimizer.lr * grad
    state = grad.pow(2).mean(dim=1, keepdim=True)  # row-wise Adagrad from a zero accumulator
    return weight - optimizer.lr * grad / (state.sqrt() + optimizer.eps)


def check_sample(table: PersistentEmbeddingBag, sample, optimizer, seed: int) -> None:
    weight, indices, offsets, weights, kwargs = sample
    out = table(indices, offsets, weights)
    reference_weight = weight.clone().requires_grad_()
    # sparse=True only changes the layout of torch's gradient, and its backward refuses it with
    # scale_grad_by_freq (which the OpInfo samples combine with max_norm): the dense gradient
    dense = {k: v for k, v in kwargs.items() if k != "sparse"}
    reference = F.embedding_bag(indices, reference_weight, offsets, per_sample_weights=weights, **dense)
    assert torch.equal(out, reference)
    renormalised = reference_weight.detach().clone()  # max_norm: torch renormalised rows in place
    assert torch.equal(table.weight, renormalised)
    grad_out = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(grad_out)
    reference.backward(grad_out)
    grad = reference_weight.grad
    torch.testing.assert_close(table.weight, expected_rows(renormalised, grad, optimizer),
                               rtol=0, atol=2e-6)


@pytest.mark.parametrize("optimizer", [SGD(lr=LR), RowWiseAdagrad(lr=LR, eps=EPS)], ids=["sgd", "adagrad"])
@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=[sample_id(s) for s in SAMPLES])
def test_torch_sample_forward_and_update(index, optimizer):
    sample = SAMPLES[index]
    kwargs = sample[4]
    table = PersistentEmbeddingBag.from_pretrained(sample[0], freeze=False, name="t", optimizer=optimizer, **kwargs)
    table.materialize()
    check_sample(table, sample, optimizer, seed=index)


def test_every_mode_is_sampled():
    """The OpInfo set still covers what this file claims (a torch upgrade that drops a case shows here)."""
    seen = {(s[4]["mode"], "padding_idx" in s[4], s[4].get("include_last_offset", False)) for s in SAMPLES}
    for mode in ("sum", "mean", "max"):
        assert {(mode, False, False), (mode, True, False), (mode, False, True)} <= seen
    renorms = {(s[4]["mode"], s[4].get("norm_type", 2.0)) for s in SAMPLES if s[4].get("max_norm") is not None}
    assert {("sum", 2.0), ("mean", 1.0), ("max", 2.0)} <= renorms
    assert len(SAMPLES) >= 45


def test_pool_table_matches_too(pool_path):
    """The same peer check on a pool-attached table with padded rows (D = 5 floats in 64-byte rows),
    on every third sample (the DRAM test above runs them all through the same code)."""
    with Pool.create(pool_path, 4 << 20) as pool:
        for index, sample in list(enumerate(SAMPLES))[::3]:
            optimizer = RowWiseAdagrad(lr=LR, eps=EPS)
            table = PersistentEmbeddingBag.from_pretrained(sample[0], freeze=False, name=f"t{index}",
                                                           optimizer=optimizer, **sample[4])
            table.attach(pool)
            check_sample(table, sample, optimizer, seed=index)


def test_scale_grad_by_freq_matches_autograd():
    weight = torch.randn(30, 6, generator=torch.Generator().manual_seed(1))
    indices = torch.tensor([1, 1, 1, 4, 7, 4, 29, 1])
    offsets = torch.tensor([0, 3, 5])
    for mode in ("sum", "mean"):
        table = PersistentEmbeddingBag.from_pretrained(weight, freeze=False, name="t", mode=mode,
                                                       scale_grad_by_freq=True, optimizer=SGD(lr=LR))
        table.materialize()
        check_sample(table, (weight, indices, offsets, None, {"mode": mode, "scale_grad_by_freq": True}),
                     SGD(lr=LR), seed=2)


def test_from_pretrained_freezes_by_default():
    weight = torch.arange(12.0).reshape(4, 3)
    table = PersistentEmbeddingBag.from_pretrained(weight, name="t")
    assert table.mode == "mean"  # nn.EmbeddingBag.from_pretrained's default
    table.materialize()
    out = table(torch.tensor([0, 3]), torch.tensor([0]))
    assert not out.requires_grad
    assert torch.equal(table.weight, weight)


def test_padding_row_starts_at_zero_as_in_torch():
    table = PersistentEmbeddingBag(10, 4, padding_idx=-2, name="t")
    table.materialize()
    assert table.padding_idx == 8 and not table.weight[8].any() and table.weight[7].any()


@pytest.mark.parametrize("kwargs, reason", [
    ({"max_norm": 0.0}, "max_norm must be a positive number"),
    ({"max_norm": "1"}, "max_norm must be a positive number"),
    ({"norm_type": None}, "norm_type must be a number"),
    ({"dtype": torch.float64}, "pool rows are float32"),
    ({"device": "meta"}, "device must be cpu"),
    ({"padding_idx": 10}, "padding_idx must be an int"),
])
def test_refused_arguments_say_why(kwargs, reason):
    with pytest.raises(ConfigError, match=reason):
        PersistentEmbeddingBag(10, 4, name="t", **kwargs)


def test_runtime_names_unnamed_tables_and_recovers_a_max_bag(pool_path):
    """A model built as with nn.EmbeddingBag (no names; mode max, padding_idx) trains under a Runtime,
    and a batch left uncommitted is rolled back exactly (the general path goes through the undo log)."""
    import cxltrain

    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"user": PersistentEmbeddingBag(50, 8, mode="max", padding_idx=0),
                                    "item": PersistentEmbeddingBag(40, 8, scale_grad_by_freq=True)})

    def step(m, b):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(0, 40, (12,), generator=g)
        offsets = torch.tensor([0, 4, 8])
        (m["user"](ids, offsets) * m["item"](ids, offsets)).sum().backward()

    m = model()
    with cxltrain.Runtime(pool_path, m, [], undo_ring_bytes=RING) as rt:
        assert sorted(t.name for t in rt.tables.values()) == ["item", "user"]
        for b in rt.batches(lambda b: b, stop=3):
            step(m, b)
        after_three = {k: t.weight.clone() for k, t in m.items()}
    m = model()
    with pytest.raises(ZeroDivisionError):
        with cxltrain.Runtime(pool_path, m, [], undo_ring_bytes=RING) as rt:
            for b in rt.batches(lambda b: b, stop=5):
                step(m, b)
                1 / 0  # the batch in flight (3) is left uncommitted
    m = model()
    with cxltrain.Runtime(pool_path, m, [], undo_ring_bytes=RING) as rt:
        assert rt.start_batch == 3
        assert all(torch.equal(t.weight, after_three[k]) for k, t in m.items())
