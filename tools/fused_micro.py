"""One table's backward cost per batch, main's two passes against the fused capture (docs/speed.md).

One 1M x 64 row-wise Adagrad table in a pool on /dev/shm, its lookups from `train`'s default
synthetic source (batch 2048, --pooling), alternating per batch: unique rows, then either the undo
record appended and the update run (two passes) or the chunk records laid out and the update run
with them (fused: the unique rows' sort handed to the kernel, as the checkpointer does), then the
updated rows flushed. Prints medians in ms, per phase, as JSON.

    .venv/bin/python tools/fused_micro.py --pooling 20 --iters 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from cxltrain.checkpoint import layout, ring
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import build_source
from cxltrain.kernels import ops
from cxltrain.pool.format import RegionKind
from cxltrain.pool.handle import Pool, RegionSpec
from cxltrain.tables.bag import PersistentEmbeddingBag


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pooling", type=int, default=1)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--chunk", type=int, default=256)
    a = p.parse_args()
    torch.set_num_threads(2)
    path = f"/dev/shm/fused-micro-{os.getpid()}.pool"
    pool = Pool.create(path, 600 << 20)
    table = PersistentEmbeddingBag(1_000_000, 64, name="t", seed=4)
    pool.add_regions([*table.region_specs(), RegionSpec(layout.RING_REGION, RegionKind.UNDO_RING, "uint8", (200 << 20,))])
    table.attach(pool, initialize=True)
    pool.commit(batches_done=0, ring_generation=5)
    writer = ring.UndoRing(pool, 5, 0, 0)
    weights, state = table.storage()
    wr, sr = pool.region("t.weight"), pool.region("t.optim")
    source = build_source(TrainConfig(pooling=a.pooling))
    grad = torch.randn(2048, 64) * 1e-3
    phases = {"2pass": ("unique", "capture", "update", "flush"), "fused": ("unique", "layout", "update", "flush")}
    times = {kind: {name: [] for name in (*names, "total")} for kind, names in phases.items()}
    for it in range(a.iters):
        batch = source.batch(it)
        indices, offsets = batch.values[0], batch.offsets[0]
        for kind in ("2pass", "fused") if it % 2 else ("fused", "2pass"):
            t0 = time.perf_counter()
            if kind == "fused":  # the lookups' order kept for the kernel, as the checkpointer does
                rows, order = ops.unique_rows_and_order(indices, weights.shape[0])
                rows = torch.from_numpy(rows)
            else:
                rows = ops.unique_rows(indices, weights.shape[0])
            t1 = time.perf_counter()
            if kind == "2pass":
                writer.append(it, wr, sr, rows, weights, state)
                writer.mark_tail()
                undo, records = None, []
            else:
                undo, records = writer.plan_chunks(it, wr, sr, rows.numpy(), rows.numpy(), a.chunk)
                undo.lookup_order = order
            t2 = time.perf_counter()
            out = ops.sparse_update("rowwise_adagrad", weights, state, indices, grad, offsets, lr=0.01, eps=1e-8,
                                    undo=undo)
            writer.land(records)
            t3 = time.perf_counter()
            updated = out.numpy()
            pool.device.flush_rows(wr.offset, wr.row_stride, updated)
            pool.device.flush_rows(sr.offset, sr.row_stride, updated)
            pool.device.drain()
            t4 = time.perf_counter()
            writer.reclaim(it + 1)
            if it >= 4:
                for name, seconds in zip((*phases[kind], "total"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                    times[kind][name].append(seconds)
    result = {kind: {name: 1000 * statistics.median(v) for name, v in named.items()} for kind, named in times.items()}
    result["fused/2pass"] = result["fused"]["total"] / result["2pass"]["total"]
    print(json.dumps({"pooling": a.pooling, "chunk": a.chunk, "unique_rows_last": int(rows.numel()),
                      "load": os.getloadavg(), **result}))
    pool.close()
    os.unlink(path)


if __name__ == "__main__":
    main()
