"""A dense slot's bytes, checked without decoding them: what recovery needs of the snapshot when no
model is there to load it into (`cxltrain recover`, `pool check`), and what dense.read_snapshot
decodes afterwards. Needs numpy only (no torch), like the rest of recovery's path.
"""

from __future__ import annotations

import numpy as np

from ..errors import PoolCorruptError
from ..pool.handle import Pool
from . import layout


def slot_names(pool: Pool) -> tuple[str, ...]:
    """The dense slots' regions of `pool`, slot 1 first (layout.dense_slot_names)."""
    return layout.dense_slot_names(layout.SLICE_REGION in pool.regions)


def slot_region(pool: Pool, slot: int):
    return pool.region(slot_names(pool)[slot - 1])


def where(pool: Pool, slot: int) -> str:
    return f"{pool.path}: dense slot {'ABC'[slot - 1] if slot in (1, 2, 3) else slot}"


def held_batches(pool: Pool) -> dict[int, int | None]:
    """{slot: the batch its valid header names, or None}: what each dense slot holds, headers only
    (a valid header vouches for its payload: the slot's ordering)."""
    held = {}
    for slot, name in enumerate(slot_names(pool), 1):
        region = pool.region(name)
        raw = pool.device.array[region.offset : region.offset + layout.DENSE_HEADER.size].tobytes()
        header = layout.unpack_dense_header(raw, pool.superblock.uuid, slot)
        held[slot] = None if header is None else header[0]
    return held


def checked_payload(pool: Pool, slot: int, batch: int) -> np.ndarray:
    """The encoded snapshot in `slot` (uint8 [payload bytes], a view of the pool), checked: header,
    batch, bounds and payload checksum. By the slot's ordering (payload durable before its header) a
    valid header vouches for the payload, so a mismatch is media corruption, refused."""
    here = where(pool, slot)
    names = slot_names(pool)
    if slot not in range(1, len(names) + 1) or names[slot - 1] not in pool.regions:
        raise PoolCorruptError(f"{here}: the root names a dense slot the pool does not have")
    region = slot_region(pool, slot)
    array = pool.device.array
    header = layout.unpack_dense_header(array[region.offset : region.offset + layout.DENSE_HEADER.size].tobytes(),
                                        pool.superblock.uuid, slot)
    if header is None:
        raise PoolCorruptError(f"{here}: header is corrupt")
    found, length, crc = header
    if found != batch:
        raise PoolCorruptError(f"{here}: holds batch {found}, the root says {batch}")
    if layout.DENSE_HEADER.size + length > region.size:
        raise PoolCorruptError(f"{here}: payload length {length} overruns the slot")
    start = region.offset + layout.DENSE_HEADER.size
    blob = array[start : start + length]
    if payload_checksum(blob, pool.superblock.uuid, batch) != crc:
        raise PoolCorruptError(f"{here}: payload checksum mismatch (media corruption)")
    return blob


def payload_checksum(blob, uuid: bytes, batch: int) -> int:
    return layout.payload_checksum(blob, uuid, 0, batch)


def payload_checksum_seed(uuid: bytes, batch: int) -> int:
    return layout.payload_checksum_seed(uuid, 0, batch)
