"""A distributed run's directory: one pool per rank and a manifest, checked at every start.

    DIR/manifest.json   {"format", "run" (a UUID), "world_size", "plan", "settings", "state"}
    DIR/rank-<r>.pool   rank r's shards, undo ring and dense slots (an ordinary cxltrain pool),
                        and its record of its own shard (shard_record.py)

The manifest is rank 0's, written before any pool ("creating"), and marked "created" once every
rank's pool holds its first commit; a start that finds "creating" makes the pools again. Hosts that
share no file system keep a copy each, beside their own ranks' pools (`keeps_copy`). It is
replaced whole (a temporary file renamed over it, synced), never edited in place. Torch-free.
"""

from __future__ import annotations

import json
import os
import uuid

from ..errors import ConfigError, RecoveryError
from ..placement.sharding import ShardingPlan

# /2: every rank pool records its own shard at creation (shard_record.py); /1 folders are still
# read, their rank pools checked by shape and snapshot only
FORMAT = "cxltrain-dist/2"
READABLE = ("cxltrain-dist/1", FORMAT)
MANIFEST = "manifest.json"
CREATING, CREATED = "creating", "created"


def pool_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.pool")


def keeps_copy() -> bool:
    """Whether this process writes the manifest's copy of its host: the first rank of each torchrun
    agent (LOCAL_RANK 0), or a process outside torchrun. Hosts may share no file system."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def is_run_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST))


def read(directory: str) -> dict:
    """The manifest of `directory`, checked for shape; RecoveryError when unreadable."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise RecoveryError(f"{directory}: no {MANIFEST} (not a distributed run's directory)") from None
    except (OSError, ValueError) as e:
        raise RecoveryError(f"{path}: unreadable ({e})") from None
    keys = {"format", "run", "world_size", "plan", "settings", "state"}
    if not isinstance(data, dict) or set(data) != keys or data["format"] not in READABLE:
        raise RecoveryError(f"{path}: not a {FORMAT} manifest")
    try:
        plan = ShardingPlan.from_json(data["plan"])
    except ConfigError as e:
        raise RecoveryError(f"{path}: {e}") from None
    if plan.world_size != data["world_size"]:
        raise RecoveryError(f"{path}: its plan is for {plan.world_size} rank(s), the manifest says {data['world_size']!r}")
    return data


def new(world_size: int, plan: ShardingPlan, settings: dict) -> dict:
    return {"format": FORMAT, "run": str(uuid.uuid4()), "world_size": world_size, "plan": plan.to_json(),
            "settings": settings, "state": CREATING}


def write(directory: str, manifest: dict) -> None:
    """Replace the manifest whole and durably."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MANIFEST)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check(directory: str, manifest: dict, world_size: int, plan: ShardingPlan | None, settings: dict | None,
          ranks: tuple[int, ...] | None = None) -> None:
    """Refuse (RecoveryError, one line) a start that does not fit the directory: another world
    size, another plan or other settings, or a rank pool missing or extra. ranks: the ranks whose
    pools must be here (default every rank's; a host of several keeps only its own). Reads only."""
    if manifest["world_size"] != world_size:
        raise RecoveryError(f"{directory}: was written by {manifest['world_size']} rank(s), this start has "
                            f"{world_size}; restart with --nproc-per-node {manifest['world_size']} (or re-shard: "
                            "`cxltrain export` then `cxltrain import --nproc-per-node N`)")
    if plan is not None and ShardingPlan.from_json(manifest["plan"]) != plan:
        raise RecoveryError(f"{directory}: was written with another sharding plan; restart with the same --sharding "
                            "(or re-shard through export and import)")
    if settings is not None and manifest["settings"] != settings:
        differ = sorted(k for k in set(settings) | set(manifest["settings"])
                        if settings.get(k) != manifest["settings"].get(k))
        raise RecoveryError(f"{directory}: was written by a run with other settings ({', '.join(differ[:3])}); "
                            "resume with the same settings, or use another directory")
    if manifest["state"] == CREATED:
        missing = [r for r in (range(world_size) if ranks is None else ranks) if not os.path.exists(pool_path(directory, r))]
        if missing:
            raise RecoveryError(f"{pool_path(directory, missing[0])}: rank {missing[0]}'s pool is missing; the "
                                "run cannot be recovered without every rank's pool")
    ranks = [name[len("rank-"):-len(".pool")] for name in os.listdir(directory)
             if name.startswith("rank-") and name.endswith(".pool")]
    extra = sorted(r for r in ranks if not r.isdigit() or int(r) >= world_size)
    if extra:
        raise RecoveryError(f"{directory}: holds rank-{extra[0]}.pool, a pool of no rank of this {world_size}-rank "
                            "run")


def settings_of(config_metadata: dict) -> dict:
    """The run's settings as the manifest keeps them (JSON: tuples become lists)."""
    return json.loads(json.dumps(config_metadata))
