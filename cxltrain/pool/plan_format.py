"""The stored placement plan's region on the media (placement/planner.py has the plan itself): a
sealed JSON region (json_region.py). Here so that every opener and `pool check` can refuse a
damaged plan without the placement layer. No torch."""

from __future__ import annotations

from .json_region import pack_json, unpack_json

PLAN_REGION = "cxltrain.plan"
PLAN_BYTES = 16 << 10
PLAN_MAGIC = int.from_bytes(b"CXPL", "little")
PLAN_VERSION = 1


def pack_plan_json(data: dict, uuid: bytes) -> bytes:
    """The plan region's bytes for the plan `data` (its JSON form); ConfigError when too big."""
    return pack_json(data, uuid, PLAN_MAGIC, PLAN_VERSION, PLAN_BYTES, "plan")


def plan_json(raw: bytes, uuid: bytes, where: str) -> dict:
    """The plan the region bytes `raw` hold, as decoded JSON; PoolCorruptError when damaged."""
    return unpack_json(raw, uuid, PLAN_MAGIC, PLAN_VERSION, f"{where}: its placement plan ({PLAN_REGION}) is damaged")
