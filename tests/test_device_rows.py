"""The device path (tables/device_rows.py) on CPU tensors: the same path a GPU runs, with the torch
kernels of kernels/device_kernels.py. A placed table must look up and update exactly as the host
path does (the C kernel), with or without a device cache, and write every change through to the pool."""

from __future__ import annotations

import pytest
import torch

from cxltrain.errors import ConfigError
from cxltrain.kernels import ops
from cxltrain.kernels.device_kernels import TorchRowKernels
from cxltrain.pool.handle import Pool
from cxltrain.tables.bag import PersistentEmbeddingBag
from cxltrain.tables.optim import SGD, RowWiseAdagrad
from helpers import cxltrain

ROWS, DIM = 300, 12  # rows padded to 16 floats


def bags(seed, batch=48, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (batch,), generator=g)
    indices = torch.randint(0, 25, (int(lengths.sum()),), generator=g)  # many repeats
    indices[::2] = torch.randint(0, rows, (indices[::2].numel(),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    weights = torch.rand(indices.numel(), generator=g) + 0.5
    return indices, offsets, weights, torch.randn(batch, DIM, generator=g)


def pair(tmp_path, optimizer, mode):
    """Two equal tables in two pools: `host` on the host path, `placed` on the device path (CPU)."""
    tables = []
    for name in ("host", "placed"):
        pool = Pool.create(str(tmp_path / f"{name}.pool"), 4 << 20)
        table = PersistentEmbeddingBag(ROWS, DIM, name="t", mode=mode, optimizer=optimizer, seed=5)
        table.attach(pool)
        tables.append(table)
    return tables


@pytest.mark.parametrize("optimizer", [SGD(lr=0.2), RowWiseAdagrad(lr=0.1)], ids=["sgd", "adagrad"])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("cached", [None, "some", "all"])
def test_placed_table_equals_host_path_bit_for_bit(tmp_path, optimizer, mode, weighted, cached):
    host, placed = pair(tmp_path, optimizer, mode)
    ids = {None: None, "some": torch.arange(0, ROWS, 3), "all": torch.arange(ROWS)}[cached]
    rows = placed.place("cpu", ids)
    assert rows.cached == (0 if ids is None else ids.numel())
    for step in range(4):
        indices, offsets, weights, grad = bags(step)
        psw = weights if weighted else None
        out_host, out_placed = host(indices, offsets, psw), placed(indices, offsets, psw)
        torch.testing.assert_close(out_placed, out_host, rtol=1e-6, atol=1e-6)
        (out_host * grad).sum().backward()
        (out_placed * grad).sum().backward()
        # the pool holds every change (write-through), bit for bit the host path's
        assert torch.equal(placed.storage()[0], host.storage()[0])
        if optimizer.state_columns:
            assert torch.equal(placed.storage()[1], host.storage()[1])
        if ids is not None:  # and the cache holds the same values as the pool
            assert torch.equal(rows.cache_rows, placed.storage()[0].index_select(0, ids))


def test_reference_update_matches_the_c_kernel_with_repeats():
    """TorchRowKernels.update (the GPU kernels' reference) rounds as kernels/rows.c does."""
    g = torch.Generator().manual_seed(1)
    weight, state = torch.randn(ROWS, 16, generator=g), torch.rand(ROWS, 1, generator=g)
    indices, offsets, _, grad = bags(7)
    expect_w, expect_s = weight.clone(), state.clone()
    ops.sparse_update("rowwise_adagrad", expect_w, expect_s, indices, grad, offsets, None, "mean", lr=0.3, eps=1e-8)
    ids, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    block, block_state = weight[ids].clone(), state[ids].clone()
    order = torch.sort(inverse, stable=True).indices
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.bincount(inverse, minlength=ids.numel()).cumsum(0)])
    lengths = torch.diff(offsets, append=offsets.new_tensor([indices.numel()]))
    bag_of = torch.repeat_interleave(torch.arange(offsets.numel()), lengths)
    TorchRowKernels().update("rowwise_adagrad", block, block_state, order, starts, bag_of, offsets, None, True, grad,
                             ids.numel(), 0.3, 1e-8)
    assert torch.equal(block, expect_w[ids]) and torch.equal(block_state, expect_s[ids])


def test_place_refuses_what_the_device_path_lacks(tmp_path):
    pool = Pool.create(str(tmp_path / "p.pool"), 4 << 20)
    table = PersistentEmbeddingBag(ROWS, DIM, name="t", mode="max")
    with pytest.raises(ConfigError, match="needs the table attached"):
        table.place("cpu")
    table.attach(pool)
    with pytest.raises(ConfigError, match="sum and mean bags"):
        table.place("cpu")
    plain = PersistentEmbeddingBag(ROWS, DIM, name="u")
    plain.attach(pool)
    with pytest.raises(ConfigError, match="distinct ids"):
        plain.place("cpu", torch.tensor([1, 1]))


def test_device_cuda_without_a_gpu_is_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = cxltrain("train", "--device", "cuda", "--steps", "2", "--rows", "1000", "--pool", str(tmp_path / "p.pool"))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0] and "docs/gpu.md) needs a CUDA build" in lines[0], \
        result.stderr
    assert not (tmp_path / "p.pool").exists()
