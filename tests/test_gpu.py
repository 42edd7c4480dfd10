"""The GPU path (DESIGN §9) on a real GPU: the CUDA kernels against their reference, the pool mapping
as CUDA sees it, placed tables against the host path, and SIGKILL at the GPU path's crash points.
Every test here is marked `gpu` and skips, with the reason, where torch sees no CUDA device or CuPy is
missing (CI never has a GPU; `make gpu-check` runs them on a GPU machine)."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before any cuBLAS handle: fixed reductions

import pytest  # noqa: E402
import torch  # noqa: E402

from cxltrain.devices.gpu_mapping import gpu_problem, mapped_view  # noqa: E402
from cxltrain.faults import CRASH_ENV, FAULT_ENV, CrashPoint, PlantedDevice  # noqa: E402
from cxltrain.jobs.crashtest import TRIAL_CONFIG, check_recovery  # noqa: E402
from cxltrain.kernels.device_kernels import TorchRowKernels  # noqa: E402
from cxltrain.pool.handle import Pool  # noqa: E402
from cxltrain.tables.bag import PersistentEmbeddingBag  # noqa: E402
from cxltrain.tables.optim import SGD, RowWiseAdagrad  # noqa: E402
from helpers import cxltrain, cxltrain_command, references, run_and_kill, shm_tempdir, tier_folders  # noqa: E402

PROBLEM = gpu_problem()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(PROBLEM is not None, reason=f"needs a GPU: {PROBLEM}")]

CUDA = torch.device("cuda")
ROWS, DIM = 2000, 40   # rows padded to 48 floats: the float4 gather; state [R, 1]: the scalar one


def lookups(seed, batch=256, rows=ROWS, hot=30):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 7, (batch,), generator=g)
    indices = torch.randint(0, hot, (int(lengths.sum()),), generator=g)   # many repeats
    indices[::2] = torch.randint(0, rows, (indices[::2].numel(),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return indices, offsets, torch.rand(indices.numel(), generator=g) + 0.5, torch.randn(batch, DIM, generator=g)


def kernels():
    from cxltrain.kernels.cupy_rows import CupyRowKernels

    return CupyRowKernels(), TorchRowKernels()


# -- kernels against the reference ---------------------------------------------------------------
@pytest.mark.parametrize("width", [48, 1, 13])
@pytest.mark.parametrize("cached", [False, True])
def test_gather_and_scatter_equal_the_reference(width, cached):
    gpu, ref = kernels()
    g = torch.Generator().manual_seed(width)
    source, cache = torch.randn(ROWS, width, generator=g), torch.randn(300, width, generator=g)
    slot_of = torch.full((ROWS,), -1, dtype=torch.int32)
    slot_of[torch.randperm(ROWS, generator=g)[:300]] = torch.arange(300, dtype=torch.int32)
    ids = torch.unique(torch.randint(0, ROWS, (700,), generator=g))
    args = (cache, slot_of) if cached else (None, None)
    want = torch.empty(ids.numel(), width)
    ref.gather(want, source, ids, ids.numel(), *args)
    got = torch.empty(ids.numel(), width, device=CUDA)
    gpu.gather(got, source.to(CUDA), ids.to(CUDA), ids.numel(), *(None if a is None else a.to(CUDA) for a in args))
    assert torch.equal(got.cpu(), want)
    values = torch.randn(ids.numel(), width, generator=g)
    dest_ref, cache_ref = source.clone(), cache.clone()
    ref.scatter(dest_ref, values, ids, ids.numel() - 5, cache_ref if cached else None, slot_of if cached else None)
    dest, cache_gpu = source.to(CUDA), cache.to(CUDA)
    gpu.scatter(dest, values.to(CUDA), ids.to(CUDA), ids.numel() - 5, cache_gpu if cached else None,
                slot_of.to(CUDA) if cached else None)
    assert torch.equal(dest.cpu(), dest_ref) and torch.equal(cache_gpu.cpu(), cache_ref)


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_bag_forward_equals_the_reference(mode, weighted):
    gpu, ref = kernels()
    indices, offsets, weights, _ = lookups(1)
    ids, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    rows = torch.randn(ids.numel(), 48)
    psw = weights if weighted else None
    want = ref.bag(rows, inverse, offsets, psw, mode == "mean", DIM)
    got = gpu.bag(rows.to(CUDA), inverse.to(CUDA), offsets.to(CUDA), None if psw is None else psw.to(CUDA),
                  mode == "mean", DIM)
    # torch's CPU embedding_bag may add a bag's rows in another order: float32 rounding apart
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_update_is_bit_identical_to_the_reference(rule, mode, weighted):
    gpu, ref = kernels()
    indices, offsets, weights, grad = lookups(2)
    psw = weights if weighted else None
    ids, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    order = torch.sort(inverse, stable=True).indices
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.bincount(inverse, minlength=ids.numel()).cumsum(0)])
    bag_of = torch.repeat_interleave(torch.arange(offsets.numel()),
                                     torch.diff(offsets, append=offsets.new_tensor([indices.numel()])))
    g = torch.Generator().manual_seed(3)
    block, state = torch.randn(ids.numel(), 48, generator=g), torch.rand(ids.numel(), 1, generator=g)
    count = ids.numel() - 3
    want_block, want_state = block.clone(), state.clone()
    ref.update(rule, want_block, want_state, order, starts, bag_of, offsets, psw, mode == "mean", grad, count, 0.3, 1e-8)
    got_block, got_state = block.to(CUDA), state.to(CUDA)
    on = [t.to(CUDA) for t in (order, starts, bag_of, offsets)]
    gpu.update(rule, got_block, got_state, *on, None if psw is None else psw.to(CUDA), mode == "mean", grad.to(CUDA),
               count, 0.3, 1e-8)
    assert torch.equal(got_block.cpu(), want_block)
    assert torch.equal(got_state.cpu(), want_state)


# -- the pool as CUDA sees it --------------------------------------------------------------------
def test_a_shm_pool_is_registered_and_written_through(shm_dir):
    pool = Pool.create(str(shm_dir / "p.pool"), 8 << 20)
    table = PersistentEmbeddingBag(ROWS, DIM, name="t", mode="sum", optimizer=SGD(lr=0.1))
    table.attach(pool)
    host = table.storage()[0]
    view = mapped_view(pool, table.weight_region, host, CUDA)
    assert view is not None and view.device.type == "cuda"
    view[7, 0] = 42.0
    torch.cuda.synchronize()
    assert host[7, 0].item() == 42.0
    pool.close()


@pytest.mark.parametrize("where", ["shm", "disk"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.2), RowWiseAdagrad(lr=0.1)], ids=["sgd", "adagrad"])
def test_placed_table_updates_the_pool_as_the_host_path_does(where, optimizer):
    """Bit for bit: a table placed on the GPU (with a cache of a third of its rows) and the same
    table on the host path; on a disk file CUDA refuses the mapping and blocks go through pinned
    host memory instead."""
    with tier_folders("cxltrain-gpu-") as (fast, disk):
        folder = fast if where == "shm" else disk
        tables = []
        for name in ("host", "placed"):
            pool = Pool.create(os.path.join(folder, f"{name}.pool"), 8 << 20)
            table = PersistentEmbeddingBag(ROWS, DIM, name="t", mode="sum", optimizer=optimizer, seed=4)
            table.attach(pool)
            tables.append(table)
        host, placed = tables
        rows = placed.place(CUDA, None if where == "disk" else torch.arange(0, ROWS, 3))
        if where == "shm":
            assert not rows.bounced
        print(f"{where}: {'pinned bounce' if rows.bounced else 'registered mapping'}")
        for step in range(3):
            indices, offsets, weights, grad = lookups(10 + step)
            out_host, out_placed = host(indices, offsets, weights), placed(indices, offsets, weights)
            assert out_placed.device.type == "cuda"
            torch.testing.assert_close(out_placed.cpu(), out_host, rtol=1e-6, atol=1e-6)
            (out_host * grad).sum().backward()
            (out_placed * grad.to(CUDA)).sum().backward()
            for got, want in zip(placed.storage(), host.storage()):
                if want is not None:
                    wrong = got != want
                    assert not wrong.any(), (f"step {step}: {int(wrong.sum())} values differ, rows "
                                             f"{wrong.any(1).nonzero().flatten()[:8].tolist()}, most by "
                                             f"{float((got - want).abs().max())}")
        for table in tables:
            table.pool.close()


# -- training on the GPU, killed -------------------------------------------------------------------
GPU_CONFIG = dataclasses.replace(TRIAL_CONFIG, device="cuda")
GPU_ARGS = ["--batch-size", "64", "--num-tables", "2", "--rows", "3000", "--dim", "8", "--seed", "3",
            "--device", "cuda", "--no-progress"]


@pytest.fixture(scope="module")
def gpu_refs():
    with shm_tempdir("cxltrain-gpu-ref-") as folder:
        yield references(GPU_CONFIG, folder)


def killed_run(pool: str, crash_at: str, fault: str = "") -> None:
    cmd = [*cxltrain_command(), "train", "--pool", pool, "--steps", str(GPU_CONFIG.steps), *GPU_ARGS]
    done = run_and_kill(cmd, env={CRASH_ENV: crash_at, FAULT_ENV: fault})
    assert done.returncode != 0, f"{crash_at} was never reached:\n{done.stderr[-2000:]}"


def test_train_on_the_gpu_runs_and_resumes_to_the_same_pool(shm_dir, gpu_refs):
    done = cxltrain("train", "--pool", shm_dir / "p.pool", "--steps", 4, *GPU_ARGS, "--json")
    assert done.returncode == 0, done.stderr
    _, problems = check_recovery(str(shm_dir / "p.pool"), gpu_refs, GPU_CONFIG)
    assert problems == []


# between the capture and the update; mid-update; between the rows' copy and the commit
CRASH_POINTS = [f"{CrashPoint.UNDO_BETWEEN_HEADER_AND_UPDATE}:7", f"{CrashPoint.UPDATE_MID}:9",
                f"{CrashPoint.COMMIT_BETWEEN_ROWS_AND_SNAPSHOT}:4", f"{CrashPoint.COMMIT_BEFORE_ROOT}:5"]


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_sigkill_on_the_gpu_path_recovers_bit_exactly(shm_dir, gpu_refs, crash_at):
    pool = str(shm_dir / "p.pool")
    killed_run(pool, crash_at)
    batch, problems = check_recovery(pool, gpu_refs, GPU_CONFIG)
    assert batch is not None and problems == []


def test_update_before_the_capture_is_caught(shm_dir, gpu_refs):
    """The planted bug: the update kernel runs before the rows' undo record is taken and persisted,
    so the record holds the new values and recovery cannot roll the batch back."""
    pool = str(shm_dir / "p.pool")
    killed_run(pool, f"{CrashPoint.COMMIT_BEFORE_ROOT}:5", PlantedDevice.DEVICE_UPDATE_BEFORE_CAPTURE)
    _, problems = check_recovery(pool, gpu_refs, GPU_CONFIG)
    assert problems, "the planted U1 bug went unnoticed"
