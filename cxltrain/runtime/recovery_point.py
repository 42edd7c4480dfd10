"""Where a Runtime resumes after a crash: the recovery-point strategy it takes (docs/distributed.md).

    Runtime(path, model, opt)                                  # OwnBatch: one process
    point = AgreedMinimum(directory, rank, world_size, manifest, fresh)
    Runtime(point.pool_path, model, opt, recovery_point=point)  # one rank of a group

One process resumes at its own durable batch. A group of ranks resumes at G, the minimum of the
ranks' durable batches: before the pool opens every rank agrees on G and rolls back to it
(group_recovery.py); while it trains, G is agreed again every batch, one way (local_target, then
settle), its targets carried by one all-reduce here or by the sharded step's id exchange, and each rank's commits keep the
undo records of every batch at or above the last G (U3b). The snapshots carry that G in their
metadata ("agreed"), so that a restart can tell whether a rank's ring still reaches the G it agrees on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..faults import CrashPoint, PlantedDist, crash_point, planted
from . import manifest as run_dir
from .group_recovery import RankRecovery, recover_group


class OwnBatch:
    """One process: the recovery point is the batch its own durable root names."""

    lag_batches = 0  # batches a commit's records outlive it by, beyond the process's own commits

    def snapshot_metadata(self, metadata: dict | None) -> tuple[dict | None, dict | None]:
        """(metadata a resumed pool's must equal, metadata stored with every snapshot)."""
        return metadata, metadata

    def before_open(self) -> None:
        """Nothing to agree on: the Runtime recovers its pool alone."""

    def opened(self, rt) -> None:
        """Nothing to tell anyone."""

    def at_batch(self, rt) -> None:
        """Nothing to agree on."""


class AgreedMinimum:
    """A group of ranks: the recovery point is G, the least durable batch of any rank, agreed by
    a collective. Entering the Runtime is collective (every rank, in the same order as its other
    collectives). agree_each_batch: agree on G with one all-reduce before each batch is handed out
    (a user's own loop); False where the step carries it (the sharded step's exchange).
    After entering: `recovered` (group_recovery.RankRecovery, or None on a fresh run)."""

    # G trails this rank's commits by a batch or two: its ring keeps their records as well
    lag_batches = 3

    def __init__(self, directory: str, rank: int, world_size: int, manifest: dict, fresh: bool, *,
                 agree_each_batch: bool = False) -> None:
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.manifest, self.fresh, self.agree_each_batch = manifest, fresh, agree_each_batch
        self.recovered: RankRecovery | None = None

    @property
    def pool_path(self) -> str:
        return run_dir.pool_path(self.directory, self.rank)

    def snapshot_metadata(self, metadata: dict | None) -> tuple[dict | None, dict]:
        """The manifest checks the run's settings; the snapshots name the run and the rank, and
        carry the last agreed G (which moves: no equality check on resume)."""
        return None, {"run": self.manifest["run"], "rank": self.rank, "agreed": 0}

    def before_open(self) -> None:
        """Every rank agrees on G and rolls its pool back to it, before any rank opens its own."""
        if not self.fresh:
            self.recovered = recover_group(self.directory, self.rank, self.world_size, self.manifest["run"])

    def opened(self, rt) -> None:
        """Every rank is at G; on a fresh run, every pool holds its first commit: from now on a
        restart recovers (rank 0 marks the manifest so)."""
        rt.agree(rt.start_batch)
        if self.fresh:
            dist.barrier()
            if self.rank == 0:
                self.manifest = {**self.manifest, "state": run_dir.CREATED}
                run_dir.write(self.directory, self.manifest)
            self.fresh = False

    def at_batch(self, rt) -> None:
        if self.agree_each_batch:
            self.agree_with_peers(rt)

    def agree_with_peers(self, rt) -> int:
        """G agreed by one all-reduce of the ranks' targets (a user's own loop, before each batch)."""
        least = torch.tensor([self.local_target(rt)], dtype=torch.int64)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        return self.settle(rt, int(least[0]))

    # The one way a group agrees on G, whatever carries the targets between the ranks (the
    # all-reduce above, or the sharded step's id exchange, which saves a collective a batch):
    def local_target(self, rt) -> int:
        """This rank's part: the recovery target its durable commits reach."""
        crash_point(CrashPoint.DIST_BEFORE_AGREEMENT)
        target = rt.durable_target
        if target > rt.agreed:
            crash_point(CrashPoint.DIST_AFTER_LOCAL_COMMIT)  # committed here, not yet known to the peers
        return target

    def settle(self, rt, least: int) -> int:
        """G = the least target of any rank (`least`, however it travelled), handed to rt.agree."""
        g = least
        if planted(PlantedDist.COMMIT_WITHOUT_AGREEMENT):
            g = rt.batch + 1  # as if every rank had this batch's commit durable already
        rt.agree(g)
        return g
