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

import torch

from ..config import TrainConfig
from .records import PairedTiming


def paired_steps(base: TrainConfig, method: TrainConfig, pools: tuple[str, str], *, warmup: int, blocks: int,
                 block_steps: int) -> PairedTiming:
    """Mean ms per step of `base` and `method` over `blocks` alternating blocks of `block_steps`
    steps each (after `warmup` steps each), their ratio, and each block pair's ratio."""
    from ..trainer import build_model, build_source, make_runtime, train_step

    source = build_source(base)
    stop = warmup + blocks * block_steps
    seconds: tuple[list[float], list[float]] = ([], [])
    with contextlib.ExitStack() as stack:
        runs = []
        for config, pool in zip((base, method), pools):
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
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):  # who goes first alternates too
                seconds[j].append(block(runs[j], block_steps))
        for _, _, batches in runs:
            next(batches, None)  # ends (commits) the last batch
    base_ms, method_ms = (1000.0 * sum(s) / (blocks * block_steps) for s in seconds)
    block_ratios = [b / a for a, b in zip(*seconds)]
    return PairedTiming(base_ms=base_ms, method_ms=method_ms, ratio=method_ms / base_ms,
                        median_block_ratio=statistics.median(block_ratios), block_ratios=block_ratios,
                        blocks=blocks, block_steps=block_steps)
