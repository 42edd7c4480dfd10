"""One recovery point for every rank (docs/distributed.md): agree on G, roll every rank's pool back to it.

Each rank's pool is at its own durable target T_r (its root), and its undo ring keeps the records
of every batch at or above the agreed target its last commit knew (its snapshot's metadata
"agreed": U3b). G = min T_r. A rank with T_r = G recovers as a single process does; a rank
with T_r > G restores its records of batches >= G too, and takes the dense state at G from the
lowest rank whose own snapshot is at G (the dense state is replicated: DDP keeps it identical on
every rank) — written into its free dense slot before the root that names it. A rank whose ring
no longer reaches G (G below what it kept) makes every rank refuse, before anything is written.

Online (`recover_group`, every rank of a starting run, over the process group) and offline
(`recover_dir`, one process over the whole directory, for `cxltrain recover DIR` and export) run
the same steps. Rolling back writes only absolute old values and a fresh root, so a crash anywhere
in here is repaired by recovering again.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint import dense, has_checkpoint, layout, recover, roll_back, verify
from ..checkpoint.codec import decode
from ..errors import CxlTrainError, RecoveryError
from ..faults import CrashPoint
from ..pool.handle import Pool
from . import manifest as run_dir


@dataclasses.dataclass(frozen=True)
class RankState:
    """What a rank's pool says, read without writing."""

    rank: int
    target: int | None      # the root's batch (None: no pool, or no committed checkpoint)
    kept_from: int          # its ring keeps undo records of batches >= min(target, kept_from)
    error: str | None = None


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
            return RankState(rank, pool.root.batches_done, int(meta.get("agreed", 0)))
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
    return g


def snapshot_payload(path: str) -> np.ndarray:
    """The encoded dense snapshot the root of the pool at `path` names (checked), as bytes."""
    with Pool.open(path, writable=False) as pool:
        dense.read_snapshot(pool, pool.root.dense_slot, pool.root.dense_batch)  # the checks
        region = dense.slot_region(pool, pool.root.dense_slot)
        header = layout.unpack_dense_header(
            pool.device.array[region.offset : region.offset + layout.DENSE_HEADER.size].tobytes(),
            pool.superblock.uuid, pool.root.dense_slot)
        start = region.offset + layout.DENSE_HEADER.size
        return np.array(pool.device.array[start : start + header[1]])


def roll_back_rank(path: str, g: int, payload: np.ndarray | None) -> tuple[int, int]:
    """Bring the pool at `path` to batch g; returns (its target before, records restored).
    payload: the dense snapshot at g (snapshot_payload of a rank at g), needed when the pool is past g."""
    with Pool.open(path) as pool:
        target = pool.root.batches_done
        if target == g:
            report, _ = recover(pool)
            return target, report.records_restored
        live, own = verify(pool)  # every check before the first write
        tree = decode(payload)
        if not isinstance(tree, dict) or tree.get("batch") != g:
            raise RecoveryError(f"{path}: the dense state sent for batch {g} is not of batch {g}")
        # where this rank's tables sit, and its own run description (with the ring's agreed target at g)
        tree["tables"] = own["tables"]
        tree["metadata"] = {**own["metadata"], "agreed": tree["metadata"].get("agreed", 0)}
        slot = dense.free_slot(pool)
        dense.write_snapshot(pool, slot, g, tree)  # the slot no root names: a crash here changes nothing
        rollback, _ = roll_back(pool, g, live, dense_slot=slot, before_root=CrashPoint.DIST_RECOVER_BEFORE_ROOT)
        return target, len(rollback)


def recover_group(directory: str, rank: int, world_size: int, run_id: str, group=None) -> RankRecovery | None:
    """Every rank of a starting run calls this together: None when the run has no checkpoint yet."""
    started = time.perf_counter()
    state = inspect_rank(directory, rank, run_id)
    states: list = [None] * world_size
    dist.all_gather_object(states, state, group=group)
    g = agree(states, directory)
    if g is None:
        return None
    payload = None
    if any(s.target > g for s in states):
        source = min(s.rank for s in states if s.target == g)
        size = torch.zeros(1, dtype=torch.int64)
        data = None
        if rank == source:
            data = torch.from_numpy(snapshot_payload(run_dir.pool_path(directory, rank)))
            size[0] = data.numel()
        dist.broadcast(size, source, group=group)
        if data is None:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(data, source, group=group)
        payload = data.numpy()
    target, restored = roll_back_rank(run_dir.pool_path(directory, rank), g, payload if state.target > g else None)
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
    payload = None
    if any(s.target > g for s in states):
        source = min(s.rank for s in states if s.target == g)
        payload = snapshot_payload(run_dir.pool_path(directory, source))
    done = []
    for s in states:
        started = time.perf_counter()
        target, restored = roll_back_rank(run_dir.pool_path(directory, s.rank), g, payload if s.target > g else None)
        done.append(RankRecovery(s.rank, target, g, restored, time.perf_counter() - started))
    return done
