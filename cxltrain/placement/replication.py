"""Which rows every rank keeps a replica of, and how the rest cross (communication avoidance: DESIGN
§8, docs/distributed.md "Replicated hot rows"). Torch-free and pure: the same profile, plan and link
speeds give the same choice.

    lookups = [global_batch_ids(batch) for batch in profiled]    # [F] x (values [N], offsets [B])
    choice = choose_replicas(plan, lookups, batch_size=1024, dim=32, links=Links(1e9, 1e9))
    choice.hot[t]                 # sorted row ids of table t that every rank holds a copy of
    choice.unique[t]              # table t's other ids cross as unique rows (True) or as bags (False)
    choice.predicted_bytes        # bytes every rank sends to the others per batch, summed

Two exchanges for the ids not replicated (models/replicated.py): **bags** (a holder gets every bag's
length and the ids, and sends back a pooled row per bag holding one) or **unique rows** (a holder
gets each distinct id once, sends back its row, the asking rank pools its bags itself and sends
back one summed gradient per row). The cost of a row, per global batch of B samples on W ranks, D
dims (HugeCTR's hybrid embedding has the bag exchange's closed form): a lookup of a row held
elsewhere costs its id (8 B) and its pooled row and gradient (2 x 4D B), and lands on a rank that
does not hold the row (W-1)/W of the time; a replicated row costs its gradient's fixed-order
all-reduce, 2 (W-1) x 4D B for the whole group (a reduce-scatter and an all-gather,
models/exchange.py). With bags, a row looked up n times a batch is worth replicating when

    n (W-1)/W (8 + 8D) / bw_all_to_all  >=  2 (W-1) 4D / bw_all_reduce,
    i.e. n >= T0 = W 8D / (8 + 8D) x bw_all_to_all / bw_all_reduce        (about W)

and with unique rows, where each other rank asks for it once if at all (row_threshold), when
n >= T1 = ln(1 - 8D / (8 + 8D) x bw_all_to_all / bw_all_reduce) / ln(1 - 1/W)   (5.0 at W=2, D=32).

Bytes add up table by table, so each table gets its own cut and exchange: the candidate cuts
T0 x 2^j and T1 x 2^j (j = -2..3), and no replication, each with either exchange, are priced by
the exact bytes the step would send for the held-out half of the profile (`exchange_bytes`: the
same counting as the models), divided by each link's speed; the cheapest wins (fewer rows, then
bags, on a tie). The rows are ranked on the even profiled batches and priced on the odd ones, as
the tier planner does (planner.py), so the prediction is not made on the very lookups that chose
the rows.

When: the profile is taken at batch 0 and again every REPROFILE_EVERY batches over the
PROFILE_BATCHES batches from there (the data a run will train on next), and the replicas are rebuilt
from their owners when the chosen rows changed. A function of the batch number alone: a run
recovered to batch G replicates, and exchanges, as an uninterrupted run did at G.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from ..errors import ConfigError
from .sharding import ShardingPlan
from .table import DATA_PARALLEL, ROW_WISE

ID_BYTES, FLOAT_BYTES = 8, 4
HEADER_BYTES = 2 * ID_BYTES                # the counts header each rank sends every other rank
PROFILE_BATCHES = 16
REPROFILE_EVERY = 256
AUTO, OFF = "auto", "off"

# one global batch's lookups: per table, (values [N] int64, offsets [B] int64), as data.Batch holds them
Lookups = Sequence[tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Links:
    """Measured bandwidths of the group's two collectives, bytes per second (rank 0's measure)."""

    all_to_all: float
    all_reduce: float


# The links a run's choice weighs: gloo's all-reduce here is made of all-to-alls on the same group
# (models/exchange.py Comm.ordered_all_reduce), so one speed divides both and the choice rests on
# bytes alone; two runs of the same data choose the same rows, whatever the noise of a measure
# (a measured ratio would make runs with the same seed differ in their rounding). A transport whose
# all-reduce is its own collective (NCCL's ring) would weigh its measured Links.
SAME_TRANSPORT = Links(1.0, 1.0)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The replicated rows and what the cost model expects of them, per global batch."""

    hot: tuple[np.ndarray, ...]            # [H_t] sorted row ids of table t (empty: none, and for data-parallel)
    unique: tuple[bool, ...]               # per table: its holders get unique rows (True) or bags (False)
    predicted_bytes: float                 # every rank's sends to the others, all-to-all and all-reduce
    predicted_off_bytes: float             # the same without replication
    why: str                               # one line: how the rows were chosen

    @property
    def rows(self) -> int:
        return sum(h.size for h in self.hot)


def parse_setting(text: str) -> str | float:
    """`auto`, `off`, or a FRACTION in (0, 1] of each sharded table's rows (the most looked up)."""
    if text in (AUTO, OFF):
        return text
    try:
        fraction = float(text)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        raise ConfigError(f"--replicate-hot {text!r}: give auto, off, or a fraction of each table's rows in (0, 1]")
    return fraction


def profile_start(batch: int) -> int:
    """The first batch of the profile that decides the replicas of batch `batch`."""
    return batch - batch % REPROFILE_EVERY


def threshold(world_size: int, dim: int, links: Links) -> float:
    """T0, the bag exchange's: lookups per global batch at which a row's all-reduce costs what its
    all-to-all saves."""
    return world_size * 2 * FLOAT_BYTES * dim / (ID_BYTES + 2 * FLOAT_BYTES * dim) * links.all_to_all / links.all_reduce


def row_threshold(world_size: int, dim: int, links: Links) -> float:
    """T1, the unique-row exchange's: a row looked up n times a batch is asked for by each of the
    W-1 ranks not holding it with probability 1 - (1 - 1/W)^n, once (8 + 8D B) however often that
    rank looks it up; its all-reduce costs 8D B per rank. inf where it never pays."""
    left = 1 - 2 * FLOAT_BYTES * dim / (ID_BYTES + 2 * FLOAT_BYTES * dim) * links.all_to_all / links.all_reduce
    return math.log(left) / math.log(1 - 1 / world_size) if left > 0 and world_size > 1 else math.inf


def choose_replicas(plan: ShardingPlan, profiled: Sequence[Lookups], *, batch_size: int, dim: int, links: Links,
                    setting: str | float = AUTO) -> Choice:
    """The rows to replicate for `setting` (auto: the cost model; off; a fraction of each table's
    rows) and, per table, the exchange of the rest (bags or unique rows), from the lookups of the
    profiled global batches (module docstring)."""
    ranking, pricing = profiled[0::2], profiled[1::2] or profiled[0::2]
    off = _mean_bytes(plan, pricing, batch_size, dim, None, None)
    none = tuple(np.empty(0, np.int64) for _ in plan.tables)
    bags = tuple(False for _ in plan.tables)
    if setting == OFF or plan.world_size == 1:
        why = "off" if setting == OFF else "one rank: no lookup crosses a network"
        return Choice(none, bags, sum(off), sum(off), why)
    ids, rates = _ranked(plan, ranking)
    t0, t1 = threshold(plan.world_size, dim, links), row_threshold(plan.world_size, dim, links)
    if setting == AUTO:
        cuts = [t * 2.0 ** j for t in (t0, t1) if math.isfinite(t) for j in range(-2, 4)]
        candidates = [[np.empty(0, np.int64), *(i[r >= cut] for cut in cuts)] for i, r in zip(ids, rates)]
    else:
        candidates = [[i[: math.ceil(setting * t.rows)]] for i, t in zip(ids, plan.tables)]
    picks = [_cheapest(plan, t, pricing, batch_size, dim, links, c) for t, c in enumerate(candidates)]
    hot = tuple(np.sort(p[0]) if plan.tables[t].kind != DATA_PARALLEL else np.empty(0, np.int64)
                for t, p in enumerate(picks))
    unique = tuple(p[1] for p in picks)
    header = plan.world_size * (plan.world_size - 1) * HEADER_BYTES
    predicted = header + sum(p[2] for p in picks)
    rows, by_rows = sum(h.size for h in hot), sum(unique)
    sharded = sum(1 for table in plan.tables if table.kind != DATA_PARALLEL)
    exchange = f"{by_rows} of {sharded} sharded table(s) exchange unique rows, the others bags"
    if setting != AUTO:
        why = f"the {setting:g} most looked-up of each table's rows, as asked; {exchange}"
    elif not rows:
        why = f"no row is looked up often enough to pay for its all-reduce (T0 {t0:.1f}, T1 {t1:.1f}); {exchange}"
    else:
        least = min(float(r[np.isin(i, h)].min()) for i, r, h in zip(ids, rates, hot) if h.size)
        why = (f"rows looked up at least {least:.2f} times a batch, each table's cut and exchange priced cheapest "
               f"on the profile's held-out batches (closed forms T0 {t0:.1f} for bags, T1 {t1:.1f} for unique "
               f"rows); {exchange}")
    return Choice(hot, unique, predicted, sum(off), why)


def _cheapest(plan: ShardingPlan, t: int, pricing: Sequence[Lookups], batch_size: int, dim: int, links: Links,
              candidates: list[np.ndarray]) -> tuple[np.ndarray, bool, float]:
    """Table t's cheapest (replicated rows, unique-row exchange?, its bytes per batch) among the
    candidate row sets, each with either exchange, priced over `pricing`; fewer rows, then bags, on
    a tie."""
    distinct = list({c.size: c for c in candidates}.values())
    costs = np.mean([_table_costs(plan, t, batch[t], batch_size, dim, distinct) for batch in pricing], axis=0)
    best = None
    for hot, (bags, rows, reduce) in zip(distinct, costs):
        for unique, a2a in ((False, bags), (True, rows)):
            key = (a2a / links.all_to_all + reduce / links.all_reduce, hot.size, unique)
            if best is None or key < best[0]:
                best = key, hot, unique, float(a2a + reduce)
    return best[1], best[2], best[3]


def _ranked(plan: ShardingPlan, batches: Sequence[Lookups]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per table: its ids, most looked up first (ties by id), and their lookups per batch."""
    ids, rates = [], []
    for t, table in enumerate(plan.tables):
        if table.kind == DATA_PARALLEL or not batches:
            ids.append(np.empty(0, np.int64))
            rates.append(np.empty(0))
            continue
        seen, counts = np.unique(np.concatenate([b[t][0] for b in batches]), return_counts=True)
        order = np.argsort(-counts, kind="stable")
        ids.append(seen[order].astype(np.int64))
        rates.append(counts[order] / len(batches))
    return ids, rates


def _mean_bytes(plan, batches, batch_size, dim, hot, unique) -> tuple[float, float]:
    """exchange_bytes averaged over `batches`: (all-to-all, all-reduce)."""
    sent = [exchange_bytes(plan, b, batch_size, dim, hot, unique) for b in batches]
    return (float(np.mean([s[0] for s in sent])), float(np.mean([s[1] for s in sent]))) if sent else (0.0, 0.0)


def exchange_bytes(plan: ShardingPlan, lookups: Lookups, batch_size: int, dim: int,
                   hot: Sequence[np.ndarray] | None, unique: Sequence[bool] | None = None) -> tuple[int, int]:
    """(all-to-all bytes, all-reduce bytes) every rank sends the others in the step of one global
    batch, counted as models/exchange.py and models/replicated.py count them. hot None: the
    exchange without replication (every bag of a slice to every holder); else the replicated one,
    where unique[t] (default False) says table t's holders get unique rows (_table_costs)."""
    w = plan.world_size
    if w == 1:
        return 0, 0
    a2a, reduce = w * (w - 1) * HEADER_BYTES, 0
    for t in range(len(plan.tables)):
        ((bags, rows, replicas),) = _table_costs(plan, t, lookups[t], batch_size, dim, [None if hot is None else hot[t]])
        a2a += rows if hot is not None and unique is not None and unique[t] else bags
        reduce += replicas
    return int(a2a), int(reduce)


def _table_costs(plan: ShardingPlan, t: int, lookups: tuple[np.ndarray, np.ndarray], batch_size: int, dim: int,
                 candidates: Sequence[np.ndarray | None]) -> np.ndarray:
    """[len(candidates), 3]: table t's bytes in one global batch's step with each candidate set of
    replicated rows (None: no replication, today's exchange), as (all-to-all with the bag exchange,
    all-to-all with the unique-row exchange, all-reduce of the replicas' gradients). Per rank and
    holder (another rank) of the table's rows:

      bags         the slice's bag lengths (B_r) and its ids not replicated (8 B each); a pooled row
                   back and a gradient out (4D B each) for every bag holding one of them (without
                   replication: every bag)
      unique rows  a count and the distinct ids not replicated (8 B each); one row back and one
                   summed gradient out (4D B each) per distinct id
      all-reduce   2 (W-1) 4D B per replicated row (a reduce-scatter and an all-gather)

    A data-parallel table is looked up on every rank: its bags go to every rank, only gradients come
    back (and no unique-row exchange: both columns the same)."""
    table, w = plan.tables[t], plan.world_size
    per, row = batch_size // w, FLOAT_BYTES * dim
    values, offsets = lookups
    ends = np.append(offsets, values.size)
    costs = np.zeros((len(candidates), 3))
    # sorted copies of the candidate sets, for a binary search per distinct id
    sets = [None if hot is None or not hot.size or table.kind == DATA_PARALLEL else np.sort(hot)
            for hot in candidates]
    for r in range(w):
        lengths = np.diff(ends[r * per : (r + 1) * per + 1])
        slice_ids, slice_bags = values[ends[r * per] : ends[(r + 1) * per]], np.repeat(np.arange(per), lengths)
        # the slice's distinct ids once: each candidate then asks only which of them it holds
        seen, inverse, counts = np.unique(slice_ids, return_inverse=True, return_counts=True)
        for owner in table.ranks:
            if owner == r:
                continue
            inside = np.ones(seen.size, bool)  # of the distinct ids, those this owner holds
            if table.kind == ROW_WISE:
                lo, hi = table.rows_of(owner)
                inside = (seen >= lo) & (seen < hi)
            if table.kind == DATA_PARALLEL:
                costs[:, :2] += ID_BYTES * (per + int(counts[inside].sum())) + row * per  # gradients only
                continue
            for c, hot in enumerate(sets):
                asked = inside
                if hot is not None:  # not replicated
                    at = np.minimum(np.searchsorted(hot, seen), hot.size - 1)
                    asked = inside & (hot[at] != seen)
                lookups_asked = int(counts[asked].sum())
                bags = per if candidates[c] is None else np.count_nonzero(np.bincount(slice_bags[asked[inverse]]))
                costs[c, 0] += ID_BYTES * (per + lookups_asked) + 2 * row * bags
                distinct = int(np.count_nonzero(asked))
                costs[c, 1] += ID_BYTES * (1 + distinct) + 2 * row * distinct
    for c, hot in enumerate(candidates):
        costs[c, 2] = 0 if hot is None else 2 * (w - 1) * row * hot.size
    return costs
