"""tools/bench_floors.py and paired.paired_runs: several runs side by side in one process, each with the
bytes it made durable per batch and their floor at a given copy bandwidth (a tiny model: this
checks the bookkeeping, never a timing)."""

from __future__ import annotations

import json

import pytest
import torch

from cxltrain.bench.bandwidth import copy_bandwidth, gather_bandwidth
from cxltrain.bench.interval import MIN_BLOCKS
from cxltrain.jobs.config import TrainConfig
from test_tools import tool

floors = tool("bench_floors")
TINY = TrainConfig(batch_size=64, num_tables=2, rows=2000, dim=8, pooling=5, seed=1)


def test_floor_rows_side_by_side(shm_dir):
    rows = floors.floor_rows(TINY, ["strict", "strict-k10"], str(shm_dir), warmup=1, blocks=MIN_BLOCKS, block_steps=1,
                      copy_gbps=10.0)
    strict, k10 = rows
    assert (strict.method, k10.method) == ("strict", "strict-k10") and strict.pooling == 5
    for r in rows:
        assert r.durable_mb_per_batch > r.undo_mb_per_batch > 0 and r.ms_per_step > 0
        assert r.floor_ms == pytest.approx(r.durable_mb_per_batch / 10) and r.floor_ratio > 1
        assert r.ratio_low <= r.ratio <= r.ratio_high
    assert k10.undo_mb_per_batch < strict.undo_mb_per_batch  # one record per row per window
    assert list(shm_dir.iterdir()) == []  # the pools are removed
    text = floors.format_rows(rows, {5: 1.0}, 10.0)
    assert "strict-k10" in text and f"{strict.ratio_low:.3f}-{strict.ratio_high:.3f}" in text


def test_measuring_the_copy_bandwidth_leaves_torchs_threads_alone():
    """The floors measure the copy on one thread before the training runs: those runs must keep the
    thread count they had (one thread made every step slower and every ratio smaller)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        copy_bandwidth(1 << 20, 1, repeats=1)
        assert torch.get_num_threads() == 2
        gather_bandwidth(TINY, 1, repeats=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_measure_floors_every_method_with_its_bytes_and_floor(shm_dir):
    """What `cxltrain bench --quick` checked of its floors section before the floors left it."""
    quick = TrainConfig(batch_size=64, num_tables=2, rows=1000, dim=8, bottom_mlp=(16,), top_mlp=(16,), pooling=1)
    # 11 batches: strict-k10 commits (and so makes its rows durable) once inside them, also where
    # rows are flushed at the commit rather than at their update (no libpmem)
    measured = floors.measure_floors(quick, ["strict", "relaxed", "strict-k10"], str(shm_dir), warmup=1, blocks=2,
                                     block_steps=5, copy_bytes=1 << 20)
    out = measured.to_json()
    assert out["pooling"] == 1 and out["copy_gbps"] > 0 and out["base_ms"] > 0
    assert [r["method"] for r in out["rows"]] == ["strict", "relaxed", "strict-k10"]
    for r in out["rows"]:
        assert r["pooling"] == 1 and r["ms_per_step"] > 0 and r["ratio"] > 0
        assert r["durable_mb_per_batch"] > r["undo_mb_per_batch"] > 0
        assert r["floor_ms"] == pytest.approx(r["durable_mb_per_batch"] * 1e6 / (out["copy_gbps"] * 1e9) * 1000)
        assert r["floor_ratio"] == pytest.approx(1 + r["floor_ms"] / out["base_ms"])
    assert floors.Floors.from_json(json.loads(json.dumps(out))) == measured
    assert list(shm_dir.iterdir()) == []


def test_format_rows_prints_each_row_with_its_interval():
    row = floors.FloorRow(pooling=1, method="strict", ms_per_step=5.2, ratio=1.04, median_block_ratio=1.03,
                          durable_mb_per_batch=2.0, undo_mb_per_batch=0.5, floor_ms=0.2, floor_ratio=1.04,
                          ratio_low=1.01, ratio_high=1.07)
    text = floors.format_rows([row], {1: 5.0}, 10.0)
    assert "  1 strict           5.2  1.040 1.010-1.070  1.030  1.040         2.00      0.50     0.20" in text
