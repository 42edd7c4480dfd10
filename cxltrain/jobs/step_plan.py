"""`cxltrain plan`'s choice of the fast tier's room (so the hot-row caches) and the write-back
interval for a new pool set (docs/planner.md): each configuration priced by the step model
(placement/step_model.py) from the measured tiers and the data's held-out batches.

    choice = choose_configuration(config, model, source, "/dev/shm/ctr.pool")
    print(format_choice(choice.priced, choice.chosen, choice.fast_step_how))
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..emulation.cxl import free_bytes
from ..errors import ConfigError
from ..knobs import KNOBS
from ..placement import planner
from ..placement import step_model as sm
from ..runtime.runtime import Runtime
from .config import TrainConfig
from .planning import PROFILE_BATCHES, hot_list_batches
from .tier_probe import measure_speeds

FAST_STEP_ROWS = 65_536   # the fast-tier step is measured on the model with tables of at most this many rows
FAST_STEP_TIMED = 5       # steps timed after the warm-up


@dataclasses.dataclass
class Choice:
    chosen: sm.Prediction
    priced: list[sm.Prediction]
    speeds: sm.TierSpeeds
    budget: int                   # the fast tier's room the caches were chosen within (whole tables included)
    fast_step_how: str

    def to_json(self) -> dict:
        return {"cache_rows": self.chosen.cache_rows_option, "write_back_every": self.chosen.write_back_every,
                "budget": self.budget, "predicted": self.chosen.to_json(), "fast_step": self.fast_step_how,
                "speeds": self.speeds.to_json(), "priced": [p.to_json() for p in self.priced]}


def shapes_of(model) -> list[sm.TableShape]:
    return [sm.TableShape(t.name, t.num_embeddings,
                          tuple(spec.row_stride(KNOBS.row_align) for spec in t.region_specs()),
                          t.optimizer.state_columns * 4)
            for t in model.tables]


def choose_configuration(config: TrainConfig, model, source, pool_path: str,
                         fast_step_ms: float | None = None) -> Choice:
    """Price every configuration whose caches fit in the fast tier's room (--fast-bytes, else the
    free space of the pool's folder, less the whole tables --fast-bytes puts there) and choose one
    (step_model.choose). --cache-rows and --write-back-every, when given, are kept, and only the
    rest is chosen."""
    shapes = shapes_of(model)
    row_bytes = [(s.name, s.rows, sum(s.strides)) for s in shapes]
    profiled = config.profile_batches or PROFILE_BATCHES
    hot_batches = max(hot_list_batches(config), profiled)
    total = hot_batches if source.num_batches is None else min(hot_batches, source.num_batches)
    batches = [[v.numpy().astype(np.int64) for v in source.batch(b).values[: len(shapes)]] for b in range(total)]
    if total < 2:
        raise ConfigError(f"plan needs at least 2 batches of data to price a configuration, the data has {total}")
    profiles = planner.profiles_of(row_bytes, batches[:profiled])
    # the hot lists `train` stores: ranked on the even batches of these (planning.plan_and_hot_rows),
    # so the odd ones are held out from the ranking
    ranked = planner.profiles_of(row_bytes, batches)
    held_out = [{s.name: ids for s, ids in zip(shapes, values)} for values in batches[1::2]]

    fast_dir = os.path.dirname(os.path.abspath(pool_path))
    budget = config.fast_bytes if config.fast_bytes is not None else free_bytes(fast_dir)
    whole = planner.make_plan(profiles, config.fast_bytes or 0)  # the whole tables --fast-bytes puts in the fast tier
    row_bytes = {p.name: p.row_bytes for p in profiles}
    room = budget - sum(t.bytes for t in whole.tables if t.tier == planner.FAST)
    options = [config.cache_rows] if config.cache_rows is not None else sm.cache_candidates(
        min(s.rows for s in shapes), sum(row_bytes[name] for name in whole.capacity_tables), room)
    intervals = [config.write_back_every] if config.write_back_every else [
        n for n in sm.INTERVALS if n <= len(held_out)]
    speeds = measure_speeds(fast_dir, os.path.dirname(os.path.abspath(config.capacity_pool)))
    if fast_step_ms is None:
        fast_step_ms, how = measure_fast_step(config, fast_dir), (
            f"measured: {FAST_STEP_TIMED} steps of this model, tables of at most {FAST_STEP_ROWS:,} rows, in {fast_dir}")
    else:
        how = "given"
    priced = []
    for option in options:
        plan = planner.make_plan(profiles, config.fast_bytes or 0, option)
        cached = plan.cached_rows
        hot = {p.name: p.hot_rows(cached[p.name]) for p in ranked if cached.get(p.name)}
        seen = sm.traffic(shapes, set(plan.capacity_tables), held_out, hot)
        ring = _ring_bytes(config, model, plan, hot)
        cache_bytes = sum(rows * row_bytes[name] for name, rows in cached.items())
        priced += [sm.predict(speeds, fast_step_ms, option, cached, cache_bytes, seen, n, ring) for n in intervals]
    return Choice(sm.choose(priced), priced, speeds, budget, how)


def _ring_bytes(config: TrainConfig, model, plan: planner.Plan, hot: dict) -> int:
    """The undo ring a new set of this configuration gets (Runtime.ring_bytes, the one sizing rule)."""
    return Runtime("", model, None, capacity_pool=config.capacity_pool, plan=plan, hot_rows=hot,
                   dense_every=config.dense_every, cache_replace_every=config.cache_replace_every,
                   rows_per_batch=config.batch_size * config.pooling).ring_bytes()


def measure_fast_step(config: TrainConfig, folder: str) -> float:
    """Mean ms a step of `config`'s model takes with every table in the fast tier: a short run with
    its tables cut to FAST_STEP_ROWS rows, in a pool in `folder` that is removed after."""
    from .train import WARMUP_STEPS, train

    rows = [min(r, FAST_STEP_ROWS) for r in config.rows_per_table()]
    small = dataclasses.replace(
        config, rows=rows[0], table_rows=None if config.table_rows is None else tuple(rows),
        steps=WARMUP_STEPS + FAST_STEP_TIMED, epochs=None, eval_every=0, metrics=None, pool=None,
        capacity_pool=None, fast_bytes=None, profile_batches=None, cache_rows=None, write_back_every=None,
        cache_replace_every=0)
    path = os.path.join(folder, f".cxltrain-step-probe-{os.getpid()}.pool")
    try:
        return train(small, pool_path=path, progress=False).timings.split_ms.total
    finally:
        for leftover in (path, path + ".creating"):
            if os.path.exists(leftover):
                os.unlink(leftover)
