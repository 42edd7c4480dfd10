"""A distributed run's replicated hot rows, the job side (docs/distributed.md, "Replicated hot
rows"): the link speeds, measured at the start; the profile of the batches ahead; the replicas
rebuilt when the choice changes (placement/replication.py says when).

    replication = Replication(setting, plan, config, source, replicas)   # collective
    replication.refresh(batch)      # collective, before each batch's exchange
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..models.exchange import Comm
from ..models.replicated import Replicas
from ..placement import replication as model
from ..placement.sharding import ShardingPlan
from .config import TrainConfig

PROBE_FLOATS = 1 << 18      # 1 MiB of floats per collective, the group's bytes
PROBE_TIMES = 5


def measure_links(comm: Comm) -> model.Links:
    """Collective: [all-to-all, all-reduce] group bytes per second, rank 0's median of PROBE_TIMES,
    the same on every rank."""
    rank, world_size, group = comm.rank, comm.world_size, comm.group
    probe = Comm(rank, world_size, group)  # its bytes are not the run's
    per = PROBE_FLOATS // (world_size * world_size)
    pieces = [torch.ones(per) for _ in range(world_size)]
    rows = torch.ones(PROBE_FLOATS // (2 * max(world_size - 1, 1) * 32), 32)
    speeds = []
    for collective, group_bytes in ((lambda: probe.all_to_all(pieces, [per] * world_size),
                                     world_size * (world_size - 1) * per * 4),
                                    (lambda: probe.ordered_all_reduce(rows), 2 * (world_size - 1) * rows.numel() * 4)):
        collective()
        seconds = []
        for _ in range(PROBE_TIMES):
            dist.barrier(group=group)
            started = time.perf_counter()
            collective()
            seconds.append(time.perf_counter() - started)
        speeds.append(group_bytes / max(statistics.median(seconds), 1e-9))
    measured = torch.tensor(speeds, dtype=torch.float64)
    dist.broadcast(measured, src=0, group=group)
    return model.Links(float(measured[0]), float(measured[1]))


class Replication:
    """The rows the ranks replicate (a function of the batch number: placement/replication.py) and
    the bytes the cost model predicts for them."""

    def __init__(self, setting, plan: ShardingPlan, config: TrainConfig, source, replicas: Replicas) -> None:
        self.setting, self.plan, self.config, self.source, self.replicas = setting, plan, config, source, replicas
        self.links = measure_links(replicas.comm) if plan.world_size > 1 else None
        self.profiled_at: int | None = None
        self.choice: model.Choice | None = None

    def refresh(self, batch: int) -> bool:
        """Collective: the choice for `batch` (profiled anew at each REPROFILE_EVERY boundary), the
        replicas rebuilt from their owners when it differs from the rows they hold (and at the
        first call: a start, after the group's recovery). Returns whether they were rebuilt."""
        start = model.profile_start(batch)
        if start == self.profiled_at:
            return False
        first = self.profiled_at is None
        self.profiled_at = start
        lookups = []
        for b in range(start, start + model.PROFILE_BATCHES):
            got = self.source.batch(b)
            lookups.append([(v.numpy(), o.numpy()) for v, o in zip(got.values, got.offsets)])
        self.choice = model.choose_replicas(self.plan, lookups, batch_size=self.config.batch_size,
                                            dim=self.config.dim, links=model.SAME_TRANSPORT, setting=self.setting)
        same = all(torch.equal(torch.from_numpy(h), ids) for h, ids in zip(self.choice.hot, self.replicas.ids))
        if same and not first:
            return False
        self.replicas.rebuild(self.choice.hot)
        return True

    def describe(self) -> str:
        """One line: what is replicated, why, and the predicted bytes per batch."""
        c = self.choice
        tables = sum(1 for h in c.hot if h.size)
        links = "" if self.links is None else (
            f"; links measured: all-to-all {self.links.all_to_all / 1e6:,.0f} MB/s, all-reduce "
            f"{self.links.all_reduce / 1e6:,.0f} MB/s")
        return (f"replicated hot rows: {c.rows:,} row(s) of {tables} table(s) on every rank ({c.why}); predicted "
                f"{c.predicted_bytes / 1024:,.1f} KiB exchanged per batch (without replication "
                f"{c.predicted_off_bytes / 1024:,.1f} KiB){links}")
