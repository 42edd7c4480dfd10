"""The pool's on-media format, v1 — defined here and nowhere else (docs/architecture.md §2).

All structures are fixed-size, little-endian, packed (`struct` '<', no implicit padding), with
reserved bytes that must be zero. tests/test_pool_format.py pins every size and offset.

Layout (offsets in bytes):

    0         superblock          512 used, page-padded        written once, at creation
    4096      root slot A         256 used, page-padded        alternate commits, LMDB-style:
    8192      root slot B         256 used, page-padded        the valid slot with higher seq wins
    12288     region directory    dir_capacity × 128           entry i valid iff i < root.dir_count
    data_off  regions             each aligned to region_align (≥ 4 KiB), rows to 64 bytes

Checksums are zlib CRC-32 over the structure's bytes before its checksum field, seeded
with the pool UUID (and the entry index for directory entries), so a structure copied from another
pool or another slot never validates.

Magic: the u64 0x4C4F4F5054584343 ("CCXTPOOL" as little-endian bytes); read with the wrong byte
order it becomes a distinct value we name in the error.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib

import numpy as np

from ..kernels import native

FORMAT_VERSION = 1
MAGIC = 0x4C4F4F5054584343
MAGIC_SWAPPED = int.from_bytes(MAGIC.to_bytes(8, "little"), "big")
# The first 8 bytes of a new pool file until its superblock replaces them: a file that starts with
# it is a pool whose creation never finished, which its creator's next run may delete.
BUILDING_MAGIC = int.from_bytes(b"CCXTBILD", "little")
PAGE = 4096

SUPERBLOCK_OFFSET = 0
ROOT_OFFSETS = (4096, 8192)
DIR_OFFSET = 12288

# Incompatible feature bits: a pool with a bit this build does not know is refused.
# A group rank's pool whose dense slots hold its slice of the replicated dense state (not all of it),
# in three slots (docs/distributed.md): a build that would read a slice as the whole refuses it.
INCOMPAT_DENSE_SLICES = 0x1
KNOWN_INCOMPAT_FEATURES = INCOMPAT_DENSE_SLICES


# ---------------------------------------------------------------------------------------------
# Superblock: what the pool is and where everything else is. Written once, at creation.
# ---------------------------------------------------------------------------------------------
SUPERBLOCK = struct.Struct(
    "<"
    "Q"    # magic
    "I"    # format version
    "I"    # incompat feature bits (unknown bit: refuse)
    "I"    # compat feature bits (unknown bit: ignore)
    "I"    # superblock struct size (512)
    "16s"  # pool UUID
    "Q"    # pool size in bytes (the whole file or device)
    "Q"    # created, ns since the epoch
    "Q"    # root slot A offset
    "Q"    # root slot B offset
    "Q"    # directory offset
    "I"    # directory capacity (entries)
    "I"    # directory entry size (128)
    "Q"    # data area offset (first byte regions may use)
    "I"    # region alignment
    "I"    # row alignment
    "404s" # reserved, zero
    "I"    # checksum of all bytes above
)
assert SUPERBLOCK.size == 512


@dataclasses.dataclass(frozen=True)
class Superblock:
    version: int
    incompat: int
    compat: int
    uuid: bytes
    pool_size: int
    created_ns: int
    root_offsets: tuple[int, int]
    dir_offset: int
    dir_capacity: int
    data_offset: int
    region_align: int
    row_align: int

    def pack(self) -> bytes:
        body = SUPERBLOCK.pack(MAGIC, self.version, self.incompat, self.compat, SUPERBLOCK.size,
                               self.uuid, self.pool_size, self.created_ns, *self.root_offsets,
                               self.dir_offset, self.dir_capacity, DIR_ENTRY.size, self.data_offset,
                               self.region_align, self.row_align, bytes(404), 0)
        return seal(body)


def unpack_superblock(raw: bytes) -> tuple[Superblock, int, int, int, bytes, int]:
    """Decode without validating. Returns (superblock, magic, struct_size, entry_size, reserved, checksum)."""
    (magic, version, incompat, compat, sb_size, uuid, pool_size, created, root_a, root_b, dir_off,
     dir_cap, entry_size, data_off, region_align, row_align, reserved, csum) = SUPERBLOCK.unpack(raw)
    sb = Superblock(version, incompat, compat, uuid, pool_size, created, (root_a, root_b), dir_off,
                    dir_cap, data_off, region_align, row_align)
    return sb, magic, sb_size, entry_size, reserved, csum


# ---------------------------------------------------------------------------------------------
# Root: the commit record. Two slots; commit n goes to slot n % 2; the valid one with the higher
# seq wins. A torn or corrupt slot fails its checksum and is ignored, never half-used.
# ---------------------------------------------------------------------------------------------
ROOT = struct.Struct(
    "<"
    "Q"    # seq: 1 for the first root, +1 per commit; 0 = slot never written
    "I"    # dir_count: directory entries [0, dir_count) are live
    "I"    # flags: ROOT_RELAXED or 0; any other bit makes the root invalid
    "q"    # batches_done: batches whose updates the pool holds (0 = freshly initialised); -1 = no
           # consistent state (being created, or tables changing with nothing to roll them back)
    # -- the checkpointer's commit fields (docs/architecture.md §4); all zero in a pool that has none --
    "Q"    # ring_generation: undo records of any other generation are never live
    "Q"    # ring_start: byte offset, in the undo ring, of the oldest live record
    "Q"    # ring_start_seq: the sequence number the record at ring_start must carry
    "I"    # dense_slot: 0 = no dense snapshot, 1 = slot A, 2 = slot B, 3 = slot C (INCOMPAT_DENSE_SLICES)
    "I"    # zero
    "q"    # dense_batch: batches the named dense snapshot has seen
    "184s" # reserved, zero
    "I"    # checksum
    "4s"   # padding to 256, zero
)
assert ROOT.size == 256
ROOT_TRAILER = 4  # the padding after the root's checksum field, outside what it sums
ROOT_RESERVED_OFFSET = 64  # where the reserved bytes start (tests pin the layout)
# Root flag: written by a relaxed-mode checkpointer, whose dense snapshot may be older than the
# batch the embeddings are committed at (dense_batch < batches_done). A root without it (every pool
# written before this flag existed included) must have them equal.
ROOT_RELAXED = 1
ROOT_KNOWN_FLAGS = ROOT_RELAXED
SLOT_NAMES = ("A", "B")  # what the two root slots (and the first two dense snapshot slots) are called
DENSE_SLOT_NAMES = ("A", "B", "C")


@dataclasses.dataclass(frozen=True)
class Root:
    """One commit record. With a checkpointer, `batches_done` is the recovery target: undo records of
    batch indices >= batches_done are rolled back by recovery, those of earlier batches are reclaimable."""

    seq: int
    dir_count: int
    batches_done: int  # a count, not an index: batches 0 .. batches_done - 1 are in the pool
    flags: int = 0
    ring_generation: int = 0
    ring_start: int = 0
    ring_start_seq: int = 0
    dense_slot: int = 0
    dense_batch: int = 0

    @property
    def dense_slot_name(self) -> str | None:
        """The dense snapshot slot this root names ("A", "B" or "C"), None when it names none."""
        return DENSE_SLOT_NAMES[self.dense_slot - 1] if self.dense_slot else None

    def pack(self, uuid: bytes, slot: int) -> bytes:
        body = ROOT.pack(self.seq, self.dir_count, self.flags, self.batches_done, self.ring_generation,
                         self.ring_start, self.ring_start_seq, self.dense_slot, 0, self.dense_batch, bytes(184), 0,
                         bytes(4))
        return seal(body, uuid, slot, trailer=ROOT_TRAILER)


def unpack_root(raw: bytes) -> tuple[Root, bytes, int, bytes]:
    """Decode without validating. Returns (root, reserved, checksum, padding); `reserved` includes
    the zero word between dense_slot and dense_batch."""
    (seq, dir_count, flags, batches_done, generation, ring_start, start_seq, dense_slot, zero, dense_batch, reserved,
     csum, pad) = ROOT.unpack(raw)
    root = Root(seq, dir_count, batches_done, flags, generation, ring_start, start_seq, dense_slot, dense_batch)
    return root, zero.to_bytes(4, "little") + reserved, csum, pad


# ---------------------------------------------------------------------------------------------
# Region directory: one entry per named region.
# ---------------------------------------------------------------------------------------------
class RegionKind(enum.IntEnum):
    TABLE_WEIGHTS = 1       # [rows, dim], rows on row_align boundaries
    TABLE_OPTIM_STATE = 2   # [rows, k] optimizer state of a table (k = 1: row-wise Adagrad)
    UNDO_RING = 3           # the checkpointer's undo log
    DENSE_SLOT = 4          # one of the two dense snapshot slots
    BLOB = 5                # any other named bytes


class DType(enum.IntEnum):
    UINT8 = 1
    INT32 = 2
    INT64 = 3
    FLOAT16 = 4
    FLOAT32 = 5
    FLOAT64 = 6

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(_NUMPY_OF[self])

    @classmethod
    def of(cls, dtype) -> "DType":
        name = np.dtype(dtype).name
        for member, np_name in _NUMPY_OF.items():
            if np_name == name:
                return member
        raise ValueError(f"dtype {name} cannot be stored in a pool")


_NUMPY_OF = {DType.UINT8: "uint8", DType.INT32: "int32", DType.INT64: "int64",
             DType.FLOAT16: "float16", DType.FLOAT32: "float32", DType.FLOAT64: "float64"}

NAME_BYTES = 48
MAX_NDIM = 4
DIR_ENTRY = struct.Struct(
    "<"
    "48s"  # name, UTF-8, NUL-padded
    "H"    # kind (RegionKind)
    "H"    # dtype (DType)
    "H"    # ndim, 1..4
    "H"    # flags, zero in v1
    "Q"    # offset from the start of the pool
    "Q"    # size in bytes
    "Q"    # row stride in bytes (distance between rows of dimension 0)
    "4Q"   # shape, unused dimensions zero
    "12s"  # reserved, zero
    "I"    # checksum (seeded with pool UUID and entry index)
)
assert DIR_ENTRY.size == 128


@dataclasses.dataclass(frozen=True)
class Region:
    """A named, typed span of the pool: `shape` rows of `row_stride` bytes starting at `offset`."""

    index: int
    name: str
    kind: RegionKind
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    size: int
    row_stride: int

    @property
    def end(self) -> int:
        return self.offset + self.size

    def pack(self, uuid: bytes) -> bytes:
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        body = DIR_ENTRY.pack(self.name.encode(), self.kind, self.dtype, len(self.shape), 0,
                              self.offset, self.size, self.row_stride, *shape, bytes(12), 0)
        return seal(body, uuid, self.index)


def unpack_entry(raw: bytes) -> tuple:
    """Decode without validating: (name_bytes, kind, dtype, ndim, flags, offset, size, row_stride,
    shape4, reserved, checksum)."""
    name, kind, dtype, ndim, flags, offset, size, stride, s0, s1, s2, s3, reserved, csum = DIR_ENTRY.unpack(raw)
    return name, kind, dtype, ndim, flags, offset, size, stride, (s0, s1, s2, s3), reserved, csum


# Every checksummed structure ends in its u32 checksum field (the root: then ROOT_TRAILER bytes of
# padding), summing every byte before it: seal fills the field in, is_sealed checks it.
CHECKSUM_FIELD = struct.Struct("<I")


def seal(packed: bytes, uuid: bytes = b"", index: int = 0, *, trailer: int = 0) -> bytes:
    """`packed`, a structure packed with its checksum field zero, with that field set to the
    checksum (uuid, index) of every byte before it. trailer: bytes after the field, kept as they are."""
    end = len(packed) - trailer - CHECKSUM_FIELD.size
    body = packed[:end]
    sealed = body + CHECKSUM_FIELD.pack(checksum(body, uuid, index))
    return sealed + packed[end + CHECKSUM_FIELD.size:] if trailer else sealed


def is_sealed(raw: bytes, uuid: bytes = b"", index: int = 0, *, trailer: int = 0) -> bool:
    """Whether `raw`'s checksum field holds what seal(raw, uuid, index, trailer=trailer) would put there."""
    end = len(raw) - trailer - CHECKSUM_FIELD.size
    return CHECKSUM_FIELD.unpack_from(raw, end)[0] == checksum(raw[:end], uuid, index)


def checksum(data: bytes, uuid: bytes = b"", index: int = 0) -> int:
    """CRC-32 (zlib's) of `data`, seeded with the pool UUID and a slot/entry index (taken modulo 2**32: an
    index read from a damaged structure may be any u64, and must fail the check, not overflow)."""
    return checksum_more(data, checksum_seed(uuid, index))


def checksum_seed(uuid: bytes = b"", index: int = 0) -> int:
    """What checksum(data, uuid, index) starts from: checksum_more(data, seed) is the same value, and a
    checksum can go on piece by piece (checksum_more(b, checksum_more(a, seed)) sums a + b)."""
    return zlib.crc32(uuid + (index & 0xFFFFFFFF).to_bytes(4, "little"))


def checksum_more(data, crc: int) -> int:
    """The CRC-32 `crc` continued over `data` (bytes, or a C-contiguous numpy array: its bytes)."""
    if (data.nbytes if isinstance(data, np.ndarray) else len(data)) < _NATIVE_CRC_BYTES:
        return zlib.crc32(data, crc)
    return native.crc32(data, crc)  # the same value, faster for payloads (undo records, snapshots)


# From here on the native CRC (kernels/rows.c) beats zlib's even counting its call overhead
# (docs/benchmarks.md).
_NATIVE_CRC_BYTES = 512


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def data_offset(dir_capacity: int, region_align: int) -> int:
    return align_up(DIR_OFFSET + dir_capacity * DIR_ENTRY.size, region_align)


def pool_size_for(region_bytes: list[int], dir_capacity: int, region_align: int) -> int:
    """Smallest pool that holds regions of these sizes, each aligned, after the metadata."""
    return data_offset(dir_capacity, region_align) + sum(align_up(n, region_align) for n in region_bytes)
