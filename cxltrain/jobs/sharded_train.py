"""The job of one rank of a distributed run, under torchrun (or in this process for one rank):

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m cxltrain train --pool DIR ...
    cxltrain train --nproc-per-node 2 --pool DIR ...     # the same, through torch.distributed.run

Start: the manifest is checked (another world size, plan or settings is refused on every rank,
nothing written), the ranks agree on G and roll back to it (recovery.py), then train from G to
--steps: every global batch is split into equal slices, one per rank; the sparse half goes through
the exchange (exchange.py), the dense half under DistributedDataParallel; each rank commits its
own pool per batch, the G all-reduce riding on the step's first all-to-all.
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.layout import record_bytes
from ..errors import CxlTrainError, NonFiniteError
from ..faults import CrashPoint, crash_point
from ..knobs import KNOBS
from ..models.exchange import Comm, SparseExchange, local_slice
from ..models.sharded import RankModel
from ..placement.sharding import ShardingPlan
from ..runtime import manifest as run_dir
from ..runtime.group import DEFAULT_TIMEOUT_S, join_group, open_run_dir
from ..runtime.group_recovery import recover_group
from ..runtime.group_runtime import DistRuntime
from .config import TrainConfig
from .lifeline import end_with_launcher, mark_launcher
from .sharded_settings import check_config, plan_for, settings_for
from .train import build_source

WARMUP_STEPS = 3  # left out of the timed steps (first-touch page faults, DDP's bucket rebuild)
MIN_RING_BYTES = 4 << 20


class PeerLost(CxlTrainError):
    """A collective failed or timed out: a rank died (torchrun restarts the group) or hangs."""


def ring_bytes(config: TrainConfig, model: RankModel) -> int:
    """Room for the records of the batches between the agreed G and this rank's commits: a few
    more than a single process keeps (G trails the local commits by a batch or two)."""
    largest = 0
    for shard in model.shards:
        rows = min(shard.num_embeddings, config.batch_size * config.pooling)
        spec = shard.region_specs()[0]
        largest += record_bytes(rows, spec.row_stride(KNOBS.row_align), shard.optimizer.state_columns * 4)
    return KNOBS.undo_ring_bytes or max(MIN_RING_BYTES, (min(config.dense_every, 4) + 4) * largest)


def build(config: TrainConfig, plan: ShardingPlan, rank: int, run_metadata: dict):
    model = RankModel(plan, rank, dim=config.dim, bottom_mlp=config.bottom_mlp, top_mlp=config.top_mlp,
                      sparse_lr=config.sparse_lr, seed=config.seed)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.dense_lr)
    rt = DistRuntime(run_dir.pool_path(run_metadata["dir"], rank), model, dense_opt,
                     run_metadata={k: v for k, v in run_metadata.items() if k != "dir"},
                     checkpoint=config.checkpoint, dense_every=config.dense_every, pipeline=config.pipeline,
                     background_capture=config.background_capture, undo_ring_bytes=ring_bytes(config, model))
    return model, dense_opt, rt


def seed_everything(seed: int) -> None:
    """The same global RNG states on every rank (a snapshot of one rank may restore another)."""
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)


def start_run_dir(directory: str, config: TrainConfig, sharding: str, rank: int, world_size: int) -> tuple[dict, bool]:
    """(the manifest, whether the pools are to be made): checked on every rank, written by rank 0."""
    return open_run_dir(directory, plan_for(config, world_size, sharding), settings_for(config, sharding), rank,
                        world_size)


def run_rank(config: TrainConfig, directory: str, *, sharding: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
             progress: bool = True) -> dict:
    """Train this rank (RANK, WORLD_SIZE and the rendezvous from torchrun's environment); returns
    rank 0's summary (every rank returns its own)."""
    end_with_launcher()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_config(config, world_size)
    join_group(timeout_s)
    try:
        return _run(config, directory, sharding, rank, world_size, progress)
    except (RuntimeError, dist.DistBackendError) as e:
        if isinstance(e, NonFiniteError):
            raise
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerLost(f"rank {rank}: a collective failed ({line[:200]}); a peer died or hangs — torchrun "
                       "restarts the group, which recovers to the agreed batch") from None
    finally:
        dist.destroy_process_group()


def _run(config: TrainConfig, directory: str, sharding: str, rank: int, world_size: int, progress: bool) -> dict:
    torch.set_num_threads(KNOBS.threads)
    seed_everything(config.seed)
    m, fresh = start_run_dir(directory, config, sharding, rank, world_size)
    plan = ShardingPlan.from_json(m["plan"])
    if rank == 0:
        print(plan.describe(), flush=True)
    model, dense_opt, rt = build(config, plan, rank, {"dir": directory, "run": m["run"], "rank": rank})
    comm = Comm(rank, world_size)
    dist.barrier()  # the recovery's time starts once every rank is here, not at the first one's start
    started = time.perf_counter()
    recovered = None if fresh else recover_group(directory, rank, world_size, m["run"])
    with rt:
        recovery_seconds = time.perf_counter() - started
        if fresh:
            dist.barrier()
            if rank == 0:
                run_dir.write(directory, {**m, "state": run_dir.CREATED})
        if rank == 0:
            where = (f"recovered every rank to batch {recovered.batch} in {recovery_seconds * 1000:.0f} ms "
                     f"(this rank was at {recovered.target}, {recovered.records_restored} undo records rolled back)"
                     if recovered else "training from batch 0")
            print(f"{world_size} rank(s): {where}", flush=True)
        summary = _train_loop(config, plan, model, dense_opt, rt, comm, world_size)
    summary.update(rank=rank, world_size=world_size, recovered_batch=None if recovered is None else recovered.batch,
                   recovery_seconds=recovery_seconds if recovered else 0.0, batch=rt.batch, dir=directory)
    return summary


def _ordered_mean_hook(world_size: int):
    """DDP comm hook: the bucket's mean over the ranks summed in rank order (all-gather, then a
    fixed-order sum), so the bits do not depend on the bucket layout DDP rebuilds after its first
    step (a ring all-reduce sums each chunk in another order). Blocking, on the run's one group:
    the autograd thread issues it and the exchange's backward in the same order on every rank, so
    the collectives of one group never interleave (a second group, created after a restart, could
    meet the previous attempt's addresses in torchrun's store)."""

    def hook(state, bucket):
        tensor = bucket.buffer()
        gathered = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(gathered, tensor)
        total = gathered[0].clone()
        for part in gathered[1:]:
            total += part
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(total.div_(world_size))
        return done

    return hook


def _train_loop(config, plan, model: RankModel, dense_opt, rt: DistRuntime, comm: Comm, world_size: int) -> dict:
    dense = model.dense
    if world_size > 1:
        dense = torch.nn.parallel.DistributedDataParallel(model.dense)
        dense.register_comm_hook(None, _ordered_mean_hook(world_size))
    source = build_source(config)
    exchange = SparseExchange(plan, model, comm, config.batch_size)
    first, losses = rt.start_batch, []
    agreed = rt.start_batch
    loop_start = time.perf_counter()
    timed_from, timed_start = first + WARMUP_STEPS, None
    for batch in rt.batches(source.batch, stop=config.steps):
        b = rt.batch
        if b == timed_from:
            timed_start, timed_bytes = time.perf_counter(), comm.bytes_sent
        local = local_slice(batch, world_size, comm.rank)
        if rt.durable_target > agreed:
            crash_point(CrashPoint.DIST_AFTER_LOCAL_COMMIT)  # committed here, not yet known to the peers
        embedded, agreed = exchange.forward(local, rt.durable_target)
        rt.agree(agreed)
        logits = dense(local.dense, embedded)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, local.labels)
        if not bool(torch.isfinite(loss)):
            raise NonFiniteError(f"rank {comm.rank}, batch {b}: the loss is {loss.item()}; stopped before its backward")
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    rt.wait_durable()
    seconds = time.perf_counter() - loop_start
    steps = max(0, config.steps - first)
    timed = config.steps - timed_from
    sent = torch.tensor([float(comm.bytes_sent - (timed_bytes if timed_start else 0))])
    dist.all_reduce(sent)  # what every rank sent to the others, in the timed batches
    stats = rt.stats
    return {"steps": steps, "start_batch": first, "seconds": seconds,
            "ms_per_step": seconds * 1000 / steps if steps else 0.0,
            "ms_per_step_after_warmup": (time.perf_counter() - timed_start) * 1000 / timed if timed_start else None,
            "bytes_exchanged_per_batch": float(sent[0]) / timed if timed_start else None,
            "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
            "bytes_sent_per_batch": comm.bytes_sent / steps if steps else 0.0,
            "checkpoint_stats": None if stats is None else stats.to_json()}


# ---------------------------------------------------------------------------------------------
# `cxltrain train --nproc-per-node N`: the same job through torch.distributed.run.
# ---------------------------------------------------------------------------------------------
def launch(argv: list[str], nproc: int, max_restarts: int) -> int:
    """Run `cxltrain train ARGV` on `nproc` ranks of this machine under torchrun (--standalone:
    a free loopback port is found for the rendezvous). Returns torchrun's exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.1", "-m", "cxltrain", "train", *argv]
    mark_launcher()
    try:
        torchrun.main(args)
    except ChildFailedError as e:
        failures = e.failures
        first = failures[min(failures)]
        print(f"cxltrain: error: rank {first.local_rank} exited with status {first.exitcode} "
              f"({len(failures)} rank(s) failed, after {max_restarts} restart(s) at most)", file=sys.stderr)
        return 1
    return 0
