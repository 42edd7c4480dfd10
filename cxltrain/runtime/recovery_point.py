"""Where a Runtime resumes after a crash: the recovery-point strategy it takes (docs/distributed.md).

    Runtime(path, model, opt)                                  # OwnBatch: one process
    point = AgreedMinimum(directory, rank, world_size, manifest, fresh)
    Runtime(point.pool_path, model, opt, recovery_point=point)  # one rank of a group

One process resumes at its own durable batch. A group of ranks resumes at G, the minimum of the
ranks' durable batches: before the pool opens every rank agrees on G and rolls back to it
(group_recovery.py); while it trains, G is agreed again every batch, one way (agree_on_g: the least
of the ranks' durable targets), the targets carried by the sharded step's id exchange or, where no
exchange carries them, by one all-gather here, and each rank's commits keep the undo records of
every batch at or above the last G (U3b). The snapshots carry that G in their
metadata ("agreed"), so that a restart can tell whether a rank's ring still reaches the G it agrees on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import codec, dense_slices, slots
from ..faults import CrashPoint, PlantedDist, crash_point, planted
from ..pool.shard_format import SHARD_BYTES
from . import manifest as run_dir
from . import shard_record
from .group_recovery import RankRecovery, recover_group


class OwnBatch:
    """One process: the recovery point is the batch its own durable root names."""

    lag_batches = 0  # batches a commit's records outlive it by, beyond the process's own commits
    dense_slice = None  # its snapshots hold the whole dense state

    def whole_dense(self, pool, snapshot: dict) -> dict:
        """The dense state to restore: the pool's snapshot is all of it."""
        return snapshot

    def snapshot_metadata(self, metadata: dict | None) -> tuple[dict | None, dict | None]:
        """(metadata a resumed pool's must equal, metadata stored with every snapshot)."""
        return metadata, metadata

    def before_open(self) -> None:
        """Nothing to agree on: the Runtime recovers its pool alone."""

    def extra_bytes(self) -> list[int]:
        """The regions `created` adds to a new pool, in bytes."""
        return []

    def created(self, pool) -> None:
        """A new pool: nothing of its own to record."""

    def opened(self, rt) -> None:
        """Nothing to tell anyone."""

    def at_batch(self, rt) -> None:
        """Nothing to agree on."""


class AgreedMinimum:
    """A group of ranks: the recovery point is G, the least durable batch of any rank, agreed by
    a collective. Entering the Runtime is collective (every rank, in the same order as its other
    collectives). Every G the rank holds comes from here: all_at (every rank at one batch) or
    agree_on_g (the ranks' targets exchanged, its rule, planted bug and crash points).
    agree_each_batch: no step carries the targets (a user's own loop), so agree on G with one
    all-gather before each batch is handed out; False where the step's exchange carries them
    (the sharded step calls agree_on_g with it).
    After entering: `recovered` (group_recovery.RankRecovery, or None on a fresh run)."""

    # G trails this rank's commits by a batch or two: its ring keeps their records as well
    lag_batches = 3

    def __init__(self, directory: str, rank: int, world_size: int, manifest: dict, fresh: bool, *,
                 agree_each_batch: bool = False) -> None:
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.manifest, self.fresh, self.agree_each_batch = manifest, fresh, agree_each_batch
        self.recovered: RankRecovery | None = None
        self.dense_slice = (rank, world_size)  # its snapshots hold its slice (checkpoint/dense_slices.py)

    def whole_dense(self, pool, snapshot: dict) -> dict:
        """The dense state to restore: every rank's slice of the batch all are at (G), gathered by one
        collective (under the group's timeout) and merged; `snapshot` is this rank's."""
        raw = slots.checked_payload(pool, pool.root.dense_slot, pool.root.dense_batch).tobytes()
        every: list = [None] * self.world_size
        dist.all_gather_object(every, raw)
        trees = [snapshot if r == self.rank else codec.decode(b) for r, b in enumerate(every)]
        return dense_slices.merge(trees, self.rank, pool.path)

    @property
    def pool_path(self) -> str:
        return run_dir.pool_path(self.directory, self.rank)

    def snapshot_metadata(self, metadata: dict | None) -> tuple[dict | None, dict]:
        """The manifest checks the run's settings; the snapshots name the run, the rank and how many
        slices the dense state is cut into, and carry the last agreed G (which moves: no equality
        check on resume)."""
        return None, {"run": self.manifest["run"], "rank": self.rank, "agreed": 0, "slices": self.world_size}

    def extra_bytes(self) -> list[int]:
        return [SHARD_BYTES]

    def created(self, pool) -> None:
        """The new rank pool records its own shard, durably, before its first commit (the root that
        makes the region live), so no rank pool of this run is ever without it."""
        shard_record.write(pool, self.manifest, self.rank)

    def before_open(self) -> None:
        """Every rank agrees on G and rolls its pool back to it, before any rank opens its own."""
        if not self.fresh:
            self.recovered = recover_group(self.directory, self.rank, self.world_size, self.manifest["run"])

    def opened(self, rt) -> None:
        """Every rank is at G; on a fresh run, every pool holds its first commit: from now on a
        restart recovers (every host's copy of the manifest says so)."""
        self.all_at(rt, rt.start_batch)
        if self.fresh:
            dist.barrier()
            self.manifest = {**self.manifest, "state": run_dir.CREATED}
            if run_dir.keeps_copy():  # every host's copy: hosts may share no file system
                run_dir.write(self.directory, self.manifest)
            self.fresh = False

    def at_batch(self, rt) -> None:
        if self.agree_each_batch:  # no step's exchange carries the targets: the fallback collective
            self.agree_on_g(rt)

    def all_at(self, rt, batch: int) -> None:
        """Every rank is at `batch` (recovered to G, made fresh, or imported at it): G is that batch,
        nothing to exchange."""
        rt.agree(batch)

    # The one way a group agrees on G while it trains, whatever carries the targets between the ranks
    def agree_on_g(self, rt, carry: Callable[[int], tuple[Any, Sequence[int]]] | None = None) -> Any:
        """G agreed for the batch in flight: this rank's target goes to every rank, the least of them
        is G, handed to rt.agree. carry(target) -> (its result, every rank's target, in rank order):
        a transport the step already has (the sharded step's id exchange: a collective saved a
        batch); None: one all-gather of the targets (a user's own loop, before each batch). Returns
        carry's result (None without one)."""
        target = self._local_target(rt)
        if carry is None:
            mine = torch.tensor([target], dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(every, mine)
            result, targets = None, [int(t) for t in every]
        else:
            result, targets = carry(target)
            if len(targets) != self.world_size:
                raise RuntimeError(f"the exchange carried {len(targets)} targets for {self.world_size} ranks")
        self._settle(rt, targets)
        return result

    def _local_target(self, rt) -> int:
        """This rank's part: the recovery target its durable commits reach."""
        crash_point(CrashPoint.DIST_BEFORE_AGREEMENT)
        target = rt.durable_target
        if target > rt.agreed:
            crash_point(CrashPoint.DIST_AFTER_LOCAL_COMMIT)  # committed here, not yet known to the peers
        return target

    def _settle(self, rt, targets: Sequence[int]) -> None:
        """G = the least target of any rank, handed to rt.agree."""
        g = min(targets)
        if planted(PlantedDist.COMMIT_WITHOUT_AGREEMENT):
            g = rt.batch + 1  # as if every rank had this batch's commit durable already
        rt.agree(g)
