"""Deterministic synthetic Criteo-like batches: `SyntheticCriteo`.

Batch b is a pure function of (configuration, seed, b): every random draw comes from a generator
seeded with exactly those numbers, and nothing is carried from one call to the next, so a run
resumed at batch b sees the batches an uninterrupted run saw (docs/architecture.md §4, "Exactness needs
determinism"). Results are bit-identical across calls, call orders and processes on one machine
with one numpy build; numpy's SIMD exp/log may differ in the last bit between CPUs, which can
very rarely move a dense value, an id at a rank boundary or a label.

Shape letters: B = batch size, F = tables (one sparse feature each), L = pooling (ids per table
per sample, fixed-length bags), D = dense features (13, as in Criteo).

Ids — bounded Zipf. Table f draws ranks k = 1..rows_f with P(k) ∝ k^-s (s = `zipf_exponent`):
the 4096 hottest ranks exactly (inverse CDF on the discrete table), the rest by the inverse CDF of
the continuous density x^-s on [4096.5, rows + 0.5) rounded to the nearest rank (s = 1 uses
the logarithm). A per-table bijection row = (a_f · (k − 1) + c_f) mod rows_f, with a_f coprime
to rows_f, scatters the hot ranks over the table instead of putting them at rows 0, 1, 2.

Why bounded: `numpy.random.zipf(1.05)` taken modulo 1,000,000 rows is barely skewed — the
unbounded tail wraps around the table, and about 78% of a 2048-lookup batch hit distinct rows.
Production tables have a few rows accessed up to 10,000x more often than most (FAE). The default
here, s = 1.05 bounded to the table, has that head. Measured for rows = 1,000,000, B = 2048, L = 1,
one table, seed 0, batches 0..49 (102,400 lookups, counted with numpy.unique;
tests/test_data_synthetic.py::test_skew_has_a_hot_head repeats it on 10 batches, looser bounds):
  - distinct rows in a batch: 55.8% of the 2048 lookups (mean over the 50 batches; 54.0–57.5%);
  - top-100 rows (`hot_rows(0, 100)`): 44.6% of all lookups;
  - hottest row: 9,580 lookups, the median accessed row 1 (ratio 9,580x); the hottest row's exact
    probability is 9.47%, so over longer windows the ratio keeps growing with the window.
The same measurement on `numpy.random.zipf(1.05, 2048) % 1_000_000`: 77.7% distinct, top-100 rows
24.7% of lookups, hottest row 5,348.

Dense features: D heavy-tailed counts like Criteo's I1..I13,
count = max(0, floor(expm1(μ_j + σ_j·z))) with z ~ N(0, 1), μ_j ∈ [0.5, 7), σ_j ∈ [0.5, 2) drawn
from the seed, up to 30% of values missing (→ 0), then log1p — what DLRM feeds its bottom MLP.
Non-negative float32.

Labels — a hidden model, so a DLRM has something to learn from both inputs:
    logit = −1.5 + Σ_j w_j·(x_j − m_j)/s_j + (1.5/√F)·Σ_f (mean over the bag of h_f(row) − E_f)
where x_j is dense feature j as fed to the model, m_j and s_j its exact mean and std (computed once
by quadrature), w a fixed random vector of norm 1, and h_f(row) ≈ N(0, 1) a hash of (seed, f, row):
no per-row array is stored, tables may have 10^7+ rows, and hot rows, seen thousands of times, have
effects a model can learn. E_f, the expected effect over the table's lookups, is subtracted: the
hottest rows alone would otherwise move the CTR by seed. label ~ Bernoulli(sigmoid(logit)); the CTR
is about 23–28% (measured over seeds 0–2 and several configurations). `logits(b)` returns the
hidden logit, the best prediction any model can make.

Example (B = 4, F = 2, L = 3):

    >>> src = SyntheticCriteo(num_tables=2, rows=[1000, 50], batch_size=4, pooling=3, seed=7)
    >>> batch = src.batch(12)
    >>> tuple(batch.dense.shape), [tuple(v.shape) for v in batch.values]
    ((4, 13), [(12,), (12,)])
    >>> batch.offsets[0]
    tensor([0, 3, 6, 9])
    >>> bool(((batch.values[1] >= 0) & (batch.values[1] < 50)).all())
    True
    >>> torch.equal(src.batch(12).values[0], batch.values[0])
    True
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Iterator, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from .batch import Batch
from .common import MAX_SEED, batch_indices, check_index, check_int, hash_key, splitmix64, table_rows

HEAD_RANKS = 4096        # ranks drawn from the exact discrete Zipf table; the tail is continuous
LOGIT_BIAS = -1.5        # puts the CTR around 25% for the scales below
DENSE_SCALE = 1.0        # std of the dense part of the logit
SPARSE_SCALE = 1.5       # std of the sparse part with L = 1, shared out over the F tables



class _Stream(enum.IntEnum):
    """What a generator is for; part of its seed so no two uses share random numbers."""

    DENSE_PARAMS = 0
    TABLE_PARAMS = 1
    DENSE = 2
    IDS = 3
    LABELS = 4
    EFFECTS = 5


# ---------------------------------------------------------------------------------------------
# Seeding and hashing (also used by the Criteo reader)


def _generator(seed: int, stream: _Stream, b: int = 0, table: int = 0) -> np.random.Generator:
    """A generator seeded by exactly (seed, stream, b, table).

    Each number is split into two 32-bit words so the seed material has a fixed length:
    SeedSequence pads short inputs with zeros, so [x, 1] and [x, 1, 0] would collide.
    """
    words = []
    for value in (seed, int(stream), b, table):
        words += [value & 0xFFFFFFFF, value >> 32]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


# ---------------------------------------------------------------------------------------------
# Bounded Zipf


@dataclasses.dataclass(frozen=True)
class ZipfRanks:
    """Bounded Zipf over 0-based ranks 0..n-1, P(rank k) ∝ (k + 1)^-exponent.

    The first `len(head_cdf)` ranks are exact; the tail is the continuous density x^-s on
    [H + 0.5, n + 0.5) rounded to the nearest 1-based rank (the midpoint rule, accurate to
    ~s²/(24·H²) relative per rank).
    """

    n: int
    exponent: float
    head_cdf: np.ndarray   # [H] float64, cumulative unnormalised weights of ranks 0..H-1
    tail_mass: float       # unnormalised weight of ranks H..n-1

    @classmethod
    def build(cls, n: int, exponent: float, head: int = HEAD_RANKS) -> "ZipfRanks":
        h = min(n, head)
        head_cdf = np.cumsum(np.arange(1, h + 1, dtype=np.float64) ** -exponent)
        tail_mass = 0.0
        if n > h:
            t, log_span = 1.0 - exponent, math.log((n + 0.5) / (h + 0.5))
            # ∫ x^-s dx over the tail, written with expm1 so s close to 1 loses no precision.
            tail_mass = log_span if t == 0.0 else (h + 0.5) ** t * math.expm1(t * log_span) / t
        return cls(n, exponent, head_cdf, tail_mass)

    def probabilities(self) -> np.ndarray:
        """[n] float64 exact P(rank k) ∝ (k + 1)^-s, for tests and analysis (small n only)."""
        w = np.arange(1, self.n + 1, dtype=np.float64) ** -self.exponent
        return w / w.sum()

    def sample(self, u: np.ndarray) -> np.ndarray:
        """Uniforms [N] in [0, 1) → 0-based ranks [N] int64, by inverse CDF."""
        head_total = float(self.head_cdf[-1])
        m = u * (head_total + self.tail_mass)
        ranks = np.empty(u.shape, dtype=np.int64)
        in_head = m < head_total
        h = len(self.head_cdf)
        ranks[in_head] = np.minimum(np.searchsorted(self.head_cdf, m[in_head], side="right"), h - 1)
        tail = ~in_head
        if tail.any():
            v = np.clip((m[tail] - head_total) / self.tail_mass, 0.0, 1.0)
            t, log_lo = 1.0 - self.exponent, math.log(h + 0.5)
            log_span = math.log((self.n + 0.5) / (h + 0.5))
            if t == 0.0:
                log_x = log_lo + v * log_span
            else:
                log_x = log_lo + np.log1p(v * math.expm1(t * log_span)) / t
            one_based = np.floor(np.exp(log_x) + 0.5)
            ranks[tail] = np.clip(one_based, h + 1, self.n).astype(np.int64) - 1
        return ranks


# ---------------------------------------------------------------------------------------------
# The source


@dataclasses.dataclass(frozen=True)
class _Table:
    """Fixed per-table constants, all derived from (seed, table index)."""

    rows: int
    multiplier: int       # a, coprime with rows: rank → row is a bijection
    shift: int            # c
    effect_key: int       # keys the hash behind the hidden per-row effect
    effect_mean: float    # E[effect] over this table's lookups (head ranks; the tail's is ~0)
    ranks: ZipfRanks

    def rows_of(self, ranks: np.ndarray) -> np.ndarray:
        """0-based ranks [N] int64 → row ids [N] int64, (a·rank + c) mod rows."""
        r = ranks.astype(np.uint64)
        row = (np.uint64(self.multiplier) * r + np.uint64(self.shift)) % np.uint64(self.rows)
        return row.astype(np.int64)

    def effects(self, rows: np.ndarray) -> np.ndarray:
        """Row ids [N] → hidden effects [N] float64, ≈ N(0, 1): Irwin–Hall sum of 4 uniforms."""
        h = splitmix64(rows.astype(np.uint64) ^ np.uint64(self.effect_key))
        mask = np.uint64(0xFFFF)
        total = np.zeros(h.shape, dtype=np.uint64)
        for shift in (0, 16, 32, 48):
            total += (h >> np.uint64(shift)) & mask
        # Integer arithmetic up to here; the sum of four U{0..65535} has mean 2·65535.
        return (total.astype(np.float64) - 2.0 * 65535) / math.sqrt(4 * (65536.0**2 - 1) / 12)


def _make_table(
    seed: int, t: int, rows: int, exponent: float, ranks_cache: dict[int, ZipfRanks]
) -> _Table:
    """Table t's bijection, effect key and expected effect; Zipf tables shared by size."""
    g = _generator(seed, _Stream.TABLE_PARAMS, table=t)
    multiplier = 1 if rows == 1 else int(g.integers(1, rows))
    while math.gcd(multiplier, rows) != 1:
        multiplier = multiplier % (rows - 1) + 1   # next candidate in 1..rows-1
    shift = int(g.integers(0, rows))
    if rows not in ranks_cache:
        ranks_cache[rows] = ZipfRanks.build(rows, exponent)
    ranks = ranks_cache[rows]
    table = _Table(rows, multiplier, shift, hash_key(seed, _Stream.EFFECTS, t), 0.0, ranks)
    # The few hottest rows carry much of the lookups, so their effects would shift the CTR by
    # seed; subtracting the expected effect keeps the CTR near its target for every seed.
    head = np.arange(len(ranks.head_cdf), dtype=np.int64)
    weights = np.diff(ranks.head_cdf, prepend=0.0) / (ranks.head_cdf[-1] + ranks.tail_mass)
    mean = float((weights * table.effects(table.rows_of(head))).sum())
    return dataclasses.replace(table, effect_mean=mean)


@dataclasses.dataclass(frozen=True)
class _DenseModel:
    """How the D dense features are drawn, and their part of the hidden logit."""

    mu: np.ndarray        # [D] log-scale location of each count
    sigma: np.ndarray     # [D] log-scale spread
    missing: np.ndarray   # [D] probability that a value is missing (fed as 0)
    mean: np.ndarray      # [D] E[feature], missing values included
    std: np.ndarray       # [D] std of each feature
    weight: np.ndarray    # [D] hidden logit weights on the standardised features, norm DENSE_SCALE

    @classmethod
    def build(cls, seed: int, num_dense: int) -> "_DenseModel":
        g = _generator(seed, _Stream.DENSE_PARAMS)
        mu = g.uniform(0.5, 7.0, num_dense)
        sigma = g.uniform(0.5, 2.0, num_dense)
        missing = g.uniform(0.0, 0.3, num_dense)
        w = g.standard_normal(num_dense)
        mean, std = _feature_moments(mu, sigma, missing)
        # Plain numpy sums, not BLAS (dot, norm, matmul), here and in _dense_part: BLAS kernels
        # may change the summation order with the thread count, and the labels must not.
        weight = w * (DENSE_SCALE / math.sqrt(float((w * w).sum())))
        return cls(mu, sigma, missing, mean, std, weight)


def _log_counts(mu: np.ndarray, sigma: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Latent normals [..., D] → log1p(count) [..., D] float64, count = floor(expm1(μ + σz)) ≥ 0."""
    return np.log1p(np.maximum(np.floor(np.expm1(mu + sigma * z)), 0.0))


def _feature_moments(
    mu: np.ndarray, sigma: np.ndarray, missing: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std [D] of each dense feature (missing → 0 included), by quadrature over z.

    A fine grid, not Gauss–Hermite: the feature is a step function of z (the floor). Accurate to
    about 1e-4, which only centres and scales the logit; the labels need no more.
    """
    z = np.linspace(-9.0, 9.0, 9_001)[:, None]                    # [Z, 1]
    pdf = np.exp(-0.5 * z * z)
    pdf /= pdf.sum()
    values = _log_counts(mu, sigma, z)                             # [Z, D]
    present = 1.0 - missing
    mean = present * (pdf * values).sum(axis=0)
    second = present * (pdf * values * values).sum(axis=0)
    return mean, np.sqrt(np.maximum(second - mean * mean, 1e-12))


class SyntheticCriteo:
    """Deterministic Criteo-like batches; `batch(b)` depends only on the configuration, seed and b.

    Args:
        num_tables: F, sparse features, one embedding table each.
        rows: rows per table (one int for all, or F ints), each in [1, 2^32].
        batch_size: B.
        seed: any integer in [0, 2^64).
        pooling: L, ids per table per sample (fixed-length bags).
        zipf_exponent: s > 0 of the bounded Zipf over each table's rows (larger = more skewed).
        num_dense: D, dense features per sample.
        num_batches: the source's length; None = endless.
    """

    def __init__(
        self,
        *,
        num_tables: int,
        rows: int | Sequence[int],
        batch_size: int,
        seed: int = 0,
        pooling: int = 1,
        zipf_exponent: float = 1.05,
        num_dense: int = 13,
        num_batches: int | None = None,
    ) -> None:
        self.num_tables = check_int("num_tables", num_tables, 1)
        self.rows = table_rows(rows, self.num_tables)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0, MAX_SEED)
        self.pooling = check_int("pooling", pooling, 1)
        self.zipf_exponent = _check_exponent(zipf_exponent)
        self.num_dense = check_int("num_dense", num_dense, 1)
        self.num_batches = None if num_batches is None else check_int("num_batches", num_batches, 1)
        ranks_cache: dict[int, ZipfRanks] = {}
        self._tables = tuple(
            _make_table(self.seed, t, n, self.zipf_exponent, ranks_cache)
            for t, n in enumerate(self.rows)
        )
        self._dense = _DenseModel.build(self.seed, self.num_dense)

    def __repr__(self) -> str:
        return (
            f"SyntheticCriteo(num_tables={self.num_tables}, rows={self.rows}, "
            f"batch_size={self.batch_size}, seed={self.seed}, pooling={self.pooling}, "
            f"zipf_exponent={self.zipf_exponent}, num_dense={self.num_dense}, "
            f"num_batches={self.num_batches})"
        )

    def batch(self, b: int) -> Batch:
        """Batch b: dense [B, D] float32, F × values [B·L] int64, F × offsets [B], labels [B]."""
        return self._draw(check_index(b, self.num_batches))[0]

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        """Batches start, start+1, ... before stop (None = to the end, or forever if endless)."""
        for b in batch_indices(start, stop, self.num_batches):
            yield self.batch(b)

    def logits(self, b: int) -> torch.Tensor:
        """[B] float64: the hidden logit batch b's labels were drawn from (the best prediction)."""
        return torch.from_numpy(self._draw(check_index(b, self.num_batches))[1])

    def hot_rows(self, table: int, k: int) -> torch.Tensor:
        """[k] int64: the k most likely row ids of `table`, hottest first (e.g. to pin on a GPU)."""
        t = check_int("table", table, 0, self.num_tables)
        k = check_int("k", k, 0, self.rows[t] + 1)
        return torch.from_numpy(self._tables[t].rows_of(np.arange(k, dtype=np.int64)))

    def _draw(self, b: int) -> tuple[Batch, np.ndarray]:
        """Batch b and its hidden logits [B] float64."""
        size, pool = self.batch_size, self.pooling
        dense, logit = self._dense_part(b)
        values, offsets = [], []
        sparse = np.zeros(size, dtype=np.float64)
        for t, table in enumerate(self._tables):
            # One generator per (b, table): a table's ids do not depend on how many tables exist.
            u = _generator(self.seed, _Stream.IDS, b, t).random(size * pool)
            rows = table.rows_of(table.ranks.sample(u))
            sparse += table.effects(rows).reshape(size, pool).mean(axis=1) - table.effect_mean
            values.append(torch.from_numpy(rows))
            offsets.append(torch.arange(0, size * pool, pool, dtype=torch.int64))
        logit += LOGIT_BIAS + sparse * (SPARSE_SCALE / math.sqrt(self.num_tables))
        u = _generator(self.seed, _Stream.LABELS, b).random(size)
        labels = (u < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        batch = Batch(
            index=b,
            dense=torch.from_numpy(dense),
            values=tuple(values),
            offsets=tuple(offsets),
            labels=torch.from_numpy(labels),
        )
        return batch, logit

    def _dense_part(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Dense features [B, D] float32 and their part of the logit [B] float64."""
        d = self._dense
        g = _generator(self.seed, _Stream.DENSE, b)
        z = g.standard_normal((self.batch_size, self.num_dense))
        missing = g.random((self.batch_size, self.num_dense)) < d.missing
        features = np.where(missing, 0.0, _log_counts(d.mu, d.sigma, z)).astype(np.float32)
        # The logit uses the float32 values the model sees.
        standard = (features.astype(np.float64) - d.mean) / d.std
        return features, (standard * d.weight).sum(axis=1)


def _check_exponent(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"zipf_exponent must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ConfigError(f"zipf_exponent must be a finite number > 0, got {value}")
    return value
