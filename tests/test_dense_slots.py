"""Dense slots (cxltrain.checkpoint.dense): the slots' size against the dense state, and snapshots
taken every k batches in relaxed mode, with the roots that name them flagged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cxltrain import knobs
from cxltrain.checkpoint import codec, dense, layout, slots
from cxltrain.devices.libpmem import load as load_libpmem
from cxltrain.errors import CheckpointError
from cxltrain.kernels import native
from cxltrain.pool.format import ROOT_RELAXED, RegionKind
from cxltrain.pool.handle import Pool, RegionSpec
from cxltrain.runtime.runtime import recover_pool
from test_runtime import train_steps


def test_relaxed_mode_snapshots_the_dense_state_every_k_and_flags_its_roots(shm_dir):
    rt, _ = train_steps(shm_dir / "p.pool", 7, dense_every=3, mode="relaxed")
    # a commit per batch, snapshots at 3 and 6; leaving commits batch 7 again, with its snapshot
    assert (rt.stats.commits, rt.stats.snapshots) == (8, 3)
    with Pool.open(str(shm_dir / "p.pool"), writable=False) as pool:
        assert pool.root.flags == ROOT_RELAXED and pool.root.dense_batch == 7
    with pytest.raises(KeyboardInterrupt):
        train_steps(shm_dir / "p.pool", 12, fail_at=11, dense_every=3, mode="relaxed")
    report = recover_pool(str(shm_dir / "p.pool"))
    assert (report.batch, report.dense_batch, report.dense_lag) == (11, 10, 1)


def test_dense_slots_too_small_say_how_big_they_are(shm_dir):
    with pytest.raises(CheckpointError, match=r"does not fit the pool's dense slots \(4,032 bytes\)"):
        train_steps(shm_dir / "p.pool", 1, dense_slot_bytes=4096)
    assert not (shm_dir / "p.pool").exists()


_STREAMS = native.built() and bool(native.lib().STREAMS)


@pytest.mark.parametrize("path", [
    pytest.param("streamed", marks=pytest.mark.skipif(not _STREAMS or load_libpmem() is None,
                                                      reason="needs the native kernels' streamed stores and libpmem")),
    pytest.param("power-loss streamed", marks=pytest.mark.skipif(not _STREAMS,
                                                                 reason="needs the native kernels' streamed stores")),
    "loop"])
def test_a_snapshot_payload_lands_whole_and_durable_whatever_path_copies_it(shm_dir, path):
    """write_payload copies a snapshot in one native pass where the device lets a kernel persist by
    itself (its long pieces streamed, the rest stored and written back; on the power-loss emulator
    the lines copied to the media), else piece by piece: the same bytes and checksum either way,
    and the device counts them. On the power-loss emulator the file holds them once write_snapshot
    returns: a copy that skipped any piece's persist would leave the file's old bytes there."""
    torch.manual_seed(3)
    tree = {"long": torch.randn(5003), "odd": torch.arange(40_001, dtype=torch.uint8), "short": torch.ones(3),
            "ints": np.arange(9), "text": "x" * 100, "longer": torch.randn(70, 301, dtype=torch.float64)}
    pool_file = shm_dir / "p.pool"
    settings = {"power_loss": int(path.startswith("power-loss")), "native_kernels": int(path != "loop")}
    with knobs.override(**settings), Pool.create(str(pool_file), 8 << 20) as pool:
        pool.add_regions([RegionSpec(name, RegionKind.DENSE_SLOT, "uint8", (2 << 20,))
                          for name in layout.DENSE_REGIONS])
        region = dense.slot_region(pool, 2)
        assert (dense.streamed_write_back(pool.device, region.offset) is not None) == (path != "loop")
        persisted = pool.device.counters.persisted_bytes
        dense.write_snapshot(pool, 2, 5, tree)
        stored = bytes(slots.checked_payload(pool, 2, 5))  # header and checksum hold
        assert pool.device.counters.persisted_bytes - persisted == layout.DENSE_HEADER.size + len(stored)
        uuid = pool.superblock.uuid
    assert stored == codec.encode(tree)
    on_file = np.fromfile(pool_file, dtype=np.uint8)[region.offset : region.offset + layout.DENSE_HEADER.size
                                                     + len(stored)]
    assert on_file[layout.DENSE_HEADER.size :].tobytes() == stored
    assert layout.unpack_dense_header(on_file[: layout.DENSE_HEADER.size].tobytes(), uuid, 2)[0] == 5
    with Pool.open(str(pool_file), writable=False) as pool:  # nothing else of the pool was touched
        assert bytes(slots.checked_payload(pool, 2, 5)) == stored
