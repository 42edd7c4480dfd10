"""The unique-row exchange's kernels (kernels/lookups.c, through kernels/lookups.py): what they
compute, checked against the definition, the C kernels equal to the torch calls bit for bit, and
bad input refused with nothing returned."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cxltrain import knobs
from cxltrain.kernels import lookups, native

needs_native = pytest.mark.skipif(not native.built(), reason="native row kernels not built")


def both(fn, *args):
    """fn(*args) with the C kernels, then with the torch calls."""
    results = []
    for flag in (1, 0):
        with knobs.override(native_kernels=flag):
            results.append(fn(*args))
    return results


def random_case(seed: int, rows: int, lookups_n: int, holders: int, copies_n: int):
    """keys [N] (Zipf-like: many repeats), copies [H] sorted distinct, spans: rows split into
    `holders` runs (some may be empty), listed in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, rows, (lookups_n,), generator=g)
    keys = torch.where(torch.rand(lookups_n, generator=g) < 0.6, ranks % max(1, rows // 8), ranks)
    copies = torch.unique(torch.randint(0, rows, (copies_n,), generator=g))
    cuts = sorted(torch.randint(0, rows + 1, (holders - 1,), generator=g).tolist())
    bounds = [0, *cuts, rows]
    spans = [(bounds[k], bounds[k + 1]) for k in range(holders)]
    order = torch.randperm(holders, generator=g).tolist()
    return keys, copies, [spans[k] for k in order]


@needs_native
@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 3000), lookups_n=st.integers(0, 600),
       holders=st.integers(1, 4), copies_n=st.integers(0, 40))
def test_asked_rows_is_its_definition_in_c_and_in_torch(seed, rows, lookups_n, holders, copies_n):
    keys, copies, spans = random_case(seed, rows, lookups_n, holders, copies_n)
    native_result, torch_result = both(lookups.asked_rows, keys, rows, copies, spans)
    cold, starts, counts, positions = native_result
    # the definition: the distinct keys not copied, ascending; each span's run of them
    distinct = torch.unique(keys)
    assert torch.equal(cold, distinct[~torch.isin(distinct, copies)])
    for (lo, hi), start, count in zip(spans, starts, counts):
        assert torch.equal(cold[start : start + count], cold[(cold >= lo) & (cold < hi)])
    # each key's row of the answers (span by span) then the copies holds that key
    answers = torch.cat([cold[start : start + count] for start, count in zip(starts, counts)] + [copies])
    assert torch.equal(answers[positions], keys)
    # and torch's calls give the same, element for element
    assert torch.equal(torch_result[0], cold) and torch_result[1:3] == (starts, counts)
    assert torch.equal(torch_result[3], positions)


@needs_native
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lookups_n=st.integers(0, 400), bags=st.integers(1, 60),
       rows=st.integers(1, 50), dim=st.integers(1, 70))
def test_bag_gradients_add_up_in_lookup_order_bit_for_bit(seed, lookups_n, bags, rows, dim):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, rows, (lookups_n,), generator=g)
    cuts = torch.sort(torch.randint(0, lookups_n + 1, (bags - 1,), generator=g)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts])
    grad = torch.randn(bags, dim, generator=g) * torch.logspace(-6, 6, bags).unsqueeze(1)  # rounding shows
    native_out, torch_out = both(lookups.add_bags_to_rows, grad, offsets, positions, rows)
    assert native_out.view(torch.int32).equal(torch_out.view(torch.int32))
    # the reference, one lookup at a time
    expected = torch.zeros(rows, dim)
    ends = offsets.tolist()[1:] + [lookups_n]
    for b, (start, end) in enumerate(zip(offsets.tolist(), ends)):
        for i in range(start, end):
            expected[positions[i]] += grad[b]
    assert native_out.view(torch.int32).equal(expected.view(torch.int32))


@pytest.mark.parametrize("native_flag", [1, 0])
def test_bad_input_is_refused(native_flag):
    if native_flag and not native.built():
        pytest.skip("native row kernels not built")
    copies = torch.tensor([2, 5])
    with knobs.override(native_kernels=native_flag):
        with pytest.raises(IndexError, match="row index 10 is out of range"):
            lookups.asked_rows(torch.tensor([1, 10]), 10, copies, [(0, 10)])
        with pytest.raises(ValueError, match="must be disjoint ranges"):
            lookups.asked_rows(torch.tensor([1]), 10, copies, [(0, 6), (5, 10)])
        with pytest.raises(ValueError, match="no holder's span holds"):
            lookups.asked_rows(torch.tensor([1, 8]), 10, copies, [(0, 6)])
        with pytest.raises(ValueError, match="distinct, ascending"):
            lookups.asked_rows(torch.tensor([1]), 10, torch.tensor([5, 2]), [(0, 10)])
        with pytest.raises(TypeError, match="keys must be a 1-D torch.int64"):
            lookups.asked_rows(torch.tensor([1.0]), 10, copies, [(0, 10)])
        with pytest.raises(IndexError, match="row index 3 is out of range"):
            lookups.add_bags_to_rows(torch.ones(1, 4), torch.tensor([0]), torch.tensor([0, 3]), 3)
        with pytest.raises(ValueError, match="2 bag offsets for 1 bag gradients"):
            lookups.add_bags_to_rows(torch.ones(1, 4), torch.tensor([0, 1]), torch.tensor([0, 1]), 3)
