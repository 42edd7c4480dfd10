"""Which rows every rank keeps a replica of (communication avoidance: DESIGN §8, docs/distributed.md
"Replicated hot rows"). Torch-free and pure: the same profile, plan and link speeds give the same rows.

    lookups = [global_batch_ids(batch) for batch in profiled]    # [F] x (values [N], offsets [B])
    choice = choose_replicas(plan, lookups, batch_size=1024, dim=32, links=Links(1e9, 1e9))
    choice.hot[t]                 # sorted row ids of table t that every rank holds a copy of
    choice.predicted_bytes        # bytes every rank sends to the others per batch, summed

The cost of a row, per global batch of B samples on W ranks, D dims (HugeCTR's hybrid embedding
has the closed form this starts from): a lookup of a row held elsewhere costs its id (8 B) and its
pooled row and gradient (2 x 4D B) over the all-to-all, and a lookup lands on a rank that does not
hold the row (W-1)/W of the time; a replicated row costs its gradient's fixed-order all-reduce,
2 (W-1) x 4D B for the whole group (a reduce-scatter and an all-gather, models/exchange.py). A row
looked up n times a batch is worth replicating when

    n (W-1)/W (8 + 8D) / bw_all_to_all  >=  2 (W-1) 4D / bw_all_reduce,
    i.e. n >= T0 = W 8D / (8 + 8D) x bw_all_to_all / bw_all_reduce        (about W)

With pooling above 1 a bag's row crosses anyway while one of its ids is not replicated, so the
closed form is only the first candidate: thresholds T0 x 2^j (j = -2..3), and no replication, are
each priced by the exact bytes the exchange would send for the held-out half of the profile
(`exchange_bytes`: the same counting as models/exchange.py), divided by each link's speed; the
cheapest wins (fewer rows on a tie). The rows are ranked on the even profiled batches and priced on
the odd ones, as the tier planner does (planner.py), so the prediction is not made on the very
lookups that chose the rows.

When: the profile is taken at batch 0 and again every REPROFILE_EVERY batches over the
PROFILE_BATCHES batches from there (the data a run will train on next), and the replicas are rebuilt
from their owners when the chosen rows changed. A function of the batch number alone: a run
recovered to batch G replicates what an uninterrupted run did at G.
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
    """T0: lookups per global batch at which a row's all-reduce costs what its all-to-all saves."""
    return world_size * 2 * FLOAT_BYTES * dim / (ID_BYTES + 2 * FLOAT_BYTES * dim) * links.all_to_all / links.all_reduce


def choose_replicas(plan: ShardingPlan, profiled: Sequence[Lookups], *, batch_size: int, dim: int, links: Links,
                    setting: str | float = AUTO) -> Choice:
    """The rows to replicate for `setting` (auto: the cost model; off; a fraction of each table's
    rows), from the lookups of the profiled global batches (module docstring)."""
    ranking, pricing = profiled[0::2], profiled[1::2] or profiled[0::2]
    off = _mean_bytes(plan, pricing, batch_size, dim, None)
    none = tuple(np.empty(0, np.int64) for _ in plan.tables)
    if setting == OFF or plan.world_size == 1:
        why = "off" if setting == OFF else "one rank: no lookup crosses a network"
        return Choice(none, sum(off), sum(off), why)
    ids, rates = _ranked(plan, ranking)
    if setting != AUTO:
        hot = tuple(np.sort(i[: math.ceil(setting * t.rows)]) if t.kind != DATA_PARALLEL else np.empty(0, np.int64)
                    for i, t in zip(ids, plan.tables))
        return Choice(hot, sum(_mean_bytes(plan, pricing, batch_size, dim, hot)), sum(off),
                      f"the {setting:g} most looked-up of each table's rows, as asked")
    t0 = threshold(plan.world_size, dim, links)
    best = (off[0] / links.all_to_all + off[1] / links.all_reduce, 0, none, off, math.inf)
    for j in range(-2, 4):
        cut = t0 * 2.0 ** j
        hot = tuple(np.sort(i[r >= cut]) for i, r in zip(ids, rates))
        sent = _mean_bytes(plan, pricing, batch_size, dim, hot)
        seconds = sent[0] / links.all_to_all + sent[1] / links.all_reduce
        rows = sum(h.size for h in hot)
        if (seconds, rows) < best[:2]:
            best = (seconds, rows, hot, sent, cut)
    _, rows, hot, sent, cut = best
    why = (f"no row is looked up often enough to pay for its all-reduce (T0 {t0:.1f} lookups a batch)" if not rows
           else f"rows looked up at least {cut:.2f} times a batch (closed form T0 {t0:.1f}, x{cut / t0:g} priced "
                f"cheapest on the profile's held-out batches)")
    return Choice(hot, sum(sent), sum(off), why)


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


def _mean_bytes(plan, batches, batch_size, dim, hot) -> tuple[float, float]:
    """exchange_bytes averaged over `batches`: (all-to-all, all-reduce)."""
    sent = [exchange_bytes(plan, b, batch_size, dim, hot) for b in batches]
    return (float(np.mean([s[0] for s in sent])), float(np.mean([s[1] for s in sent]))) if sent else (0.0, 0.0)


def exchange_bytes(plan: ShardingPlan, lookups: Lookups, batch_size: int, dim: int,
                   hot: Sequence[np.ndarray] | None) -> tuple[int, int]:
    """(all-to-all bytes, all-reduce bytes) every rank sends the others in the step of one global
    batch, counted as models/exchange.py counts them; hot None: the exchange without replication
    (every bag of a slice to every holder), else the replicated one (a holder gets the lengths of
    every bag, the ids not replicated, and sends back and receives gradients only for the bags
    holding one of them)."""
    w = plan.world_size
    if w == 1:
        return 0, 0
    per, row = batch_size // w, FLOAT_BYTES * dim
    total = w * (w - 1) * HEADER_BYTES
    for r in range(w):
        for t, table in enumerate(plan.tables):
            values, offsets = lookups[t]
            ends = np.append(offsets, values.size)
            start, stop = ends[r * per], ends[(r + 1) * per]
            mine = values[start:stop]
            bag = np.repeat(np.arange(per), np.diff(ends[r * per : (r + 1) * per + 1]))
            if hot is not None and hot[t].size and table.kind != DATA_PARALLEL:
                cold = ~np.isin(mine, hot[t])
                mine, bag = mine[cold], bag[cold]
            for owner in table.ranks:
                if owner == r:
                    continue
                ids = mine
                bags = bag
                if table.kind == ROW_WISE:
                    lo, hi = table.rows_of(owner)
                    inside = (mine >= lo) & (mine < hi)
                    ids, bags = mine[inside], bag[inside]
                total += ID_BYTES * (per + ids.size)
                if table.kind == DATA_PARALLEL:
                    total += row * per     # gradients only: each rank looks a copy up itself
                elif hot is None:
                    total += 2 * row * per  # pooled rows back, gradients out: every bag
                else:
                    total += 2 * row * np.unique(bags).size
    reduce = 0 if hot is None else 2 * (w - 1) * row * sum(h.size for h in hot)
    return int(total), int(reduce)
