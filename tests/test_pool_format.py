"""Pins the v1 on-media layout: a change here is a format change and needs a new version."""

import struct

from cxltrain.pool import format as fmt


def test_structure_sizes():
    assert fmt.SUPERBLOCK.size == 512
    assert fmt.ROOT.size == 256
    assert fmt.DIR_ENTRY.size == 128


def test_fixed_offsets():
    assert fmt.SUPERBLOCK_OFFSET == 0
    assert fmt.ROOT_OFFSETS == (4096, 8192)
    assert fmt.DIR_OFFSET == 12288
    assert fmt.data_offset(256, 4096) == 45056
    assert fmt.data_offset(256, 2 << 20) == 2 << 20


def test_field_offsets():
    sb = fmt.Superblock(1, 0, 0, bytes(range(16)), 1 << 20, 7, fmt.ROOT_OFFSETS, fmt.DIR_OFFSET, 256,
                        45056, 4096, 64).pack()
    assert struct.unpack_from("<Q", sb, 0)[0] == fmt.MAGIC
    assert struct.unpack_from("<I", sb, 8)[0] == 1                  # version
    assert sb[24:40] == bytes(range(16))                             # uuid
    assert struct.unpack_from("<Q", sb, 40)[0] == 1 << 20            # pool size
    assert struct.unpack_from("<QQQ", sb, 56) == (4096, 8192, 12288)  # roots, directory
    assert struct.unpack_from("<Q", sb, 88)[0] == 45056              # data offset
    assert sb[104:508] == bytes(404)                                 # reserved
    assert struct.unpack_from("<I", sb, 508)[0] == fmt.checksum(sb[:508])

    root = fmt.Root(seq=5, dir_count=3, batches_done=42, ring_generation=7, ring_start=4160, ring_start_seq=9,
                    dense_slot=2, dense_batch=41).pack(bytes(16), 1)
    assert struct.unpack_from("<QIIq", root, 0) == (5, 3, 0, 42)
    assert struct.unpack_from("<QQQIIq", root, 24) == (7, 4160, 9, 2, 0, 41)   # checkpointer fields
    assert fmt.ROOT_RESERVED_OFFSET == 64
    assert root[64:248] == bytes(184) and root[252:] == bytes(4)
    assert fmt.unpack_root(root)[0] == fmt.Root(5, 3, 42, 0, 7, 4160, 9, 2, 41)

    region = fmt.Region(2, "t0.weight", fmt.RegionKind.TABLE_WEIGHTS, fmt.DType.FLOAT32, (10, 16), 45056, 640, 64)
    entry = region.pack(bytes(16))
    assert entry[:9] == b"t0.weight" and entry[9:48] == bytes(39)
    assert struct.unpack_from("<HHHH", entry, 48) == (1, 5, 2, 0)
    assert struct.unpack_from("<QQQ4Q", entry, 56) == (45056, 640, 64, 10, 16, 0, 0)


def test_magic_reads_as_ascii_and_exposes_byte_order():
    assert fmt.MAGIC.to_bytes(8, "little") == b"CCXTPOOL"
    assert fmt.MAGIC_SWAPPED != fmt.MAGIC


def test_checksums_are_seeded_by_pool_and_slot():
    root = fmt.Root(seq=2, dir_count=0, batches_done=0)
    assert root.pack(bytes(16), 0) != root.pack(bytes(16), 1)
    assert root.pack(bytes(16), 0) != root.pack(b"x" * 16, 0)
