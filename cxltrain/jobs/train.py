"""The main job: DLRM on deterministic synthetic Criteo-like data, tables in a persistent pool.

    result = train(TrainConfig(steps=200, rows=100_000))
    print(result.timings.steps_per_s, result.quality.eval_auc)

The training loop (run_steps) is the one loop of every run: it drives a step, a LocalStep here (the
whole batch through the DLRM) or a sharded step (sharded_train.py: one rank's slice, the exchange),
and does the rest alike: progress, metrics, warm-up, timing, evaluation and the TrainResult.

The loop runs inside a `cxltrain.Runtime`: with `checkpoint="undo"` (the default) every batch is
durable, and running again on the same pool after a crash recovers the last committed batch and
resumes from there, bit for bit. With `checkpoint="off"` the pool is made consistent only when the
run ends normally; a run that dies part-way starts over from batch 0 the next time.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Callable

import torch
from tqdm import tqdm

from ..data.batch import BatchSource
from ..data.prefetch import Prefetcher
from ..devices import DeviceCounters
from ..devices.gpu_mapping import gpu_problem
from ..errors import ConfigError, NonFiniteError, TrainingStopped
from ..kernels.cpu_threads import set_cpu_threads
from ..knobs import KNOBS
from ..models import DLRM
from ..models.metrics import logloss, roc_auc
from ..runtime.runtime import Runtime
from ..tables.optim import RowWiseAdagrad
from .config import TrainConfig
from .data_source import TrainingData, training_data
from .metrics_log import STATE_KEY, MetricsLog, check_metrics_path, check_new_run, check_own_run
from .planning import device_cache_ids, plan_and_hot_rows
from .resume import record_lr_changes

# Batches at the start left out of the per-step time breakdown (first-touch page faults, warm-up,
# DDP's bucket rebuild).
WARMUP_STEPS = 5


@dataclasses.dataclass
class StepSplit:
    """Mean milliseconds per step, after warm-up."""

    data: float
    embedding_forward: float
    embedding_backward_update: float
    checkpoint: float                  # the training thread's share of checkpointing: undo capture,
                                       # commits (inline) or handing them over and waiting (pipelined)
    mlp: float                         # MLP forward + backward + dense optimizer, and the rest
    total: float


@dataclasses.dataclass
class RunProgress:
    """Where the run started and ended, in the pool's batches."""

    batch: int                         # batches whose updates are in the pool's state
    steps: int                         # batches run by this invocation
    start_batch: int                   # the first of them (0 unless the pool was recovered)
    restarted: bool                    # the pool held the tables but no committed checkpoint: started over
    recovered_batch: int | None        # the batch recovery rolled the pool back to (None: a fresh pool)
    recovery_seconds: float


@dataclasses.dataclass
class RunTimings:
    seconds: float                     # the training loop only
    steps_per_s: float
    split_ms: StepSplit


@dataclasses.dataclass
class ModelQuality:
    first_loss: float | None           # None: nothing left to train (the pool was at --steps already)
    final_loss: float | None           # mean over the last 10% of batches
    train_auc: float | None            # over the last 10% of batches
    eval_auc: float | None             # held-out batches, after training (None: a file with none left)
    eval_logloss: float | None


@dataclasses.dataclass
class CheckpointSummary:
    method: str                        # "undo" or "off"
    mode: str                          # "strict" or "relaxed"
    pipeline: bool                     # commits on a background worker
    background_capture: bool           # undo captures on the worker too
    stats: dict | None                 # CheckpointStats.to_json() of this run (None with checkpoint "off")


@dataclasses.dataclass
class PoolUse:
    """The pool, its device, and what the run did to them."""

    path: str
    device: str                        # the device kind
    rows_updated_per_batch: float      # unique rows written per batch, all tables
    device_model: str | None = None    # what the emulated device modelled (power loss, domain, write-back)
    cost_model: dict | None = None     # per batch: pool traffic and what it would take on each memory preset
    early_writebacks: int | None = None  # lines the emulated device's evictor wrote back early (None: no evictor)
    compute_device: str = "cpu"        # where the MLPs, lookups and updates ran (docs/gpu.md)
    device_cached_rows: int = 0        # rows of all tables held in the GPU's hot-row cache
    tiers: TierUse | None = None       # a pool set's capacity tier and caches (None: one pool)


@dataclasses.dataclass
class TierUse:
    """What a run on a pool set did with its capacity tier (docs/tiers.md)."""

    capacity_pool: str
    capacity_tables: list[str]         # the tables whose rows live there
    cache_rows: dict[str, int]         # table -> hot rows cached in the fast tier (cached tables only)
    cache_hit_rate: float | None       # the caches' share of their tables' lookups (None: no cache)
    disk_bytes_written_per_batch: float  # this process's writes to storage (/proc/self/io): the capacity tier's
    disk_bytes_read_per_batch: float
    miss_lookups_per_batch: float = 0.0  # the capacity tables' lookups their caches did not serve
    write_back_every: int = 1          # the interval the set ran with (docs/tiers.md, Steal, no force)
    # of the bytes written, those the commits waited to have synced, over the batches so far (None:
    # the disk's count unknown, or no checkpoint)
    disk_bytes_forced_per_batch: float | None = None


@dataclasses.dataclass
class GroupFacts:
    """What only a run of several ranks has (this rank's view; None for one process)."""

    rank: int
    world_size: int
    dir: str                           # the run's directory (one pool per rank, the manifest)
    bytes_exchanged_per_batch: float | None  # every rank's sends to the others, timed batches (None: none timed)
    bytes_sent_per_batch: float        # this rank's sends to the others, every batch
    replicated_rows: int = 0           # hot rows copied on every rank at the end (docs/distributed.md)
    predicted_bytes_per_batch: float | None = None  # the cost model's bytes_exchanged_per_batch (None: off)


@dataclasses.dataclass
class TrainResult:
    """What a training run did and measured, grouped; `to_json()` is the flat `cxltrain train
    --json`, one schema for one process and for a rank of many (`group` None for one process)."""

    pool: PoolUse
    progress: RunProgress
    timings: RunTimings
    quality: ModelQuality
    checkpoint: CheckpointSummary
    group: GroupFacts | None = None

    def to_json(self) -> dict:
        """The flat layout `--json` prints: the keys a single process has always printed, in
        their order, then "group" (null for one process; see docs/distributed.md)."""
        pool, progress, timings, quality, checkpoint = (self.pool, self.progress, self.timings, self.quality,
                                                         self.checkpoint)
        return {"pool": pool.path, "device": pool.device, "batch": progress.batch, "steps": progress.steps,
                "start_batch": progress.start_batch, "seconds": timings.seconds, "steps_per_s": timings.steps_per_s,
                "first_loss": quality.first_loss, "final_loss": quality.final_loss, "train_auc": quality.train_auc,
                "eval_auc": quality.eval_auc, "eval_logloss": quality.eval_logloss,
                "rows_updated_per_batch": pool.rows_updated_per_batch, "split_ms": dataclasses.asdict(timings.split_ms),
                "restarted": progress.restarted, "checkpoint": checkpoint.method, "mode": checkpoint.mode,
                "pipeline": checkpoint.pipeline, "background_capture": checkpoint.background_capture,
                "recovered_batch": progress.recovered_batch, "recovery_seconds": progress.recovery_seconds,
                "checkpoint_stats": checkpoint.stats, "device_model": pool.device_model,
                "cost_model": pool.cost_model, "early_writebacks": pool.early_writebacks,
                "compute_device": pool.compute_device, "device_cached_rows": pool.device_cached_rows,
                "tiers": None if pool.tiers is None else dataclasses.asdict(pool.tiers),
                "group": None if self.group is None else dataclasses.asdict(self.group)}


def build_model(config: TrainConfig) -> DLRM:
    return DLRM(embedding_rows=list(config.rows_per_table()), embedding_dim=config.dim,
                bottom_mlp=config.bottom_mlp, top_mlp=config.top_mlp,
                sparse_optimizer=RowWiseAdagrad(lr=config.sparse_lr), seed=config.seed)


def build_source(config: TrainConfig) -> BatchSource:
    """The batches a run with `config` trains on (training_data.py: synthetic, or file data)."""
    return training_data(config).train


def dense_optimizer(config: TrainConfig, parameters) -> torch.optim.Optimizer:
    """The MLPs' optimizer `config.optimizer` names, at config.dense_lr."""
    kind = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[config.optimizer]
    return kind(parameters, lr=config.dense_lr)


def make_runtime(config: TrainConfig, model: DLRM, dense_opt, pool_path: str,
                 source: BatchSource | None = None, *, rank_hot_rows: bool = True) -> Runtime:
    """The Runtime of a `train` run: its metadata the trajectory settings (checked on resume) and the
    remembered ones (`settings`, which a resume may change, as it may the learning rates).
    rank_hot_rows=False: a Runtime to size a pool with, whose caches' lists are placeholders."""
    metadata = {**config.run_metadata(getattr(source, "fingerprint", None)), "settings": config.run_settings()}
    if source is None and config.capacity_pool is not None:
        source = build_source(config)  # profiled to plan a new pool set
    plan, hot_rows = plan_and_hot_rows(config, model, source, pool_path, rank_hot_rows=rank_hot_rows)
    return Runtime(pool_path, model, dense_opt, checkpoint=config.checkpoint, dense_every=config.dense_every,
                   mode=config.mode, pipeline=config.pipeline,
                   background_capture=config.background_capture, fused_capture=config.fused_capture,
                   metadata=metadata,
                   rows_per_batch=config.batch_size * config.pooling, discard_checkpoint=config.discard_checkpoint,
                   capacity_pool=config.capacity_pool,
                   prefetch_ids=lambda batch: {t.name: v for t, v in zip(model.tables, batch.values)}, plan=plan,
                   hot_rows=hot_rows, cache_replace_every=config.cache_replace_every,
                   write_back_every=config.write_back_every,
                   mutable_metadata=TrainConfig.MUTABLE_METADATA, keep_given_lr=True)


def pool_bytes(config: TrainConfig) -> int:
    """Size of the pool `train` creates for `config`: tables, undo ring, dense snapshot slots."""
    return make_runtime(config, build_model(config), None, "", rank_hot_rows=False).pool_bytes()


def train(config: TrainConfig, *, pool_path: str, progress: bool = True,
          on_ready: Callable[[Runtime], None] | None = None, stop: threading.Event | None = None) -> TrainResult:
    """Run batches up to `config.steps` (resuming a pool after its last committed batch); returns
    what the run did and measured. `on_ready(rt)` is called once the pool is open (and recovered),
    before the first batch. A NaN or inf loss or table gradient stops the run with NonFiniteError
    before that batch is committed; the pool keeps the previous commit. Setting `stop` ends the run
    at the next batch boundary, with the batches done committed: TrainingStopped says which."""
    config.validate()
    KNOBS.validate()
    set_cpu_threads(KNOBS.threads)
    check_metrics_path(config.metrics)  # written only once the pool is open: checked before it is
    data = training_data(config)  # first: a bad data file is refused before any pool is touched
    if data.steps != config.steps:  # --epochs: the steps are the epochs' batches
        config = dataclasses.replace(config, steps=data.steps)
    source = data.train
    device = compute_device(config.device)
    model = build_model(config).to(device)  # the MLPs (before their optimizer, and before a restore fills them)
    dense_opt = dense_optimizer(config, model.dense_parameters())
    # a metrics file of another run is refused before a new pool is made, or an old one recovered
    if not os.path.exists(pool_path):
        check_new_run(config.metrics)
    else:
        check_own_run(config.metrics, pool_path)
    with make_runtime(config, model, dense_opt, pool_path, source) as rt:
        record_lr_changes(rt, config)
        if device.type != "cpu":  # after recovery: a device cache is filled from the recovered pool
            model.place_tables(device, device_cache_ids(config, model, source, device))
        if on_ready is not None:
            on_ready(rt)
        result = run_steps(config, LocalStep(model, rt.optimizers), data, rt, progress, stop)
    if result is not None and rt.stats is not None:
        # the block's exit made the run's last commit (on a stealing set, its last write-back):
        # counted with the rest; the timings stay the timed batches'
        final = rt.stats
        result.checkpoint.stats.update(commits=final.commits, snapshots=final.snapshots, write_backs=final.write_backs)
    if result is None:  # after the block: its normal exit has committed the batches done
        raise TrainingStopped(f"stopped by SIGTERM at a batch boundary; {rt.path} is committed at batch "
                              f"{rt.batch} (run the same command to resume)")
    return result


def compute_device(name: str) -> torch.device:
    """The device `--device` names: cpu, cuda (refused in one line without a GPU or CuPy), or auto
    (cuda where it would not be refused)."""
    if name == "cpu":
        return torch.device("cpu")
    problem = gpu_problem()
    if problem is not None:
        if name == "auto":
            return torch.device("cpu")
        raise ConfigError(f"--device cuda: {problem}; the GPU path (MLPs, lookups and updates on the GPU, the tables "
                          "in the pool it reads over the link: docs/gpu.md) needs a CUDA build of torch and CuPy "
                          "(the gpu extra)")
    # cuBLAS picks reduction orders by workspace; a fixed one keeps a resumed run bit-identical
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return torch.device("cuda")


def train_step(model: DLRM, batch, optimizers, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on batch `b`: forward, the loss (checked before backward), backward (the tables
    update their rows in place in the pool), the dense optimizers' steps. Returns (logits [B], loss)."""
    logits = model(batch)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.device))
    if not bool(torch.isfinite(loss)):  # before backward: neither tables nor MLPs take a NaN step
        raise NonFiniteError(f"batch {b}: the loss is {loss.item()}; stopped before its backward, and the "
                             "batch is not committed")
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return logits, loss


class LocalStep:
    """The step of one process: the whole batch through the DLRM (train_step)."""

    def __init__(self, model: DLRM, optimizers) -> None:
        self.model, self.optimizers = model, optimizers

    @property
    def tables(self) -> list:
        """The tables this process updates."""
        return self.model.tables

    @property
    def forward_seconds(self) -> float:
        """Wall seconds spent in table lookups so far."""
        return self.model.embedding_forward_seconds

    def __call__(self, batch, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [B], labels [B], loss) of batch `b`, its updates done."""
        logits, loss = train_step(self.model, batch, self.optimizers, b)
        return logits, batch.labels, loss

    def timing_started(self) -> None:
        """The timed batches begin (after the warm-up)."""

    def evaluate(self, source: BatchSource, indices: range) -> tuple[float | None, float | None]:
        return evaluate(self.model, source, indices)

    def group_facts(self, timed_steps: int) -> GroupFacts | None:
        return None


def run_steps(config: TrainConfig, step, data: TrainingData, rt: Runtime, progress: bool,
              stop: threading.Event | None = None) -> TrainResult | None:
    """The training loop: `step` (LocalStep, or sharded_train.ShardedStep) on every batch from
    rt.start_batch to config.steps; None when `stop` ended it early (the batches done are
    committed when the Runtime's block exits)."""
    source = data.train
    first = rt.start_batch
    steps = max(0, config.steps - first)
    tail = max(1, steps // 10)
    losses: list[float] = []
    tail_logits, tail_labels = [], []
    timed_from = first + (WARMUP_STEPS if steps > WARMUP_STEPS else 0)
    clock = _StepClock(step, rt)

    prefetcher = Prefetcher(source, first, config.steps, config.prefetch) if config.prefetch else None
    resumed = rt.resumed_metadata or {}
    metrics = MetricsLog(config.metrics, every=config.eval_every or 10, data=data, run=rt.pool.superblock.uuid.hex(),
                         start_batch=first, resumed=resumed.get(STATE_KEY))

    def fetch(b: int):
        started = time.perf_counter()
        batch = prefetcher.get(b) if prefetcher is not None else source.batch(b)
        if b > timed_from:  # fetched inside the timed window (the window opens at batch timed_from)
            clock.data += time.perf_counter() - started
        return batch

    # disable=None: tqdm shows the bar on a terminal and stays quiet in logs and pipes
    bar = tqdm(total=config.steps, initial=first, desc="train", unit="batch", disable=None if progress else True,
               file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    device = rt.pool.device
    device_before = device.counters.copy()
    io_before = storage_io()
    loop_start = time.perf_counter()
    try:
        for batch in rt.batches(fetch, stop=config.steps):
            if stop is not None and stop.is_set():
                bar.close()
                return None  # before the batch touches anything: the Runtime drops it, commits the rest
            _step(config, step, data, rt, batch, clock, timed_from, tail, losses, tail_logits, tail_labels, metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    finally:
        if prefetcher is not None:
            prefetcher.close()
        metrics.close()
    split = clock.stop(config.steps - timed_from)  # the generator has committed the last batch
    seconds = time.perf_counter() - loop_start
    device_work = device.counters - device_before
    io = {name: value - io_before.get(name, 0) for name, value in storage_io().items()}
    bar.close()

    eval_auc, eval_loss = step.evaluate(data.evaluation, data.heldout)
    rows_updated = sum(t.stats.rows_updated for t in step.tables) / steps if steps else 0.0
    stats = rt.stats
    return TrainResult(
        pool=PoolUse(path=rt.path, device=device.kind, rows_updated_per_batch=rows_updated,
                     device_model=device.model, cost_model=modelled_costs(step.tables, rt, steps, device_work),
                     early_writebacks=None if device.evictor is None else device.evictor.lines_written,
                     tiers=_tier_facts(rt, steps, io), **_compute_facts(step.tables)),
        progress=RunProgress(batch=rt.batch, steps=steps, start_batch=first, restarted=rt.restarted,
                             recovered_batch=rt.recovered_batch, recovery_seconds=rt.recovery_seconds),
        timings=RunTimings(seconds=seconds, steps_per_s=steps / seconds if steps else 0.0, split_ms=split),
        quality=ModelQuality(first_loss=losses[0] if losses else None,
                             final_loss=sum(losses[-tail:]) / tail if losses else None,
                             train_auc=roc_auc(torch.cat(tail_logits), torch.cat(tail_labels)) if losses else None,
                             eval_auc=eval_auc, eval_logloss=eval_loss),
        checkpoint=CheckpointSummary(method=config.checkpoint, mode=config.mode, pipeline=config.pipeline,
                                     background_capture=config.background_capture and config.pipeline,
                                     stats=None if stats is None else stats.to_json()),
        group=step.group_facts(config.steps - timed_from))


def storage_io() -> dict[str, int]:
    """This process's bytes read from and written to storage so far ({} where /proc has no io file)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
    return {name: int(fields[name]) for name in ("read_bytes", "write_bytes") if name in fields}


def _tier_facts(rt: Runtime, steps: int, io: dict[str, int]) -> TierUse | None:
    """The capacity tier's part in the run, or None for a run on one pool."""
    if rt.tiers.capacity_path is None:
        return None
    caches = rt.cache_stats
    lookups = sum(s.lookups for s in caches.values())
    per_batch = max(steps, 1)
    options = rt.checkpoint_options
    # lookups per batch of each capacity table (its updates'), times the share its cache missed
    misses = sum(t.stats.lookups / t.stats.updates * (1 - (caches[t.name].hit_rate if t.name in caches else 0.0))
                 for t in rt.tables.values() if t.name in rt.tiers.capacity_tables and t.stats.updates)
    return TierUse(capacity_pool=rt.tiers.capacity_path, capacity_tables=sorted(rt.tiers.capacity_tables),
                   cache_rows=rt.cache_rows,
                   cache_hit_rate=sum(s.hits for s in caches.values()) / lookups if lookups else None,
                   disk_bytes_written_per_batch=io.get("write_bytes", 0) / per_batch,
                   disk_bytes_read_per_batch=io.get("read_bytes", 0) / per_batch, miss_lookups_per_batch=misses,
                   write_back_every=1 if options.captures_on_worker else options.write_back_every,
                   disk_bytes_forced_per_batch=_forced_per_batch(rt.stats))


def _forced_per_batch(stats) -> float | None:
    """The capacity bytes the commits have waited to have synced, per batch ended so far."""
    if stats is None or stats.capacity_forced_bytes is None:
        return None
    return stats.capacity_forced_bytes / max(stats.batches, 1)


def _compute_facts(tables: list) -> dict:
    """Where the tables' lookups and updates ran, and how many rows the device cached."""
    placed = [t.device_rows for t in tables if getattr(t, "device_rows", None) is not None]
    if not placed:
        return {}
    return {"compute_device": str(placed[0].device), "device_cached_rows": sum(rows.cached for rows in placed)}


def _step(config: TrainConfig, step, data: TrainingData, rt: Runtime, batch, clock, timed_from: int,
          tail: int, losses: list, tail_logits: list, tail_labels: list, metrics: MetricsLog) -> None:
    """One training step of the loop, and what it records; every eval_every steps, an evaluation."""
    b = rt.batch
    if b == timed_from:
        clock.start()
        step.timing_started()
    logits, labels, loss = step(batch, b)
    losses.append(loss.item())
    if b >= config.steps - tail:
        tail_logits.append(logits.detach().cpu())
        tail_labels.append(labels)
    evaluated = None
    if config.eval_every and (b + 1) % config.eval_every == 0:
        evaluated = step.evaluate(data.evaluation, data.heldout)   # reads the tables, writes nothing
    metrics.step(b, losses[-1], evaluated)
    rt.update_metadata(**{STATE_KEY: metrics.state(b + 1)})  # committed with batch b: a resume goes on from it


class _StepClock:
    """Splits the wall time of the timed batches: data, embedding lookups, embedding updates,
    checkpointing (undo capture + commits), and the rest (MLPs, dense optimizer)."""

    def __init__(self, step, rt: Runtime) -> None:
        self.step, self.rt = step, rt
        self.data = 0.0
        self.started: float | None = None

    def _totals(self) -> tuple[float, ...]:
        stats = self.rt.stats
        return (self.step.forward_seconds, sum(t.stats.update_seconds for t in self.step.tables),
                *((stats.training_lookup_seconds,
                   stats.training_capture_seconds + stats.capture_wait_seconds + stats.training_flush_seconds,
                   stats.training_boundary_seconds) if stats else (0.0, 0.0, 0.0)))

    def start(self) -> None:
        self.started = time.perf_counter()
        self.before = self._totals()

    def stop(self, timed_steps: int) -> StepSplit:
        if self.started is None or timed_steps <= 0:
            return StepSplit(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        total = time.perf_counter() - self.started
        emb_fwd, emb_upd, lookup, capture, boundary = (a - b for a, b in zip(self._totals(), self.before))
        ms = 1000.0 / timed_steps
        # the checkpointer's time inside the table lookups (handing captures over) and updates
        # (capturing, or waiting for the worker's capture) counts as checkpointing; its time at
        # batch ends is outside both
        return StepSplit(data=self.data * ms, embedding_forward=(emb_fwd - lookup) * ms,
                         embedding_backward_update=(emb_upd - capture) * ms,
                         checkpoint=(lookup + capture + boundary) * ms,
                         mlp=(total - self.data - emb_fwd - emb_upd - boundary) * ms, total=total * ms)


def traffic_per_batch(tables: list, rt: Runtime, steps: int, device_work: DeviceCounters):
    """What one batch of this run did to the pool, on average (emulation.costmodel.AccessCounts):
    lookups and undo captures read rows, updates write them (the tables count both); the device
    counted the flushes, fences and bytes persisted (`device_work`, over the run's batches); the
    checkpointer counted the undo records and dense snapshots appended."""
    from ..emulation.costmodel import AccessCounts

    stats = rt.stats
    gather_rows = gather_bytes = write_rows = write_bytes = 0
    for table in tables:
        weights = rt.pool.region(table.weight_region)
        state_stride = rt.pool.region(table.state_region).row_stride if table.optimizer.state_columns else 0
        row_bytes = table.embedding_dim * 4
        captured = table.stats.rows_updated if stats is not None else 0
        gather_rows += table.stats.lookups + captured
        gather_bytes += table.stats.lookups * row_bytes + captured * (weights.row_stride + state_stride)
        write_rows += table.stats.rows_updated
        write_bytes += table.stats.rows_updated * (row_bytes + table.optimizer.state_columns * 4)
    log_bytes = stats.undo_bytes + stats.dense_bytes if stats is not None else 0
    totals = dict(gather_bytes=gather_bytes, gather_rows=gather_rows, write_bytes=write_bytes, write_rows=write_rows,
                  persist_bytes=device_work.persisted_bytes, flush_calls=device_work.flushes,
                  drains=device_work.drains, log_bytes=log_bytes)
    return AccessCounts(**{name: round(value / steps) for name, value in totals.items()})


def modelled_costs(tables: list, rt: Runtime, steps: int, device_work: DeviceCounters) -> dict | None:
    """Per batch: the run's pool traffic (`tables`: the ones this process updates) and the time it
    would take on each memory preset (ms)."""
    if not steps:
        return None
    from ..emulation.costmodel import PRESETS, estimate

    counts = traffic_per_batch(tables, rt, steps, device_work)
    return {"counts": counts.to_json(),
            "ms_per_batch": {name: estimate(counts, preset).total_s * 1e3 for name, preset in PRESETS.items()}}


def evaluate(model: DLRM, source: BatchSource, indices: range) -> tuple[float | None, float | None]:
    """(AUC, log loss) on the given batches; reads the tables, writes nothing. (None, None) if none."""
    if not indices:
        return None, None
    logits, labels = [], []
    with torch.no_grad():
        for b in indices:
            batch = source.batch(b)
            logits.append(model(batch).cpu())
            labels.append(batch.labels)
    logits_all, labels_all = torch.cat(logits), torch.cat(labels)
    return roc_auc(logits_all, labels_all), logloss(logits_all, labels_all)
