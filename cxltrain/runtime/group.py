"""A user's own model under torchrun: one `Runtime` per rank, one recovery point for all (docs/distributed.md).

    # torchrun --standalone --nproc-per-node 2 --max-restarts 3 my_train.py
    model = MyModel(rank)          # this rank's PersistentEmbeddingBags (own shards or replicas) + dense part
    with TorchrunRuntime("/dev/shm/my-run", model, dense_opt) as rt:   # a Runtime agreeing on G
        for batch in rt.batches(source, stop=1000):   # each batch: the ranks agree on G first
            loss = model.loss(batch); loss.backward(); dense_opt.step(); dense_opt.zero_grad()

It joins the gloo group torchrun's environment describes (unless one is up already), keeps the
rank's pool in DIR/rank-<r>.pool beside a manifest (manifest.py) whose plan records which rank
holds which table (a table on one rank: table-wise; on every rank: data-parallel), checked at
every start; on a restart every rank recovers to the agreed batch G (group_recovery.py) before the block
begins. The user owns the exchange between ranks; the dense state must be the same on every rank
(DDP, or every rank computing it alike), since a rank rolled back past its own snapshot takes it
from another. The agreement is one all-gather of the ranks' durable batches per batch, on the group
(recovery_point.py: the least of them is G).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..errors import CxlTrainError
from ..placement.sharding import ShardingPlan
from ..placement.table import DATA_PARALLEL, TABLE_WISE, TablePlacement
from . import manifest as run_dir
from .attempt import agree_on_attempt
from .recovery_point import AgreedMinimum
from .runtime import Runtime, persistent_tables

DEFAULT_TIMEOUT_S = 60.0
# torchrun's store outlives a restart: an error that a restart would only repeat is kept there
FAILED_KEY = "cxltrain/failed"
_launcher_store = None  # torchrun's store, once join_group has met it


class PeerLost(CxlTrainError):
    """A collective failed or timed out: a rank died (torchrun restarts the group) or hangs.

    Its group is not destroyed: gloo's destructor waits, holding the GIL, for the work queued on its
    connections, the dead peer's included, to end (a rank was seen to stay 30 s after its line,
    deaf to the agent's SIGTERM, until the SIGKILL). Left alive, its threads would meet the
    interpreter's exit (an abort, see join_group), so the rank ends at once (os._exit), its pool as
    committed as the Runtime left it."""

    ends_process_at_once = True


def peer_lost(error: BaseException) -> bool:
    """Whether `error` is what a dead or hung peer makes a collective raise: torch's distributed
    errors (backend, network, store), and gloo's transport errors (a connection reset, a receive
    timed out), which torch raises as plain RuntimeErrors naming gloo's transport sources."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo/transport/" in str(error))


def end_without_restart(line: str) -> None:
    """Keep `line` in torchrun's store: every rank of a later attempt of this torchrun refuses
    with it in join_group, before joining, instead of running into the same error again."""
    if _launcher_store is not None:
        _launcher_store.set(FAILED_KEY, line)


def join_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """(rank, world size): a gloo group from torchrun's environment (RANK, WORLD_SIZE, MASTER_*),
    or one rank in this process without it; every collective times out after timeout_s. Refuses
    (CxlTrainError) when an earlier attempt of this torchrun ended with an error no restart mends."""
    global _launcher_store
    # before the group exists: this module's functions take `group=group.WORLD` as a default, read
    # at import. Imported later (torch imports it lazily, e.g. with the optimizers' dynamo guard) it
    # keeps the group alive past destroy_process_group, and gloo's threads then meet the
    # interpreter's finalization: now and then a rank aborts at its exit (docs/testing.md)
    import torch.distributed.nn.functional  # noqa: F401
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        _launcher_store = store
        if store.check([FAILED_KEY]):
            raise CxlTrainError(f"{store.get(FAILED_KEY).decode()} (an earlier attempt's error: not retried)")
        # torchrun's store outlives a restart: keys of this attempt under a prefix of its own, or
        # gloo may read a dead rank's address from the attempt before (attempt.py: why not
        # TORCHELASTIC_RESTART_COUNT)
        attempt = agree_on_attempt(store, rank, world_size, timeout_s)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"cxltrain/attempt-{attempt}", store), rank=rank,
                                world_size=world_size, timeout=timeout)
    else:  # one rank in this process: no rendezvous, no port
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return rank, world_size


def refuse_together(error: str | None, world_size: int) -> None:
    """Every rank raises the first rank's error, or none does: one clear line on each."""
    errors: list = [None] * world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CxlTrainError(first)


def open_run_dir(directory: str, plan: ShardingPlan, settings: dict, rank: int, world_size: int) -> tuple[dict, bool]:
    """(the manifest, whether the pools are to be made). Each rank checks the copy in its own folder
    (hosts that share no file system keep one each, beside their ranks' pools); the copies must
    name one run, and one marked created makes the run created on every rank. A fresh run's
    manifest is rank 0's; the first rank of each host writes its host's copy (manifest.keeps_copy)."""
    error, found = None, None
    try:
        if run_dir.is_run_dir(directory):
            found = run_dir.read(directory)
            run_dir.check(directory, found, world_size, plan, settings, ranks=(rank,))
        elif os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
            error = f"{directory}: exists and is not a distributed run's directory (no {run_dir.MANIFEST})"
    except CxlTrainError as e:
        error = str(e)
    every: list = [None] * world_size
    dist.all_gather_object(every, (error, found))
    copies = [m for _, m in every if m is not None]
    if len({m["run"] for m in copies}) > 1 and not any(e for e, _ in every):
        error = f"{directory}: the ranks' manifests name different runs; every host's copy must be the same run's"
    refuse_together(error or next((e for e, _ in every if e), None), world_size)
    agreed = ([m for m in copies if m["state"] == run_dir.CREATED] + copies + [None])[0]
    if agreed is None:
        made = [run_dir.new(world_size, plan, settings) if rank == 0 else None]
        dist.broadcast_object_list(made, src=0)
        agreed = made[0]
    if found != agreed and run_dir.keeps_copy():
        run_dir.write(directory, agreed)
    dist.barrier()
    fresh = agreed["state"] == run_dir.CREATING
    if fresh:  # a start that died while making the pools: none holds a commit, make them again
        for leftover in (run_dir.pool_path(directory, rank), run_dir.pool_path(directory, rank) + ".creating"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return agreed, fresh


def plan_of(tables: dict, world_size: int) -> ShardingPlan:
    """Where the user put the tables: every rank's (name, rows) gathered, in name order."""
    mine = sorted((t.name or path, t.num_embeddings) for path, t in tables.items())
    every: list = [None] * world_size
    dist.all_gather_object(every, mine)
    holders: dict[tuple[str, int], list[int]] = {}
    for rank, held in enumerate(every):
        for table in held:
            holders.setdefault(tuple(table), []).append(rank)
    return ShardingPlan(world_size, tuple(
        TablePlacement(name, rows, kind=DATA_PARALLEL if len(ranks) > 1 else TABLE_WISE, ranks=tuple(ranks))
        for (name, rows), ranks in sorted(holders.items())))


def TorchrunRuntime(directory: str | os.PathLike, model: torch.nn.Module, optimizers=None, *,  # noqa: N802
                    settings: dict | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> Runtime:
    """The Runtime of this rank of a torchrun job (see the module docstring): a Runtime whose
    recovery point is the group's agreed G, agreed before every batch it hands out. settings: a
    JSON-like dict describing the run, stored in the manifest; a restart with other settings,
    another world size or other tables is refused on every rank before anything is written.
    Calling it and entering the Runtime are collective: every rank together, in the same order
    as its other collectives. After entering, `rt.recovery_point` holds `rank`, `world_size` and
    `recovered` (group_recovery.RankRecovery, or None on a fresh run)."""
    directory = os.fspath(directory)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = join_group(timeout_s)
    plan = plan_of(persistent_tables(model), world_size)
    manifest, fresh = open_run_dir(directory, plan, run_dir.settings_of(settings or {}), rank, world_size)
    point = AgreedMinimum(directory, rank, world_size, manifest, fresh, agree_each_batch=True)
    return Runtime(point.pool_path, model, optimizers, recovery_point=point, **kwargs)
