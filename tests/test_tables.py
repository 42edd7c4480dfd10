"""PersistentEmbeddingBag against nn.EmbeddingBag + torch optimizers, and its input checks."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from cxltrain.errors import PoolError
from cxltrain.kernels import native
from cxltrain.pool.format import RegionKind
from cxltrain.pool.handle import Pool
from cxltrain.tables.bag import PersistentEmbeddingBag
from cxltrain.tables.optim import SGD, RowWiseAdagrad

ROWS, DIM = 500, 10  # DIM 10: rows are padded to 64 bytes, so the padded-storage path is exercised


def make_table(pool_path, optimizer, mode="sum", dim=DIM, seed=3):
    pool = Pool.create(pool_path, 8 << 20)
    table = PersistentEmbeddingBag(ROWS, dim, name="t0", mode=mode, optimizer=optimizer, seed=seed)
    assert table.attach(pool)
    return pool, table


def random_bags(seed, batch=64, max_len=6, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (batch,), generator=g)
    lengths[0] = 3
    # a few hot rows so duplicates within and across bags are common
    indices = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    indices[::3] = torch.randint(0, rows, (indices[::3].numel(),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return indices, offsets, g


def unique_bags(seed, batch=40, rows=ROWS):
    """Bags of lengths 0..5 whose lookups never repeat a row within the batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (batch,), generator=g)
    indices = torch.randperm(rows, generator=g)[: int(lengths.sum())]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return indices, offsets, g


# torch allows per_sample_weights only with mode "sum"
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("duplicates", [False, True])
def test_sgd_matches_torch_embedding_bag(pool_path, mode, weighted, duplicates):
    """Outputs and updated weights equal nn.EmbeddingBag(sparse=True) + torch.optim.SGD.

    Bit for bit when no row repeats within a batch. With repeats, torch applies each lookup's
    gradient to the row separately while we sum a row's gradients first (as FBGEMM does), so the
    float rounding differs in the last bits: compared to within 1e-6 (relative and absolute).
    """
    pool, table = make_table(pool_path, SGD(lr=0.3), mode)
    reference = nn.EmbeddingBag(ROWS, DIM, mode=mode, sparse=True)
    with torch.no_grad():
        reference.weight.copy_(table.weight)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3)
    for step in range(5):
        seed = 100 + step
        print(f"seed={seed}")
        indices, offsets, g = (random_bags if duplicates else unique_bags)(seed)
        psw = torch.rand(indices.shape, generator=g) if weighted else None
        upstream = torch.randn(offsets.numel(), DIM, generator=g)
        before = table.weight.clone()
        ours = table(indices, offsets, per_sample_weights=psw)
        theirs = reference(indices, offsets, per_sample_weights=psw)
        if duplicates:
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(ours, theirs)
        (ours * upstream).sum().backward()
        (theirs * upstream).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert not torch.equal(table.weight, before)
        if duplicates:
            torch.testing.assert_close(table.weight, reference.weight, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(table.weight, reference.weight)
    pool.close()


def reference_rowwise_adagrad(weight, state, indices, offsets, upstream, lr, eps):
    """Dense formulation of row-wise Adagrad through autograd: an independent reference."""
    w = weight.clone().requires_grad_(True)
    out = nn.functional.embedding_bag(indices, w, offsets, mode="sum")
    (out * upstream).sum().backward()
    grad = w.grad
    touched = grad.abs().sum(1) > 0
    state = state.clone()
    state[touched, 0] += grad[touched].square().mean(1)
    new = weight.clone()
    new[touched] -= lr * grad[touched] / (state[touched].sqrt() + eps)
    return new, state


def test_rowwise_adagrad_matches_reference(pool_path):
    pool, table = make_table(pool_path, RowWiseAdagrad(lr=0.2, eps=1e-6, initial_accumulator_value=0.1))
    weight, state = table.weight.clone(), table.optimizer_state.clone()
    assert torch.equal(state, torch.full((ROWS, 1), 0.1))
    for step in range(4):
        print(f"seed={200 + step}")
        indices, offsets, g = random_bags(200 + step)
        upstream = torch.randn(offsets.numel(), DIM, generator=g)
        (table(indices, offsets) * upstream).sum().backward()
        weight, state = reference_rowwise_adagrad(weight, state, indices, offsets, upstream, 0.2, 1e-6)
        torch.testing.assert_close(table.weight, weight, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(table.optimizer_state, state, rtol=1e-6, atol=1e-7)
    pool.close()


def test_duplicate_reduction_is_deterministic(shm_dir):
    results = []
    for run in range(2):
        pool, table = make_table(str(shm_dir / f"r{run}.pool"), RowWiseAdagrad(lr=0.1))
        for step in range(3):
            indices, offsets, g = random_bags(300 + step, batch=512)
            (table(indices, offsets) * torch.randn(512, DIM, generator=g)).sum().backward()
        results.append(table.weight.clone())
        pool.close()
    assert torch.equal(results[0], results[1])


def test_two_dimensional_input_equals_offsets_form(shm_dir):
    pool_a, a = make_table(str(shm_dir / "a.pool"), SGD(lr=0.5))
    pool_b, b = make_table(str(shm_dir / "b.pool"), SGD(lr=0.5))
    bags = torch.tensor([[1, 2, 2], [4, 1, 9]])
    out_a = a(bags)
    out_b = b(bags.reshape(-1), torch.tensor([0, 3]))
    assert torch.equal(out_a, out_b)
    out_a.sum().backward()
    out_b.sum().backward()
    assert torch.equal(a.weight, b.weight)
    pool_a.close(), pool_b.close()


def test_weights_are_a_zero_copy_view_of_the_pool(shm_dir):
    pool, table = make_table(str(shm_dir / "z.pool"), SGD(lr=0.1))
    region = pool.region("t0.weight")
    base = pool.device.array.ctypes.data
    assert table.weight.data_ptr() == base + region.offset
    assert table.weight.stride() == (region.row_stride // 4, 1)
    pool.array("t0.weight")[5, :] = 42.0
    assert torch.equal(table.weight[5], torch.full((DIM,), 42.0))
    pool.close()


def test_updates_are_in_the_pool_after_reopen(shm_dir):
    path = str(shm_dir / "p.pool")
    pool, table = make_table(path, RowWiseAdagrad(lr=0.1))
    table(torch.tensor([1, 2, 3]), torch.tensor([0, 1])).sum().backward()
    expected_w, expected_s = table.weight.clone(), table.optimizer_state.clone()
    pool.persist_region("t0.weight")
    pool.commit(batches_done=1)
    pool.close()
    with pytest.raises(RuntimeError, match="no storage"):
        table(torch.tensor([1]), torch.tensor([0]))
    again = PersistentEmbeddingBag(ROWS, DIM, name="t0", optimizer=RowWiseAdagrad(lr=0.1), seed=999)
    with Pool.open(path) as pool:
        assert not again.attach(pool)  # adopted, not re-initialised (seed 999 is ignored)
        assert torch.equal(again.weight, expected_w)
        assert torch.equal(again.optimizer_state, expected_s)


def test_initialisation_is_deterministic_and_seeded(shm_dir):
    a = PersistentEmbeddingBag(ROWS, DIM, name="t0", seed=1)
    b = PersistentEmbeddingBag(ROWS, DIM, name="t0", seed=1)
    c = PersistentEmbeddingBag(ROWS, DIM, name="t0", seed=2)
    for t in (a, b, c):
        t.materialize()
    assert torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, c.weight)
    bound = ROWS ** -0.5
    assert float(a.weight.abs().max()) <= bound
    pool, d = make_table(str(shm_dir / "d.pool"), RowWiseAdagrad(), seed=1)
    assert torch.equal(d.weight, a.weight)  # the pool and DRAM paths initialise alike
    pool.close()


def test_mismatched_existing_regions_are_refused(shm_dir):
    path = str(shm_dir / "m.pool")
    pool, _ = make_table(path, SGD())
    wrong = PersistentEmbeddingBag(ROWS, DIM + 1, name="t0", optimizer=SGD())
    with pytest.raises(PoolError, match="expects table_weights float32"):
        wrong.attach(pool)
    needs_state = PersistentEmbeddingBag(ROWS, DIM, name="t0", optimizer=RowWiseAdagrad())
    with pytest.raises(PoolError, match="'t0.optim', which is missing"):
        needs_state.attach(pool)
    pool.add_region("t1.weight", RegionKind.BLOB, "float32", (ROWS, DIM))
    pool.add_region("t2.weight", RegionKind.TABLE_WEIGHTS, "float32", (ROWS, DIM))
    pool.add_region("t2.optim", RegionKind.TABLE_OPTIM_STATE, "int32", (ROWS, 1))
    for name in ("t1", "t2"):
        with pytest.raises(PoolError, match="expects"):
            PersistentEmbeddingBag(ROWS, DIM, name=name, optimizer=RowWiseAdagrad()).attach(pool)
    pool.close()


BAD_INPUTS = [
    ("out of range", lambda: (torch.tensor([1, ROWS]), torch.tensor([0])), IndexError),
    ("negative", lambda: (torch.tensor([-1, 2]), torch.tensor([0])), IndexError),
    ("float indices", lambda: (torch.tensor([1.0, 2.0]), torch.tensor([0])), TypeError),
    ("offsets not from 0", lambda: (torch.tensor([1, 2]), torch.tensor([1])), ValueError),
    ("offsets decreasing", lambda: (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), ValueError),
    ("offsets past end", lambda: (torch.tensor([1, 2]), torch.tensor([0, 3])), ValueError),
    ("no offsets", lambda: (torch.tensor([1, 2]), None), ValueError),
    ("3-D", lambda: (torch.zeros(2, 2, 2, dtype=torch.int64), None), ValueError),
]


@pytest.mark.parametrize("label,make,error", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_before_any_write(shm_dir, label, make, error):
    path = str(shm_dir / "bad.pool")
    pool, table = make_table(path, RowWiseAdagrad())
    pool.close()
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    pool = Pool.open(path)
    table = PersistentEmbeddingBag(ROWS, DIM, name="t0", mode="sum", optimizer=RowWiseAdagrad())
    table.attach(pool)
    indices, offsets = make()
    with pytest.raises(error, match="table 't0'"):
        table(indices, offsets).sum().backward()
    pool.close()
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == digest


def test_per_sample_weights_checks(shm_dir):
    pool, table = make_table(str(shm_dir / "w.pool"), SGD(), mode="mean")
    with pytest.raises(ValueError, match="need mode 'sum'"):
        table(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2))
    pool.close()
    pool, table = make_table(str(shm_dir / "w2.pool"), SGD())
    with pytest.raises(TypeError, match="shaped like"):
        table(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(3))
    pool.close()


def test_no_update_without_grad(shm_dir):
    pool, table = make_table(str(shm_dir / "n.pool"), SGD(lr=1.0))
    before = table.weight.clone()
    with torch.no_grad():
        out = table(torch.tensor([1, 2]), torch.tensor([0, 1]))
    assert not out.requires_grad
    assert torch.equal(table.weight, before)
    pool.close()


def test_empty_bags_and_empty_batch(shm_dir):
    pool, table = make_table(str(shm_dir / "e.pool"), SGD(lr=1.0))
    before = table.weight.clone()
    out = table(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0]))
    assert torch.equal(out, torch.zeros(2, DIM))
    out.sum().backward()
    assert torch.equal(table.weight, before)
    pool.close()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's own Adagrad says this
def test_rowwise_adagrad_with_one_column_matches_torch_adagrad(pool_path):
    """With D = 1 the row-wise accumulator is torch's element-wise one: torch.optim.Adagrad is then
    a reference written by someone else. No row repeats within a batch, so the accumulators are
    equal bit for bit, and so are the weights from the torch kernels. The native kernel's weights
    may differ by 1 ulp: its sqrtf is correctly rounded, torch's CPU sqrt (MKL vector math in this
    build) is not, about 1 result in 5 being 1 ulp off."""
    pool = Pool.create(pool_path, 8 << 20)
    table = PersistentEmbeddingBag(ROWS, 1, name="t0", mode="sum", optimizer=RowWiseAdagrad(lr=0.2, eps=1e-10,
                                                                                 initial_accumulator_value=0.1))
    table.attach(pool)
    reference = nn.EmbeddingBag(ROWS, 1, mode="sum", sparse=True)
    with torch.no_grad():
        reference.weight.copy_(table.weight)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.2, eps=1e-10, initial_accumulator_value=0.1)
    for step in range(5):
        print(f"seed={400 + step}")
        indices, offsets, g = unique_bags(400 + step)
        upstream = torch.randn(offsets.numel(), 1, generator=g)
        (table(indices, offsets) * upstream).sum().backward()
        (reference(indices, offsets) * upstream).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if native.lib() is None:
            assert torch.equal(table.weight, reference.weight)
        else:
            torch.testing.assert_close(table.weight, reference.weight, rtol=2.4e-7, atol=1e-7)  # ulps of the step
        assert torch.equal(table.optimizer_state, ref_opt.state[reference.weight]["sum"])
    pool.close()
