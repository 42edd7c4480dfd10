"""Micro-benchmark of the row kernels, per table per batch: native C against the torch kernels and
the torch baselines, on the row sets of `cxltrain train`'s default configuration.

    from cxltrain.kernels.microbench import run
    result = run(batches=30)          # dict: {"ms": {variant: median ms}, "ratio": {...}, "setup": {...}}

Variants (each timed once per batch, all variants on the same batch, batches in turn, so a noisy
neighbour slows every variant alike; medians over the batches):

  lookup_update_{adagrad,sgd}: forward + backward of one table, the sparse update included —
      `ours` PersistentEmbeddingBag (DRAM storage) with the C kernels, `ours_torch` the same with
      the torch kernels (knob native_kernels=0), `torch` nn.EmbeddingBag(sparse=True) +
      torch.optim.Adagrad / SGD (element-wise Adagrad: torch has no row-wise one);
  update_adagrad: the fused sparse update alone (kernels.ops.sparse_update), C vs torch kernels;
  capture: one table's undo payload (old weights, state, row ids) into a ring on an emulated CXL
      device, C (non-temporal stores) vs torch index_select; undo_append: the same plus what
      UndoRing.append does next (CRC-32 of the payload, persist it);
  flush: the commit's row flush of all F tables (weights and state rows), then one drain, on an
      emulated CXL device with libpmem — C (one call per row set) vs the Python loop (one ctypes
      pmem_flush per run of adjacent rows); skipped without libpmem;
  copy_lines: the power-loss device's flush of the same row sets, C vs its Python loop
      (one ctypes memmove per run);
  checksum: CRC-32 of a 4 MiB buffer (a dense snapshot's size), native (lib().crc32_path()) vs
      zlib.crc32.

This module sits above the kernels it measures: it builds tables, devices and data, imported
when run() is called.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
import zlib

import numpy as np
import torch
from torch import nn

from ..knobs import override
from . import native, ops


def run(*, batches: int = 30, rows: int = 1_000_000, dim: int = 64, batch_size: int = 2048, num_tables: int = 8,
        zipf_exponent: float = 1.05, threads: int = 2, seed: int = 0, folder: str | None = None) -> dict:
    """Time every variant on `batches` batches of the synthetic data; returns medians in ms."""
    from ..data.synthetic import SyntheticCriteo

    source = SyntheticCriteo(num_tables=num_tables, rows=rows, batch_size=batch_size, seed=seed,
                             zipf_exponent=zipf_exponent)
    data = [source.batch(b) for b in range(batches)]
    folder = folder or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {}
    try:
        with contextlib.ExitStack() as stack:
            cases = _lookup_update_cases(rows, dim) + _kernel_cases(rows, dim, folder, stack)
            cases += _flush_cases(rows, dim, num_tables, folder, stack) + _checksum_cases()
            for batch in data:
                for name, prepare, step in cases:
                    args = prepare(batch)
                    started = time.perf_counter()
                    step(*args)
                    times.setdefault(name, []).append((time.perf_counter() - started) * 1e3)
    finally:
        torch.set_num_threads(saved_threads)
    ms = {name: statistics.median(values) for name, values in times.items()}
    ratio = {}
    for name in ms:
        group, variant = name.rsplit(".", 1)
        for base in ("torch", "python", "torch_kernels", "zlib"):
            if variant == "ours" and f"{group}.{base}" in ms:
                ratio[f"{group}: {base} / ours"] = ms[f"{group}.{base}"] / ms[name]
    unique = statistics.mean(int(torch.unique(b.values[0]).numel()) for b in data)
    return {"ms": ms, "ratio": ratio,
            "setup": {"rows": rows, "dim": dim, "batch_size": batch_size, "tables": num_tables, "batches": batches,
                      "threads": threads, "unique_rows_per_table": unique, "native": native.built(),
                      "cpu_flush": native.cpu_flush() if native.built() else None,
                      "crc32_path": native.lib().crc32_path() if native.built() else None}}


def _lookup_update_cases(rows: int, dim: int):
    from ..optim import SGD, RowWiseAdagrad
    from ..tables import PersistentEmbeddingBag

    def table(optimizer):
        ours = PersistentEmbeddingBag(rows, dim, name="t0", optimizer=optimizer)
        ours.materialize()
        return ours

    cases = []  # every variant has its own table: none finds the batch's rows cached by another
    for rule, ours_opt, torch_opt in (("adagrad", RowWiseAdagrad(lr=0.05), torch.optim.Adagrad),
                                      ("sgd", SGD(lr=0.05), torch.optim.SGD)):
        theirs = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        optimizer = torch_opt(theirs.parameters(), lr=0.05)

        def step_ours(indices, offsets, grad, table=table(ours_opt)):
            table(indices, offsets).backward(grad)

        def step_ours_torch(indices, offsets, grad, table=table(ours_opt)):
            with override(native_kernels=0):
                table(indices, offsets).backward(grad)

        def step_torch(indices, offsets, grad, module=theirs, opt=optimizer):
            module(indices, offsets).backward(grad)
            opt.step()
            opt.zero_grad()

        for variant, step in (("ours", step_ours), ("torch_kernels", step_ours_torch), ("torch", step_torch)):
            cases.append((f"lookup_update_{rule}.{variant}", _first_table(dim), step))
    return cases


def _first_table(dim: int):
    def prepare(batch):
        grad = torch.randn(batch.size, dim, generator=torch.Generator().manual_seed(batch.index))
        return batch.values[0], batch.offsets[0], grad
    return prepare


def _kernel_cases(rows: int, dim: int, folder: str, stack: contextlib.ExitStack):
    tables = {flag: (torch.randn(rows, dim), torch.rand(rows, 1)) for flag in (1, 0)}  # one per variant
    ring_device = _device(folder, 4 << 20, 0, stack)
    ring_device.array[:] = 0  # map every page now, as a long run has
    ring = ring_device.array

    def prepare_update(batch):
        grad = torch.randn(batch.size, dim, generator=torch.Generator().manual_seed(batch.index))
        return batch.values[0], batch.offsets[0], grad

    def update(indices, offsets, grad, flag=1):
        with override(native_kernels=flag):
            ops.sparse_update("rowwise_adagrad", *tables[flag], indices, grad, offsets, lr=0.05, eps=1e-8)

    def update_torch(indices, offsets, grad):
        update(indices, offsets, grad, flag=0)

    def prepare_capture(batch):
        picks = torch.unique(batch.values[0])
        count = picks.numel()
        w_end, s_end = count * dim * 4, count * (dim + 1) * 4
        views = (ring[:w_end].reshape(count, dim * 4), ring[w_end:s_end].reshape(count, 4),
                 ring[s_end : s_end + count * 8].view(np.int64))
        return views, picks

    def capture(views, picks, flag=1):
        with override(native_kernels=flag):
            ops.capture_undo(*views, *tables[flag], picks)

    def capture_torch(views, picks):
        capture(views, picks, flag=0)

    def append(views, picks, flag=1):
        """What UndoRing.append does around the capture: checksum the payload, persist it."""
        capture(views, picks, flag)
        length = views[2].ctypes.data + views[2].nbytes - ring.ctypes.data
        (native.crc32 if flag else zlib.crc32)(ring[:length])  # as layout.payload_checksum picks
        ring_device.persist(0, length)

    def append_torch(views, picks):
        append(views, picks, flag=0)

    return [("update_adagrad.ours", prepare_update, update), ("update_adagrad.torch_kernels", prepare_update,
                                                                update_torch),
            ("capture.ours", prepare_capture, capture), ("capture.torch_kernels", prepare_capture, capture_torch),
            ("undo_append.ours", prepare_capture, append),
            ("undo_append.torch_kernels", prepare_capture, append_torch)]


def _flush_cases(rows: int, dim: int, num_tables: int, folder: str, stack: contextlib.ExitStack):
    """Row flushes of all tables of a batch on a device shaped like one table (weights, then state):
    every table's row set goes to the same region, as many flush calls as the commit makes."""
    w_bytes, s_bytes = rows * dim * 4, rows * 4
    size = w_bytes + s_bytes

    def prepare(dev):
        def dirty(batch):
            sets = [np.unique(values.numpy()) for values in batch.values]
            weights = dev.array[:w_bytes].reshape(rows, dim * 4)
            for picks in sets:  # store into the rows, as the update did, so their lines are dirty
                weights[picks, :4] += 1
            return (sets,)
        return dirty

    def commit_flush(dev, native_flag):
        def flush(sets):
            with override(native_kernels=native_flag):
                for picks in sets:
                    dev.flush_rows(0, dim * 4, picks)
                    dev.flush_rows(w_bytes, 4, picks)
                dev.drain()
        return flush

    cases = []
    shared = _device(folder, size, 0, stack)
    shared.array[:] = 0  # map every page now, as a long run has
    if shared.is_pmem:  # libpmem present: the C path applies
        cases += [("flush.ours", prepare(shared), commit_flush(shared, 1)),
                  ("flush.python", prepare(shared), commit_flush(shared, 0))]
    lossy = _device(folder, size, 1, stack)
    lossy.flush(0, size)  # map every media page now

    def copy_lines(sets):
        for picks in sets:
            with lossy.media_lock:  # as the device's own flush_rows does
                native.copy_lines(lossy.address, lossy._media_address, size, 0, dim * 4, rows, picks)
                native.copy_lines(lossy.address, lossy._media_address, size, w_bytes, 4, rows, picks)

    if native.built():
        cases.append(("copy_lines.ours", prepare(lossy), copy_lines))
    cases.append(("copy_lines.python", prepare(lossy), commit_flush(lossy, 0)))
    return cases


def _checksum_cases():
    """CRC-32 of the same 4 MiB each batch (in cache after the first: a snapshot just copied is)."""
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    cases = [("checksum.zlib", lambda batch: (data,), zlib.crc32)]
    if native.built():
        cases.append(("checksum.ours", lambda batch: (data,), native.crc32))
    return cases


def _device(folder: str, size: int, power_loss: int, stack: contextlib.ExitStack):
    """An emulated CXL device on a fresh file in `folder`, closed and deleted with `stack`."""
    from ..devices import map_device

    path = stack.enter_context(_shm_file(folder, size))
    fd = os.open(path, os.O_RDWR)
    stack.callback(os.close, fd)
    with override(power_loss=power_loss):
        device = map_device(path, fd, size, writable=True, backend="emulated")
    stack.callback(device.close)
    return device


@contextlib.contextmanager
def _shm_file(folder: str, size: int):
    fd, path = tempfile.mkstemp(prefix="cxltrain-microbench-", dir=folder)
    try:
        os.posix_fallocate(fd, 0, size)  # allocated, as a pool is: no page faults in the timed stores
        os.close(fd)
        yield path
    finally:
        os.unlink(path)
