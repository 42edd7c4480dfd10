"""The undo ring (cxltrain.checkpoint.ring): its size against the records a batch writes, wrap-around
and the scan that follows it, and recovery's row scatter (ring.restore): an undo record's old rows go
back in place bit for bit, and no other row of the table changes. Recovery scatters raw bytes with
numpy (any region dtype, row indices read straight from the record), so this is the scatter the
kernels' tests once covered.

Recovery's use of the ring's records (torn and damaged ones included) is in test_recovery.py.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import cxltrain
from cxltrain import knobs
from cxltrain.checkpoint import layout, ordering, ring
from cxltrain.errors import CheckpointError
from cxltrain.pool.format import RegionKind
from cxltrain.pool.handle import Pool, RegionSpec
from cxltrain.tables.bag import PersistentEmbeddingBag
from helpers import STREAMING_MODEL, assert_same_export
from test_runtime import BATCH, DIM, ROWS, state_of, train_steps


# ---------------------------------------------------------------------------------------------
# The ring's size
# ---------------------------------------------------------------------------------------------
def test_a_ring_too_small_for_the_interval_commits_early(shm_dir):
    """dense_every=50 with room for about 4 batches of records: snapshots come early, counted."""
    record = 2 * layout.record_bytes(BATCH * 3, 64, 4)  # both tables, at most this many rows each
    rt, _ = train_steps(shm_dir / "p.pool", 20, dense_every=50, undo_ring_bytes=4 * record)
    assert rt.stats.ring_full_commits >= 3 and rt.stats.ring_wait_seconds > 0
    train_steps(shm_dir / "ref.pool", 20)
    assert_same_export(state_of(shm_dir / "p.pool"), state_of(shm_dir / "ref.pool"))


def test_a_ring_smaller_than_one_record_is_a_clear_error(shm_dir):
    with pytest.raises(CheckpointError, match="cannot fit the 1,024-byte undo ring"):
        train_steps(shm_dir / "p.pool", 3, undo_ring_bytes=1024)
    with pytest.raises(CheckpointError, match="batch 0 needs more undo space than the ring has left"):
        train_steps(shm_dir / "q.pool", 3, undo_ring_bytes=4096)


# ---------------------------------------------------------------------------------------------
# The undo ring on its own: wrap-around, the scan.
# ---------------------------------------------------------------------------------------------
def _ring_pool(path, ring_bytes):
    pool = Pool.create(str(path), 8 << 20)
    table = PersistentEmbeddingBag(ROWS, DIM, name="t", seed=4)
    pool.add_regions([*table.region_specs(),
                      cxltrain.pool.handle.RegionSpec(layout.RING_REGION, cxltrain.pool.format.RegionKind.UNDO_RING,
                                               "uint8", (ring_bytes,))])
    table.attach(pool, initialize=True)
    pool.commit(batches_done=0, ring_generation=5)
    return pool, table


def test_ring_wraps_and_the_scan_follows(shm_dir):
    seed = int(os.environ.get("CXLTRAIN_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed}")  # shown on failure
    rng = np.random.default_rng(seed)
    pool, table = _ring_pool(shm_dir / "r.pool", 16 * 1024)
    writer = ring.UndoRing(pool, 5, 0, 0)
    weights, state = table.storage()
    offsets = []

    def append(batch):  # a record of 5-29 rows (0.4-2 KiB), then the "update" it undoes
        rows = torch.from_numpy(np.unique(rng.integers(0, ROWS, rng.integers(5, 30))))
        writer.append(batch, pool.region("t.weight"), pool.region("t.optim"), rows, weights, state)
        offsets.append(writer._live[-1].offset)
        weights[rows] += 1.0

    def commit(target):  # records of batches < target reclaimed
        start, seq = writer.start_after_reclaim(target)
        pool.commit(batches_done=target, ring_start=start, ring_start_seq=seq)
        writer.reclaim(target)

    batch = 0
    # round and round the ring, committing every third batch; then on until the head is in the
    # ring's second half, so the records that follow must wrap before the ring fills
    while batch < 40 or writer.head < writer.capacity // 2:
        append(batch)
        if batch % 3 == 2 or batch >= 40:
            commit(batch)
        batch += 1
    while len(writer._live) < 2 or writer._live[-1].offset > writer._live[-2].offset:
        append(batch)  # no commits: the live records end up straddling the end of the ring
        batch += 1
    live = ring.scan(pool, 5, pool.root.ring_start, pool.root.ring_start_seq)
    assert [r.header.batch for r in live] == list(range(pool.root.batches_done, batch))
    assert sum(b < a for a, b in zip(offsets, offsets[1:])) >= 3, "the ring wrapped too rarely"
    assert ring.scan(pool, 6, pool.root.ring_start, pool.root.ring_start_seq) == []  # another generation
    pool.close()


# ---------------------------------------------------------------------------------------------
# Recovery's row scatter (ring.restore)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,count", [(0, 1), (1, 7), (2, 64), (3, 0)])  # odd counts: indices off 8-byte alignment
def test_restore_puts_back_exactly_the_recorded_rows(shm_dir, seed, count):
    rows_total, dim = 200, 12
    g = torch.Generator().manual_seed(seed)
    with Pool.create(str(shm_dir / "ring.pool"), size=8 << 20) as pool:
        pool.add_regions([RegionSpec("t.weight", RegionKind.TABLE_WEIGHTS, "float32", (rows_total, dim), True),
                          RegionSpec("t.state", RegionKind.TABLE_OPTIM_STATE, "float32", (rows_total, 1)),
                          RegionSpec(layout.RING_REGION, RegionKind.UNDO_RING, "uint8", (1 << 20,))])
        weights = torch.from_numpy(pool.array("t.weight", padded=True))
        state = torch.from_numpy(pool.array("t.state", padded=True))
        weights.copy_(torch.randn(weights.shape, generator=g))
        state.copy_(torch.rand(state.shape, generator=g))
        before = weights.clone(), state.clone()
        rows = torch.sort(torch.randperm(rows_total, generator=g)[:count]).values
        undo = ring.UndoRing(pool, generation=1, start=0, start_seq=0)
        undo.append(0, pool.region("t.weight"), pool.region("t.state"), rows, weights, state)
        undo.mark_tail()
        weights[rows] = torch.randn(count, weights.shape[1], generator=g)  # the batch's in-place update
        state[rows] = 7.0
        [record] = ring.scan(pool, 1, 0, 0)
        ring.restore(pool, pool.region(layout.RING_REGION), record)
        assert torch.equal(weights, before[0]) and torch.equal(state, before[1])


# ---------------------------------------------------------------------------------------------
# The fused capture (kernels/undo.c): the records written inside the update.
# ---------------------------------------------------------------------------------------------


def _fused_ring(path, power_loss: int, seed: int):
    """A 256 KiB ring's pool (on the power-loss model or not) for fused updates, and a batch for
    one: (pool, table, ring writer, indices [300], their gradients [300, DIM]). Skips without
    the native kernels' streamed stores."""
    from cxltrain.kernels import ops

    if not ops.fused_available():
        pytest.skip("the native kernels are not built")
    rng = np.random.default_rng(seed)
    with knobs.override(power_loss=power_loss):
        pool, table = _ring_pool(path, 256 << 10)
    writer = ring.UndoRing(pool, 5, 0, 0)
    if not writer.streams():
        pool.close()
        pytest.skip("without libpmem only the power-loss model's kernels persist their own stores")
    indices = torch.from_numpy(rng.integers(0, ROWS, 300))
    grad = torch.from_numpy(rng.standard_normal((300, DIM)).astype(np.float32))
    return pool, table, writer, indices, grad


def _recorded_rows(pool, scanned, before_w: torch.Tensor, before_s: torch.Tensor | None = None) -> torch.Tensor:
    """The rows the scanned records hold [V], in order, each record's old values checked against
    the table's before the update (weights [R, P]; state [R, K] where given)."""
    array, base = pool.device.array, pool.region(layout.RING_REGION).offset
    got = []
    for record in scanned:
        h = record.header
        start = base + record.offset + layout.UNDO_HEADER.size
        old_w, old_s, ids = layout.split_payload(array[start : start + h.payload_bytes], h.count, h.row_bytes,
                                                 h.state_bytes)
        ids = torch.from_numpy(ids.copy())
        assert torch.equal(torch.from_numpy(old_w.copy()).view(torch.float32).view(h.count, -1), before_w[ids])
        if before_s is not None:
            assert torch.equal(torch.from_numpy(old_s.copy()).view(torch.float32).view(h.count, -1), before_s[ids])
        got.append(ids)
    return torch.cat(got)


@pytest.mark.parametrize("power_loss", [0, 1], ids=["emulated", "power-loss"])
@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("window", [False, True], ids=["all-rows", "first-touches"])
@pytest.mark.parametrize("handed", [False, True], ids=["kernel-sorts", "order-handed-over"])
def test_fused_update_writes_chunk_records_and_the_same_rows(shm_dir, rule, window, power_loss, handed):
    """One chunk record per chunk of the unique rows that has a row to record, each holding those
    rows' values from before the update; the table ends bit-identical to the plain kernel's, whether
    the kernel sorts the lookups itself or takes the order the layout sorted (handed); the scan
    reads the chunk records back in order; on the power-loss model they are on the media."""
    from cxltrain.kernels import ops

    pool, table, writer, indices, grad = _fused_ring(shm_dir / "f.pool", power_loss, seed=7)
    assert writer.streams()
    weights, state = table.storage()
    state = state if rule == "rowwise_adagrad" else None
    before_w, before_s = weights.clone(), None if state is None else state.clone()
    expected_w, expected_s = weights.clone(), None if state is None else state.clone()
    expected_rows = ops.sparse_update(rule, expected_w, expected_s, indices, grad, lr=0.1, eps=1e-8)

    rows, order = ops.unique_rows_and_order(indices, ROWS)
    assert np.array_equal(rows, ops.unique_rows(indices, ROWS).numpy())
    assert np.array_equal(order, np.argsort(indices.numpy(), kind="stable"))
    recorded = rows[::3].copy() if window else rows
    undo, records = writer.plan_chunks(0, pool.region("t.weight"), None if state is None else pool.region("t.optim"),
                                       rows, recorded, 16)
    undo.lookup_order = order if handed else None
    updated = ops.sparse_update(rule, weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo)
    writer.land(records)
    assert torch.equal(updated, expected_rows) and torch.equal(weights, expected_w)
    assert state is None or torch.equal(state, expected_s)

    chunks = -(-rows.size // 16)
    written = sum(r.count for r in records)  # one run of back-to-back records here (no wrap)
    assert written == sum(1 for c in range(chunks) if np.isin(rows[16 * c : 16 * (c + 1)], recorded).any())
    scanned = ring.scan(pool, 5, 0, 0)
    assert [r.header.seq for r in scanned] == list(range(written)) and writer.marked == written
    assert torch.equal(_recorded_rows(pool, scanned, before_w, before_s), torch.from_numpy(recorded))
    if power_loss:  # every record and the tail mark reached the media
        media = pool.device._file.media
        region = pool.region(layout.RING_REGION)
        assert np.array_equal(media[region.offset : region.end], pool.device.array[region.offset : region.end])
    pool.close()


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
def test_a_cached_tables_fused_update_records_its_table_rows_only(shm_dir, rule):
    """With a hot-row cache (every other looked-up row in a slot), the fused update updates each row
    where it lives, bit-identical to the kernel without a record, and its records hold exactly the
    uncached rows, from before the update. A plan that records a cached row (its table copy is not
    what the update changes) or asks the kernel to write rows back (it would flush table rows, not
    slots) is refused before any store."""
    from cxltrain.kernels import ops

    pool, table, writer, indices, grad = _fused_ring(shm_dir / "cached.pool", STREAMING_MODEL, seed=17)
    weights, state = table.storage()
    state = state if rule == "rowwise_adagrad" else None
    rows, order = ops.unique_rows_and_order(indices, ROWS)
    cached_rows = rows[::2]
    slot_of = torch.full((ROWS,), -1, dtype=torch.int32)
    slot_of[torch.from_numpy(cached_rows)] = torch.arange(cached_rows.size, dtype=torch.int32)
    slots = ops.CachedRows(slot_of, weights[torch.from_numpy(cached_rows)].clone(),
                           None if state is None else state[torch.from_numpy(cached_rows)].clone())
    expected = ops.CachedRows(slot_of, slots.weights.clone(), None if state is None else slots.state.clone())
    expected_w, expected_s = weights.clone(), None if state is None else state.clone()
    ops.sparse_update(rule, expected_w, expected_s, indices, grad, lr=0.1, eps=1e-8, cached=expected)
    before_w = weights.clone()
    region = (pool.region("t.weight"), None if state is None else pool.region("t.optim"))

    refused = [(cached_rows[:3].copy(), None, "records a row the map caches")]
    device_flush = pool.device.native_persistence()
    if device_flush is not None:  # a device with a native row flush the plan could hand over
        refused.append((rows[1::2].copy(), device_flush, "writes no rows back"))
    for recorded, flush, says in refused:
        undo, _ = writer.plan_chunks(0, *region, rows, recorded, 16)
        undo.row_flush = flush
        with pytest.raises(ValueError, match=says):
            ops.sparse_update(rule, weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo, cached=slots)
        assert torch.equal(weights, before_w) and ring.scan(pool, 5, 0, 0) == []

    uncached = rows[1::2].copy()
    undo, records = writer.plan_chunks(0, *region, rows, uncached, 16)
    undo.lookup_order = order
    ops.sparse_update(rule, weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo, cached=slots)
    writer.land(records)
    assert torch.equal(weights, expected_w) and torch.equal(slots.weights, expected.weights)
    assert state is None or (torch.equal(state, expected_s) and torch.equal(slots.state, expected.state))
    assert torch.equal(_recorded_rows(pool, ring.scan(pool, 5, 0, 0), before_w), torch.from_numpy(uncached))
    pool.close()


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
def test_a_cached_tables_fused_update_records_its_slots_beside_its_table_rows(shm_dir, rule):
    """Each chunk's slots' record follows the chunk's table record (the next seq): the scan reads
    them all back in ring order, the table records holding the uncached rows and the slots'
    records the cached rows' slots (weights, and the state row with the map column), each from
    before the update, and every row ends as the kernel without records leaves it. A slots' plan
    naming a slot outside the cache is refused before any store."""
    from cxltrain.kernels import ops
    from cxltrain.tables import cache

    if not ops.fused_available():
        pytest.skip("the native kernels are not built")
    rng = np.random.default_rng(23)
    indices = torch.from_numpy(rng.integers(0, ROWS, 300))
    grad = torch.from_numpy(rng.standard_normal((300, DIM)).astype(np.float32))
    rows, order = ops.unique_rows_and_order(indices, ROWS)
    cached_rows = rows[::2].copy()
    with knobs.override(power_loss=STREAMING_MODEL):
        pool = Pool.create(str(shm_dir / "slots.pool"), 8 << 20)
    table = PersistentEmbeddingBag(ROWS, DIM, name="t", seed=4)
    pool.add_regions([*table.region_specs(), *cache.region_specs(table, cached_rows.size),
                      RegionSpec(layout.RING_REGION, RegionKind.UNDO_RING, "uint8", (256 << 10,))])
    table.attach(pool, initialize=True)
    pool.commit(batches_done=0, ring_generation=5)
    writer = ring.UndoRing(pool, 5, 0, 0)
    if not writer.streams():
        pool.close()
        pytest.skip("without libpmem only the power-loss model's kernels persist their own stores")
    weights, state = table.storage()
    state = state if rule == "rowwise_adagrad" else None
    k = table.optimizer.state_columns
    slot_w = torch.from_numpy(pool.array("t.cache.weight", padded=True))
    slot_s = torch.from_numpy(pool.array("t.cache.optim"))
    slot_w[:] = weights[torch.from_numpy(cached_rows)]
    slot_s[:, :k] = table.storage()[1][torch.from_numpy(cached_rows)]
    slot_s[:, k:].view(torch.int32)[:, 0] = torch.from_numpy(cached_rows).to(torch.int32)  # the map column
    slot_of = torch.full((ROWS,), -1, dtype=torch.int32)
    slot_of[torch.from_numpy(cached_rows)] = torch.arange(cached_rows.size, dtype=torch.int32)
    slots = ops.CachedRows(slot_of, slot_w, slot_s)
    expected = ops.CachedRows(slot_of, slot_w.clone(), slot_s.clone())
    expected_w, expected_s = weights.clone(), None if state is None else state.clone()
    ops.sparse_update(rule, expected_w, expected_s, indices, grad, lr=0.1, eps=1e-8, cached=expected)
    before = weights.clone(), table.storage()[1].clone(), slot_w.clone(), slot_s.clone()

    hit = slot_of[torch.from_numpy(rows)].numpy() >= 0
    slot_ids = slot_of[torch.from_numpy(rows[hit])].numpy().astype(np.int64)
    region = (pool.region("t.weight"), None if state is None else pool.region("t.optim"))

    def plan(row_map):  # every uncached row and every slot recorded: the layout picks them out
        return writer.plan_chunks(0, *region, rows, None, 16, None, ring.SlotRecords(
            pool.region("t.cache.weight"), pool.region("t.cache.optim"), row_map.numpy()))

    past = slot_of.clone()
    past[int(cached_rows[0])] = cached_rows.size  # one slot past the cache
    with pytest.raises(ValueError, match=f"maps to slot {cached_rows.size}, outside the {cached_rows.size} slots"):
        plan(past)
    undo, _ = plan(slot_of)
    undo.slots.recorded[undo.slots.recorded == slot_ids[0]] = cached_rows.size  # the plan damaged after its layout
    with pytest.raises(ValueError, match=f"records a slot outside the {cached_rows.size} slots"):
        ops.sparse_update(rule, weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo, cached=slots)
    assert torch.equal(weights, before[0]) and torch.equal(slot_w, before[2]) and ring.scan(pool, 5, 0, 0) == []

    undo, records = plan(slot_of)
    undo.lookup_order = order
    ops.sparse_update(rule, weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo, cached=slots)
    writer.land(records)
    assert torch.equal(weights, expected_w) and torch.equal(slot_w, expected.weights)
    assert state is None or (torch.equal(state, expected_s) and torch.equal(slot_s, expected.state))
    scanned = ring.scan(pool, 5, 0, 0)
    assert [r.header.seq for r in scanned] == list(range(len(scanned))) and writer.marked == len(scanned)
    in_ring_order = [name for c in range(-(-rows.size // 16)) for name, any_row in
                     (("t.weight", (~hit[16 * c : 16 * (c + 1)]).any()), ("t.cache.weight", hit[16 * c : 16 * (c + 1)].any()))
                     if any_row]
    assert [r.weights_region.name for r in scanned] == in_ring_order
    mine = [r for r in scanned if r.weights_region.name == "t.weight"]
    theirs = [r for r in scanned if r.weights_region.name == "t.cache.weight"]
    assert torch.equal(_recorded_rows(pool, mine, before[0], None if state is None else before[1]),
                       torch.from_numpy(rows[~hit]))
    assert torch.equal(_recorded_rows(pool, theirs, before[2], before[3]), torch.from_numpy(slot_ids))
    pool.close()


@pytest.mark.parametrize("power_loss", [0, 1], ids=["emulated", "power-loss"])
@pytest.mark.parametrize("flush", ["device", "caller", "planted-skip"])
def test_fused_update_writes_its_rows_back_chunk_by_chunk(shm_dir, power_loss, flush):
    """With the device's row flush (Device.native_persistence) the kernel writes each chunk's updated
    rows back itself, weights and state: on the power-loss model the media then holds every updated
    row, and the runs it wrote are counted chunk by chunk. Left to the caller, or with the planted
    bug's skip (which counts the runs all the same), the media still holds the rows from before."""
    from cxltrain.devices.base import runs_of
    from cxltrain.kernels import native, ops

    pool, table, writer, indices, grad = _fused_ring(shm_dir / "r.pool", power_loss, seed=11)
    weights, state = table.storage()
    wr, sr = pool.region("t.weight"), pool.region("t.optim")
    rows, order = ops.unique_rows_and_order(indices, ROWS)
    undo, records = writer.plan_chunks(0, wr, sr, rows, rows, 16)
    undo.lookup_order = order
    device_flush = pool.device.native_persistence()
    if device_flush is None:  # only the emulated device without libpmem has none
        pool.close()
        pytest.skip("this device writes rows back without libpmem: no native row flush to hand over")
    assert device_flush.kind == (native.NativePersistence.MEDIA if power_loss else native.NativePersistence.LINES)
    undo.row_flush = {"device": device_flush, "caller": None,
                      "planted-skip": ordering.KernelSkipsRowFlush().kernel_row_flush(device_flush)}[flush]
    view = pool.device.array
    media = pool.device._file.media if power_loss else None
    spans = [(region.offset, region.end) for region in (wr, sr)]
    before = [view[a:b].copy() for a, b in spans]
    assert media is None or all(np.array_equal(media[a:b], view[a:b]) for a, b in spans)

    updated = ops.sparse_update("rowwise_adagrad", weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo)
    writer.land(records)
    assert np.array_equal(updated.numpy(), rows) and not np.array_equal(view[spans[0][0]:spans[0][1]], before[0])
    per_chunk = sum(len(runs_of(rows[c : c + 16])[0]) for c in range(0, rows.size, 16))
    assert undo.flushed_runs == (0 if flush == "caller" else per_chunk)
    if media is not None:
        for (a, b), old in zip(spans, before):
            assert np.array_equal(media[a:b], view[a:b] if flush == "device" else old)
    pool.close()


@pytest.mark.parametrize("outside", ["ends-past-the-mapping", "starts-before-it"])
def test_a_row_write_back_outside_its_mapping_is_refused_before_any_store(shm_dir, outside):
    """The kernel copies lines to the media only inside the view it is told of: a table that does not
    lie inside it is refused before any record or row is written."""
    import dataclasses

    from cxltrain.kernels import ops

    pool, table, writer, indices, grad = _fused_ring(shm_dir / "b.pool", 1, seed=5)
    weights, state = table.storage()
    rows, order = ops.unique_rows_and_order(indices, ROWS)
    undo, records = writer.plan_chunks(0, pool.region("t.weight"), pool.region("t.optim"), rows, rows, 16)
    flush = pool.device.native_persistence()
    undo.row_flush = (dataclasses.replace(flush, map_end=weights.data_ptr() + 64) if outside == "ends-past-the-mapping"
                      else dataclasses.replace(flush, map_start=weights.data_ptr() + 64))
    before_w, before_s = weights.clone(), state.clone()
    with pytest.raises(ValueError, match="does not lie inside the mapping"):
        ops.sparse_update("rowwise_adagrad", weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo)
    assert torch.equal(weights, before_w) and torch.equal(state, before_s)
    assert ring.scan(pool, 5, 0, 0) == []
    pool.close()


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("window", [False, True], ids=["all-rows", "first-touches"])
def test_the_kernel_writes_each_chunk_back_right_after_updating_it(shm_dir, rule, window):
    """With a recording flush handed over (NativePersistence.LINES, a ctypes callback), the kernel writes back
    exactly the updated rows, weights and (Adagrad) state, run by run within each 16-row chunk,
    chunks without a record included; and when it writes a chunk back, that chunk's rows hold their
    new values and the next chunk's still their old ones: each chunk goes back right after its own
    update, not after the table's."""
    import ctypes

    from cxltrain.kernels import native, ops

    pool, table, writer, indices, grad = _fused_ring(shm_dir / "c.pool", STREAMING_MODEL, seed=13)
    weights, state = table.storage()
    state = state if rule == "rowwise_adagrad" else None
    expected_w, expected_s = weights.clone(), None if state is None else state.clone()
    ops.sparse_update(rule, expected_w, expected_s, indices, grad, lr=0.1, eps=1e-8)
    before_w = weights.clone()
    rows, order = ops.unique_rows_and_order(indices, ROWS)
    recorded = rows[::40].copy() if window else rows  # with a window, most chunks have no record
    undo, records = writer.plan_chunks(0, pool.region("t.weight"), None if state is None else pool.region("t.optim"),
                                       rows, recorded, 16)
    undo.lookup_order = order
    seen = []
    flush = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)(
        lambda address, length: seen.append((address, length, weights.clone())))
    undo.row_flush = native.NativePersistence(native.NativePersistence.LINES, ctypes.cast(flush, ctypes.c_void_p).value)
    ops.sparse_update(rule, weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo)
    writer.land(records)
    assert torch.equal(weights, expected_w) and (state is None or torch.equal(state, expected_s))

    tables = [(weights.data_ptr(), weights.stride(0) * 4)]
    if state is not None:
        tables.append((state.data_ptr(), state.stride(0) * 4))
    expected_calls, chunk_of_call = [], []
    for c in range(0, rows.size, 16):
        chunk = rows[c : c + 16]
        for run in np.split(chunk, np.flatnonzero(np.diff(chunk) != 1) + 1):
            for base, stride in tables:
                expected_calls.append((base + int(run[0]) * stride, int(run.size) * stride))
                chunk_of_call.append(c)
    assert [(address, length) for address, length, _ in seen] == expected_calls
    assert undo.flushed_runs == len(expected_calls) // len(tables)
    ids = torch.from_numpy(rows)
    for (_, _, at_flush), c in zip(seen, chunk_of_call):
        done, next_chunk = ids[c : c + 16], ids[c + 16 : c + 32]
        assert torch.equal(at_flush[done], expected_w[done]) and torch.equal(at_flush[next_chunk], before_w[next_chunk])
    pool.close()


def test_a_fused_run_leaves_the_rows_write_back_to_the_kernel(shm_dir, monkeypatch):
    """A strict run on the emulated device writes each updated row back once, in the kernel: the
    Python row-set flush is never called, and the device counts the kernel's write-back. With the
    fused capture off the Python flush does it instead; the rows counted and the tables are the same."""
    from cxltrain.devices.base import Device
    from cxltrain.kernels import ops

    if not ops.fused_available():
        pytest.skip("the native kernels are not built")
    calls = {"flush_rows": 0, "rows_flushed": 0}
    for name in calls:
        original = getattr(Device, name)

        def counted(self, *args, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(Device, name, counted)
    persisted = {}
    for fused in (1, 0):
        calls.update(flush_rows=0, rows_flushed=0)
        with knobs.override(power_loss=STREAMING_MODEL):
            rt, _ = train_steps(shm_dir / f"f{fused}.pool", 6, fused_capture=bool(fused))
        persisted[fused] = rt.stats.rows_persisted
        kernel = calls["rows_flushed"] if fused else calls["flush_rows"]
        python = calls["flush_rows"] if fused else calls["rows_flushed"]
        assert kernel > 0 and python == 0, (fused, calls)
    assert persisted[1] == persisted[0] > 0
    assert_same_export(state_of(shm_dir / "f1.pool"), state_of(shm_dir / "f0.pool"))


# (chunks of the update, slots of batch 0's records reclaimed before it, slots free at the head)
_WRAPS = {"one-run-at-the-head": (4, 3, 5),
          "one-by-one-though-a-run-fits-at-the-start": (4, 5, 2),
          "one-by-one-across-the-wrap": (6, 3, 3)}


@pytest.mark.parametrize("where", list(_WRAPS))
def test_fused_records_wrap_as_appended_ones_do(shm_dir, where):
    """A fused update's chunk records go back to back as one run where they all fit at the head,
    else one by one as appends would go: the head's room first, then from the ring's start (never
    the whole run moved to the start, which would leave the head's room unused and fill the ring
    early). Either way the scan reads them after the live records, in order, each with its rows'
    old values."""
    from cxltrain.kernels import ops

    if not ops.fused_available():
        pytest.skip("the native kernels are not built")
    with knobs.override(power_loss=STREAMING_MODEL):
        pool, table = _ring_pool(shm_dir / "w.pool", 64 << 10)
    writer = ring.UndoRing(pool, 5, 0, 0)
    weights, state = table.storage()
    wr, sr = pool.region("t.weight"), pool.region("t.optim")
    one = layout.record_bytes(16, wr.row_stride, sr.row_stride)  # a full 16-row chunk's record
    slots = writer.capacity // one
    chunks, reclaimed, free_at_head = _WRAPS[where]  # batch 1's records live between the two free spans
    rng = np.random.default_rng(5)
    for slot in range(slots - free_at_head):
        rows = torch.from_numpy(np.sort(rng.choice(ROWS, 16, replace=False)))
        writer.append(0 if slot < reclaimed else 1, wr, sr, rows, weights, state)
    writer.mark_tail()
    writer.reclaim(1)
    start, start_seq = writer.start_after_reclaim(1)
    head = writer.head

    rows = np.sort(rng.choice(ROWS, 16 * chunks, replace=False))
    indices = torch.from_numpy(np.repeat(rows, 2))
    grad = torch.from_numpy(rng.standard_normal((indices.numel(), DIM)).astype(np.float32))
    before_w = weights.clone()
    undo, records = writer.plan_chunks(2, wr, sr, rows, rows, 16)
    ops.sparse_update("rowwise_adagrad", weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo)
    writer.land(records)
    if where == "one-run-at-the-head":
        assert [(r.offset, r.count) for r in records] == [(head, chunks)]
    else:
        assert [r.offset for r in records] == ([head + c * one for c in range(free_at_head)]
                                               + [c * one for c in range(chunks - free_at_head)])

    scanned = ring.scan(pool, 5, start, start_seq)
    assert [r.header.batch for r in scanned] == [1] * (slots - free_at_head - reclaimed) + [2] * chunks
    assert [r.header.seq for r in scanned] == list(range(start_seq, writer.next_seq))
    array, base = pool.device.array, pool.region(layout.RING_REGION).offset
    for c, record in enumerate(scanned[-chunks:]):
        h = record.header
        at = base + record.offset + layout.UNDO_HEADER.size
        old_w, _, ids = layout.split_payload(array[at : at + h.payload_bytes], h.count, h.row_bytes, h.state_bytes)
        assert np.array_equal(ids, rows[16 * c : 16 * (c + 1)])
        ids = torch.from_numpy(ids.copy())
        assert torch.equal(torch.from_numpy(old_w.copy()).view(torch.float32).view(h.count, -1), before_w[ids])
    pool.close()


def _swap_equal_rows(order: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """order with the first two lookups of one row swapped: the same permutation, not stable."""
    j = int(np.flatnonzero(keys[order[1:]] == keys[order[:-1]])[0])
    order = order.copy()
    order[j], order[j + 1] = order[j + 1], order[j]
    return order


@pytest.mark.parametrize("spoil", ["other-lookups", "unsorted", "unstable", "out-of-range", "repeated"])
def test_a_handed_over_order_that_is_not_the_lookups_is_refused_before_any_store(shm_dir, spoil):
    """The kernel checks an order it is handed (kernels/rows.c sorted_order_holds) before writing
    anything: a wrong one would sum some lookups twice and others never."""
    from cxltrain.kernels import ops

    if not ops.fused_available():
        pytest.skip("the native kernels are not built")
    rng = np.random.default_rng(3)
    with knobs.override(power_loss=STREAMING_MODEL):
        pool, table = _ring_pool(shm_dir / "o.pool", 256 << 10)
    writer = ring.UndoRing(pool, 5, 0, 0)
    weights, state = table.storage()
    indices = torch.from_numpy(rng.integers(0, 40, 300))  # many repeats: rows with several lookups
    grad = torch.from_numpy(rng.standard_normal((300, DIM)).astype(np.float32))
    rows, order = ops.unique_rows_and_order(indices, ROWS)
    keys = indices.numpy()
    spoiled = {"other-lookups": lambda: ops.unique_rows_and_order(indices.flip(0).contiguous(), ROWS)[1],
               "unsorted": lambda: order[::-1].copy(),
               "unstable": lambda: _swap_equal_rows(order, keys),
               "out-of-range": lambda: np.where(order == order.max(), 300, order),
               "repeated": lambda: np.where(order == 0, 1, order)}[spoil]()
    undo, records = writer.plan_chunks(0, pool.region("t.weight"), pool.region("t.optim"), rows, rows, 16)
    undo.lookup_order = spoiled
    before_w, before_s = weights.clone(), state.clone()
    with pytest.raises(ValueError, match="lookup order"):
        ops.sparse_update("rowwise_adagrad", weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo)
    assert torch.equal(weights, before_w) and torch.equal(state, before_s)
    assert ring.scan(pool, 5, 0, 0) == []  # no record written either
    undo.lookup_order = order[:-1].copy()
    with pytest.raises(ValueError, match="lookup order has 299 lookups"):
        ops.sparse_update("rowwise_adagrad", weights, state, indices, grad, lr=0.1, eps=1e-8, undo=undo)
    pool.close()
