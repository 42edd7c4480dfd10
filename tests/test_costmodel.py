"""The CXL/PMEM cost model: hand-computed estimates, and presets that keep their published shape."""

from __future__ import annotations

import pytest

from cxltrain.emulation.costmodel import (
    PRESETS,
    AccessCounts,
    MemoryPreset,
    estimate,
    format_estimate,
    media_write_bytes,
    preset,
)
from cxltrain.errors import ConfigError

TOY = MemoryPreset("toy", load_latency_ns=100.0, persist_latency_ns=50.0, read_gb_s=10.0, write_gb_s=5.0,
                   source="hand-made for the tests", note="round numbers")


def test_latency_bound_case_by_hand():
    counts = AccessCounts(gather_bytes=1_000_000, gather_rows=10_000, write_bytes=400_000, write_rows=10_000,
                          persist_bytes=500_000, flush_calls=2_000, drains=30, log_bytes=50_000)
    e = estimate(counts, TOY, memory_level_parallelism=4)
    assert e.random_s == pytest.approx(10_000 * 100e-9 / 4)           # 250 us
    assert e.read_transfer_s == pytest.approx(1_000_000 / 10e9)       # 100 us
    assert e.write_transfer_s == pytest.approx(500_000 / 5e9)         # max(450,000 stored, 500,000 flushed): 100 us
    assert e.persist_s == pytest.approx((30 + 2_000 / 4) * 50e-9)     # 26.5 us
    assert e.total_s == pytest.approx(250e-6 + 26.5e-6)               # latency-bound: 276.5 us
    assert "0.277 ms, latency-bound" in format_estimate(e)


def test_bandwidth_bound_case_by_hand():
    # few rows, many bytes: one 1 MB row read and rewritten, appended to the log, flushed once
    counts = AccessCounts(gather_bytes=1 << 20, gather_rows=1, write_bytes=1 << 20, write_rows=1,
                          persist_bytes=1 << 20, flush_calls=1, drains=1, log_bytes=1 << 20)
    e = estimate(counts, TOY, memory_level_parallelism=1)
    assert media_write_bytes(counts) == 2 << 20                        # row + log; the flush covers the row
    assert e.transfer_s == pytest.approx((1 << 20) / 10e9 + (2 << 20) / 5e9)
    assert e.total_s == pytest.approx(e.transfer_s + (1 + 1) * 50e-9)
    assert "bandwidth-bound" in format_estimate(e)


def test_optane_figures_by_hand():
    counts = AccessCounts(gather_bytes=256_000, gather_rows=1_000, write_bytes=256_000, persist_bytes=300_000,
                          flush_calls=1_000, drains=10)
    e = estimate(counts, PRESETS["optane-6dimm"])  # default memory-level parallelism: 10
    assert e.random_s == pytest.approx(1_000 * 305e-9 / 10)
    assert e.transfer_s == pytest.approx(256_000 / 39.4e9 + 300_000 / 13.9e9)
    assert e.persist_s == pytest.approx((10 + 100) * 62.3e-9)
    assert e.total_s == pytest.approx(30.5e-6 + 110 * 62.3e-9)
    assert e.to_json()["total_s"] == e.total_s and e.to_json()["counts"]["gather_rows"] == 1_000


def test_nothing_done_costs_nothing():
    assert estimate(AccessCounts(), PRESETS["cxl-expander"]).total_s == 0.0


def test_presets_keep_the_shape_of_their_sources():
    assert set(PRESETS) >= {"dram", "optane-1dimm", "optane-6dimm", "cxl-expander"}
    for p in PRESETS.values():
        assert p.load_latency_ns > 0 and p.persist_latency_ns > 0 and p.read_gb_s > 0 and p.write_gb_s > 0
        assert p.source and p.note and preset(p.name) is p
    dram, one, six, cxl = (PRESETS[n] for n in ("dram", "optane-1dimm", "optane-6dimm", "cxl-expander"))
    assert dram.load_latency_ns < cxl.load_latency_ns < one.load_latency_ns == six.load_latency_ns
    assert one.read_gb_s < six.read_gb_s < dram.read_gb_s and one.write_gb_s < six.write_gb_s < dram.write_gb_s
    for optane in (one, six):  # Optane's bandwidth is asymmetric: writes about 3x slower than reads
        assert 2.5 < optane.read_gb_s / optane.write_gb_s < 3.5
        assert "1903.05714" in optane.source


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="gather_rows"):
        AccessCounts(gather_rows=-1)
    with pytest.raises(ValueError, match="drains"):
        AccessCounts(drains=1.5)
    with pytest.raises(ConfigError, match="memory_level_parallelism 0"):
        estimate(AccessCounts(), TOY, memory_level_parallelism=0)
    with pytest.raises(ConfigError, match="choose one of dram, optane-1dimm"):
        preset("hbm")
