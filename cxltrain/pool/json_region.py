"""A region holding one small JSON document, sealed: a header (magic, version, length, zero), the
JSON, zero padding, a CRC-32 seeded with the pool's UUID (a region copied from another pool never
validates). The stored placement plan (plan_format.py) and a rank pool's shard record
(shard_format.py) are such regions. No torch."""

from __future__ import annotations

import json
import struct

from ..errors import ConfigError, PoolCorruptError
from . import format as fmt

HEADER = struct.Struct("<IIII")      # magic, version, JSON length, zero


def pack_json(data: dict, uuid: bytes, magic: int, version: int, size: int, what: str) -> bytes:
    """The `size` bytes of a region holding `data`; ConfigError when it does not fit."""
    body = json.dumps(data, sort_keys=True).encode()
    room = size - HEADER.size - fmt.CHECKSUM_FIELD.size
    if len(body) > room:
        raise ConfigError(f"the {what} takes {len(body):,} bytes, more than the {room:,} its region holds "
                          "(too many tables)")
    raw = HEADER.pack(magic, version, len(body), 0) + body
    return fmt.seal(raw + bytes(room - len(body)) + bytes(fmt.CHECKSUM_FIELD.size), uuid)


def unpack_json(raw: bytes, uuid: bytes, magic: int, version: int, damaged: str) -> dict:
    """The JSON object the region bytes `raw` hold; PoolCorruptError(damaged) when they do not."""
    if len(raw) < HEADER.size + fmt.CHECKSUM_FIELD.size:
        raise PoolCorruptError(damaged)
    found, found_version, length, zero = HEADER.unpack_from(raw)
    if (found != magic or found_version != version or zero or length > len(raw)
            or not fmt.is_sealed(raw, uuid)):
        raise PoolCorruptError(damaged)
    try:
        data = json.loads(raw[HEADER.size : HEADER.size + length])
    except ValueError:
        raise PoolCorruptError(damaged) from None
    if not isinstance(data, dict):
        raise PoolCorruptError(damaged)
    return data
