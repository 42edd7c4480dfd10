"""Recovery's row scatter (ring.restore): an undo record's old rows go back in place bit for bit,
and no other row of the table changes. Recovery scatters raw bytes with numpy (any region dtype,
row indices read straight from the record), so this is the scatter the kernels' tests once covered."""

from __future__ import annotations

import pytest
import torch

from cxltrain.checkpoint import layout, ring
from cxltrain.pool import Pool, RegionSpec
from cxltrain.pool_format import RegionKind


@pytest.mark.parametrize("seed,count", [(0, 1), (1, 7), (2, 64), (3, 0)])  # odd counts: indices off 8-byte alignment
def test_restore_puts_back_exactly_the_recorded_rows(shm_dir, seed, count):
    rows_total, dim = 200, 12
    g = torch.Generator().manual_seed(seed)
    with Pool.create(str(shm_dir / "ring.pool"), size=8 << 20) as pool:
        pool.add_regions([RegionSpec("t.weight", RegionKind.TABLE_WEIGHTS, "float32", (rows_total, dim), True),
                          RegionSpec("t.state", RegionKind.TABLE_OPTIM_STATE, "float32", (rows_total, 1)),
                          RegionSpec(layout.RING_REGION, RegionKind.UNDO_RING, "uint8", (1 << 20,))])
        weights = torch.from_numpy(pool.array("t.weight", padded=True))
        state = torch.from_numpy(pool.array("t.state", padded=True))
        weights.copy_(torch.randn(weights.shape, generator=g))
        state.copy_(torch.rand(state.shape, generator=g))
        before = weights.clone(), state.clone()
        rows = torch.sort(torch.randperm(rows_total, generator=g)[:count]).values
        undo = ring.UndoRing(pool, generation=1, start=0, start_seq=0)
        undo.append(0, pool.region("t.weight"), pool.region("t.state"), rows, weights, state)
        undo.mark_tail()
        weights[rows] = torch.randn(count, weights.shape[1], generator=g)  # the batch's in-place update
        state[rows] = 7.0
        [record] = ring.scan(pool, 1, 0, 0)
        ring.restore(pool, pool.region(layout.RING_REGION), record)
        assert torch.equal(weights, before[0]) and torch.equal(state, before[1])
