"""Two of our runs side by side in one process: the same model and data, one without checkpoints
and one with a checkpointing method, taking turns in blocks of a few steps.

Run-to-run noise on a shared 2-core machine (which memory a process gets, what the host does
meanwhile) moves one run's mean step by more than the 5% the strict target allows.
Alternating blocks inside one process puts both runs under the same conditions, so what differs
between their block times is what the method costs. A block's time includes its run's work still
in flight when the block ends (Runtime.wait_idle: a commit, a capacity write-back): a run's
commits and write-backs are never billed to another run (its prefetcher's reads ahead may be).
Each run keeps its own pool, model and optimizer; they share the data source.

    paired_steps(TrainConfig(checkpoint="off"), TrainConfig(), ("/dev/shm/a.pool", "/dev/shm/b.pool"),
                 warmup=5, blocks=8, block_steps=10)
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from ..jobs.config import TrainConfig
from .interval import ratio_interval
from .records import PairedTiming


@dataclasses.dataclass
class SideBySide:
    """One run of paired_runs: its block times (seconds, in block order) and checkpoint totals."""

    block_seconds: list[float]
    stats: dict | None     # CheckpointStats.to_json() at the end (None: checkpoints off)
    block_steps: int
    probe_totals: dict = dataclasses.field(default_factory=dict)  # summed probe deltas over the timed blocks

    @property
    def mean_ms(self) -> float:
        return 1000.0 * sum(self.block_seconds) / (len(self.block_seconds) * self.block_steps)

    def durable_bytes_per_batch(self) -> float:
        """Undo records, dense snapshots and table rows made durable, per batch."""
        stats = self.stats
        if not stats or not stats["batches"]:
            return 0.0
        return (stats["undo_bytes"] + stats["dense_bytes"] + stats["row_bytes"]) / stats["batches"]


def paired_steps(base: TrainConfig, method: TrainConfig, pools: tuple[str, str], *, warmup: int, blocks: int,
                 block_steps: int) -> PairedTiming:
    """Mean ms per step of `base` and `method` over `blocks` alternating blocks of `block_steps`
    steps each (after `warmup` steps each), their ratio, and each block pair's ratio."""
    return paired_timing(*paired_runs([base, method], list(pools), warmup=warmup, blocks=blocks,
                                      block_steps=block_steps))


def paired_timing(first: SideBySide, second: SideBySide) -> PairedTiming:
    """`second` against `first` (the baseline): mean ms per step, their ratio and its interval."""
    block_ratios = [b / a for a, b in zip(first.block_seconds, second.block_seconds)]
    low, high = ratio_interval(first.block_seconds, second.block_seconds) or (None, None)
    return PairedTiming(base_ms=first.mean_ms, method_ms=second.mean_ms, ratio=second.mean_ms / first.mean_ms,
                        median_block_ratio=statistics.median(block_ratios), block_ratios=block_ratios,
                        blocks=len(first.block_seconds), block_steps=first.block_steps, ratio_low=low,
                        ratio_high=high)


def paired_runs(configs: list[TrainConfig], pools: list[str], *, warmup: int, blocks: int, block_steps: int,
                probe: Callable | None = None, first_batch: int = 0) -> list[SideBySide]:
    """Several runs in one process, taking turns in blocks of `block_steps` steps (after `warmup`
    steps each); who goes first rotates from block to block. They share the data source of the
    first config, so every config must have the same data settings (pooling included); each run's
    batch b is the source's batch first_batch + b.
    probe(rt) -> {name: counter} is read before and after every timed block (SideBySide.probe_totals)."""
    from ..jobs.train import build_model, build_source, make_runtime, train_step

    source = build_source(configs[0])

    def fetch(b: int):
        return source.batch(first_batch + b)
    stop = warmup + blocks * block_steps
    with contextlib.ExitStack() as stack:
        runs = []
        for config, pool in zip(configs, pools):
            model = build_model(config)
            dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)
            rt = stack.enter_context(make_runtime(config, model, dense_opt, pool))
            runs.append(Turns(rt, rt.batches(fetch, stop=stop),
                              lambda batch, rt, model=model: train_step(model, batch, rt.optimizers, rt.batch)))
        return take_turns(runs, warmup=warmup, blocks=blocks, block_steps=block_steps, probe=probe)


@dataclasses.dataclass
class Turns:
    """One run of take_turns: its Runtime, its batches (rt.batches(...) up to the last timed
    step) and step(batch, rt), which trains one batch."""

    rt: object
    batches: Iterator
    step: Callable


def take_turns(runs: list[Turns], *, warmup: int, blocks: int, block_steps: int, probe: Callable | None = None,
               settle: Callable[[], None] | None = None) -> list[SideBySide]:
    """The runs in turn, `blocks` blocks of `block_steps` steps each after `warmup` steps each;
    who goes first rotates from block to block. A block ends once its run's commits are durable
    and its capacity write-back has returned (rt.wait_idle, then settle(): a group's barrier), so
    no run's commits or write-backs are billed to the next block. The batch in flight is committed at the
    end (the runs' batches run out)."""
    seconds: list[list[float]] = [[] for _ in runs]
    totals: list[dict] = [{} for _ in runs]

    def block(run: Turns, steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            run.step(next(run.batches), run.rt)
        run.rt.wait_idle()
        if settle is not None:
            settle()
        return time.perf_counter() - started

    for run in runs:
        block(run, warmup)
    order = list(range(len(runs)))
    for i in range(blocks):
        for j in order[i % len(order):] + order[: i % len(order)]:  # who goes first rotates too
            before = probe(runs[j].rt) if probe else {}
            seconds[j].append(block(runs[j], block_steps))
            for name, value in (probe(runs[j].rt) if probe else {}).items():
                totals[j][name] = totals[j].get(name, 0) + value - before[name]
    for run in runs:
        next(run.batches, None)  # ends (commits) the last batch
        run.rt.wait_durable()  # the stats below count its commit
    return [SideBySide(s, None if run.rt.stats is None else run.rt.stats.to_json(), block_steps, t)
            for s, t, run in zip(seconds, totals, runs)]
