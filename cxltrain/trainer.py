"""The main job: DLRM on deterministic synthetic Criteo-like data, tables in a persistent pool.

    result = train(TrainConfig(steps=200, rows=100_000))
    print(result.steps_per_s, result.eval_auc)

Without the checkpointer, the pool holds the tables as of the last batch once `train` returns
(every table region persisted, then a root committed with `batch` = batches done); a run that dies
part-way leaves tables with some batches' updates and no dense state to match. Running again on an
existing pool of the same shape therefore starts over from batch 0.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
from tqdm import tqdm

from .data import CriteoFile, SyntheticCriteo
from .data.batch import BatchSource
from .config import TrainConfig
from .errors import ConfigError, PoolError
from .knobs import KNOBS
from .metrics import logloss, roc_auc
from .models import DLRM
from .optim import RowWiseAdagrad
from .pool import Pool
from .pool_format import pool_size_for

# Held-out evaluation batches are drawn far past any training batch index.
EVAL_FIRST_BATCH = 1 << 40
EVAL_BATCHES = 4
# Batches at the start left out of the per-step time breakdown (first-touch page faults, warm-up).
WARMUP_STEPS = 5
# Extra pool space beyond the tables, for the regions the checkpointer adds later (undo ring,
# dense snapshot slots).
POOL_HEADROOM = 64 << 20


@dataclasses.dataclass
class StepSplit:
    """Mean milliseconds per step, after warm-up."""

    data: float
    embedding_forward: float
    embedding_backward_update: float
    mlp: float                         # MLP forward + backward + dense optimizer, and the rest
    total: float


@dataclasses.dataclass
class TrainResult:
    pool: str
    device: str
    batch: int                         # batches whose updates are in the pool's state
    steps: int                         # batches run by this invocation
    seconds: float                     # the training loop only
    steps_per_s: float
    first_loss: float
    final_loss: float                  # mean over the last 10% of batches
    train_auc: float                   # over the last 10% of batches
    eval_auc: float | None             # held-out batches, after training (None: a file with none left)
    eval_logloss: float | None
    rows_updated_per_batch: float      # unique rows written per batch, all tables
    split_ms: StepSplit
    restarted: bool                    # the pool held these tables already, and training started over

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def build_model(config: TrainConfig) -> DLRM:
    return DLRM(embedding_rows=[config.rows] * config.num_tables, embedding_dim=config.dim,
                bottom_mlp=config.bottom_mlp, top_mlp=config.top_mlp,
                sparse_optimizer=RowWiseAdagrad(lr=config.sparse_lr), seed=config.seed)


def build_source(config: TrainConfig) -> BatchSource:
    """The synthetic source, or the raw Criteo file named by `config.data` (which must hold
    at least `steps` batches)."""
    if config.data is None:
        return SyntheticCriteo(num_tables=config.num_tables, rows=config.rows, batch_size=config.batch_size,
                               seed=config.seed, pooling=config.pooling, zipf_exponent=config.zipf_exponent)
    source = CriteoFile(config.data, batch_size=config.batch_size, rows=config.rows,
                        num_tables=config.num_tables, seed=config.seed)
    if source.num_batches < config.steps:
        raise ConfigError(f"{config.data}: holds {source.num_batches} batches of {config.batch_size}, "
                          f"fewer than --steps {config.steps}")
    return source


def heldout_batches(source: BatchSource, steps: int) -> range:
    """Batches no training step saw: far past the run for endless sources, after it for files."""
    if source.num_batches is None:
        return range(EVAL_FIRST_BATCH, EVAL_FIRST_BATCH + EVAL_BATCHES)
    return range(steps, min(steps + EVAL_BATCHES, source.num_batches))


def pool_bytes(model: DLRM) -> int:
    """Size of the pool `train` creates for `model`: its tables plus headroom."""
    sizes = [spec.nbytes(KNOBS.row_align) for table in model.tables for spec in table.region_specs()]
    return pool_size_for(sizes, KNOBS.dir_capacity, KNOBS.region_align) + POOL_HEADROOM


def open_or_create_pool(path: str, model: DLRM) -> tuple[Pool, bool]:
    """(pool with the model's tables attached and initialised, whether it held them already)."""
    if os.path.exists(path):
        pool = Pool.open(path)
        try:
            try:
                restarted = not model.attach(pool)
            except (PoolError, ConfigError) as e:
                raise type(e)(f"{e} (a pool holds one model: pass another --pool, or delete this one)") from None
            if restarted:  # the tables were there, but no dense state to resume from: start over
                pool.commit(batch=-1)  # ORDERING: the root stops vouching for the tables before they change
                for table in model.tables:
                    table.reset_parameters()
                    table.persist()
            pool.commit(batch=0)  # ORDERING: initial tables durable before the root says batch 0
        except BaseException:
            pool.close()
            raise
        return pool, restarted
    pool = Pool.create(path, pool_bytes(model))
    try:
        model.attach(pool)
        pool.commit(batch=0)  # ORDERING: tables initialised and persisted (attach) before the root says so
    except BaseException:
        pool.close()
        os.unlink(path)  # never leave a half-built pool behind
        raise
    return pool, False


def train(config: TrainConfig, *, pool_path: str, progress: bool = True) -> TrainResult:
    """Run `config.steps` batches; returns what the run did and measured."""
    config.validate()
    KNOBS.validate()
    torch.set_num_threads(KNOBS.threads)
    source = build_source(config)  # first: a bad data file is refused before any pool is touched
    model = build_model(config)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)
    pool, restarted = open_or_create_pool(pool_path, model)
    try:
        return _run(config, model, source, dense_opt, pool, restarted, progress)
    finally:
        pool.close()


def _run(config, model, source, dense_opt, pool, restarted, progress) -> TrainResult:
    tail = max(1, config.steps // 10)
    losses: list[float] = []
    tail_logits, tail_labels = [], []
    timing = {"data": 0.0, "emb_fwd": 0.0, "emb_upd": 0.0, "total": 0.0}
    # ORDERING: the root stops vouching for the tables before the first in-place update (nothing
    # could roll the rows back to batch 0 after a crash)
    pool.commit(batch=-1)
    # disable=None: tqdm shows the bar on a terminal and stays quiet in logs and pipes
    bar = tqdm(total=config.steps, desc="train", unit="batch", disable=None if progress else True, file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5)
    loop_start = time.perf_counter()
    for b in range(config.steps):
        step_start = time.perf_counter()
        batch = source.batch(b)
        data_done = time.perf_counter()
        emb_fwd_before = model.embedding_forward_seconds
        emb_upd_before = sum(t.stats.update_seconds for t in model.tables)
        logits = model(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()  # embedding rows are updated in place in the pool here
        dense_opt.step()
        dense_opt.zero_grad(set_to_none=True)
        step_end = time.perf_counter()
        if b >= WARMUP_STEPS or config.steps <= WARMUP_STEPS:
            timing["data"] += data_done - step_start
            timing["emb_fwd"] += model.embedding_forward_seconds - emb_fwd_before
            timing["emb_upd"] += sum(t.stats.update_seconds for t in model.tables) - emb_upd_before
            timing["total"] += step_end - step_start
        losses.append(loss.item())
        if b >= config.steps - tail:
            tail_logits.append(logits.detach())
            tail_labels.append(batch.labels)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    seconds = time.perf_counter() - loop_start
    bar.close()

    for table in model.tables:
        table.persist()
    pool.commit(batch=config.steps)  # ORDERING: the final tables are durable before the root says so

    eval_auc, eval_loss = evaluate(model, source, heldout_batches(source, config.steps))
    timed = config.steps - WARMUP_STEPS if config.steps > WARMUP_STEPS else config.steps
    ms = {k: v * 1000 / timed for k, v in timing.items()}
    split = StepSplit(data=ms["data"], embedding_forward=ms["emb_fwd"], embedding_backward_update=ms["emb_upd"],
                      mlp=ms["total"] - ms["data"] - ms["emb_fwd"] - ms["emb_upd"], total=ms["total"])
    rows_updated = sum(t.stats.rows_updated for t in model.tables) / config.steps
    return TrainResult(pool=pool.path, device=pool.device.kind, batch=config.steps, steps=config.steps,
                       seconds=seconds, steps_per_s=config.steps / seconds, first_loss=losses[0],
                       final_loss=sum(losses[-tail:]) / tail,
                       train_auc=roc_auc(torch.cat(tail_logits), torch.cat(tail_labels)),
                       eval_auc=eval_auc, eval_logloss=eval_loss, rows_updated_per_batch=rows_updated,
                       split_ms=split, restarted=restarted)


def evaluate(model: DLRM, source: BatchSource, indices: range) -> tuple[float | None, float | None]:
    """(AUC, log loss) on the given batches; reads the tables, writes nothing. (None, None) if none."""
    if not indices:
        return None, None
    logits, labels = [], []
    with torch.no_grad():
        for b in indices:
            batch = source.batch(b)
            logits.append(model(batch))
            labels.append(batch.labels)
    logits_all, labels_all = torch.cat(logits), torch.cat(labels)
    return roc_auc(logits_all, labels_all), logloss(logits_all, labels_all)
