"""One recovery point for every rank (docs/distributed.md): agree on G, roll every rank's pool back to it.

Each rank's pool is at its own durable target T_r (its root), and its undo ring keeps the records
of every batch at or above the agreed target its last commit knew (its snapshot's metadata
"agreed": U3b); its dense slots keep its slices of the dense state of those batches (U3d,
dense.free_slot): each rank's snapshot holds only its slice (checkpoint/dense_slices.py).
G = min T_r. A rank with T_r = G recovers as a single process does; a rank with T_r > G restores
its records of batches >= G too, and its root names its own slot holding its slice of G. A rank
whose ring or dense slots no longer reach G makes every rank refuse, before anything is written.
The whole dense state is put together afterwards from every rank's slice of G
(AgreedMinimum.whole_dense online, whole_dense_of_dir offline).

Online (`recover_group`, every rank of a starting run, over the process group) and offline
(`recover_dir`, one process over the whole directory, for `cxltrain recover DIR` and export) run
the same steps. Rolling back writes only absolute old values and a fresh root, so a crash anywhere
in here is repaired by recovering again.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch.distributed as dist

from ..checkpoint import dense, dense_slices, has_checkpoint, recover, roll_back, slots, verify
from ..errors import CxlTrainError, RecoveryError
from ..faults import CrashPoint
from ..pool.format import INCOMPAT_DENSE_SLICES
from ..pool.handle import Pool
from . import manifest as run_dir


@dataclasses.dataclass(frozen=True)
class RankState:
    """What a rank's pool says, read without writing."""

    rank: int
    target: int | None      # the root's batch (None: no pool, or no committed checkpoint)
    kept_from: int          # its ring keeps undo records of batches >= min(target, kept_from)
    error: str | None = None
    slices: tuple[int, ...] | None = None  # the batches of its dense slices (None: not read)


@dataclasses.dataclass(frozen=True)
class RankRecovery:
    rank: int
    target: int             # where its pool was
    batch: int              # G, where it is now
    records_restored: int
    seconds: float


def inspect_rank(directory: str, rank: int, run_id: str) -> RankState:
    path = run_dir.pool_path(directory, rank)
    if not os.path.exists(path):
        return RankState(rank, None, 0)
    try:
        with Pool.open(path, writable=False) as pool:
            if not has_checkpoint(pool):
                return RankState(rank, None, 0)
            _, snapshot = verify(pool)
            meta = snapshot["metadata"]
            if meta.get("run") != run_id or meta.get("rank") != rank:
                return RankState(rank, None, 0, f"{path}: is not rank {rank}'s pool of this run (it belongs to "
                                                f"run {meta.get('run')} rank {meta.get('rank')})")
            if not pool.superblock.incompat & INCOMPAT_DENSE_SLICES:
                return RankState(rank, None, 0, f"{path}: holds the whole dense state, as a cxltrain before dense "
                                                "slices wrote a rank's pool; recover, export or resume it with that "
                                                "version")
            held = tuple(sorted(b for b in slots.held_batches(pool).values()
                                if b is not None and b <= pool.root.batches_done))
            return RankState(rank, pool.root.batches_done, int(meta.get("agreed", 0)), slices=held)
    except CxlTrainError as e:
        return RankState(rank, None, 0, str(e))


def agree(states: list[RankState], directory: str) -> int | None:
    """G, or None when no rank holds a checkpoint yet; RecoveryError (the same line on every rank)
    when the ranks cannot be brought to one batch."""
    for s in states:
        if s.error:
            raise RecoveryError(f"rank {s.rank}: {s.error}")
    held = [s for s in states if s.target is not None]
    if not held:
        return None
    if len(held) < len(states):
        lacking = next(s for s in states if s.target is None)
        raise RecoveryError(f"{run_dir.pool_path(directory, lacking.rank)}: holds no committed checkpoint while "
                            f"rank {held[0].rank}'s pool does; the run cannot be recovered without every rank's pool")
    g = min(s.target for s in held)
    for s in held:
        if g < min(s.target, s.kept_from):
            raise RecoveryError(f"rank {s.rank} cannot reach batch {g}: its pool is at batch {s.target} and keeps "
                                f"undo records from batch {min(s.target, s.kept_from)} on; the ranks' pools "
                                "cannot be reconciled")
        if s.slices is not None and g not in s.slices:
            raise RecoveryError(f"rank {s.rank} cannot reach batch {g}: its pool holds its dense slices of batches "
                                f"{', '.join(map(str, s.slices))} only; the ranks' pools cannot be reconciled")
    return g


def roll_back_rank(path: str, g: int) -> tuple[int, int]:
    """Bring the pool at `path` to batch g, its root naming its own dense slice of g; returns (its
    target before, records restored). Slices of batches past g are dropped once the root is durable."""
    with Pool.open(path) as pool:
        target = pool.root.batches_done
        if target == g:
            report, _ = recover(pool)
            restored = report.records_restored
        else:
            live, _ = verify(pool, decode=False)  # every check before the first write
            slot = next((s for s, b in slots.held_batches(pool).items() if b == g), None)
            if slot is None:
                raise RecoveryError(f"{path}: holds no dense slice of batch {g}, the batch the ranks agreed on")
            dense.read_snapshot(pool, slot, g)  # its checksum and shape
            rollback, _ = roll_back(pool, g, live, dense_slot=slot, before_root=CrashPoint.DIST_RECOVER_BEFORE_ROOT)
            restored = len(rollback)
        dense.drop_abandoned_slices(pool)  # after the root naming g: a crash before it recovers again
        return target, restored


def whole_dense_of_dir(directory: str, world_size: int, own: int = 0, have: dict | None = None) -> dict:
    """The whole dense snapshot of a run directory whose ranks are all at one batch: every rank's
    slice (the one its root names), merged; the rest is rank `own`'s (`have`: its slice, already
    read). RecoveryError (one line) for a slice missing or of another batch."""
    trees = []
    for r in range(world_size):
        path = run_dir.pool_path(directory, r)
        if r == own and have is not None:
            trees.append(have)
            continue
        if not os.path.exists(path):
            raise RecoveryError(f"{path}: is missing: rank {r}'s slice of the dense state is in it")
        with Pool.open(path, writable=False) as pool:
            if not has_checkpoint(pool):
                raise RecoveryError(f"{path}: holds no dense slice: the dense state cannot be put together")
            trees.append(dense.read_snapshot(pool, pool.root.dense_slot, pool.root.dense_batch))
    return dense_slices.merge(trees, own, directory)


def recover_group(directory: str, rank: int, world_size: int, run_id: str, group=None) -> RankRecovery | None:
    """Every rank of a starting run calls this together: None when the run has no checkpoint yet."""
    started = time.perf_counter()
    state = inspect_rank(directory, rank, run_id)
    states: list = [None] * world_size
    dist.all_gather_object(states, state, group=group)
    g = agree(states, directory)
    if g is None:
        return None
    target, restored = roll_back_rank(run_dir.pool_path(directory, rank), g)
    dist.barrier(group=group)
    return RankRecovery(rank, target, g, restored, time.perf_counter() - started)


def recover_dir(directory: str) -> list[RankRecovery]:
    """`cxltrain recover DIR`: the same steps in one process, over every rank's pool."""
    m = run_dir.read(directory)
    world_size = m["world_size"]
    run_dir.check(directory, m, world_size, None, None)
    states = [inspect_rank(directory, r, m["run"]) for r in range(world_size)]
    g = agree(states, directory)
    if g is None:
        raise RecoveryError(f"{directory}: holds no committed checkpoint to recover")
    done = []
    for s in states:
        started = time.perf_counter()
        target, restored = roll_back_rank(run_dir.pool_path(directory, s.rank), g)
        done.append(RankRecovery(s.rank, target, g, restored, time.perf_counter() - started))
    return done
