"""Replicated hot rows, the cost model (placement/replication.py): pure functions, in this process.
The replicated step itself, its bytes against this model, and its recovery: tests/test_replicate_dist.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cxltrain.errors import ConfigError
from cxltrain.placement import replication as rep
from cxltrain.placement.sharding import make_plan, parse_kinds

LINKS = rep.Links(1e9, 1e9)


def one_hot(ids) -> tuple[np.ndarray, np.ndarray]:
    """A table's lookups of one id per sample: (values [B], offsets [B])."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids, np.arange(ids.size, dtype=np.int64)


def zipf_batches(plan, batches: int, batch: int, rows: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, rows + 1) ** 1.05
    p /= p.sum()
    return [[one_hot(rng.choice(rows, batch, p=p)) for _ in plan.tables] for _ in range(batches)]


def test_bytes_without_replication_are_the_exchanges_closed_form():
    """8 table-wise tables on 2 ranks, batch 1024, 32 dims: docs/distributed.md's 1,088 KiB."""
    plan = make_plan([100_000] * 8, 2)
    lookups = [one_hot(np.arange(1024) % 5) for _ in plan.tables]
    a2a, reduce = rep.exchange_bytes(plan, lookups, 1024, 32, None)
    per_table = 8 * (512 + 512) + 2 * 128 * 512  # lengths and ids out, pooled rows back, gradients out
    assert (a2a, reduce) == (4 * 2 * per_table + 2 * 16, 0)


def test_replicated_bytes_count_only_the_bags_that_still_cross():
    plan = make_plan([10, 10], 2, parse_kinds("table-wise", 2))  # t0 on rank 0, t1 on rank 1
    lookups = [one_hot([5, 5, 7, 9]), one_hot([1, 2, 3, 3])]
    hot = [np.array([5, 9]), np.empty(0, np.int64)]
    a2a, reduce = rep.exchange_bytes(plan, lookups, 4, 4, hot)
    # rank 1 (samples 2, 3) sends t0's lengths [2] and its one cold id (7), gets one pooled row and
    # sends one gradient; rank 0 (samples 0, 1) sends t1 all of its: 2 lengths, 2 ids, 2 + 2 rows
    assert a2a == 2 * 16 + (8 * 3 + 2 * 16) + (8 * 4 + 4 * 16)
    assert reduce == 2 * 1 * 16 * 2  # 2 replicated rows, summed in a reduce-scatter and an all-gather
    assert rep.exchange_bytes(plan, lookups, 4, 4, None)[0] == 2 * 16 + 2 * (8 * 4 + 4 * 16)


def test_unique_rows_are_priced_per_distinct_id_as_counted_by_hand():
    plan = make_plan([10, 10], 2, parse_kinds("table-wise", 2))  # t0 on rank 0, t1 on rank 1
    # t0: bags [5 5] [7] | [5 7 7] [9 5]; t1: one id a bag, [1] [1] | [2] [3]
    lookups = [(np.array([5, 5, 7, 5, 7, 7, 9, 5]), np.array([0, 2, 3, 6])), one_hot([1, 1, 2, 3])]
    header, row = 2 * 16, 4 * 4
    # rank 1 asks rank 0 for t0's distinct ids {5, 7, 9}: a count and 3 ids, 3 rows back, 3 gradients
    # out; rank 0 asks rank 1 for t1's {1}: a count and 1 id, 1 row, 1 gradient
    none = [np.empty(0, np.int64)] * 2
    assert rep.exchange_bytes(plan, lookups, 4, 4, none, [True, True]) == (
        header + (8 * 4 + 2 * row * 3) + (8 * 2 + 2 * row * 1), 0)
    # with row 5 replicated, t0's cold ids are {7, 9}; its all-reduce: 2 (W-1) rows of 16 B
    hot = [np.array([5]), np.empty(0, np.int64)]
    assert rep.exchange_bytes(plan, lookups, 4, 4, hot, [True, True]) == (
        header + (8 * 3 + 2 * row * 2) + (8 * 2 + 2 * row * 1), 2 * row)
    # t0 as bags instead: 2 lengths, 3 cold ids, both bags hold one (2 rows, 2 gradients)
    assert rep.exchange_bytes(plan, lookups, 4, 4, hot, [False, True])[0] == (
        header + (8 * 5 + 2 * row * 2) + (8 * 2 + 2 * row * 1))
    # without replication the exchange is the plain one, whatever unique says: every bag
    assert rep.exchange_bytes(plan, lookups, 4, 4, None, [True, True]) == (
        header + (8 * 7 + 2 * row * 2) + (8 * 4 + 2 * row * 2), 0)


def test_each_table_gets_the_cheaper_exchange():
    """Repeated ids: unique rows; bags of 4 ids that never repeat: bags (4 rows would cross per bag)."""
    plan = make_plan([2000, 100_000], 2, parse_kinds("table-wise", 2))
    rng = np.random.default_rng(5)
    batches = [[one_hot(rng.integers(0, 20, 256)),
                (np.arange(b * 1024, (b + 1) * 1024, dtype=np.int64), np.arange(0, 1024, 4, dtype=np.int64))]
               for b in range(8)]
    choice = rep.choose_replicas(plan, batches, batch_size=256, dim=16, links=LINKS)
    assert choice.unique == (True, False)
    held_out = [sum(rep.exchange_bytes(plan, batch, 256, 16, choice.hot, choice.unique)) for batch in batches[1::2]]
    assert choice.predicted_bytes == pytest.approx(np.mean(held_out))
    for unique in ((False, False), (True, True)):  # either other choice sends more
        assert np.mean([sum(rep.exchange_bytes(plan, batch, 256, 16, choice.hot, unique))
                        for batch in batches[1::2]]) > choice.predicted_bytes


def test_the_unique_row_closed_form():
    # W=2, D=32: (1/2)^n <= 1 - 256/264, n >= log2(33)
    assert rep.row_threshold(2, 32, LINKS) == pytest.approx(np.log2(33))
    assert rep.row_threshold(4, 32, LINKS) > rep.row_threshold(2, 32, LINKS)
    assert rep.row_threshold(2, 32, rep.Links(1e9, 1e8)) == float("inf")  # an all-reduce 10x slower never pays


def counted_plainly(plan, t, lookups, batch_size, dim, candidates) -> np.ndarray:
    """_table_costs's definition (its docstring) counted the plain way: each candidate's cold ids
    found apart, then each holder's share of them and their distinct ids and bags."""
    table, w = plan.tables[t], plan.world_size
    per, row = batch_size // w, 4 * dim
    values, offsets = lookups
    ends = np.append(offsets, values.size)
    costs = np.zeros((len(candidates), 3))
    for r in range(w):
        ids = values[ends[r * per] : ends[(r + 1) * per]]
        bags = np.repeat(np.arange(per), np.diff(ends[r * per : (r + 1) * per + 1]))
        for c, hot in enumerate(candidates):
            cold = np.ones(ids.size, bool)
            if hot is not None and table.kind != "data-parallel":
                cold = ~np.isin(ids, hot)
            for owner in (o for o in table.ranks if o != r):
                lo, hi = table.rows_of(owner) if table.kind == "row-wise" else (0, table.rows)
                mine = cold & (ids >= lo) & (ids < hi)
                if table.kind == "data-parallel":
                    costs[c, :2] += 8 * (per + mine.sum()) + row * per
                    continue
                costs[c, 0] += 8 * (per + mine.sum()) + 2 * row * (per if hot is None else np.unique(bags[mine]).size)
                costs[c, 1] += 8 * (1 + np.unique(ids[mine]).size) + 2 * row * np.unique(ids[mine]).size
    for c, hot in enumerate(candidates):
        costs[c, 2] = 0 if hot is None else 2 * (w - 1) * row * hot.size
    return costs


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), world_size=st.integers(1, 4), kinds=st.lists(
    st.sampled_from(["table-wise", "row-wise", "data-parallel"]), min_size=1, max_size=3), per=st.integers(1, 5))
def test_the_costs_are_their_plain_count(seed, world_size, kinds, per):
    """Every table's bytes per candidate set (none, empty, random sets) equal counted_plainly's."""
    rng = np.random.default_rng(seed)
    rows = [int(rng.integers(1, 300)) for _ in kinds]
    if "row-wise" not in kinds and len(kinds) < world_size:
        kinds = [*kinds[:-1], "row-wise"]  # else a rank holds nothing, which the plan refuses
    try:
        plan = make_plan(rows, world_size, parse_kinds(",".join(kinds), len(kinds)))
    except ConfigError:
        assume(False)  # a row-wise table of fewer rows than ranks, say: refused, no plan to price
    for t in range(len(kinds)):
        lengths = rng.integers(0, 4, per * world_size)
        lookups = rng.integers(0, rows[t], int(lengths.sum())), np.cumsum(lengths) - lengths
        candidates = [None, np.empty(0, np.int64), *(rng.choice(rows[t], int(rng.integers(1, rows[t] + 1)),
                                                                 replace=False) for _ in range(3))]
        assert np.array_equal(rep._table_costs(plan, t, lookups, per * world_size, 4, candidates),
                              counted_plainly(plan, t, lookups, per * world_size, 4, candidates))


def test_row_wise_holders_get_only_the_ids_of_their_rows():
    plan = make_plan([10], 2, parse_kinds("row-wise", 1))  # rows 0-4 on rank 0, 5-9 on rank 1
    lookups = [one_hot([6, 1, 2, 8])]
    # rank 0 sends rank 1 lengths [2] and id 6; rank 1 sends rank 0 lengths [2] and id 2
    assert rep.exchange_bytes(plan, lookups, 4, 4, [np.empty(0, np.int64)])[0] == 2 * 16 + 2 * (8 * 3 + 2 * 16)


def test_auto_replicates_the_head_of_a_skewed_profile_and_nothing_of_a_flat_one():
    plan = make_plan([2000] * 4, 2)
    skewed = rep.choose_replicas(plan, zipf_batches(plan, 16, 512, 2000), batch_size=512, dim=16, links=LINKS)
    assert 0 < skewed.rows < 4 * 200 and skewed.predicted_bytes < 0.8 * skewed.predicted_off_bytes
    for hot in skewed.hot:  # the most looked-up ids: Zipf's first ranks
        assert hot.size and set(range(3)) <= set(hot.tolist()) and np.all(np.diff(hot) > 0)
    flat = [[one_hot(np.arange(b * 512, (b + 1) * 512) % 2000) for _ in plan.tables] for b in range(16)]
    none = rep.choose_replicas(plan, flat, batch_size=512, dim=16, links=LINKS)
    assert none.rows == 0 and "no row" in none.why
    # no id repeats: unique rows still pay, a count instead of the 256 bags' lengths (4 tables, 1 asker each)
    assert all(none.unique) and none.predicted_off_bytes - none.predicted_bytes == 4 * 8 * (256 - 1)


def test_a_slow_all_reduce_replicates_fewer_rows():
    plan = make_plan([2000] * 4, 2)
    batches = zipf_batches(plan, 16, 512, 2000)
    fast = rep.choose_replicas(plan, batches, batch_size=512, dim=16, links=LINKS)
    slow = rep.choose_replicas(plan, batches, batch_size=512, dim=16, links=rep.Links(1e9, 1e8))
    assert slow.rows < fast.rows
    assert rep.threshold(2, 16, rep.Links(1e9, 1e8)) == pytest.approx(10 * rep.threshold(2, 16, LINKS))


def test_the_choice_is_a_function_of_its_inputs_and_the_held_out_batches_price_it():
    plan = make_plan([2000] * 4, 4)
    batches = zipf_batches(plan, 16, 512, 2000, seed=3)
    a = rep.choose_replicas(plan, batches, batch_size=512, dim=16, links=LINKS)
    b = rep.choose_replicas(plan, batches, batch_size=512, dim=16, links=LINKS)
    assert all(np.array_equal(x, y) for x, y in zip(a.hot, b.hot)) and a.predicted_bytes == b.predicted_bytes
    assert a.unique == b.unique
    held_out = [rep.exchange_bytes(plan, batch, 512, 16, a.hot, a.unique) for batch in batches[1::2]]
    assert a.predicted_bytes == pytest.approx(np.mean([sum(s) for s in held_out]))


def test_off_one_rank_and_a_fraction():
    plan = make_plan([2000] * 4, 2)
    batches = zipf_batches(plan, 4, 256, 2000)
    off = rep.choose_replicas(plan, batches, batch_size=256, dim=16, links=LINKS, setting=rep.OFF)
    assert off.rows == 0 and off.predicted_bytes == off.predicted_off_bytes
    alone = make_plan([2000] * 4, 1)
    assert rep.choose_replicas(alone, batches, batch_size=256, dim=16, links=LINKS).rows == 0
    tenth = rep.choose_replicas(plan, batches, batch_size=256, dim=16, links=LINKS, setting=0.01)
    assert [h.size for h in tenth.hot] == [20] * 4  # ceil(0.01 x 2000), the most looked up
    kept = make_plan([2000, 500], 2)  # a data-parallel table is on every rank already
    assert rep.choose_replicas(kept, [b[:2] for b in batches], batch_size=256, dim=16, links=LINKS,
                               setting=0.5).hot[1].size == 0


def test_the_profile_moves_every_reprofile_every_batches():
    every = rep.REPROFILE_EVERY
    assert [rep.profile_start(b) for b in (0, 1, every - 1, every, 2 * every + 3)] == [0, 0, 0, every, 2 * every]


@pytest.mark.parametrize("text", ["0", "1.5", "-0.1", "most", "nan"])
def test_bad_settings_are_refused(text):
    with pytest.raises(ConfigError, match="--replicate-hot"):
        rep.parse_setting(text)
    assert rep.parse_setting("auto") == "auto" and rep.parse_setting("off") == "off"
    assert rep.parse_setting("0.25") == 0.25
