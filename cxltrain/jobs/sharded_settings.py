"""What a distributed run's settings decide, torch-free (the launcher checks them before torch
starts): the plan for a world size, the settings the manifest keeps, and what a run refuses."""

from __future__ import annotations

from ..errors import ConfigError
from ..modes import STRICT
from ..placement.sharding import ShardingPlan, make_plan, parse_kinds
from ..runtime import manifest as run_dir
from .config import TrainConfig


def plan_for(config: TrainConfig, world_size: int, sharding: str) -> ShardingPlan:
    return make_plan([config.rows] * config.num_tables, world_size, parse_kinds(sharding, config.num_tables))


def settings_for(config: TrainConfig, sharding: str) -> dict:
    return run_dir.settings_of({**config.run_metadata(), "sharding": sharding, "checkpoint": config.checkpoint,
                                "dense_every": config.dense_every})


def check_config(config: TrainConfig, world_size: int) -> None:
    config.validate()
    if config.batch_size % world_size:
        raise ConfigError(f"--batch-size {config.batch_size} must split evenly over {world_size} ranks")
    if config.mode != STRICT:
        raise ConfigError("a distributed run commits in strict mode only (relaxed mode has no one recovery point)")
    if config.data is not None:
        raise ConfigError("a distributed run trains on synthetic data (--data is single-process for now)")
    if config.device == "cuda":
        raise ConfigError("--device cuda trains in one process for now; leave out --nproc-per-node or the device")
