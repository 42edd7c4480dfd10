"""bench/interval.py: the bootstrap interval a side-by-side ratio is printed with."""

from __future__ import annotations

import numpy as np
import pytest

from cxltrain.bench.interval import MIN_BLOCKS, interval_text, ratio_interval


def test_blocks_with_one_ratio_give_that_ratio_exactly():
    base = [0.9, 1.1, 1.0, 1.3] * 3
    low, high = ratio_interval(base, [1.04 * b for b in base])
    assert low == pytest.approx(1.04) and high == pytest.approx(1.04)


def test_the_ratio_is_of_the_sums_not_the_mean_of_the_block_ratios():
    """Short blocks that doubled and long ones that did not: the run took 120/110 of the time
    (1.09), though the block ratios average 1.5."""
    low, high = ratio_interval([1.0] * 10 + [10.0] * 10, [2.0] * 10 + [10.0] * 10)
    assert low < 120 / 110 < high < 1.3


def test_too_few_blocks_give_no_interval():
    assert ratio_interval([1.0] * (MIN_BLOCKS - 1), [1.1] * (MIN_BLOCKS - 1)) is None
    assert ratio_interval([1.0] * MIN_BLOCKS, [1.1] * MIN_BLOCKS) is not None


def test_the_interval_holds_the_ratio_narrows_with_more_blocks_and_repeats_itself():
    rng = np.random.default_rng(7)

    def blocks(n):
        base = rng.normal(1.0, 0.05, n)
        return base, base * 1.03 * rng.normal(1.0, 0.02, n)

    few, many = blocks(10), blocks(400)
    for base, method in (few, many):
        low, high = ratio_interval(base, method)
        assert low < method.sum() / base.sum() < high
        assert ratio_interval(base, method) == (low, high)  # a fixed seed: the same interval every time
    assert np.subtract(*ratio_interval(*many)[::-1]) < np.subtract(*ratio_interval(*few)[::-1]) / 3


def test_the_95_percent_interval_covers_the_true_ratio_about_95_times_in_100():
    """Runs of 40 blocks whose true ratio is 1.03, with block noise like a shared machine's: the
    interval must hold 1.03 in about 95% of them (a wrong quantile fails this, and so does resampling
    the two runs' blocks apart, which loses the pairing and widens the interval)."""
    rng = np.random.default_rng(11)
    covered = 0
    trials = 300
    for _ in range(trials):
        base = rng.normal(0.47, 0.03, 40)
        method = base * 1.03 + rng.normal(0.0, 0.012, 40)
        low, high = ratio_interval(base, method, resamples=1000)
        covered += low <= 1.03 <= high
    assert 0.925 <= covered / trials <= 0.975  # 0.943 measured; 99%, 90% and 80% intervals cover 0.98, 0.91, 0.82


TEN = [1.0] * 10


@pytest.mark.parametrize("base, method, level", [
    ([1.0, 1.0], [1.0], 0.95), (TEN, TEN, 1.0), ([0.0] + TEN[1:], TEN, 0.95),
    ([float("nan")] + TEN[1:], TEN, 0.95), (TEN, [float("inf")] + TEN[1:], 0.95), ([TEN], [TEN], 0.95)])
def test_refuses_what_has_no_interval(base, method, level):
    with pytest.raises(ValueError, match="ratio_interval"):
        ratio_interval(base, method, level=level)


def test_an_older_record_without_an_interval_prints_a_dash():
    assert interval_text(None, None) == "-" and interval_text(1.0123, 1.0456) == "1.012-1.046"
