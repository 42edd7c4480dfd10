"""The emulation's models as `train` uses them: the persistence bandwidth cap on the emulated
device, and the cost model's per-batch traffic in train's summary."""

from __future__ import annotations

import pytest

from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import train
from cxltrain.knobs import override
from cxltrain.pool.handle import Pool


def test_bandwidth_cap_charges_every_flushed_byte(shm_dir):
    with override(persist_bandwidth=10**12):
        pool = Pool.create(str(shm_dir / "cap.pool"), 4 << 20, backend="emulated")
    with pool:
        cap = pool.device.bandwidth_cap
        assert cap is not None and cap.bytes_per_s == 10**12
        charged = []
        real_charge = cap.charge
        cap.charge = lambda n: charged.append(n) or real_charge(n)
        pool.device.persist(pool.superblock.data_offset, 1 << 20)
        assert charged == [1 << 20]


def test_no_cap_unless_asked(shm_dir):
    with Pool.create(str(shm_dir / "nocap.pool"), 4 << 20, backend="emulated") as pool:
        assert pool.device.bandwidth_cap is None


@pytest.mark.parametrize("checkpoint", ["undo", "off"])
def test_train_reports_its_pool_traffic_and_modelled_costs(shm_dir, checkpoint):
    config = TrainConfig(steps=4, batch_size=32, num_tables=2, rows=400, dim=8, seed=1, checkpoint=checkpoint)
    result = train(config, pool_path=str(shm_dir / "t.pool"), progress=False)
    counts, ms = result.pool.cost_model["counts"], result.pool.cost_model["ms_per_batch"]
    lookups = config.batch_size * config.num_tables  # one id per table per sample
    if checkpoint == "undo":
        # lookups, plus the rows each undo record captured
        assert counts["gather_rows"] == lookups + round(result.pool.rows_updated_per_batch)
        assert counts["log_bytes"] > 0 and counts["drains"] > 0
    else:
        assert counts["gather_rows"] == lookups and counts["log_bytes"] == 0
    assert counts["write_rows"] == round(result.pool.rows_updated_per_batch)
    assert set(ms) == {"dram", "optane-1dimm", "optane-6dimm", "cxl-expander"}
    assert ms["dram"] < ms["cxl-expander"] and ms["optane-6dimm"] <= ms["optane-1dimm"]
