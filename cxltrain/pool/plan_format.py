"""The stored placement plan's region on the media (placement/planner.py has the plan itself): a
header, the plan as JSON, a CRC-32 seeded with the primary's UUID. Here so that every opener and
`pool check` can refuse a damaged plan without the placement layer. No torch."""

from __future__ import annotations

import json
import struct

from ..errors import PoolCorruptError
from . import format as fmt

PLAN_REGION = "cxltrain.plan"
PLAN_BYTES = 16 << 10
PLAN_HEADER = struct.Struct("<IIII")      # magic, version, JSON length, zero
PLAN_MAGIC = int.from_bytes(b"CXPL", "little")
PLAN_VERSION = 1


def plan_json(raw: bytes, uuid: bytes, where: str) -> dict:
    """The plan the region bytes `raw` hold, as decoded JSON; PoolCorruptError when damaged."""
    magic, version, length, zero = PLAN_HEADER.unpack_from(raw)
    damaged = PoolCorruptError(f"{where}: its placement plan ({PLAN_REGION}) is damaged")
    if (magic != PLAN_MAGIC or version != PLAN_VERSION or zero or length > len(raw)
            or not fmt.is_sealed(raw, uuid)):
        raise damaged
    try:
        data = json.loads(raw[PLAN_HEADER.size : PLAN_HEADER.size + length])
    except ValueError:
        raise damaged from None
    if not isinstance(data, dict):
        raise damaged
    return data
