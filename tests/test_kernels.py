"""The native row kernels (kernels/rows.c) against the torch kernels of kernels/rows.py.

Each test runs the same call through kernels.ops twice, with the native_kernels knob at 1 (C) and
at 0 (torch), on copies of the same inputs. Gathers, duplicate reduction and SGD must be
equal bit for bit, row-wise Adagrad included (rows.py adds the squares in the C kernel's order and
rounds the root correctly), and bit-equal to itself run to run.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cxltrain import knobs
from cxltrain.checkpoint import fused
from cxltrain.checkpoint.layout import split_payload
from cxltrain.devices.libpmem import load as load_libpmem
from cxltrain.devices.registry import map_device
from cxltrain.kernels import native, ops

needs_native = pytest.mark.skipif(not native.built(), reason="native row kernels not built")
CACHE_LINE = 64


def test_the_extension_is_built():
    """`make setup` compiles kernels/rows.c; without it every other test here would only skip."""
    assert native.built(), "cxltrain.kernels._rows did not build or import (see `pip install -e .` output)"


def run_both(fn, *tensors):
    """fn(*copies) with the C kernels and with the torch kernels → ((result, copies), (result, copies))."""
    results = []
    for flag in (1, 0):
        copies = [None if t is None else t.clone() for t in tensors]
        with knobs.override(native_kernels=flag):
            results.append((fn(*copies), copies))
    return results


def random_table(g, rows, width):
    return torch.randn(rows, width, generator=g)


def random_lookups(g, rows, lookups, bags):
    """indices [N] with hot rows (duplicates are common) and offsets [B] (empty bags allowed)."""
    indices = torch.randint(0, rows, (lookups,), generator=g)
    hot = torch.rand(lookups, generator=g) < 0.5
    indices[hot] = torch.randint(0, min(rows, 4), (int(hot.sum()),), generator=g)
    cuts = torch.sort(torch.randint(0, lookups + 1, (bags - 1,), generator=g)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts])
    return indices, offsets


def random_update(g, rows, dim, pad, lookups, bags, mode):
    """(weight [R, D + pad], state [R, 1], indices [N], offsets [B], grad_out [B, D], per-sample
    weights [N] in mode "weighted", else None): one random update's inputs."""
    weight = random_table(g, rows, dim + pad)
    state = torch.rand(rows, 1, generator=g)
    indices, offsets = random_lookups(g, rows, lookups, bags)
    grad_out = torch.randn(bags, dim, generator=g)
    psw = torch.rand(lookups, generator=g) if mode == "weighted" else None
    return weight, state, indices, offsets, grad_out, psw


# -- gather (recovery's scatter is ring.restore: tests/test_ring.py) ----------------------
@needs_native
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 300), width=st.integers(1, 40), count=st.integers(0, 80))
def test_gather_equals_torch(seed, rows, width, count):
    g = torch.Generator().manual_seed(seed)
    table = random_table(g, rows, width)
    picks = torch.randint(0, rows, (count,), generator=g)  # duplicates and any order
    (ours, _), (theirs, _) = run_both(lambda t: ops.gather_rows(t, picks), table)
    assert torch.equal(ours, table[picks])
    assert torch.equal(ours, theirs)


# -- fused sparse update ------------------------------------------------------------------------
def update(rule, mode, indices, offsets, grad_out, psw, lr=0.3, eps=1e-6):
    return lambda w, s: ops.sparse_update(rule, w, s, indices, grad_out, offsets, psw, mode, lr=lr, eps=eps)


@needs_native
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 200), dim=st.integers(1, 70), pad=st.integers(0, 9),
       lookups=st.integers(0, 300), bags=st.integers(1, 50), mode=st.sampled_from(["sum", "mean", "weighted"]),
       rule=st.sampled_from(["sgd", "rowwise_adagrad"]))
def test_sparse_update_equals_torch(seed, rows, dim, pad, lookups, bags, mode, rule):
    g = torch.Generator().manual_seed(seed)
    weight, state, indices, offsets, grad_out, psw = random_update(g, rows, dim, pad, lookups, bags, mode)
    fn = update(rule, "mean" if mode == "mean" else "sum", indices, offsets, grad_out, psw)
    (ours, [w1, s1]), (theirs, [w2, s2]) = run_both(fn, weight, state)
    assert torch.equal(ours, theirs) and torch.equal(ours, torch.unique(indices))
    assert torch.equal(w1[:, dim:], weight[:, dim:])  # padding columns are never written
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[ours] = False
    assert torch.equal(w1[untouched], weight[untouched]) and torch.equal(s1[untouched], state[untouched])
    assert torch.equal(w1, w2) and torch.equal(s1, s2)


def split_update(rule, mode, indices, offsets, grad_out, psw, weight, state, slot_of, slot_weight, slot_state,
                 lr=0.3, eps=1e-6):
    """The cached update as it was done before the kernel took the row map: the lookups split into
    hits (slots) and misses (table rows) in Python, each lookup's gradient scaled there (1/len in
    mode mean, or its per-sample weight), then the kernel once per side, each lookup its own bag."""
    n = indices.numel()
    lengths = torch.diff(offsets, append=torch.tensor([n], dtype=torch.int64))
    bag_of = torch.repeat_interleave(torch.arange(offsets.numel()), lengths)
    grads = grad_out[bag_of].contiguous()
    scale = (1.0 / lengths.to(torch.float32))[bag_of] if mode == "mean" else psw
    slots = slot_of[indices].to(torch.int64)
    hit = slots >= 0
    for where, where_state, at in ((slot_weight, slot_state, slots), (weight, state, indices)):
        for side in (hit,) if where is slot_weight else (~hit,):
            if bool(side.any()):
                ops.sparse_update(rule, where, where_state, at[side].contiguous(), grads[side].contiguous(), None,
                                  None if scale is None else scale[side].contiguous(), "sum", lr=lr, eps=eps)


@needs_native
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 200), dim=st.integers(1, 70), pad=st.integers(0, 9),
       lookups=st.integers(0, 300), bags=st.integers(1, 50), mode=st.sampled_from(["sum", "mean", "weighted"]),
       rule=st.sampled_from(["sgd", "rowwise_adagrad"]), cached=st.floats(0, 1), wide=st.booleans(),
       native_flag=st.sampled_from([1, 0]))
def test_the_cached_update_equals_the_split_update_bit_for_bit(seed, rows, dim, pad, lookups, bags, mode, rule,
                                                               cached, wide, native_flag):
    """One kernel call with the row map and the slots gives each row, cached or not, the very bits
    the Python split (hits and misses updated apart) gave: same lookups, same order, same scale."""
    g = torch.Generator().manual_seed(seed)
    weight, state, indices, offsets, grad_out, psw = random_update(g, rows, dim, pad, lookups, bags, mode)
    kept = torch.nonzero(torch.rand(rows, generator=g) < cached).reshape(-1)
    slot_count = kept.numel() + 3  # spare slots stay as they are
    slot_of = torch.full((rows,), -1, dtype=torch.int64 if wide else torch.int32)
    slot_of[kept] = torch.randperm(slot_count, generator=g)[: kept.numel()].to(slot_of.dtype)
    slot_weight = random_table(g, slot_count, dim + pad)
    slot_state = torch.rand(slot_count, 2, generator=g)  # the cache's: state columns, then its map column
    mode_of = "mean" if mode == "mean" else "sum"
    inputs = [weight, state, slot_weight, slot_state]
    with knobs.override(native_kernels=native_flag):
        expected = [t.clone() for t in inputs]
        split_update(rule, mode_of, indices, offsets, grad_out, psw, *expected[:2], slot_of, *expected[2:])
        got = [t.clone() for t in inputs]
        slots = ops.CachedRows(slot_of, got[2], got[3] if rule == "rowwise_adagrad" else None)
        rows_done = ops.sparse_update(rule, got[0], got[1] if rule == "rowwise_adagrad" else None, indices,
                                      grad_out, offsets, psw, mode_of, lr=0.3, eps=1e-6, cached=slots)
    assert torch.equal(rows_done, torch.unique(indices))
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


class FileTable:
    """A table's weights [R, P] and state [R, 1] in a file mapped shared (as a capacity pool's), at
    page-aligned offsets after a page the update must leave alone; `fd` is opened for writing."""

    def __init__(self, folder: str, weight: torch.Tensor, state: torch.Tensor) -> None:
        page = mmap.PAGESIZE
        self.weight_offset = page
        self.state_offset = page + -(-weight.numel() * 4 // page) * page
        size = self.state_offset + -(-state.numel() * 4 // page) * page
        self.fd = os.open(os.path.join(folder, "table"), os.O_RDWR | os.O_CREAT)
        os.ftruncate(self.fd, size)
        self.mapping = mmap.mmap(self.fd, size)
        whole = np.frombuffer(self.mapping, dtype=np.uint8)
        whole[:page] = 0xAB
        self.weight = torch.from_numpy(whole[self.weight_offset :].view(np.float32)[: weight.numel()]).view(weight.shape)
        self.state = torch.from_numpy(whole[self.state_offset :].view(np.float32)[: state.numel()]).view(state.shape)
        self.weight.copy_(weight)
        self.state.copy_(state)
        self.first_page = whole[:page]

    def rows(self, fd: int | None = None) -> ops.FileRows:
        return ops.FileRows(self.fd if fd is None else fd, self.weight_offset, self.state_offset)

    def close(self) -> None:
        del self.weight, self.state, self.first_page
        try:
            self.mapping.close()
        except BufferError:
            pass  # a traceback still holds a view: the mapping goes with it
        os.close(self.fd)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 200), dim=st.integers(1, 70), pad=st.integers(0, 9),
       lookups=st.integers(0, 300), bags=st.integers(1, 50), mode=st.sampled_from(["sum", "mean", "weighted"]),
       rule=st.sampled_from(["sgd", "rowwise_adagrad"]), cached=st.floats(0, 1), native_flag=st.sampled_from([1, 0]))
def test_rows_written_to_the_file_are_the_rows_stores_would_leave(seed, rows, dim, pad, lookups, bags, mode, rule,
                                                                  cached, native_flag):
    """FileRows: the C kernel writes each updated table row to the file, not through the mapping
    (the torch kernels store through it); the mapping then reads exactly what stores in memory leave,
    cached rows updated in their slots, nothing else in the file touched."""
    g = torch.Generator().manual_seed(seed)
    weight, state, indices, offsets, grad_out, psw = random_update(g, rows, dim, pad, lookups, bags, mode)
    kept = torch.nonzero(torch.rand(rows, generator=g) < cached).reshape(-1)
    slot_of = torch.full((rows,), -1, dtype=torch.int64)
    slot_of[kept] = torch.arange(kept.numel())
    slot_weight, slot_state = random_table(g, kept.numel() + 1, dim + pad), torch.rand(kept.numel() + 1, 2, generator=g)
    mode_of, adagrad = ("mean" if mode == "mean" else "sum"), rule == "rowwise_adagrad"
    with tempfile.TemporaryDirectory() as folder, knobs.override(native_kernels=native_flag):
        want = [t.clone() for t in (weight, state, slot_weight, slot_state)]
        ops.sparse_update(rule, want[0], want[1] if adagrad else None, indices, grad_out, offsets, psw, mode_of,
                          lr=0.3, eps=1e-6, cached=ops.CachedRows(slot_of, want[2], want[3] if adagrad else None))
        table = FileTable(folder, weight, state)
        slots = ops.CachedRows(slot_of, slot_weight.clone(), slot_state.clone() if adagrad else None)
        try:
            done = ops.sparse_update(rule, table.weight, table.state if adagrad else None, indices, grad_out, offsets,
                                     psw, mode_of, lr=0.3, eps=1e-6, cached=slots, file_rows=table.rows())
            assert torch.equal(done, torch.unique(indices))
            assert torch.equal(table.weight, want[0]) and torch.equal(table.state, want[1])
            assert torch.equal(slots.weights, want[2])
            assert not adagrad or torch.equal(slots.state, want[3])
            assert (table.first_page == 0xAB).all()
        finally:
            table.close()


@needs_native
def test_a_row_the_file_refuses_stops_the_update_with_oserror():
    """The kernel writes the rows through the file descriptor it is given: one that cannot write
    (opened read-only) fails the first row's write, which raises, and no row has changed."""
    weight, state = torch.rand(50, 8), torch.rand(50, 1)
    with tempfile.TemporaryDirectory() as folder:
        table = FileTable(folder, weight, state)
        read_only = os.open(os.path.join(folder, "table"), os.O_RDONLY)
        try:
            with pytest.raises(OSError) as refused:
                ops.sparse_update("rowwise_adagrad", table.weight, table.state, torch.tensor([3, 7, 3]),
                                  torch.ones(3, 8), lr=0.1, eps=1e-8, file_rows=table.rows(read_only))
            assert refused.value.errno == errno.EBADF
            assert torch.equal(table.weight, weight) and torch.equal(table.state, state)
        finally:
            os.close(read_only)
            table.close()


@pytest.mark.parametrize("native_flag", [1, 0])
def test_a_row_map_outside_the_slots_is_refused_before_any_store(native_flag):
    weight, state = torch.zeros(10, 4), torch.zeros(10, 1)
    slot_of = torch.full((10,), -1, dtype=torch.int32)
    slot_of[3] = 2  # two slots only
    slots = ops.CachedRows(slot_of, torch.zeros(2, 4), torch.zeros(2, 2))
    with knobs.override(native_kernels=native_flag), pytest.raises(ValueError, match="outside the 2 slots"):
        ops.sparse_update("rowwise_adagrad", weight, state, torch.tensor([1, 3]), torch.ones(2, 4), lr=0.1,
                          eps=1e-8, cached=slots)
    assert not weight.any() and not state.any() and not slots.weights.any()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 300), width=st.integers(1, 20), lookups=st.integers(0, 400),
       cached=st.floats(0, 1), wide=st.booleans())
def test_the_cached_gather_copies_each_row_from_where_it_lives(seed, rows, width, lookups, cached, wide):
    """Each lookup's row from its slot where the map holds it, else from the table, in lookup order
    (C and torch alike), and the count of lookups served by a slot."""
    g = torch.Generator().manual_seed(seed)
    table = random_table(g, rows, width)
    held = torch.nonzero(torch.rand(rows, generator=g) < cached).reshape(-1)
    slot_of = torch.full((rows,), -1, dtype=torch.int64 if wide else torch.int32)
    slot_of[held] = torch.randperm(held.numel(), generator=g).to(slot_of.dtype)
    slots = random_table(g, held.numel() + 1, width)  # a cache has a slot at least (cache.check_table)
    indices = torch.randint(0, rows, (lookups,), generator=g)
    want = table[indices].clone()
    hit = slot_of[indices] >= 0
    want[hit] = slots[slot_of[indices][hit].long()]
    for (got, hits), _ in run_both(lambda t, s: ops.gather_cached(t, ops.CachedRows(slot_of, s, None), indices),
                                   table, slots):
        assert torch.equal(got, want) and hits == int(hit.sum())


@pytest.mark.parametrize("native_flag", [1, 0])
def test_the_cached_gather_refuses_a_row_map_outside_the_slots(native_flag):
    slot_of = torch.full((10,), -1, dtype=torch.int32)
    slot_of[3] = 2  # two slots only
    with knobs.override(native_kernels=native_flag), pytest.raises(ValueError, match="outside the 2 slots"):
        ops.gather_cached(torch.zeros(10, 4), ops.CachedRows(slot_of, torch.zeros(2, 4), None), torch.tensor([1, 3]))


@needs_native
@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
def test_sparse_update_is_deterministic(rule):
    g = torch.Generator().manual_seed(11)
    weight, state = random_table(g, 1000, 64), torch.rand(1000, 1, generator=g)
    indices, offsets = random_lookups(g, 1000, 4096, 2048)
    grad_out = torch.randn(2048, 64, generator=g)
    results = []
    for _ in range(3):
        w, s = weight.clone(), state.clone()
        ops.sparse_update(rule, w, s, indices, grad_out, offsets, lr=0.1, eps=1e-8)
        results.append((w, s))
    for w, s in results[1:]:
        assert torch.equal(w, results[0][0]) and torch.equal(s, results[0][1])


@needs_native
@pytest.mark.parametrize("native_flag", [1, 0])
def test_duplicates_are_summed_in_lookup_order(native_flag):
    """Row 5's gradients 1e8, 1, -1e8 (in that lookup order) sum to 0 in float32, not to 1: the big
    value swallows the 1 before it cancels. Another order (or a tree sum) would give 1."""
    weight = torch.zeros(10, 1)
    indices = torch.tensor([5, 2, 5, 5])
    grad_out = torch.tensor([[1e8], [7.0], [1.0], [-1e8]])
    with knobs.override(native_kernels=native_flag):
        rows = ops.sparse_update("sgd", weight, None, indices, grad_out, lr=1.0)
    assert rows.tolist() == [2, 5]
    assert weight[5, 0].item() == 0.0 and weight[2, 0].item() == -7.0


@needs_native
@pytest.mark.parametrize("native_flag", [1, 0])
def test_empty_batch_changes_nothing(native_flag):
    weight, state = torch.randn(10, 4), torch.rand(10, 1)
    before = weight.clone(), state.clone()
    with knobs.override(native_kernels=native_flag):
        rows = ops.sparse_update("rowwise_adagrad", weight, state, torch.empty(0, dtype=torch.int64),
                                 torch.empty(3, 4), torch.zeros(3, dtype=torch.int64), lr=0.1, eps=1e-8)
        assert ops.gather_rows(weight, torch.empty(0, dtype=torch.int64)).shape == (0, 4)
    assert rows.numel() == 0
    assert torch.equal(weight, before[0]) and torch.equal(state, before[1])


# -- refusals: nothing written ------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("native_flag", [1, 0])
@pytest.mark.parametrize("bad", [10, -1])
def test_out_of_range_rows_are_refused_before_any_store(native_flag, bad):
    weight, state = torch.randn(10, 4), torch.rand(10, 1)
    before = weight.clone(), state.clone()
    rows = torch.tensor([0, 3, bad])  # the good rows come first: a kernel that checks as it goes writes them
    payload = np.zeros(3 * (16 + 4 + 8), dtype=np.uint8)
    old_w, old_s, old_r = payload[:48].reshape(3, 16), payload[48:60].reshape(3, 4), payload[60:].view(np.int64)
    with knobs.override(native_kernels=native_flag):
        with pytest.raises(IndexError, match=f"row index {bad} is out of range"):
            ops.sparse_update("rowwise_adagrad", weight, state, rows, torch.ones(3, 4), lr=0.1, eps=1e-8)
        with pytest.raises(IndexError):
            ops.gather_rows(weight, rows)
        with pytest.raises(IndexError):
            ops.capture_undo(old_w, old_s, old_r, weight, state, rows)
    assert torch.equal(weight, before[0]) and torch.equal(state, before[1])
    assert not payload.any()


@needs_native
def test_native_row_set_kernels_refuse_out_of_range_rows():
    view, media = np.arange(640, dtype=np.uint8), np.zeros(640, dtype=np.uint8)
    rows = np.array([1, 10], dtype=np.int64)  # 10 rows of 64 bytes: row 10 is past the end
    with pytest.raises(IndexError, match="row index 10"):
        native.copy_lines(view.ctypes.data, media.ctypes.data, 640, 0, 64, 10, rows)
    assert not media.any()
    with pytest.raises(IndexError, match="row index 10"):
        native.flush_rows(view.ctypes.data, 64, 10, rows)
    with pytest.raises(ValueError, match="inside the mapping"):
        native.copy_lines(view.ctypes.data, media.ctypes.data, 640, 64, 64, 10, rows[:1])


@needs_native
def test_wrong_dtype_shape_or_layout_is_refused():
    weight, state = torch.randn(10, 4), torch.rand(10, 1)
    rows, grads = torch.tensor([1, 2]), torch.ones(2, 4)
    sgd = lambda **kw: ops.sparse_update(**{"rule": "sgd", "weight": weight, "state": None, "indices": rows,  # noqa: E731
                                            "grad_out": grads, "lr": 0.1, **kw})
    with pytest.raises(TypeError, match="indices"):
        sgd(indices=rows.to(torch.int32))
    with pytest.raises(TypeError, match="grad_out"):
        sgd(grad_out=grads.double())
    with pytest.raises(ValueError, match="contiguous"):
        sgd(grad_out=torch.ones(4, 2).t())
    with pytest.raises(ValueError, match="contiguous"):
        sgd(weight=torch.randn(10, 8)[:, :4])
    with pytest.raises(ValueError, match="columns"):
        sgd(grad_out=torch.ones(2, 5))
    with pytest.raises(ValueError, match="offsets"):
        sgd(offsets=torch.tensor([0]))
    with pytest.raises(ValueError, match="per_sample_weights"):
        sgd(per_sample_weights=torch.ones(2), mode="mean")
    with pytest.raises(TypeError, match="state"):
        ops.sparse_update("rowwise_adagrad", weight, None, rows, grads, lr=0.1)
    with pytest.raises(ValueError, match="rule"):
        sgd(rule="adam")
    with pytest.raises(TypeError, match="rows"):
        native.flush_rows(0, 64, 10, np.array([1, 2], dtype=np.int32))
    with pytest.raises(TypeError, match="aligned"):
        native.flush_rows(0, 64, 10, np.zeros(40, np.uint8)[4:36].view(np.int64))
    with pytest.raises(ValueError, match="old_weights"):
        ops.capture_undo(np.zeros((2, 8), np.uint8), np.zeros((2, 4), np.uint8), np.zeros(2, np.int64),
                         weight, state, rows)
    assert torch.equal(weight, weight)


@needs_native
def test_bad_offsets_are_refused_by_the_kernel():
    """The C kernel checks offsets itself: they index its per-lookup arrays."""
    weight = torch.randn(10, 4)
    before = weight.clone()
    for offsets in ([0, 3, 2], [1, 2, 3], [0, 1, 9]):
        with pytest.raises(ValueError, match="offsets"):
            ops.sparse_update("sgd", weight, None, torch.tensor([1, 2, 3]), torch.ones(3, 4),
                              torch.tensor(offsets), lr=0.1)
    assert torch.equal(weight, before)


# -- undo capture -------------------------------------------------------------------------------
@needs_native
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 300), width=st.integers(1, 33), k=st.integers(0, 2),
       count=st.integers(0, 60), skew=st.integers(0, 3))
def test_capture_undo_equals_torch(seed, rows, width, k, count, skew):
    g = torch.Generator().manual_seed(seed)
    weights = random_table(g, rows, width)
    state = torch.rand(rows, k, generator=g) if k else None
    picks = torch.sort(torch.randperm(rows, generator=g)[: min(count, rows)]).values
    payloads = []
    for flag in (1, 0):
        # a payload that starts `skew` 4-byte words after a 16-byte boundary, as ring records can
        raw = np.zeros(picks.numel() * (width * 4 + k * 4 + 8) + 64, dtype=np.uint8)
        start = (-raw.ctypes.data) % 16 + 4 * skew
        payload = raw[start : start + picks.numel() * (width * 4 + k * 4 + 8)]
        with knobs.override(native_kernels=flag):
            streamed = ops.capture_undo(*split_payload(payload, picks.numel(), width * 4, k * 4), weights, state,
                                        picks)
        # non-temporal stores (the caller then persists with a fence only) from the x86 kernel alone
        assert streamed == (bool(flag) and native.lib() is not None and platform.machine() == "x86_64")
        payloads.append(payload.copy())
    assert np.array_equal(payloads[0], payloads[1])
    w_end = picks.numel() * width * 4
    assert np.array_equal(payloads[0][:w_end].view(np.float32).reshape(-1, width), weights[picks].numpy())


# -- row-set flush and line copy ----------------------------------------------------------------
FLUSH_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)
DRAIN_FN = ctypes.CFUNCTYPE(None)


def python_runs(base, stride, rows):
    """The calls the Python Device.flush_rows makes: one per run of adjacent rows."""
    calls = []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    for run in np.split(rows, breaks):
        if run.size:
            calls.append((base + int(run[0]) * stride, int(run.size) * stride))
    return calls


@needs_native
@settings(max_examples=30, deadline=None)
@given(rows=st.sets(st.integers(0, 199), max_size=120), stride=st.sampled_from([4, 64, 192]))
def test_flush_rows_calls_the_flush_once_per_run_then_drains_once(rows, stride):
    rows = np.array(sorted(rows), dtype=np.int64)
    calls, drains = [], []
    flush = FLUSH_FN(lambda address, length: calls.append((address, length)))
    drain = DRAIN_FN(lambda: drains.append(len(calls)))
    base = 1 << 20  # never dereferenced: the recording flush only notes addresses
    native.flush_rows(base, stride, 200, rows, ctypes.cast(flush, ctypes.c_void_p).value,
                      ctypes.cast(drain, ctypes.c_void_p).value, drain=True)
    assert calls == python_runs(base, stride, rows)
    assert drains == [len(calls)]


@needs_native
def test_flush_rows_with_libpmem_and_with_cpu_instructions():
    """The real flushes run over a real buffer (a wrong address would fault) and change no byte."""
    buffer = np.arange(64 * 100, dtype=np.uint8)
    before = buffer.copy()
    rows = np.array([0, 1, 2, 7, 50, 51, 99], dtype=np.int64)
    pmem = load_libpmem()
    if pmem is not None:
        native.flush_rows(buffer.ctypes.data, 64, 100, rows, pmem.flush_address, pmem.drain_address, drain=True)
    if native.cpu_flush() != "none":
        native.flush_rows(buffer.ctypes.data, 64, 100, rows, drain=True)
    else:
        with pytest.raises(RuntimeError, match="no flush available"):
            native.flush_rows(buffer.ctypes.data, 64, 100, rows)
    assert np.array_equal(buffer, before)


@needs_native
@settings(max_examples=40, deadline=None)
@given(rows=st.sets(st.integers(0, 99), max_size=60), stride=st.sampled_from([4, 12, 64, 200]),
       offset=st.sampled_from([0, 4, 64, 4096]), tail=st.integers(0, 70))
def test_copy_lines_copies_exactly_the_lines_of_the_rows(rows, stride, offset, tail):
    """Against the power-loss device's flush: every 64-byte line a row touches, and no other, and
    nothing past the mapping's end when it ends inside the last row's line (`tail` bytes after the
    table)."""
    rows = np.array(sorted(rows), dtype=np.int64)
    size = offset + 100 * stride + tail
    view = np.random.default_rng(len(rows)).integers(1, 256, size + CACHE_LINE, dtype=np.uint8)
    media = np.zeros(size + CACHE_LINE, dtype=np.uint8)  # bytes past `size` must stay zero
    native.copy_lines(view.ctypes.data, media.ctypes.data, size, offset, stride, 100, rows)
    expected = np.zeros(size + CACHE_LINE, dtype=np.uint8)
    for row in rows.tolist():
        start = (offset + row * stride) // CACHE_LINE * CACHE_LINE
        end = min(-(-(offset + (row + 1) * stride) // CACHE_LINE) * CACHE_LINE, size)
        expected[start:end] = view[start:end]
    assert np.array_equal(media, expected)


@needs_native
@pytest.mark.skipif(load_libpmem() is None, reason="needs libpmem")
def test_device_flush_rows_is_one_native_call_where_libpmem_flushes(shm_dir, monkeypatch):
    """An emulated CXL device with libpmem flushes a row set in C (never through its per-run
    Python flush); with the knob at 0 it takes the Python path, one flush per run."""
    path = str(shm_dir / "dev")
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    fd = os.open(path, os.O_RDWR)
    try:
        with knobs.override(power_loss=0):
            device = map_device(path, fd, 1 << 20, writable=True, backend="emulated")
        assert device.is_pmem
        calls = []
        monkeypatch.setattr(device, "flush", lambda offset, length: calls.append((offset, length)))
        rows = np.array([1, 2, 3, 9, 40], dtype=np.int64)
        device.flush_rows(4096, 256, rows)
        unaligned = np.zeros(48, np.uint8)[4:44].view(np.int64)  # as a record's row ids can be
        unaligned[:] = rows
        device.flush_rows(4096, 256, unaligned)
        assert calls == []
        with knobs.override(native_kernels=0):
            device.flush_rows(4096, 256, rows)
        assert calls == python_runs(4096, 256, rows)
        with pytest.raises(IndexError, match="out of range"):  # past the mapping's end
            device.flush_rows(4096, 256, np.array([(1 << 20) // 256], dtype=np.int64))
        device.close()
    finally:
        os.close(fd)


def test_without_the_extension_one_warning_and_torch_kernels():
    """If _rows cannot be imported, importing the kernels prints one warning line and the torch
    kernels do the work."""
    code = """
import sys
sys.modules["cxltrain.kernels._rows"] = None   # what a failed build looks like: the import fails
import torch
from cxltrain.kernels import native, ops
import cxltrain.kernels.native
assert native.lib() is None and not native.built()
w = torch.zeros(4, 2)
print(ops.sparse_update("sgd", w, None, torch.tensor([1, 1]), torch.ones(2, 2), lr=1.0).tolist(), w[1].tolist())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1] [-2.0, -2.0]"
    warnings = [line for line in out.stderr.splitlines() if "native row kernels not built" in line]
    assert len(warnings) == 1, out.stderr


# ---------------------------------------------------------------------------------------------
# unique_rows and crc32
# ---------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 999), max_size=300))
def test_unique_rows_are_torch_unique(ids):
    indices = torch.tensor(ids, dtype=torch.int64)
    for flag in (1, 0):
        with knobs.override(native_kernels=flag):
            assert torch.equal(ops.unique_rows(indices, 1000), torch.unique(indices, sorted=True))


def test_unique_rows_refuses_an_index_out_of_range():
    for flag in (1, 0):
        with knobs.override(native_kernels=flag), pytest.raises(IndexError, match="1000 is out of range"):
            ops.unique_rows(torch.tensor([3, 1000, 2]), 1000)


def _crc_paths():
    """The CRC-32 paths this CPU has, each switched on in turn (the best one restored after)."""
    lib = native.lib()
    best = lib.crc32_path()
    names = ["bytes", "pclmul", "vpclmul"]
    try:
        for name in names[: names.index(best) + 1]:
            lib.crc32_path(name)
            yield name
    finally:
        lib.crc32_path(best)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 63), st.sampled_from([0, 1, 0xFFFFFFFF, 0x12345678]), st.integers(0, 99))
def test_crc32_is_zlibs(length, start, seed, content):
    """Any length (lengths spread evenly: most fold through the 64- and 256-byte loops), any
    alignment (the data starts `start` bytes into a buffer), any seed, on every path the CPU has."""
    import zlib

    data = np.random.default_rng(content).integers(0, 256, length, dtype=np.uint8).tobytes()
    buffer = np.zeros(start + len(data) + 8, dtype=np.uint8)
    buffer[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
    view = buffer[start : start + len(data)]
    for path in _crc_paths():
        assert native.crc32(view, seed) == native.crc32(data, seed) == zlib.crc32(data, seed), path
    with knobs.override(native_kernels=0):
        assert native.crc32(view, seed) == zlib.crc32(data, seed)


def test_crc32_of_large_buffers_and_continuations():
    import zlib

    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, (8 << 20) + 13, dtype=np.uint8)
    floats = rng.standard_normal(100_003).astype(np.float32)  # an array is its bytes
    for path in _crc_paths():
        assert native.crc32(big) == zlib.crc32(big.tobytes()), path
        a, b = big[: (1 << 20) + 5], big[(1 << 20) + 5 :]
        assert native.crc32(b, native.crc32(a)) == zlib.crc32(big.tobytes()), path
        assert native.crc32(floats, 5) == zlib.crc32(floats.tobytes(), 5), path
    with pytest.raises(ValueError, match="contiguous"):
        native.crc32(floats[::2])


def test_crc32_folds_with_the_widest_carry_less_multiply_the_cpu_has():
    """The fast paths are the ones the tests above check (not only the byte loop), and a path the
    CPU lacks is refused."""
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    if not {"pclmulqdq", "sse4_1"} <= flags:
        pytest.skip("this CPU has no PCLMULQDQ/SSE4.1")
    best = "vpclmul" if {"vpclmulqdq", "avx512f"} <= flags else "pclmul"
    assert native.lib().crc32_path() == best
    assert list(_crc_paths())[-1] == best and native.lib().crc32_path() == best
    if best == "pclmul":
        with pytest.raises(ValueError, match="not one this CPU has"):
            native.lib().crc32_path("vpclmul")
    with pytest.raises(ValueError, match="not one this CPU has"):
        native.lib().crc32_path("crc32c")


@pytest.mark.skipif(not native.built() or not native.lib().STREAMS, reason="needs the native streamed stores")
@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 15, 63, 64, 100, 16383, 16384, 16385, 40_001]), max_size=6),
       st.integers(0, 127), st.booleans(), st.integers(0, 2**32 - 1))
def test_stream_pieces_stores_the_pieces_back_to_back_and_sums_them(lengths, start, to_media, seed):
    """A snapshot's payload in one call (dense._stream_payload): the pieces, long and short, at any
    alignment, land back to back and nothing else changes; the checksum is zlib's over them; on the
    power-loss model's kind the lines they touch are in the media copy too."""
    import zlib

    rng = np.random.default_rng(len(lengths) * 1000 + start)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8)[n % 3 :] if n % 2 else
              rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    expected = b"".join(bytes(p) for p in pieces)
    mapping = np.full(len(expected) + 256 + 64, 0xEE, dtype=np.uint8)
    view = mapping[-mapping.ctypes.data % 64 :][: len(expected) + 256]  # a mapping starts on a line
    media = np.full_like(view, 0x11)
    lib = native.lib()
    sources = np.array(lib.addresses(*pieces), dtype=np.int64)
    sizes = np.array([len(p) for p in pieces], dtype=np.int64)
    if to_media:
        write_back = native.NativePersistence(native.NativePersistence.MEDIA, media_offset=media.ctypes.data - view.ctypes.data,
                                              map_start=view.ctypes.data, map_end=view.ctypes.data + view.size)
    else:
        write_back = native.NativePersistence(native.NativePersistence.LINES,
                                              load_libpmem().flush_address if load_libpmem() else 0)
        if not write_back.flush and native.cpu_flush() == "none":
            pytest.skip("no flush: neither libpmem nor CLWB/CLFLUSHOPT")
    crc = lib.stream_pieces(view.ctypes.data + start, len(expected), write_back, sources.ctypes.data,
                            sizes.ctypes.data, len(pieces), seed)
    assert crc == zlib.crc32(expected, seed)
    assert view[start : start + len(expected)].tobytes() == expected
    assert (view[:start] == 0xEE).all() and (view[start + len(expected) :] == 0xEE).all()
    if to_media:
        assert media[start : start + len(expected)].tobytes() == expected
    if expected:  # never past the room it is given
        with pytest.raises(ValueError, match="longer than the room"):
            lib.stream_pieces(view.ctypes.data, len(expected) - 1, write_back, sources.ctypes.data, sizes.ctypes.data,
                              len(pieces), seed)


@needs_native
def test_addresses_are_numpys_for_contiguous_buffers_only():
    """One call for the addresses a kernel's arguments need: what `ndarray.ctypes.data` says, for
    read-only arrays and bytes too; None is 0; a strided or Fortran-order view is refused, not
    mis-addressed."""
    lib = native.lib()
    rows = np.arange(10, dtype=np.int64)
    headers = np.zeros((3, 64), dtype=np.uint8)
    template = bytes(range(64))
    frozen = np.frombuffer(template, dtype=np.uint8)
    empty = np.empty(0, dtype=np.int64)
    assert lib.addresses(rows, None, headers[1:], frozen, empty, template) == (
        rows.ctypes.data, 0, headers.ctypes.data + 64, frozen.ctypes.data, empty.ctypes.data, frozen.ctypes.data)
    assert lib.addresses() == ()
    assert native.address(rows[3:]) == rows.ctypes.data + 24
    for strided in (rows[::2], headers.T):
        with pytest.raises(ValueError, match="contiguous"):
            lib.addresses(strided)
    with pytest.raises(TypeError):
        lib.addresses(5)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 10**6), st.sampled_from([None, float("nan"), float("inf"), -float("inf")]))
def test_all_finite_is_torchs(count, where, bad):
    values = torch.randn(count) * 1e30  # large but finite
    if bad is not None and count:
        values[where % count] = bad
    for flag in (1, 0):
        with knobs.override(native_kernels=flag):
            assert ops.all_finite(values) == bool(torch.isfinite(values).all())
            assert ops.all_finite(values.reshape(-1, 1)[::2]) == bool(torch.isfinite(values[::2]).all())


# ---------------------------------------------------------------------------------------------
# The fused capture's undo layout (undo_chunk_counts, undo_chunk_headers) against numpy
# ---------------------------------------------------------------------------------------------
@needs_native
@settings(max_examples=60, deadline=None)
@given(unique=st.integers(0, 700), chunk_rows=st.integers(1, 300), keep=st.floats(0.0, 1.0),
       seed=st.integers(0, 1 << 30), one_run=st.booleans())
def test_fused_undo_layout_is_the_numpy_rule(unique, chunk_rows, keep, seed, one_run):
    """Each chunk records the recorded rows that fall in it (numpy.searchsorted's split); a chunk
    with one gets a record of header + count * row bytes rounded up, its seq in chunk order, its
    offset back to back from the run's start or the one given; every header is the template with
    its count and payload bytes."""
    if not ops.fused_available():
        pytest.skip("no streamed stores on this CPU")
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(10_000, unique, replace=False)).astype(np.int64)
    recorded = rows[rng.random(unique) < keep].copy()  # capture once per window: a subset
    header, row_payload, align = 64, 264, 64
    rec_first, sizes, total = fused.undo_chunk_counts(rows, recorded, chunk_rows, header, row_payload, align)
    chunks = -(-unique // chunk_rows)
    assert np.array_equal(rec_first, np.append(np.searchsorted(recorded, rows[::chunk_rows]), recorded.size))
    counts = np.diff(rec_first)
    has = counts > 0
    assert np.array_equal(sizes, -(-(header + counts[has] * row_payload) // align) * align)
    assert total == sizes.sum() and rec_first.size == chunks + 1

    template = bytes(rng.integers(0, 256, 64, dtype=np.uint8))
    offsets = None if one_run else np.sort(rng.choice(1 << 20, sizes.size, replace=False)).astype(np.int64)
    rec_offset, headers = fused.undo_chunk_headers(template, 77, rec_first, sizes, offsets, 4096, row_payload)
    expected_offsets = 4096 + np.cumsum(sizes) - sizes if one_run else offsets
    assert np.array_equal(rec_offset[has], expected_offsets) and (rec_offset[~has] == -1).all()
    expected = np.tile(np.frombuffer(template, dtype=np.uint8), (chunks, 1))
    expected.view(np.uint64)[has, 2] = 77 + np.arange(sizes.size)      # seq at byte 16
    expected.view(np.uint32)[:, 8] = counts                             # count at byte 32
    expected.view(np.uint64)[:, 6] = counts * row_payload               # payload bytes at byte 48
    assert np.array_equal(headers, expected)


@needs_native
@settings(max_examples=60, deadline=None)
@given(unique=st.integers(0, 700), chunk_rows=st.integers(1, 300), cached=st.floats(0.0, 1.0),
       keep=st.one_of(st.none(), st.floats(0.0, 1.0)), seed=st.integers(0, 1 << 30), one_run=st.booleans())
def test_cached_undo_layout_is_the_numpy_rule(unique, chunk_rows, cached, keep, seed, one_run):
    """A cached table's layout, both kinds in one pass, is the numpy rule it replaced: each chunk's
    uncached rows to record (all of them, or the window's subset) in one record, then the slots its
    cached rows map to (all, or the window's fresh ones) in the next; sizes, seqs and offsets in
    that ring order, every header its kind's template with its count and payload bytes."""
    if not ops.fused_available():
        pytest.skip("no streamed stores on this CPU")
    rng = np.random.default_rng(seed)
    table_rows, slot_count, header, row_payload, slot_payload, align = 10_000, 4_000, 64, 264, 328, 64
    rows = np.sort(rng.choice(table_rows, unique, replace=False)).astype(np.int64)
    slot_of = np.full(table_rows, -1, dtype=np.int32)
    held = np.flatnonzero(rng.random(table_rows) < cached)[:slot_count]
    slot_of[held] = rng.permutation(slot_count)[: held.size]
    at = slot_of[rows]
    hit = at >= 0
    fresh = None if keep is None else rng.random(slot_count) < keep
    recorded = None if keep is None else rows[~hit][rng.random(int((~hit).sum())) < keep].copy()
    counts = fused.undo_cached_counts(rows, recorded, slot_of, fresh, slot_count, chunk_rows, header, row_payload,
                                      slot_payload, align)

    chunks = -(-unique // chunk_rows)
    table_recorded = rows[~hit] if recorded is None else recorded
    taken = hit if fresh is None else hit & fresh[np.where(hit, at, 0)]
    assert np.array_equal(counts.recorded, table_recorded) and np.array_equal(counts.slot_ids, at[taken])
    assert np.array_equal(counts.rec_first, np.append(np.searchsorted(table_recorded, rows[::chunk_rows]),
                                                      table_recorded.size))
    assert np.array_equal(counts.slot_first, np.searchsorted(np.flatnonzero(taken),
                                                             np.arange(0, unique + chunk_rows, chunk_rows))[: chunks + 1])
    both = np.zeros((chunks, 2), dtype=np.int64)  # ring order: each chunk's table record, then its slots'
    per_row = np.array([row_payload, slot_payload])
    for kind, first in enumerate((counts.rec_first, counts.slot_first)):
        n = np.diff(first)
        both[:, kind] = np.where(n > 0, -(-(header + n * per_row[kind]) // align) * align, 0)
    flat = both.reshape(-1)
    assert np.array_equal(counts.sizes, flat[flat > 0]) and counts.total == flat.sum()
    assert counts.slot_bytes == both[:, 1].sum()

    templates = [bytes(rng.integers(0, 256, 64, dtype=np.uint8)) for _ in range(2)]
    offsets = None if one_run else np.sort(rng.choice(1 << 20, counts.sizes.size, replace=False)).astype(np.int64)
    laid_out = fused.undo_chunk_headers(templates[0], 77, counts.rec_first, counts.sizes, offsets, 4096, row_payload,
                                        (templates[1], counts.slot_first, slot_payload))
    place = (np.cumsum(flat > 0) - 1).reshape(chunks, 2)  # each record's place in ring order
    ring_offsets = 4096 + np.cumsum(counts.sizes) - counts.sizes if one_run else offsets
    for kind, first in enumerate((counts.rec_first, counts.slot_first)):
        rec_offset, headers = laid_out[2 * kind : 2 * kind + 2]
        n = np.diff(first)
        has = n > 0
        assert np.array_equal(rec_offset[has], ring_offsets[place[has, kind]]) and (rec_offset[~has] == -1).all()
        expected = np.tile(np.frombuffer(templates[kind], dtype=np.uint8), (chunks, 1))
        expected.view(np.uint64)[has, 2] = 77 + place[has, kind]   # seq at byte 16
        expected.view(np.uint32)[:, 8] = n                           # count at byte 32
        expected.view(np.uint64)[:, 6] = n * per_row[kind]           # payload bytes at byte 48
        assert np.array_equal(headers, expected)
