"""Export a distributed run to one plain state dict, and import one onto any world size.

    state = export_dir(DIR)            # the keys and shapes of a single-process `cxltrain export`
    import_state("OUT.pt", NEW_DIR, config, world_size=3, sharding="auto")

Export recovers the directory to its agreed batch G first (recovery.recover_dir), then gathers the
tables from the pools that hold them (a row-wise table's shards in rank order, a data-parallel
table from rank 0). `cxltrain export` streams them (streamed_export_dir): read a chunk at a time as
the file is written, never a whole table in memory.
The dense state and the optimizers' are put together from every rank's slice of G.

Import re-shards: it plans the tables for the new world size, and writes every rank's pool as a
start would, but with the imported rows, optimizer state and dense state, committed at the
exported batch; the new run continues from there. Nothing is written unless the state dict fits
the settings (table count, rows, dim, dense shapes); the directory must not exist.
"""

from __future__ import annotations

import os
import shutil
import zipfile

import numpy as np
import torch

from ..checkpoint import first_commit
from ..errors import ConfigError
from ..placement.sharding import DATA_PARALLEL, ShardingPlan
from ..pool.handle import Pool, publish
from ..runtime import manifest as run_dir
from ..runtime.group_recovery import recover_dir, whole_dense_of_dir
from ..runtime.interop import DLRM_COLLECTION
from ..runtime.recovery_point import AgreedMinimum
from ..runtime.run_check import refuse_damaged_run_dir
from ..runtime.runtime import materialized
from ..runtime.state_import import load_dcp
from ..runtime.streamed_save import Streamed
from ..tables.bag import region_names
from ..tables.cache import merged_chunks
from .config import TrainConfig
from .sharded_settings import check_config, plan_for, settings_for
from .sharded_train import build, seed_everything

DENSE_PREFIX = "dense."
OLD_TABLE_PREFIX = "tables."   # exports made before the DLRM held its tables in a collection


def table_key(t: int, what: str) -> str:
    """The export key of table t's `what` ("weight", "optimizer_state"), as a single process names it."""
    return f"{DLRM_COLLECTION}.embedding_bags.t{t}.{what}"


def _table_tensor(model: dict, t: int, what: str):
    found = model.get(table_key(t, what))
    return found if found is not None else model.get(f"{OLD_TABLE_PREFIX}{t}.{what}")


def _is_table_key(key: str) -> bool:
    return key.startswith((OLD_TABLE_PREFIX, f"{DLRM_COLLECTION}.embedding_bags."))


def export_dir(directory: str) -> dict:
    """{"batch", "model", "optimizers", "schedulers"} as a single process exports them, every table in
    memory (streamed_export_dir's, read)."""
    return materialized(streamed_export_dir(directory))


def streamed_export_dir(directory: str) -> dict:
    """export_dir's dict with every table a streamed_save.Streamed: gathered from the pools that hold
    it a chunk at a time as it is written, so memory holds a chunk, never a table."""
    refuse_damaged_run_dir(directory)  # before recovery writes to any pool
    done = recover_dir(directory)
    m = run_dir.read(directory)
    plan = ShardingPlan.from_json(m["plan"])
    snapshot = whole_dense_of_dir(directory, m["world_size"])  # every rank's slice of G
    model = {k[len(DENSE_PREFIX):]: v for k, v in snapshot["model"].items() if k.startswith(DENSE_PREFIX)}
    for t, table in enumerate(plan.tables):
        weight_region, state_region = region_names(table.name)
        ranks = table.ranks[:1] if table.kind == DATA_PARALLEL else table.ranks
        for key, region in ((table_key(t, "weight"), weight_region), (table_key(t, "optimizer_state"), state_region)):
            gathered = _gathered(directory, ranks, table.name, region, region == state_region)
            if gathered is not None:
                model[key] = gathered
    tables = {f"{DLRM_COLLECTION}.embedding_bags.t{t}": f"t{t}" for t in range(len(plan.tables))}
    return {"batch": done[0].batch, "model": model, "optimizers": snapshot["optimizers"],
            "schedulers": snapshot["schedulers"], "tables": tables}


def _gathered(directory: str, ranks, table: str, region: str, optimizer_state: bool) -> Streamed | None:
    """Region `region` of the pools of `ranks`, their rows one after the other (row-wise shards in rank
    order), as a Streamed value; None where no pool holds it."""
    holders, rows, columns, dtype = [], 0, 0, None
    for r in ranks:
        with Pool.open(run_dir.pool_path(directory, r), writable=False) as pool:
            if region in pool.regions:
                shape = pool.array(region).shape
                holders.append(r)
                rows, columns = rows + shape[0], shape[1]
                dtype = torch.from_numpy(np.empty(0, pool.region(region).dtype.numpy)).dtype
    if not holders:
        return None

    def chunks():
        for r in holders:
            with Pool.open(run_dir.pool_path(directory, r), writable=False) as pool:
                yield from merged_chunks(pool, table, region, optimizer_state)
    return Streamed((rows, columns), dtype, chunks)


def import_state(source: str, directory: str, config: TrainConfig, world_size: int, sharding: str) -> int:
    """Write `directory`: `world_size` rank pools holding the state dict at `source`; returns its batch."""
    check_config(config, world_size)
    if os.path.exists(directory):
        raise ConfigError(f"{directory}: already exists; import makes a new run's directory")
    if os.path.isdir(source):  # a DCP checkpoint: read as the pool import reads it
        state = load_dcp(source)[0]
    else:
        try:
            # mapped, not read: each rank's rows are paged in as they are copied into its pool
            state = torch.load(source, weights_only=True, mmap=zipfile.is_zipfile(source))
        except (OSError, RuntimeError, ValueError) as e:
            raise ConfigError(f"{source}: not a state dict cxltrain can read ({str(e).splitlines()[0][:120]})") \
                from None
    plan = plan_for(config, world_size, sharding)
    batch = _check_fits(state, config, plan, source)
    m = {**run_dir.new(world_size, plan, settings_for(config, sharding))}
    try:
        run_dir.write(directory, m)
        for rank in range(world_size):
            _write_rank(state, config, plan, directory, rank, m, batch)
        run_dir.write(directory, {**m, "state": run_dir.CREATED})
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)  # nothing half-made is left behind
        raise
    return batch


def _check_fits(state, config: TrainConfig, plan: ShardingPlan, source: str) -> int:
    if not isinstance(state, dict) or not {"batch", "model", "optimizers", "schedulers"} <= set(state):
        raise ConfigError(f"{source}: not a cxltrain export (it needs batch, model, optimizers, schedulers)")
    model = state["model"]
    for t, table in enumerate(plan.tables):
        weight = _table_tensor(model, t, "weight")
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (table.rows, config.dim):
            shape = None if weight is None else list(weight.shape)
            raise ConfigError(f"{source}: table {t} is {shape}, the settings make it [{table.rows}, {config.dim}] "
                              "(give import the options the run was trained with)")
    if _table_tensor(model, len(plan.tables), "weight") is not None:
        raise ConfigError(f"{source}: holds more than the {len(plan.tables)} tables of --num-tables")
    batch = state["batch"]
    if not isinstance(batch, int) or not 0 <= batch <= config.steps:
        raise ConfigError(f"{source}: batch {batch!r} is not within --steps {config.steps}")
    return batch


def _write_rank(state, config: TrainConfig, plan: ShardingPlan, directory: str, rank: int, manifest: dict,
                batch: int) -> None:
    seed_everything(config.seed)  # the global RNG states a start has
    point = AgreedMinimum(directory, rank, plan.world_size, manifest, fresh=True)
    model, dense_opt, rt = build(config, plan, point)
    try:
        model.dense.load_state_dict({k: v for k, v in state["model"].items() if not _is_table_key(k)})
        if state["optimizers"]:  # TorchRec's checkpoints bring none: Adam starts afresh, as on a new run
            dense_opt.load_state_dict(state["optimizers"][0])
    except (RuntimeError, ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"the dense or optimizer state does not fit this model ({str(e).splitlines()[0][:160]})") \
            from None
    path = run_dir.pool_path(directory, rank)
    pool = Pool.create(path + ".creating", rt.pool_bytes(), incompat=rt.pool_incompat)
    try:
        pool.add_regions(rt.new_pool_regions())
        point.created(pool)  # its record of its own shard, as a trained run's rank pools hold
        for t, shard in zip(model.table_index, model.shards):
            shard.attach(pool, initialize=False)
            lo, hi = plan.rows_of(t, rank)
            weights, opt_state = shard.storage()
            with torch.no_grad():
                weights[:, : config.dim].copy_(_table_tensor(state["model"], t, "weight")[lo:hi])
                if opt_state is not None:
                    opt_state.copy_(_table_tensor(state["model"], t, "optimizer_state")[lo:hi])
            shard.persist()
        point.all_at(rt, batch)  # every rank is imported at `batch`
        first_commit(pool, batch, rt.dense_state.capture(batch))
        publish(pool, path)
    except BaseException:
        pool.close()
        os.unlink(pool.path)
        raise
    pool.close()
