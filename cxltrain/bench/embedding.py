"""Embedding lookup + update throughput: F tables of R x D, the batches `cxltrain train` uses
(B samples, L ids per table per sample), each step a pooled lookup [B, D] per table, a backward
with a fixed gradient, and the optimizer update of the rows it touched.

Contenders (each with a plain SGD and an Adagrad flavour):
    ours     PersistentEmbeddingBag on pool tables, fused SGD / row-wise Adagrad (cxltrain.tables.optim)
    torch    nn.EmbeddingBag(sparse=True) in DRAM + torch.optim.SGD / torch.optim.Adagrad
             (torch's Adagrad keeps one accumulator per element, [R, D], not per row)
    torchrec torchrec FusedEmbeddingBagCollection on the CPU, FBGEMM's table-batched kernels with the
             optimizer fused into backward: EXACT_SGD / EXACT_ROWWISE_ADAGRAD (optional extra)
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn

from ..jobs.config import TrainConfig
from ..jobs.train import build_source
from ..knobs import KNOBS
from ..pool.format import pool_size_for
from ..pool.handle import Pool
from ..tables.bag import PersistentEmbeddingBag
from ..tables.optim import SGD, RowWiseAdagrad
from .plain import remove
from .records import EmbeddingTiming

OPTIMIZERS = ("sgd", "adagrad")
TORCHREC_INSTALL = "make bench-extras (pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 and their deps)"


def torchrec_missing() -> str | None:
    """Why torchrec's fused tables cannot run here, or None."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers the CPU kernels torchrec calls)
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except Exception as e:  # a broken install raises more than ImportError
        return f"not installed ({type(e).__name__}: {str(e).splitlines()[0][:80]}); install: {TORCHREC_INSTALL}"
    return None


def measure(contender: str, optimizer: str, config: TrainConfig, *, pool_path: str, warmup: int,
            timed: int) -> EmbeddingTiming:
    """Median ms of one lookup + backward + update over all F tables, and lookups per second."""
    source = build_source(config)
    batches = [source.batch(b) for b in range(min(warmup + timed, 8))]  # data generation stays out
    grad = torch.randn(config.batch_size, config.dim, generator=torch.Generator().manual_seed(config.seed))
    step, close = _BUILDERS[contender](config, optimizer, pool_path)
    try:
        times = []
        for i in range(warmup + timed):
            batch = batches[i % len(batches)]
            started = time.perf_counter()
            step(batch, grad)
            if i >= warmup:
                times.append((time.perf_counter() - started) * 1000)
    finally:
        close()
    ms = statistics.median(times)
    lookups = config.batch_size * config.pooling * config.num_tables
    return EmbeddingTiming(ms=ms, mlookups_per_s=lookups / ms / 1000)


def _ours(config: TrainConfig, optimizer: str, pool_path: str):
    sparse = SGD(config.sparse_lr) if optimizer == "sgd" else RowWiseAdagrad(config.sparse_lr)
    tables = [PersistentEmbeddingBag(config.rows, config.dim, name=f"t{i}", mode="sum", optimizer=sparse,
                                     seed=config.seed + i)
              for i in range(config.num_tables)]
    specs = [spec for t in tables for spec in t.region_specs()]
    size = pool_size_for([s.nbytes(KNOBS.row_align) for s in specs], KNOBS.dir_capacity, KNOBS.region_align)
    remove(pool_path)
    pool = Pool.create(pool_path, size)
    for table in tables:
        table.attach(pool)

    def step(batch, grad):
        for table, values, offsets in zip(tables, batch.values, batch.offsets):
            table(values, offsets).backward(grad)  # rows updated in place, in the pool

    def close():
        pool.close()
        remove(pool_path)

    return step, close


def _torch(config: TrainConfig, optimizer: str, pool_path: str):
    tables = [nn.EmbeddingBag(config.rows, config.dim, mode="sum", sparse=True) for _ in range(config.num_tables)]
    params = [t.weight for t in tables]
    opt = torch.optim.SGD(params, lr=config.sparse_lr) if optimizer == "sgd" else \
        torch.optim.Adagrad(params, lr=config.sparse_lr)

    def step(batch, grad):
        for table, values, offsets in zip(tables, batch.values, batch.offsets):
            table(values, offsets).backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: None


def _torchrec(config: TrainConfig, optimizer: str, pool_path: str):
    import fbgemm_gpu  # noqa: F401
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad

    names = [f"f{i}" for i in range(config.num_tables)]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=config.dim, num_embeddings=config.rows,
                                 feature_names=[name]) for i, name in enumerate(names)]
    opt_type = torch.optim.SGD if optimizer == "sgd" else TorchrecRowWiseAdagrad
    ebc = FusedEmbeddingBagCollection(tables=tables, optimizer_type=opt_type,
                                      optimizer_kwargs={"lr": config.sparse_lr})

    def step(batch, grad):
        lengths = torch.cat([torch.diff(o, append=o.new_tensor([v.numel()])) for v, o in zip(batch.values, batch.offsets)])
        features = KeyedJaggedTensor(keys=names, values=torch.cat(batch.values), lengths=lengths)
        pooled = ebc(features).values()                 # [B, F*D]
        pooled.backward(grad.repeat(1, len(names)))     # the optimizer runs inside backward

    return step, lambda: None


_BUILDERS: dict[str, Callable] = {"ours": _ours, "torch": _torch, "torchrec": _torchrec}
CONTENDERS = tuple(_BUILDERS)
