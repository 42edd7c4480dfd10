"""One rank of `bench --dist`'s side-by-side runs: checkpointing off and every batch durable, two
runs of the same group in each rank's process, taking turns in blocks (paired.take_turns), so both
meet the same load on a shared machine. Launched by dist.py under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m cxltrain.bench.dist_paired '<job json>'

job: {"config": TrainConfig as a dict, "dirs": [off's run folder, durable's], "warmup", "blocks",
"block_steps"}. Each run is `cxltrain train`'s rank job (jobs/sharded_train.py: its own run folder,
recovery point, model, DDP and exchange) on the run's one gloo group; every rank takes the same
turns, so their collectives meet in the same order. A block ends once every rank's commits are
durable (wait_idle, then a barrier). Rank 0 prints one JSON line: DistPaired.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys

import torch.distributed as dist

from ..jobs.data_source import training_data
from ..jobs.sharded_train import ShardedStep, build, seed_everything, start_run_dir
from ..kernels.cpu_threads import set_cpu_threads
from ..knobs import torch_threads
from ..models.exchange import Comm
from ..modes import OFF, UNDO
from ..placement.sharding import ShardingPlan
from ..runtime.group import join_group
from ..runtime.recovery_point import AgreedMinimum
from .paired import Turns, paired_timing, take_turns
from .records import DistPaired
from .worker import config_from_json


def _opened(stack: contextlib.ExitStack, config, directory: str, rank: int, world_size: int,
            source, stop: int) -> tuple[Turns, ShardedStep]:
    """A fresh run of `config` in `directory`, open, its step ready to take turns."""
    m, fresh = start_run_dir(directory, config, "auto", rank, world_size)
    plan = ShardingPlan.from_json(m["plan"])
    point = AgreedMinimum(directory, rank, world_size, m, fresh)
    model, dense_opt, rt = build(config, plan, point)
    rt = stack.enter_context(rt)
    step = ShardedStep(plan, model, dense_opt, rt, Comm(rank, world_size), config.batch_size, directory, point)
    return Turns(rt, rt.batches(source, stop=stop), lambda batch, rt: step(batch, rt.batch)), step


def run(job: dict) -> DistPaired | None:
    """Both runs side by side on this rank; rank 0's figures (None on the other ranks)."""
    rank, world_size = join_group()
    set_cpu_threads(torch_threads(world_size))
    config = config_from_json(job["config"])
    warmup, blocks, block_steps = job["warmup"], job["blocks"], job["block_steps"]
    stop = warmup + blocks * block_steps
    source = training_data(dataclasses.replace(config, steps=stop)).train
    try:
        with contextlib.ExitStack() as stack:
            opened = []
            for method, directory in zip((OFF, UNDO), job["dirs"]):
                seed_everything(config.seed)  # each run starts as `cxltrain train` would
                opened.append(_opened(stack, dataclasses.replace(config, checkpoint=method, steps=stop), directory,
                                      rank, world_size, source, stop))
            for _, step in opened:
                step.timing_started()
            off, durable = take_turns([turns for turns, _ in opened], warmup=warmup, blocks=blocks,
                                      block_steps=block_steps, settle=dist.barrier)
            timed = blocks * block_steps + warmup  # the bytes counted from the first step on
            exchanged = [_exchanged(step, timed) for _, step in opened]
            durable_mb, phase_ms = _per_rank(durable.stats)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return DistPaired(ranks=world_size, timing=paired_timing(off, durable), off_bytes_per_batch=exchanged[0],
                      durable_bytes_per_batch=exchanged[1], stats=durable.stats, durable_mb=durable_mb,
                      phase_ms=phase_ms)


def _per_rank(stats: dict) -> tuple[list[list[float]], list[list[float]]]:
    """Collective: each rank's [dense snapshot, table rows + undo records] MB made durable a batch,
    and its [undo capture in backward, batch end, commit on the worker] ms a batch."""
    batches = max(stats["batches"], 1)
    mine = ([stats["dense_bytes"] / batches / 1e6, (stats["row_bytes"] + stats["undo_bytes"]) / batches / 1e6],
            [1000 * stats[k] / batches for k in ("training_capture_seconds", "training_boundary_seconds",
                                                 "commit_seconds")])
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [mb for mb, _ in every], [ms for _, ms in every]


def _exchanged(step: ShardedStep, steps: int) -> float:
    """Collective: every rank's sends to the others, per batch."""
    facts = step.group_facts(steps)
    return facts.bytes_exchanged_per_batch or 0.0


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]))
    if result is not None:
        print(json.dumps(result.to_json()), flush=True)
