"""The planner's job side (docs/planner.md): profile a `train` configuration's data, plan a new pool
set, or read an existing set's stored plan back; measure the tiers for `cxltrain plan`.

    plan = plan_for(config, model, source, pool_path)   # None without a capacity pool
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..emulation.cxl import free_bytes
from ..errors import ConfigError
from ..knobs import KNOBS
from ..placement import planner
from ..pool.handle import Pool
from .config import TrainConfig
from .tier_probe import copy_mb_s

PROFILE_BATCHES = 16
# The hot-row caches' hot lists rank the rows of this many lookups a table (or of the plan's profile,
# when it has more): fewer see too few lookups of the tail's rows to rank them, so a long run misses
# more (docs/tiers.md, "The hot list", measures the hit rate of batches no ranking saw). Counted in
# lookups, so that the profile's ids, held in memory while they are ranked, do not grow with the batch.
HOT_LIST_LOOKUPS = 1 << 20
HOT_LIST_BATCHES = 512  # at most: a batch of few lookups is ranked on this many
PROBE_BYTES = 8 << 20     # the capacity tier's read probe: a file this big, read back at random
PROBE_SECONDS = 0.2


def table_profiles(config: TrainConfig, model, source, batches: int | None = None) -> list[planner.TableProfile]:
    """Each table's size and the ids of `source`'s first batches (`batches`, else config.profile_batches)."""
    tables = []
    for table in model.tables:
        row_bytes = sum(spec.nbytes(KNOBS.row_align) for spec in table.region_specs()) // table.num_embeddings
        tables.append((table.name, table.num_embeddings, row_bytes))
    return planner.profile_source(source, tables, batches or config.profile_batches or PROFILE_BATCHES)


def plan_for(config: TrainConfig, model, source, pool_path: str) -> planner.Plan | None:
    """The plan of the pool set `config` trains in: the one stored in an existing set (options
    that would plan differently refused), or a new one. None without a capacity pool."""
    return plan_and_hot_rows(config, model, source, pool_path)[0]


def hot_list_batches(config: TrainConfig) -> int:
    """The batches the hot lists of `config`'s tables are ranked on: HOT_LIST_LOOKUPS lookups of each
    table, at most HOT_LIST_BATCHES batches (512 for the default model's 2,048 lookups a batch)."""
    return max(1, min(HOT_LIST_BATCHES, -(-HOT_LIST_LOOKUPS // (config.batch_size * config.pooling))))


def plan_and_hot_rows(config: TrainConfig, model, source, pool_path: str, *,
                      rank_hot_rows: bool = True) -> tuple[planner.Plan | None, dict]:
    """plan_for's plan, and for a new set the rows each capacity table's hot-row cache admits
    ({table: row ids, hottest first}, as many as the plan's cached_rows; empty for an existing set,
    which holds its own). rank_hot_rows=False: rows 0..n-1 instead, for sizing a pool, which needs
    only how many (the ranking reads hot_list_batches batches)."""
    if config.capacity_pool is None:
        if config.fast_bytes is not None or config.profile_batches is not None or config.cache_rows is not None:
            raise ConfigError("--fast-bytes, --profile-batches and --cache-rows plan a pool set: they need "
                              "--capacity-pool")
        return None, {}
    if pool_path and os.path.exists(pool_path):
        with Pool.open(pool_path, writable=False) as pool:
            stored = planner.stored_plan(pool) if pool.members else None
        if stored is not None:
            planner.check_options(stored, config.fast_bytes, config.profile_batches, pool_path, config.cache_rows)
            return stored, {}
        if config.fast_bytes is not None or config.cache_rows is not None:
            raise ConfigError(f"{pool_path}: this pool set was made without a placement plan; resume without "
                              "--fast-bytes and --cache-rows, or use another pool")
        return None, {}
    profiles = table_profiles(config, model, source)
    plan = planner.make_plan(profiles, config.fast_bytes or 0, config.cache_rows)
    cached = plan.cached_rows
    if not rank_hot_rows:
        return plan, {name: np.arange(rows, dtype=np.int64) for name, rows in cached.items() if rows}
    ranked = hot_list_batches(config)
    if any(cached.values()) and plan.profile_batches < ranked:
        profiles = table_profiles(config, model, source, ranked)
    hot = {p.name: p.hot_rows(cached[p.name]) for p in profiles if cached.get(p.name)}
    return plan, hot


def measure_tiers(pool_path: str, capacity_path: str) -> dict:
    """Each tier's free space and read speed, measured quickly: the fast tier by a copy in memory,
    the capacity tier by random page reads of a probe file beside the capacity pool, with the
    page cache bypassed (O_DIRECT) where the file system allows it."""
    fast_dir = os.path.dirname(os.path.abspath(pool_path))
    cap_dir = os.path.dirname(os.path.abspath(capacity_path))
    return {planner.FAST: {"path": fast_dir, "free_bytes": free_bytes(fast_dir), "read_mb_s": copy_mb_s(PROBE_BYTES),
                           "how": "a copy in memory"},
            planner.CAPACITY: {"path": cap_dir, "free_bytes": free_bytes(cap_dir), **_probe_reads(cap_dir)}}


def _probe_reads(folder: str) -> dict:
    path = os.path.join(folder, f".cxltrain-probe-{os.getpid()}")
    page = planner.PAGE_BYTES
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            fd, how = os.open(path, os.O_RDONLY | os.O_DIRECT), f"random {page}-byte reads, O_DIRECT"
        except OSError:  # tmpfs and a few others have no O_DIRECT
            fd, how = os.open(path, os.O_RDONLY), f"random {page}-byte reads, through the page cache"
        try:
            import mmap

            buffer = mmap.mmap(-1, page)  # page-aligned, as O_DIRECT wants
            offsets = np.random.default_rng(0).integers(0, PROBE_BYTES // page, 1 << 16) * page
            reads, started = 0, time.perf_counter()
            while time.perf_counter() - started < PROBE_SECONDS and reads < offsets.size:
                os.preadv(fd, [buffer], int(offsets[reads]))
                reads += 1
            seconds = time.perf_counter() - started
        finally:
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"read_mb_s": reads * page / seconds / 1e6, "how": how}


def device_cache_ids(config: TrainConfig, model, source, device) -> dict:
    """{table: the row ids [C] a GPU's hot-row cache holds}, hottest first (profiled from `source`),
    sized by planner.device_cache_rows within half the GPU's free memory (--device-cache-rows
    overrides; 0: no cache)."""
    import torch

    if config.device_cache_rows == 0:
        return {}
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    tables = [(t.name, t.num_embeddings,
               sum(spec.nbytes(KNOBS.row_align) for spec in t.region_specs()) // t.num_embeddings)
              for t in model.tables]
    sizes = planner.device_cache_rows(tables, free // 2, config.batch_size * config.pooling, config.device_cache_rows)
    if all(sizes[name] == rows for name, rows, _ in tables):  # every row: no profile needed
        return {name: torch.arange(rows) for name, rows, _ in tables}
    profiles = table_profiles(config, model, source, hot_list_batches(config))
    return {p.name: torch.from_numpy(p.hot_rows(sizes[p.name]).astype(np.int64)) for p in profiles if sizes[p.name]}
