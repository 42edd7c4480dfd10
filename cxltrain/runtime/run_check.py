"""Checking a distributed run's directory whole, without writing (`pool check|info DIR`, and
`recover`/`export DIR` before they use it): the manifest, every rank pool on its own, and the
manifest against each rank pool — the tables the plan gives the rank are the regions it holds,
with the plan's rows, the pool's own record of its shard is the manifest's (shard_record.py), and
the pool's dense snapshot names this run and this rank. A rank pool
swapped, copied in from another run or out of reach of the others is refused here, not used.

    check_run_dir("/dev/shm/run").problems      # [] when the directory is whole
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import CxlTrainError, RecoveryError
from ..placement.sharding import ShardingPlan
from ..pool.format import Region
from ..pool.info import inspect
from ..tables.bag import region_names
from . import manifest as run_dir
from . import shard_record


@dataclasses.dataclass(frozen=True)
class RunCheck:
    problems: list[str]     # one line each; empty when the directory is whole
    batch: int | None       # the batch recovery brings every rank to (None: not known, or no checkpoint)


def check_run_dir(directory: str) -> RunCheck:
    """Every problem of the run directory `directory`. Raises RecoveryError when the manifest itself
    cannot be read."""
    m = run_dir.read(directory)
    try:
        run_dir.check(directory, m, m["world_size"], None, None)
    except RecoveryError as e:
        return RunCheck([str(e)], None)
    plan = ShardingPlan.from_json(m["plan"])
    problems, checked = [], True
    for rank in range(m["world_size"]):
        path = run_dir.pool_path(directory, rank)
        if not os.path.exists(path):
            checked = False  # a run still "creating": the next start makes it
            continue
        try:
            report = inspect(path)
        except CxlTrainError as e:
            problems.append(str(e))
            continue
        problems.extend(f"{path}: {p}" for p in report.problems)
        if report.ok:
            problems.extend(f"{path}: {p}" for p in _plan_problems(plan, rank, report.regions))
            problems.extend(f"{path}: {p}" for p in shard_record.problems(path, report, m, rank))
        checked = checked and not report.in_use  # a writer's snapshot changes under us
    if problems or not checked:
        return RunCheck(problems, None)
    return _check_snapshots(directory, m)


def refuse_damaged_run_dir(directory: str) -> None:
    """RecoveryError with the first problem of `directory` (check_run_dir), if it has any."""
    problems = check_run_dir(directory).problems
    if problems:
        raise RecoveryError(problems[0])


def _plan_problems(plan: ShardingPlan, rank: int, regions: list[Region]) -> list[str]:
    """What differs between the tables `plan` gives `rank` and the table regions its pool holds."""
    held = {r.name: r for r in regions}
    problems = []
    for t, table in enumerate(plan.tables):
        lo, hi = plan.rows_of(t, rank)
        for name in region_names(table.name):
            region = held.get(name)
            if rank not in table.ranks and region is not None:
                problems.append(f"holds {name}, which the manifest's plan gives rank {rank} no part of")
            elif rank in table.ranks and (region is None or region.shape[0] != hi - lo):
                has = "nothing" if region is None else f"{region.shape[0]:,} rows"
                problems.append(f"the manifest's plan gives rank {rank} {hi - lo:,} rows of {name} "
                                f"({table.kind}), its pool holds {has}")
    return problems


def _check_snapshots(directory: str, m: dict) -> RunCheck:
    """Each rank pool's own run id and rank, and whether the ranks can be brought to one batch."""
    from .group_recovery import agree, inspect_rank  # torch: only once the pools passed the checks above

    states = [inspect_rank(directory, r, m["run"]) for r in range(m["world_size"])]
    problems = [f"rank {s.rank}: {s.error}" for s in states if s.error]
    if problems:
        return RunCheck(problems, None)
    try:
        return RunCheck([], agree(states, directory))
    except RecoveryError as e:
        return RunCheck([str(e)], None)
