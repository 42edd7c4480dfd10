"""bench/floors.py and paired.paired_runs: several runs side by side in one process, each with the
bytes it made durable per batch and their floor at a given copy bandwidth (a tiny model: this
checks the bookkeeping, never a timing)."""

from __future__ import annotations

import pytest
import torch

from cxltrain.bench.bandwidth import copy_bandwidth, gather_bandwidth
from cxltrain.bench.floors import floor_rows, format_rows
from cxltrain.bench.interval import MIN_BLOCKS
from cxltrain.jobs.config import TrainConfig

TINY = TrainConfig(batch_size=64, num_tables=2, rows=2000, dim=8, pooling=5, seed=1)


def test_floor_rows_side_by_side(shm_dir):
    rows = floor_rows(TINY, ["strict", "strict-k10"], str(shm_dir), warmup=1, blocks=MIN_BLOCKS, block_steps=1,
                      copy_gbps=10.0)
    strict, k10 = rows
    assert (strict.method, k10.method) == ("strict", "strict-k10") and strict.pooling == 5
    for r in rows:
        assert r.durable_mb_per_batch > r.undo_mb_per_batch > 0 and r.ms_per_step > 0
        assert r.floor_ms == pytest.approx(r.durable_mb_per_batch / 10) and r.floor_ratio > 1
        assert r.ratio_low <= r.ratio <= r.ratio_high
    assert k10.undo_mb_per_batch < strict.undo_mb_per_batch  # one record per row per window
    assert list(shm_dir.iterdir()) == []  # the pools are removed
    text = format_rows(rows, {5: 1.0}, 10.0)
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
