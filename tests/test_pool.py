"""Pool v1: create, open, check, commit; every refusal is one clear error and leaves the file as it was."""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cxltrain.errors import (
    ConfigError,
    CxlTrainError,
    NotAPoolError,
    PoolCorruptError,
    PoolError,
    PoolFullError,
    PoolLockedError,
    PoolVersionError,
)
from cxltrain.knobs import override
from cxltrain.pool import format as fmt
from cxltrain.pool.format import RegionKind
from cxltrain.pool.handle import Pool, RegionSpec
from cxltrain.pool.info import inspect


def small_pool(path, regions=2):
    """A closed pool with `regions` regions filled with a known pattern; returns their names."""
    names = []
    with Pool.create(str(path), 1 << 20, dir_capacity=8) as pool:
        for i in range(regions):
            name = f"t{i}.weight"
            pool.add_region(name, RegionKind.TABLE_WEIGHTS, "float32", (50, 10), aligned_rows=True)
            pool.array(name)[:] = np.arange(10, dtype=np.float32) + i
            pool.persist_region(name)
            names.append(name)
        pool.commit(batches_done=7)
    return names


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def patch(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_round_trip(pool_path):
    names = small_pool(pool_path)
    with Pool.open(pool_path) as pool:
        assert list(pool.regions) == names
        assert pool.root.batches_done == 7
        assert np.array_equal(pool.array("t1.weight")[49], np.arange(10, dtype=np.float32) + 1)
        region = pool.region("t0.weight")
        assert region.row_stride == 64 and region.offset % 4096 == 0
    report = inspect(pool_path)
    assert report.ok and report.root.batches_done == 7 and len(report.regions) == 2


def test_commits_alternate_slots_and_the_newest_valid_wins(pool_path):
    small_pool(pool_path, regions=0)
    with Pool.open(pool_path) as pool:
        seq = pool.root.seq
        for batch in (8, 9, 10):
            pool.commit(batches_done=batch)
        assert pool.root.seq == seq + 3
    report = inspect(pool_path)
    assert {s.root.batches_done for s in report.slots} == {9, 10}
    assert report.root.batches_done == 10
    # tear the newest slot: the older one wins, never a half-used record
    newest = report.root.seq % 2
    patch(pool_path, fmt.ROOT_OFFSETS[newest] + 16, b"\xff" * 8)
    with Pool.open(pool_path) as pool:
        assert pool.root.batches_done == 9


def test_padded_view_is_contiguous_and_covers_row_padding(shm_dir):
    path = shm_dir / "p.pool"
    small_pool(path, regions=1)
    with Pool.open(str(path)) as pool:
        padded = pool.array("t0.weight", padded=True)
        assert padded.shape == (50, 16) and padded.flags["C_CONTIGUOUS"]
        assert np.array_equal(padded[:, :10], pool.array("t0.weight"))


def test_region_errors(shm_dir):
    with Pool.create(str(shm_dir / "r.pool"), 1 << 20, dir_capacity=2) as pool:
        pool.add_region("a", RegionKind.BLOB, "uint8", (1000,))
        with pytest.raises(PoolError, match="already exists"):
            pool.add_region("a", RegionKind.BLOB, "uint8", (10,))
        with pytest.raises(PoolFullError, match="need 2,097,152 bytes"):
            pool.add_region("big", RegionKind.BLOB, "uint8", (1 << 21,))
        with pytest.raises(ConfigError):
            pool.add_region("x" * 49, RegionKind.BLOB, "uint8", (10,))
        with pytest.raises(ConfigError):
            pool.add_region("neg", RegionKind.BLOB, "uint8", (0,))
        pool.add_region("b", RegionKind.BLOB, "uint8", (10,))
        with pytest.raises(PoolFullError, match="room for 0 more regions"):
            pool.add_region("c", RegionKind.BLOB, "uint8", (10,))
        with pytest.raises(PoolError, match="no region"):
            pool.region("zzz")


def test_add_regions_is_all_or_nothing(shm_dir):
    path = str(shm_dir / "atomic.pool")
    with Pool.create(path, 1 << 20) as pool:
        root = pool.root
        with pytest.raises(PoolFullError):
            pool.add_regions([RegionSpec("fits", RegionKind.BLOB, "uint8", (1000,)),
                              RegionSpec("too-big", RegionKind.BLOB, "uint8", (1 << 21,))])
        with pytest.raises(ConfigError):
            pool.add_regions([RegionSpec("ok", RegionKind.BLOB, "uint8", (10,)),
                              RegionSpec("bad", RegionKind.BLOB, "uint8", (0,))])
        assert pool.regions == {} and pool.root == root
        made = pool.add_regions([RegionSpec("a", RegionKind.BLOB, "uint8", (10,)),
                                 RegionSpec("b", RegionKind.BLOB, "float32", (3, 5), aligned_rows=True)])
        assert pool.root.seq == root.seq + 1  # one commit for both
        assert [r.name for r in made] == ["a", "b"] and made[1].row_stride == 64
    assert [r.name for r in inspect(path).regions] == ["a", "b"]


@pytest.mark.parametrize("knob,value,message", [
    ("row_align", 48, "row alignment 48"),
    ("dir_capacity", 0, "directory capacity 0"),
    ("dir_capacity", 70000, "directory capacity 70000"),
    ("region_align", 1000, "region alignment 1000"),
])
def test_create_refuses_a_layout_open_would_reject(shm_dir, knob, value, message):
    path = shm_dir / "k.pool"
    with override(**{knob: value}), pytest.raises(ConfigError, match=message):
        Pool.create(str(path), 16 << 20)
    assert not path.exists()


def test_a_commit_that_fails_poisons_the_handle(shm_dir):
    path = str(shm_dir / "poison.pool")
    small_pool(path)
    pool = Pool.open(path)

    def failing_copy(offset, data):
        raise OSError("media error")

    pool.device.copy_persist = failing_copy
    with pytest.raises(OSError):
        pool.commit(batches_done=8)
    with pytest.raises(PoolError, match="a commit failed"):
        pool.commit(batches_done=9)
    with pytest.raises(PoolError, match="a commit failed"):
        pool.array("t0.weight")
    pool.close()
    with Pool.open(path) as again:
        assert again.root.batches_done == 7


def test_fifo_and_empty_file_are_refused_without_blocking(shm_dir):
    fifo = str(shm_dir / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(NotAPoolError, match="not a regular file"):
        Pool.open(fifo)
    assert "not a regular file" in inspect_problem(fifo)
    zeros = shm_dir / "zeros.pool"
    zeros.write_bytes(bytes(1 << 16))
    with pytest.raises(NotAPoolError, match="interrupted"):
        Pool.open(str(zeros))


def inspect_problem(path) -> str:
    try:
        return "; ".join(inspect(path).problems)
    except PoolError as e:
        return str(e)


def test_create_refuses_existing_file_and_tiny_size(shm_dir):
    path = str(shm_dir / "e.pool")
    open(path, "wb").write(b"precious")
    with pytest.raises(CxlTrainError, match="already exists"):
        Pool.create(path, 1 << 20)
    assert open(path, "rb").read() == b"precious"
    with pytest.raises(ConfigError, match="too small"):
        Pool.create(str(shm_dir / "tiny.pool"), 4096)
    assert not os.path.exists(shm_dir / "tiny.pool")


def test_full_disk_at_creation_leaves_nothing(shm_dir):
    # a 1 MiB tmpfs would need root to mount; an impossible size on the real /dev/shm does the same
    path = str(shm_dir / "huge.pool")
    with pytest.raises(CxlTrainError, match="space|allocate"):
        Pool.create(path, 1 << 50)
    assert not os.path.exists(path)


def _open_and_report(path, queue):
    try:
        Pool.open(path).close()
        queue.put("opened")
    except PoolLockedError as e:
        queue.put(f"locked: {e}")


def test_second_opener_is_refused(shm_dir):
    path = str(shm_dir / "l.pool")
    small_pool(path)
    with Pool.open(path) as first:
        with pytest.raises(PoolLockedError, match="in use by another process"):
            Pool.open(path)
        queue = multiprocessing.get_context("spawn").Queue()
        child = multiprocessing.get_context("spawn").Process(target=_open_and_report, args=(path, queue))
        child.start()
        child.join(60)
        assert queue.get(timeout=5).startswith("locked")
        first.array("t0.weight")[0, 0] = 42.0  # the first opener keeps working
        first.persist_region("t0.weight")
        first.commit(batches_done=8)
    with Pool.open(path) as again:  # released on close
        assert again.root.batches_done == 8 and again.array("t0.weight")[0, 0] == 42.0


def test_lock_is_released_on_close_even_while_views_live(shm_dir):
    path = str(shm_dir / "v.pool")
    small_pool(path)
    pool = Pool.open(path)
    view = pool.array("t0.weight")
    pool.close()
    Pool.open(path).close()
    assert view[0, 1] == 1.0  # the mapping outlives the pool handle while a view holds it


def _open_in_child(path: str, uid: int | None) -> str:
    """Try both opens in a forked child, as `uid` when given; returns what it saw."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: everything it needs is already imported
        os.close(read_end)
        lines = []
        try:
            if uid is not None:
                os.setuid(uid)
            try:
                Pool.open(path).close()
                lines.append("opened read-write")
            except PoolError as e:
                lines.append(str(e))
            with Pool.open(path, writable=False) as pool:
                lines.append(f"read-only batch {pool.root.batches_done}")
        except BaseException as e:  # report, never raise out of a forked pytest
            lines.append(f"child failed: {e!r}")
        os.write(write_end, "\n".join(lines).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_read_only_file(shm_dir):
    path = str(shm_dir / "ro.pool")
    small_pool(path)
    os.chmod(path, 0o444)
    os.chmod(shm_dir, 0o755)
    before = digest(path)
    # root ignores permission bits: the opener runs as an unprivileged user then
    out = _open_in_child(path, 65534 if os.geteuid() == 0 else None)
    assert "permission denied opening for read-write" in out, out
    assert "read-only batch 7" in out, out
    assert digest(path) == before


def test_read_only_open_cannot_write(shm_dir):
    path = str(shm_dir / "ro2.pool")
    small_pool(path)
    before = digest(path)
    with Pool.open(path, writable=False) as pool:
        with pytest.raises(PoolError, match="read-only"):
            pool.commit(batches_done=1)
        with pytest.raises(ValueError):
            pool.array("t0.weight")[0, 0] = 5.0
    assert digest(path) == before


# -- refusals: distinct error, file untouched ------------------------------------------------
def _newer_version(path):
    raw = bytearray(open(path, "rb").read(512))
    struct.pack_into("<I", raw, 8, 2)
    struct.pack_into("<I", raw, 508, fmt.checksum(bytes(raw[:508])))
    patch(path, 0, bytes(raw))


def _swapped_magic(path):
    patch(path, 0, fmt.MAGIC.to_bytes(8, "big"))


def _unknown_feature(path):
    raw = bytearray(open(path, "rb").read(512))
    struct.pack_into("<I", raw, 12, 1 << 7)
    struct.pack_into("<I", raw, 508, fmt.checksum(bytes(raw[:508])))
    patch(path, 0, bytes(raw))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 4096)


def _foreign(path):
    with open(path, "wb") as f:
        f.write(b"\x7fELF" + bytes(100_000))


REFUSALS = [
    ("wrong magic", lambda p: patch(p, 0, b"NOTAPOOL"), NotAPoolError, "bad magic"),
    ("other byte order", _swapped_magic, NotAPoolError, "byte order"),
    ("newer version", _newer_version, PoolVersionError, "newer than this cxltrain"),
    ("unknown feature", _unknown_feature, PoolVersionError, "features"),
    ("superblock checksum", lambda p: patch(p, 40, b"\x01"), PoolCorruptError, "superblock checksum"),
    ("truncated", _truncate, PoolCorruptError, "truncated"),
    ("both roots", lambda p: (patch(p, 4096 + 30, b"\x01"), patch(p, 8192 + 30, b"\x01")), PoolCorruptError,
     "no valid root"),
    ("directory entry", lambda p: patch(p, fmt.DIR_OFFSET + 128 + 60, b"\x09"), PoolCorruptError,
     "directory entry 1"),
    ("foreign file", _foreign, NotAPoolError, "not a cxltrain pool"),
    ("empty file", lambda p: os.truncate(p, 0), NotAPoolError, "too small"),
]


@pytest.mark.parametrize("label,damage,error,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusal_is_clear_and_leaves_the_file_untouched(shm_dir, label, damage, error, message):
    path = str(shm_dir / "bad.pool")
    small_pool(path)
    damage(path)
    before = digest(path)
    with pytest.raises(error, match=message):
        Pool.open(path)
    report = inspect(path)
    assert not report.ok and any(message in p for p in report.problems)
    assert digest(path) == before


def test_missing_pool_and_directory(shm_dir):
    with pytest.raises(PoolError, match="no such pool"):
        Pool.open(str(shm_dir / "nope.pool"))
    with pytest.raises(NotAPoolError, match="directory"):
        Pool.open(str(shm_dir))


def test_torn_directory_entry_past_dir_count_is_ignored(shm_dir):
    """A crash inside add_region leaves an entry the root does not count: harmless."""
    path = str(shm_dir / "t.pool")
    small_pool(path)
    patch(path, fmt.DIR_OFFSET + 2 * 128, b"garbage, half an entry")
    with Pool.open(path) as pool:
        assert len(pool.regions) == 2
        pool.add_region("t2.weight", RegionKind.TABLE_WEIGHTS, "float32", (5, 4))  # overwrites it
    assert inspect(path).ok


# -- hypothesis: corrupt images never crash, never open silently wrong ----------------------
@dataclasses.dataclass(frozen=True)
class Golden:
    path: str
    superblock: object
    roots: tuple            # the roots of both slots: either may legitimately win after damage
    regions: list           # in directory order


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden") / "golden.pool"
    small_pool(path)
    report = inspect(str(path))
    assert report.ok and all(s.state == "valid" for s in report.slots)
    return Golden(str(path), report.superblock, tuple(s.root for s in report.slots), report.regions)


METADATA_END = fmt.data_offset(8, 4096)
# Every checksummed structure of the golden pool, so mutations land in each of them often, not
# only in the much larger padding around them.
STRUCTURES = [
    (0, fmt.SUPERBLOCK.size),
    (fmt.ROOT_OFFSETS[0], fmt.ROOT_OFFSETS[0] + fmt.ROOT.size),
    (fmt.ROOT_OFFSETS[1], fmt.ROOT_OFFSETS[1] + fmt.ROOT.size),
    (fmt.DIR_OFFSET, fmt.DIR_OFFSET + 3 * fmt.DIR_ENTRY.size),  # two live entries and one free one
    (0, METADATA_END),
]
byte_offset = st.sampled_from(STRUCTURES).flatmap(lambda span: st.integers(span[0], span[1] - 1))

mutation = st.one_of(
    st.tuples(st.just("flip"), byte_offset, st.integers(0, 7)),
    st.tuples(st.just("bytes"), byte_offset, st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
)


def apply(path, m):
    if m[0] == "flip":
        if m[1] >= os.path.getsize(path):
            return
        with open(path, "r+b") as f:
            f.seek(m[1])
            byte = f.read(1)[0]
            f.seek(m[1])
            f.write(bytes([byte ^ (1 << m[2])]))
    elif m[0] == "bytes":
        patch(path, m[1], m[2])
    else:
        os.truncate(path, m[1])


def check_corrupt_image(golden, tmp_path, mutations):
    """A damaged pool is refused with one clean line, or opens in a state it really had: the same
    superblock, one of its two roots, and exactly the regions that root counts."""
    path = str(tmp_path / "fuzz.pool")
    shutil.copyfile(golden.path, path)
    for m in mutations:
        apply(path, m)
    report = inspect(path)  # never raises for a readable file
    try:
        pool = Pool.open(path, writable=False)
    except PoolError as e:
        assert str(e) and "\n" not in str(e)
        assert not report.ok
        return
    with pool:
        assert pool.superblock == golden.superblock
        assert pool.root in golden.roots
        assert list(pool.regions.values()) == golden.regions[: pool.root.dir_count]
    assert report.ok


def test_every_single_bit_flip_in_live_metadata_is_caught(golden, tmp_path):
    """Exhaustive over the checksummed bytes: a flip in the superblock or a live directory entry is
    refused; a flip in a root slot makes the other, intact slot win (or is refused)."""
    # (first byte, end, the root that must win if the pool opens; None: it must be refused)
    spans = [(0, fmt.SUPERBLOCK.size, None),
             (fmt.ROOT_OFFSETS[0], fmt.ROOT_OFFSETS[0] + fmt.ROOT.size, golden.roots[1]),
             (fmt.ROOT_OFFSETS[1], fmt.ROOT_OFFSETS[1] + fmt.ROOT.size, golden.roots[0]),
             (fmt.DIR_OFFSET, fmt.DIR_OFFSET + 2 * fmt.DIR_ENTRY.size, None)]
    for start, end, intact_root in spans:
        for offset in range(start, end):
            path = tmp_path / "flip.pool"
            shutil.copyfile(golden.path, path)
            apply(str(path), ("flip", offset, offset % 8))
            try:
                pool = Pool.open(str(path), writable=False)
            except PoolError:
                continue
            with pool:
                root, regions = pool.root, list(pool.regions.values())
            assert intact_root is not None, f"a flip at byte {offset} was not caught"
            assert root == intact_root, f"a flip at byte {offset} let the damaged root win"
            assert regions == golden.regions[: root.dir_count], offset


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=4))
def test_corrupt_images_are_refused_or_opened_correctly(golden, tmp_path, mutations):
    check_corrupt_image(golden, tmp_path, mutations)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=4))
def test_many_corrupt_images(golden, tmp_path, mutations):
    check_corrupt_image(golden, tmp_path, mutations)
