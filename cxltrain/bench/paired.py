"""Two of our runs side by side in one process: the same model and data, one without checkpoints
and one with a checkpointing method, taking turns in blocks of a few steps.

Run-to-run noise on a shared 2-core machine (which memory a process gets, what the host does
meanwhile) moves one run's mean step by 5-15%, more than the 5% the strict target allows.
Alternating blocks inside one process puts both runs under the same conditions, so what differs
between their block times is what the method costs. A block's time includes its run's work still
in flight when the block ends (Runtime.wait_durable): a background commit is never billed to the
other run. Each run keeps its own pool, model and optimizer; they share the data source.

    paired_steps(TrainConfig(checkpoint="off"), TrainConfig(), ("/dev/shm/a.pool", "/dev/shm/b.pool"),
                 warmup=5, blocks=8, block_steps=10)
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch

from ..config import TrainConfig
from .records import PairedTiming


def interleaved_blocks(configs: list[TrainConfig], pools: list[str], *, warmup: int, blocks: int, block_steps: int,
                       probe: Callable | None = None) -> tuple[list[list[float]], list[dict]]:
    """Runs `configs` (each in its pool, the first one's data source shared) taking turns in blocks:
    (seconds of each run's blocks, each run's summed probe deltas). probe(rt) -> {name: counter} is
    read before and after every timed block; who goes first rotates from block to block."""
    from ..trainer import build_model, build_source, make_runtime, train_step

    source = build_source(configs[0])
    stop = warmup + blocks * block_steps
    seconds: list[list[float]] = [[] for _ in configs]
    totals: list[dict] = [{} for _ in configs]
    with contextlib.ExitStack() as stack:
        runs = []
        for config, pool in zip(configs, pools):
            model = build_model(config)
            dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)
            rt = stack.enter_context(make_runtime(config, model, dense_opt, pool))
            runs.append((model, rt, rt.batches(source, stop=stop)))

        def block(run, steps: int) -> float:
            model, rt, batches = run
            started = time.perf_counter()
            for _ in range(steps):
                batch = next(batches)
                train_step(model, batch, rt.optimizers, rt.batch)
            rt.wait_durable()
            return time.perf_counter() - started

        for run in runs:
            block(run, warmup)
        for i in range(blocks):
            for j in (k % len(runs) for k in range(i, i + len(runs))):  # who goes first rotates too
                before = probe(runs[j][1]) if probe else {}
                seconds[j].append(block(runs[j], block_steps))
                for name, value in (probe(runs[j][1]) if probe else {}).items():
                    totals[j][name] = totals[j].get(name, 0) + value - before[name]
        for _, _, batches in runs:
            next(batches, None)  # ends (commits) the last batch
    return seconds, totals


def paired_steps(base: TrainConfig, method: TrainConfig, pools: tuple[str, str], *, warmup: int, blocks: int,
                 block_steps: int) -> PairedTiming:
    """Mean ms per step of `base` and `method` over `blocks` alternating blocks of `block_steps`
    steps each (after `warmup` steps each), their ratio, and each block pair's ratio."""
    seconds, _ = interleaved_blocks([base, method], list(pools), warmup=warmup, blocks=blocks,
                                    block_steps=block_steps)
    base_ms, method_ms = (1000.0 * sum(s) / (blocks * block_steps) for s in seconds)
    block_ratios = [b / a for a, b in zip(*seconds)]
    return PairedTiming(base_ms=base_ms, method_ms=method_ms, ratio=method_ms / base_ms,
                        median_block_ratio=statistics.median(block_ratios), block_ratios=block_ratios,
                        blocks=blocks, block_steps=block_steps)
