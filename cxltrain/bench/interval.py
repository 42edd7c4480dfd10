"""How sure a side-by-side ratio is: a bootstrap interval over its paired blocks.

A paired run (paired.py) times each method in blocks that alternate with the baseline's, so block
i of the method and block i of the baseline ran under the same conditions. Its ratio is
sum(method) / sum(base). Resampling whole pairs (i, with replacement) and taking the ratio of each
resample gives the spread that ratio has from the blocks' own scatter; the interval is that
spread's central `level` share (a percentile bootstrap). Where it straddles a target, the run has
not decided the target either way. A percentile bootstrap runs narrow on few blocks (it holds the
true ratio less often than `level` says), so below MIN_BLOCKS pairs there is no interval. Torch-free;
a fixed seed, so a result prints the same interval every time it is formatted.

    ratio_interval([1.00, 1.02, 0.98] * 4, [1.05, 1.04, 1.03] * 4)   # (low, high) around 1.04
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
RESAMPLES = 4000
MIN_BLOCKS = 10  # docs/speed.md: on fewer blocks a 95% interval holds the true ratio far less often


def ratio_interval(base: list[float], method: list[float], *, level: float = LEVEL, resamples: int = RESAMPLES,
                   seed: int = 0) -> tuple[float, float] | None:
    """(low, high): the central `level` share of sum(method[i]) / sum(base[i]) over `resamples`
    resamples of the block pairs i; None for fewer than MIN_BLOCKS pairs. base, method: seconds
    of block i of each run, [n] each, finite, base's positive."""
    base_s, method_s = np.asarray(base, dtype=np.float64), np.asarray(method, dtype=np.float64)
    if base_s.ndim != 1 or base_s.shape != method_s.shape:
        raise ValueError(f"ratio_interval: one block of each run per pair, got {base_s.shape} and {method_s.shape}")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"ratio_interval: level in (0, 1) and resamples >= 1, got {level} and {resamples}")
    if not (np.isfinite(base_s).all() and np.isfinite(method_s).all() and (base_s > 0).all()):
        raise ValueError("ratio_interval: block times must be finite, and the baseline's above zero")
    if base_s.size < MIN_BLOCKS:
        return None
    picks = np.random.default_rng(seed).integers(0, base_s.size, size=(resamples, base_s.size))
    ratios = method_s[picks].sum(axis=1) / base_s[picks].sum(axis=1)
    low, high = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def interval_text(low: float | None, high: float | None) -> str:
    """"low-high" to three places, or "-" where a record has none (too few blocks, or an older bench)."""
    return "-" if low is None or high is None else f"{low:.3f}-{high:.3f}"
