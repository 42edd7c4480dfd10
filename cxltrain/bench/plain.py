"""The plain-PyTorch baseline: the same DLRM, data and dense optimizer as `cxltrain train`, with
DRAM nn.EmbeddingBag(sparse=True) tables trained by a torch optimizer, and checkpointed the usual
ways (torch.save, or torch.distributed.checkpoint.async_save, of the full state every k batches).

Shapes as in cxltrain.models.dlrm: B batch, F tables, R rows, D dim.

    model = plain_model(config)                 # DLRM whose tables are nn.EmbeddingBag [R, D]
    sparse_opt = torch.optim.SGD(sparse_parameters(model), lr=config.sparse_lr)
"""

from __future__ import annotations

import os
import shutil
import time

import torch
from torch import nn

from ..jobs.config import TrainConfig
from ..jobs.train import build_source
from ..models import DLRM
from ..tables.optim import SGD
from .records import PlainSteps

SPARSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}


def plain_model(config: TrainConfig, *, initialize: bool = True) -> DLRM:
    """`cxltrain train`'s DLRM (same MLP weights, same initial table values), its tables replaced by
    nn.EmbeddingBag(sparse=True) in DRAM. initialize=False leaves the tables unset (for loading)."""
    model = DLRM(embedding_rows=[config.rows] * config.num_tables, embedding_dim=config.dim,
                 bottom_mlp=config.bottom_mlp, top_mlp=config.top_mlp, sparse_optimizer=SGD(config.sparse_lr),
                 seed=config.seed)
    bags = model.embedding_bag_collection.embedding_bags
    for table in model.tables:
        if initialize:
            table.materialize()  # the same values a pool table starts with
            weight = table.weight
        else:
            weight = torch.empty(config.rows, config.dim)
        bags[table.name] = nn.EmbeddingBag(config.rows, config.dim, mode="sum", sparse=True, _weight=weight)
    return model


def sparse_parameters(model: DLRM) -> list[nn.Parameter]:
    return [table.weight for table in model.tables]


def optimizers(model: DLRM, config: TrainConfig, sparse: str = "sgd") -> list[torch.optim.Optimizer]:
    """[sparse optimizer of the tables, Adam of the MLPs] (Adam as `cxltrain train` uses)."""
    return [SPARSE_OPTIMIZERS[sparse](sparse_parameters(model), lr=config.sparse_lr),
            torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)]


def full_state(model: DLRM, opts: list[torch.optim.Optimizer]) -> dict:
    """What a full checkpoint holds: every parameter and every optimizer's state."""
    return {"model": model.state_dict(), "optimizers": [o.state_dict() for o in opts]}


def dcp_state(model: DLRM, opts: list[torch.optim.Optimizer]) -> dict:
    """The full state in the form torch.distributed.checkpoint saves and loads (fully qualified
    parameter names; optimizer state created if a step has not made it yet)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opts)
    return {"model": model_state, "optimizers": optim_state}


def load_dcp_state(model: DLRM, opts: list[torch.optim.Optimizer], path: str) -> None:
    """Read a dcp_state checkpoint from folder `path` into `model` and `opts`, in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = dcp_state(model, opts)
    dcp.load(state, checkpoint_id=path)
    # not strict: plain SGD keeps no state for the tables, which set_state_dict would call missing
    set_state_dict(model, opts, model_state_dict=state["model"], optim_state_dict=state["optimizers"],
                   options=StateDictOptions(strict=False))


def load_torch_state(model: DLRM, opts: list[torch.optim.Optimizer], path: str) -> None:
    """Read a torch.save'd full_state from `path` into `model` and `opts`."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    for opt, opt_state in zip(opts, state["optimizers"]):
        opt.load_state_dict(opt_state)


def state_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def remove(path: str) -> None:
    """Delete a checkpoint file or DCP folder, if there."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def train_steps(config: TrainConfig, *, save: str, every: int, path: str, warmup: int,
                timed: int, sparse: str = "sgd") -> PlainSteps:
    """Train `warmup + timed` batches, checkpointing with `save` ("none", "torch" or "dcp") to `path`
    every `every` batches of the timed window (every batch of the warm-up too, when every = 1).

    Returns mean_ms: the timed window's wall time per step, checkpoint cost included: with
    timed a multiple of every, the window holds whole periods, its last save at its end, and the
    wait for an asynchronous save still running then counts too; median_ms of the steps;
    state_bytes of a full checkpoint; for dcp, overlap_steps: the most steps one save ran
    behind training (a crash in that time falls back to the checkpoint before).
    """
    import torch.distributed.checkpoint as dcp

    source = build_source(config)
    model = plain_model(config)
    opts = optimizers(model, config, sparse)
    pending, started_at, overlap = None, 0, 0
    step_ms: list[float] = []
    drain_ms = 0.0
    try:
        for b in range(warmup + timed):
            started = time.perf_counter()  # data included, as in `cxltrain train`'s step time
            model.loss(source.batch(b)).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if pending is not None and pending.done():
                overlap, pending = max(overlap, b - started_at), None
            i = b - warmup
            if save != "none" and (i + 1) % every == 0 and (i >= 0 or every == 1):
                if save == "torch":
                    torch.save(full_state(model, opts), path)
                else:
                    if pending is not None:  # one save in flight at a time, as DCP's docs ask
                        pending.result()
                        overlap = max(overlap, b - started_at)
                    pending, started_at = dcp.async_save(dcp_state(model, opts), checkpoint_id=path), b
            if i >= 0:
                step_ms.append((time.perf_counter() - started) * 1000)
        if pending is not None:
            started = time.perf_counter()
            pending.result()
            drain_ms = (time.perf_counter() - started) * 1000
            overlap = max(overlap, warmup + timed - started_at)
    finally:
        remove(path)
    ordered = sorted(step_ms)
    return PlainSteps(mean_ms=(sum(step_ms) + drain_ms) / len(step_ms), median_ms=ordered[len(ordered) // 2],
                      state_bytes=state_bytes(full_state(model, opts)), overlap_steps=overlap)
