"""`cxltrain bench --gpu`'s runs: the plain-PyTorch baseline and cxltrain's placements, each a model of
its own stepping through the same batches, timed side by side in interleaved blocks.

Shape letters as in cxltrain.models.dlrm: B batch, F tables, R rows a table, D dim, L pooling.

A variant is where its tables are and whether every batch is durable:

    torch       nn.EmbeddingBag(R, D, mode="sum", sparse=True) tables on the device, sparse SGD on
                them, Adam on the MLPs (bench/plain.py's model); no pool, no durability
    all         cxltrain, every row held in device memory (cached_ids = arange(R) a table)
    pool        cxltrain, the rows read and written over the link in the mapped pool, no cache
    cache       cxltrain, the pool plus a hot-row cache of two batches' lookups (2 B L rows a table)

cxltrain's variants train with SGD too (not row-wise Adagrad), so both sides do the same arithmetic.
Each cxltrain variant has its own pool and Runtime (checkpoint "undo" for durability on, "off" for
off); all are open at once and interleave(...) times them in turns.

    runs = [TorchRun(config, device, batches), OursRun(config, device, batches, pool, True, {}, stack)]
    timed = interleave(runs, blocks=12, warmup_blocks=2, block_steps=5, sync=sync(device))
    timed.seconds                                                                      # [run][block]
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from ..data.batch import Batch
from ..jobs.config import TrainConfig
from ..jobs.train import make_runtime, train_step
from ..models import DLRM
from ..tables.optim import SGD
from . import plain


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str               # key in the JSON: "torch", "all-on", "pool-off", ...
    tables: str             # "torch", "all", "pool" or "cache" (the module docstring)
    durable: bool | None    # checkpoint "undo" (True) or "off" (False); None: the baseline has no pool

    def label(self, device: torch.device) -> str:
        where = "GPU" if device.type == "cuda" else device.type.upper()
        return {"torch": f"torch, tables in {where}", "all": f"cxltrain, tables in {where}",
                "pool": "cxltrain, pool, no cache", "cache": "cxltrain, pool + 2-batch cache"}[self.tables]


VARIANTS = (Variant("torch", "torch", None),
            *(Variant(f"{tables}-{'on' if durable else 'off'}", tables, durable)
              for tables in ("all", "pool", "cache") for durable in (True, False)))


def sync(device: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work: a block's time must hold its own kernels, no others'."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def on_device(batch: Batch, device: torch.device) -> Batch:
    """The batch's tensors on `device`: nn.EmbeddingBag on a GPU takes ids there (cxltrain's tables
    move them themselves, in their lookup)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return dataclasses.replace(batch, dense=move(batch.dense), values=tuple(move(v) for v in batch.values),
                               offsets=tuple(move(o) for o in batch.offsets), labels=move(batch.labels))


class TorchRun:
    """The baseline: plain.plain_model's DLRM (the same initial values as cxltrain's) on `device`,
    [SGD on the tables, Adam on the MLPs]; it steps through `batches` [steps] from batch 0."""

    def __init__(self, config: TrainConfig, device: torch.device, batches: list[Batch]) -> None:
        self.model = plain.plain_model(config).to(device)
        self.optimizers = plain.optimizers(self.model, config, "sgd")  # after .to: they hold the moved tensors
        self.device, self.batches, self.b = device, batches, 0
        self.loss: torch.Tensor | None = None   # the last step's (every run trains the same trajectory)
        self.cached_rows = None

    def step(self) -> None:
        _, loss = train_step(self.model, on_device(self.batches[self.b], self.device), self.optimizers, self.b)
        self.loss = loss.detach()
        self.b += 1

    def settle(self) -> None:
        """Nothing runs on after a step: no background commits."""

    def counters(self) -> tuple[float, ...] | None:
        return None

    def finish(self) -> None:
        pass


def ours_model(config: TrainConfig) -> DLRM:
    """`cxltrain train`'s DLRM (jobs/train.build_model) with SGD on the tables, as the baseline has."""
    return DLRM(embedding_rows=list(config.rows_per_table()), embedding_dim=config.dim,
                bottom_mlp=config.bottom_mlp, top_mlp=config.top_mlp,
                sparse_optimizer=SGD(lr=config.sparse_lr), seed=config.seed)


class OursRun:
    """A cxltrain variant: its own model on `device`, Adam on the MLPs, its own Runtime on pool file
    `pool` (entered on `stack`, checkpoint "undo" when durable, else "off"), its tables placed on the
    device with `cached_ids` ({table: ids [C]}; {} no cache). It drives rt.batches(batches) by hand."""

    def __init__(self, config: TrainConfig, device: torch.device, batches: list[Batch], pool: str,
                 durable: bool, cached_ids: dict, stack) -> None:
        config = dataclasses.replace(config, checkpoint="undo" if durable else "off")
        self.model = ours_model(config).to(device)  # the MLPs, before their optimizer takes them
        dense_opt = torch.optim.Adam(self.model.dense_parameters(), lr=config.dense_lr)
        self.rt = stack.enter_context(make_runtime(config, self.model, dense_opt, pool))
        # after the pool is open (the rows exist): a cache is filled from the pool as it is now
        self.model.place_tables(device, cached_ids)
        self.cached_rows = [t.device_rows.cached for t in self.model.tables]   # [F]
        self.batches = self.rt.batches(batches, stop=len(batches))
        self.loss: torch.Tensor | None = None

    def step(self) -> None:
        batch = next(self.batches)  # commits (or hands over) the batch before
        _, loss = train_step(self.model, batch, self.rt.optimizers, self.rt.batch)
        self.loss = loss.detach()

    def settle(self) -> None:
        """The commits handed over are durable: a block pays for its own background work."""
        self.rt.wait_durable()

    def counters(self) -> tuple[float, ...]:
        """Host seconds so far: (lookups, updates, the checkpointer's share of the lookups, of the
        updates, at batch ends). GPU work counts where the host waits for it (torch.unique in a lookup,
        the synchronise at an update's end)."""
        stats = self.rt.stats
        mine = (stats.training_lookup_seconds, stats.training_capture_seconds + stats.training_flush_seconds
                + stats.capture_wait_seconds, stats.training_boundary_seconds) if stats else (0.0, 0.0, 0.0)
        return (self.model.embedding_forward_seconds, sum(t.stats.update_seconds for t in self.model.tables), *mine)

    def finish(self) -> None:
        next(self.batches, None)  # ends (commits) the last batch


def split_ms(counter_deltas: list[float], total_seconds: float, steps: int) -> dict:
    """Milliseconds a step of a cxltrain run went to, from counters() summed over its timed blocks:
    lookups, updates, the checkpointer's share on the training thread, and the rest (data to the
    device, MLPs, Adam, waiting for background commits)."""
    forward, update, lookup, capture, boundary = counter_deltas
    ms = 1000.0 / steps
    return {"lookup": (forward - lookup) * ms, "update": (update - capture) * ms,
            "checkpoint": (lookup + capture + boundary) * ms,
            "rest": (total_seconds - forward - update - boundary) * ms}


def failure(error: BaseException) -> str:
    """One line saying why a run failed (its record carries it; the other runs go on)."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


@dataclasses.dataclass
class Timed:
    """What interleave() measured, per run (in the order of the runs given)."""

    seconds: list[list[float]]             # [run][block] of the timed blocks; [] for a failed run
    deltas: list[list[float] | None]        # [run][5]: counters() over the timed blocks (None: no counters)
    errors: list[str | None]                # why a run failed (None: it did not)


def interleave(runs: list, *, blocks: int, warmup_blocks: int, block_steps: int, sync: Callable[[], None],
               log: Callable[[str], None] = lambda line: None, errors: list[str | None] | None = None) -> Timed:
    """Time `runs` in turns: block i of every run back to back, the first in turn rotating with i, each
    `block_steps` steps between two device synchronisations; the first `warmup_blocks` blocks are
    dropped. A run that raises (out of GPU memory, say) is dropped with its error and the others go on,
    so one failure does not cost a whole GPU session. errors[j] given: run j failed before (None there)."""
    errors = list(errors) if errors is not None else [None] * len(runs)
    seconds: list[list[float]] = [[] for _ in runs]
    deltas: list[list[float] | None] = [None for _ in runs]
    for i in range(warmup_blocks + blocks):
        if i == warmup_blocks or (i > warmup_blocks and (i - warmup_blocks) % 4 == 0):
            log(f"block {i - warmup_blocks + 1} of {blocks}")
        first = i % len(runs)
        for j in list(range(first, len(runs))) + list(range(first)):
            if errors[j] is not None:
                continue
            run = runs[j]
            try:
                before = run.counters()
                sync()
                started = time.perf_counter()
                for _ in range(block_steps):
                    run.step()
                run.settle()
                sync()
                took = time.perf_counter() - started
            except Exception as e:  # any failure of one run: recorded, the others measured
                errors[j], seconds[j], deltas[j] = failure(e), [], None
                log(f"run {j} failed: {errors[j]}")
                continue
            if i < warmup_blocks:
                continue
            seconds[j].append(took)
            if before is not None:
                now = [a - b for a, b in zip(run.counters(), before)]
                deltas[j] = now if deltas[j] is None else [a + b for a, b in zip(deltas[j], now)]
    return Timed(seconds, deltas, errors)
