"""The job of one rank of a distributed run, under torchrun (or in this process for one rank):

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m cxltrain train --pool DIR ...
    cxltrain train --nproc-per-node 2 --pool DIR ...     # the same, through torch.distributed.run

Start: the manifest is checked (another world size, plan or settings is refused on every rank,
nothing written), the ranks agree on G and roll back to it (recovery_point.py), then train from G to
--steps: every global batch is split into equal slices, one per rank; the sparse half goes through
the exchange (exchange.py), the dense half under DistributedDataParallel; each rank commits its
own pool per batch, the ranks' targets for G riding on the step's first all-to-all.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CxlTrainError, NonFiniteError
from ..faults import PlantedDist, planted
from ..kernels.cpu_threads import set_cpu_threads
from ..knobs import torch_threads
from ..models.exchange import Comm, SparseExchange, local_slice
from ..models.replicated import Replicas, ReplicatedExchange
from ..models.sharded import RankModel
from ..placement.replication import OFF
from ..placement.sharding import ShardingPlan
from ..runtime.group import DEFAULT_TIMEOUT_S, PeerLost, end_without_restart, join_group, open_run_dir, peer_lost
from ..runtime.recovery_point import AgreedMinimum
from ..runtime.runtime import Runtime
from .config import TrainConfig
from .data_source import training_data
from .lifeline import (
    PEER_LOST,
    RANK_ERROR_ENV,
    end_with_launcher,
    failure_line,
    mark_launcher,
    restarts_left,
    stopped_by,
)
from .replication import Replication
from .sharded_settings import check_config, plan_for, settings_for
from .train import GroupFacts, TrainResult, dense_optimizer, run_steps


def build(config: TrainConfig, plan: ShardingPlan, point: AgreedMinimum):
    """This rank's model, dense optimizer and Runtime (its recovery point: the group's G)."""
    model = RankModel(plan, point.rank, dim=config.dim, bottom_mlp=config.bottom_mlp, top_mlp=config.top_mlp,
                      sparse_lr=config.sparse_lr, seed=config.seed)
    dense_opt = dense_optimizer(config, model.dense_parameters())
    rt = Runtime(point.pool_path, model, dense_opt, checkpoint=config.checkpoint, dense_every=config.dense_every,
                 pipeline=config.pipeline, background_capture=config.background_capture,
                 rows_per_batch=config.batch_size * config.pooling, recovery_point=point)
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
             progress: bool = True, replicate_hot: str | float = "auto") -> TrainResult:
    """Train this rank (RANK, WORLD_SIZE and the rendezvous from torchrun's environment); returns
    what this rank did and measured (its `group` says which rank it is). replicate_hot: "auto",
    "off" or a fraction of each sharded table's rows (placement/replication.py)."""
    end_with_launcher()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_config(config, world_size)
    join_group(timeout_s)
    lost = False
    try:
        return _run(config, directory, sharding, rank, world_size, progress, replicate_hot)
    except Exception as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if peer_lost(e):
            lost = True
            then = ("torchrun restarts the group, which recovers to the agreed batch" if restarts_left() > 0 else
                    "no restart is left: the same command resumes from the agreed batch")
            raise PeerLost(f"rank {rank}: a collective failed ({line[:200]}); {PEER_LOST} — {then}") from None
        # a restart would only run into it again: the group ends here, with this line
        failure = e if isinstance(e, CxlTrainError) else CxlTrainError(f"rank {rank}: {type(e).__name__}: {line[:200]}")
        end_without_restart(str(failure))
        raise failure from None
    finally:
        if not lost:  # a lost peer's group would hang its destroy (PeerLost says why)
            dist.destroy_process_group()


def _run(config: TrainConfig, directory: str, sharding: str, rank: int, world_size: int,
         progress: bool, replicate_hot: str | float) -> TrainResult:
    set_cpu_threads(torch_threads(world_size))
    seed_everything(config.seed)
    m, fresh = start_run_dir(directory, config, sharding, rank, world_size)
    plan = ShardingPlan.from_json(m["plan"])
    point = AgreedMinimum(directory, rank, world_size, m, fresh)
    model, dense_opt, rt = build(config, plan, point)
    comm = Comm(rank, world_size)
    dist.barrier()  # the recovery's time starts once every rank is here, not at the first one's start
    started = time.perf_counter()
    with rt:  # every rank agrees on G and rolls back to it first (recovery_point.py)
        recovery_seconds = time.perf_counter() - started
        recovered = point.recovered
        if rank == 0:  # said once the group is open and recovered: a refused run prints only its refusal
            print(plan.describe(), flush=True)
            where = (f"recovered every rank to batch {recovered.batch} in {recovery_seconds * 1000:.0f} ms "
                     f"(this rank was at {recovered.target}, {recovered.records_restored} undo records rolled back)"
                     if recovered else "training from batch 0")
            print(f"{world_size} rank(s): {where}", flush=True)
        data = training_data(config)
        replication = None
        if replicate_hot != OFF:  # off: the exchange as it always was, no profile, no probe
            replication = Replication(replicate_hot, plan, config, data.train, Replicas(plan, model, comm))
            replication.refresh(rt.start_batch)
            if rank == 0:
                print(replication.describe(), flush=True)
        step = ShardedStep(plan, model, dense_opt, rt, comm, config.batch_size, directory, point, replication)
        result = run_steps(config, step, data, rt, progress and rank == 0)
    # the group's recovery: from every rank being here to every rank at G, agreement included
    result.progress.recovery_seconds = recovery_seconds if recovered else 0.0
    return result


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


class ShardedStep:
    """The step of one rank (train.run_steps drives it): its slice of the batch, the sparse half
    through the exchange (which carries the ranks' targets for the agreement on G), the dense half under
    DistributedDataParallel, each rank updating its own shards."""

    def __init__(self, plan: ShardingPlan, model: RankModel, dense_opt, rt: Runtime, comm: Comm, batch_size: int,
                 directory: str, point: AgreedMinimum, replication: Replication | None = None) -> None:
        self.model, self.dense_opt, self.rt, self.comm, self.directory = model, dense_opt, rt, comm, directory
        self.dense = model.dense
        if comm.world_size > 1:
            self.dense = torch.nn.parallel.DistributedDataParallel(model.dense)
            self.dense.register_comm_hook(None, _ordered_mean_hook(comm.world_size))
        self.plain = SparseExchange(plan, model, comm, batch_size)
        self.replication = replication
        self.replicated = None if replication is None else ReplicatedExchange(plan, model, comm, batch_size,
                                                                              replication.replicas)
        self.predicted = 0.0  # the cost model's bytes for the timed batches, summed
        self.point = point  # how the group agrees on G; the exchange carries the ranks' targets
        self.first = rt.start_batch
        self.timed_bytes: int | None = None  # what this rank had sent when the timed batches began

    @property
    def tables(self) -> list:
        """This rank's shards."""
        return list(self.model.shards)

    @property
    def forward_seconds(self) -> float:
        """Lookups are inside the exchange, not timed apart."""
        return 0.0

    def __call__(self, batch, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [B_r], labels [B_r], loss) of this rank's slice of batch `b`, its updates done."""
        rt, comm = self.rt, self.comm
        local = local_slice(batch, comm.world_size, comm.rank)
        replication = self.replication
        if replication is not None:
            replication.refresh(b)  # collective: a new profile every REPROFILE_EVERY batches
            if self.timed_bytes is not None:
                self.predicted += replication.choice.predicted_bytes
        # no replicated row and every table's bags: the plain exchange, the same bits and bytes as off
        exchange = self.plain
        if replication is not None and (replication.replicas.count or any(replication.choice.unique)):
            exchange = self.replicated
            exchange.unique = replication.choice.unique  # the same on every rank: a function of the batch
        # G agreed through the exchange's id header: no collective of its own
        embedded = self.point.agree_on_g(rt, lambda target: exchange.forward(local, target))
        if planted(PlantedDist.ERROR_IN_STEP) and b == self.first + 1 and comm.rank == comm.world_size - 1:
            raise RuntimeError(f"planted error in the step of batch {b}")
        logits = self.dense(local.dense, embedded)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, local.labels)
        if not bool(torch.isfinite(loss)):
            raise NonFiniteError(f"rank {comm.rank}, batch {b}: the loss is {loss.item()}; stopped before its backward")
        loss.backward()
        self.dense_opt.step()
        self.dense_opt.zero_grad(set_to_none=True)
        return logits, local.labels, loss

    def timing_started(self) -> None:
        self.timed_bytes = self.comm.bytes_sent

    def evaluate(self, source, indices: range) -> tuple[None, None]:
        """No held-out evaluation across ranks yet."""
        return None, None

    def group_facts(self, timed_steps: int) -> GroupFacts:
        """Collective: every rank's bytes sent in the timed batches are summed."""
        comm = self.comm
        sent = torch.tensor([float(comm.bytes_sent - (self.timed_bytes or 0))])
        dist.all_reduce(sent)  # what every rank sent to the others, in the timed batches
        steps = self.rt.batch - self.first
        timed = self.timed_bytes is not None and timed_steps > 0
        replication = self.replication
        return GroupFacts(rank=comm.rank, world_size=comm.world_size, dir=self.directory,
                          bytes_exchanged_per_batch=float(sent[0]) / timed_steps if timed else None,
                          bytes_sent_per_batch=comm.bytes_sent / steps if steps else 0.0,
                          replicated_rows=0 if replication is None else replication.replicas.count,
                          predicted_bytes_per_batch=self.predicted / timed_steps
                          if timed and replication is not None else None)


# ---------------------------------------------------------------------------------------------
# `cxltrain train --nproc-per-node N`: the same job through torch.distributed.run.
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _signal_handlers_kept():
    """torchrun's agent sets handlers that raise its SignalException and leaves them set: a signal
    after it returned (while the launcher prints its line, or to a caller of `launch`) would end in
    that exception's traceback. The handlers before it are put back when it returns."""
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    if threading.current_thread() is not threading.main_thread():
        yield  # torchrun cannot set handlers off the main thread either
        return
    kept = {s: signal.getsignal(s) for s in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for number, handler in kept.items():
            signal.signal(number, handler)


def launch(argv: list[str], nproc: int, max_restarts: int) -> int:
    """Run `cxltrain train ARGV` on `nproc` ranks of this machine under torchrun (--standalone:
    a free loopback port is found for the rendezvous). Returns 0, 1 when the ranks failed, or 128 +
    the signal that stopped the launcher. How the run ended reaches the user as one line: the ranks
    write their error lines to a file of this launcher's (RANK_ERROR_ENV) instead of stderr, this
    launcher picks the line (lifeline.failure_line), and torchrun's own log is kept to its errors."""
    import logging
    import tempfile

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.1", "-m", "cxltrain", "train", *argv]
    mark_launcher()
    # torchrun warns that it sets OMP_NUM_THREADS when it is unset; the ranks set their own threads
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # every elastic module sets its own logger's level: each one is quieted, not just their parent
    quiet = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
             if name.startswith(("torch.distributed.run", "torch.distributed.elastic"))]
    levels = [logger.level for logger in quiet]
    with tempfile.TemporaryDirectory(prefix="cxltrain-launch-") as folder:
        errors = os.path.join(folder, "rank-errors")
        os.environ[RANK_ERROR_ENV] = errors
        try:
            for logger in quiet:
                logger.setLevel(logging.CRITICAL)
            with _signal_handlers_kept():
                # torchrun's own log folder (its ranks' error files) inside this one: by default it
                # makes one in $TMPDIR that it never removes, one more for every run
                torchrun.main(["--log-dir", os.path.join(folder, "torchrun"), *args])
        except ChildFailedError as e:
            lines = open(errors).read().splitlines() if os.path.exists(errors) else []
            exit_codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
            print(failure_line(exit_codes, lines, max_restarts), file=sys.stderr)
            return 1
        except SignalException as e:  # the agent has stopped the ranks; each is committed at its last batch
            print(f"cxltrain: {stopped_by(e.sigval)}; the run resumes from its last committed batch", file=sys.stderr)
            return 128 + e.sigval
        finally:
            os.environ.pop(RANK_ERROR_ENV, None)
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
    return 0
