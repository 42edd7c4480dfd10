"""A rank pool's record of its own shard, on the media: which run, which rank of how many, and the
rows of each table it holds a part of (runtime/shard_record.py makes and compares it). Written once,
before the pool's first commit; a sealed JSON region (json_region.py). Here so that `pool check`
refuses a damaged record without the runtime layer. No torch."""

from __future__ import annotations

import os

from .format import Region
from .json_region import pack_json, unpack_json

SHARD_REGION = "cxltrain.shard"
SHARD_BYTES = 16 << 10
SHARD_MAGIC = int.from_bytes(b"CXSH", "little")
SHARD_VERSION = 1


def pack_shard(record: dict, uuid: bytes) -> bytes:
    """The shard region's bytes for `record`; ConfigError when too big."""
    return pack_json(record, uuid, SHARD_MAGIC, SHARD_VERSION, SHARD_BYTES, "shard record")


def shard_json(raw: bytes, uuid: bytes, where: str = "") -> dict:
    """The record the region bytes `raw` hold; PoolCorruptError (prefixed `where: `) when damaged."""
    return unpack_json(raw, uuid, SHARD_MAGIC, SHARD_VERSION,
                       (f"{where}: " if where else "") + f"its record of its own shard ({SHARD_REGION}) is damaged")


def read_shard(path: str, region: Region, uuid: bytes) -> dict:
    """The record in `region` of the pool file `path`, read without mapping (pool info, pool check)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return shard_json(os.pread(fd, region.size, region.offset), uuid, path)
    finally:
        os.close(fd)
