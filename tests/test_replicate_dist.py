"""Replicated hot rows in a distributed run (docs/distributed.md, "Replicated hot rows"): 2 ranks,
the same small model as tests/test_dist.py. A replicated run and an unreplicated one are made once
(in two halves each: the second half is a resume, whose replicas are rebuilt from their owners);
the replicated one sends fewer bytes, exactly those the cost model's counting gives for the batches
it trained, trains to the same losses within rounding, and a rank of it killed at a named point
(between the replicas' gradient sum and any update; between the ranks' commits) ends, after
torchrun's restart, bit-identical to it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cxltrain.faults import CRASH_ENV, CRASH_RANK_ENV, CrashPoint
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.data_source import training_data
from cxltrain.jobs.reshard import export_dir
from cxltrain.jobs.sharded_settings import plan_for
from cxltrain.jobs.train import WARMUP_STEPS
from cxltrain.placement import replication as rep
from helpers import assert_same_export, cxltrain, run_python, shm_tempdir

STEPS, HALF = 8, 4
SHARDING = "table-wise,row-wise,data-parallel"
CONFIG = TrainConfig(batch_size=96, num_tables=3, rows=2000, dim=16)
CHILD_TIMEOUT = 240
# rounding: a replicated row's gradient is summed per rank, then over the ranks, where the
# exchange sums every lookup's in one pass; after 8 batches the weights agree to this
RTOL, ATOL = 1e-4, 1e-6


def train(run, steps: int, setting: str, env=None, pooling: int = 1) -> dict:
    done = cxltrain("train", "--nproc-per-node", 2, "--pool", run, "--steps", steps, "--batch-size", 96,
                    "--num-tables", 3, "--rows", 2000, "--dim", 16, "--pooling", pooling, "--sharding", SHARDING,
                    "--no-progress", "--dist-timeout", 30, "--replicate-hot", setting, "--json", env=env,
                    timeout=CHILD_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"out": done.stdout, "json": json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.fixture(scope="module")
def runs():
    """{setting: (the first half's result, the second's, the export at the end)}."""
    with shm_tempdir("cxltrain-replicate-") as folder:
        made = {}
        for setting in ("auto", "off"):
            run = Path(folder) / setting
            made[setting] = (train(run, HALF, setting), train(run, STEPS, setting), export_dir(str(run)))
        yield made


def trained_lookups(first: int, stop: int, config: TrainConfig = CONFIG) -> list:
    source = training_data(config).train
    return [[(v.numpy(), o.numpy()) for v, o in zip(b.values, b.offsets)]
            for b in (source.batch(i) for i in range(first, stop))]


def test_replicated_run_sends_fewer_bytes_exactly_as_counted(runs):
    """Every timed batch's bytes, measured, equal exchange_bytes over the same batches (off: today's
    exchange; auto: the rows the run chose, chosen again here from its profile), but for the sums
    the first batch after a start has none of to send."""
    auto, off = runs["auto"][1]["json"]["group"], runs["off"][1]["json"]["group"]
    assert off["replicated_rows"] == 0 and off["predicted_bytes_per_batch"] is None
    assert auto["replicated_rows"] > 0 and auto["bytes_exchanged_per_batch"] < off["bytes_exchanged_per_batch"]
    plan = plan_for(CONFIG, 2, SHARDING)
    choice = rep.choose_replicas(plan, trained_lookups(0, rep.PROFILE_BATCHES), batch_size=96, dim=16,
                                 links=rep.SAME_TRANSPORT)
    assert choice.rows == auto["replicated_rows"]
    assert choice.unique == (True, True, False)  # the table-wise and row-wise tables' holders get unique rows
    timed = trained_lookups(HALF, STEPS)  # the resumed half: fewer batches than the warm-up, all timed
    assert STEPS - HALF <= WARMUP_STEPS
    for group, hot in ((auto, choice.hot), (off, None)):
        counted = [rep.exchange_bytes(plan, batch, 96, 16, hot, choice.unique) for batch in timed]
        # the owners' sums of a batch go out with the next batch's rows: the first after the
        # resume carries none (the replicas were rebuilt from the owners), the owners' half of the sum
        late = counted[0][1] // 2
        assert group["bytes_exchanged_per_batch"] == np.mean([sum(c) for c in counted]) - late / len(timed)
    assert math.isclose(auto["predicted_bytes_per_batch"], auto["bytes_exchanged_per_batch"], rel_tol=0.1)
    assert "the cost model predicted" in runs["auto"][1]["out"]


def test_its_losses_and_weights_match_the_unreplicated_run_within_rounding(runs):
    for half in (0, 1):
        a, b = runs["auto"][half]["json"], runs["off"][half]["json"]
        for key in ("first_loss", "final_loss"):
            assert a[key] == pytest.approx(b[key], rel=RTOL), (half, key)
    assert_same_within_rounding(runs["auto"][2], runs["off"][2])


@pytest.mark.slow
def test_bags_of_distinct_ids_cross_as_bags_beside_the_replicas(shm_dir):
    """8 ids a sample: a holder asked for distinct rows would send more rows than bags, so every
    table keeps the bag exchange, the replicas beside it: its bytes as counted, its weights
    within rounding of off's."""
    config = dataclasses.replace(CONFIG, pooling=8)
    made = {setting: train(shm_dir / setting, STEPS, setting, pooling=8) for setting in ("auto", "off")}
    plan = plan_for(config, 2, SHARDING)
    choice = rep.choose_replicas(plan, trained_lookups(0, rep.PROFILE_BATCHES, config), batch_size=96, dim=16,
                                 links=rep.SAME_TRANSPORT)
    assert choice.unique == (False, False, False) and choice.rows == made["auto"]["json"]["group"]["replicated_rows"] > 0
    timed = trained_lookups(WARMUP_STEPS, STEPS, config)
    for setting, hot in (("auto", choice.hot), ("off", None)):
        counted = np.mean([sum(rep.exchange_bytes(plan, batch, 96, 16, hot, choice.unique)) for batch in timed])
        assert made[setting]["json"]["group"]["bytes_exchanged_per_batch"] == counted
    for key in ("first_loss", "final_loss"):
        assert made["auto"]["json"][key] == pytest.approx(made["off"]["json"][key], rel=RTOL)
    # 8 lookups a bag: more terms summed apart, a weight of the data-parallel table 2.6e-6 apart
    assert_same_within_rounding(export_dir(str(shm_dir / "auto")), export_dir(str(shm_dir / "off")), atol=1e-5)


def assert_same_within_rounding(auto: dict, off: dict, atol: float = ATOL) -> None:
    """Two exports at STEPS: every weight within RTOL/atol, and not all the same bits."""
    assert auto["batch"] == off["batch"] == STEPS
    differ = 0
    for key, value in auto["model"].items():
        torch.testing.assert_close(value, off["model"][key], rtol=RTOL, atol=atol, msg=key)
        differ += not torch.equal(value, off["model"][key])
    assert differ  # the replicated rows' sums are rounded apart: the runs are not the same bits


@pytest.mark.parametrize("crash", [f"{CrashPoint.DIST_REPLICAS_REDUCED}:3",
                                   pytest.param(f"{CrashPoint.COMMIT_BEFORE_ROOT}:5", marks=pytest.mark.slow)])
def test_a_rank_killed_mid_run_recovers_bit_identical(runs, shm_dir, crash):
    """Rank 1 SIGKILLed (under the power-loss model) after the replicas' gradients were summed and
    before any row took them, or between the ranks' commits; torchrun restarts the group, the
    owners' rows roll back to G, every replica is rebuilt from them: the export at the end equals
    the uninterrupted replicated run's, bit for bit."""
    env = {CRASH_ENV: crash, CRASH_RANK_ENV: "1", "CXLTRAIN_POWER_LOSS": "1"}
    killed = train(shm_dir / "run", STEPS, "auto", env=env)
    assert "recovered every rank to batch" in killed["out"], killed["out"]
    assert_same_export(export_dir(str(shm_dir / "run")), runs["auto"][2])


ONE_RANK = r"""
import datetime, sys, torch
import torch.distributed as dist
from cxltrain.data.batch import Batch
from cxltrain.models.exchange import Comm, SparseExchange
from cxltrain.models.replicated import Replicas, ReplicatedExchange
from cxltrain.models.sharded import RankModel
from cxltrain.placement.sharding import make_plan, parse_kinds

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
plan = make_plan([50, 50], 1, parse_kinds("table-wise", 2))
g = torch.Generator().manual_seed(0)
values = (torch.randint(0, 6, (24,), generator=g), torch.randint(0, 50, (24,), generator=g))
offsets = torch.arange(0, 24, 3)  # 8 bags of 3 ids, repeats among them
batch = Batch(0, torch.zeros(8, 13), values, (offsets, offsets), torch.zeros(8))
weights = torch.randn(2, 8, 4, generator=g)
out = {}
for name in ("plain", "unique"):
    model = RankModel(plan, 0, dim=4, bottom_mlp=(8, 4), top_mlp=(8,), sparse_lr=0.05, seed=1)
    for shard in model.shards:
        shard.materialize()
    before = [s.storage()[0][:, :4].clone() for s in model.shards]
    comm = Comm(0, 1)
    if name == "plain":
        exchange = SparseExchange(plan, model, comm, 8)
    else:
        replicas = Replicas(plan, model, comm)
        replicas.rebuild([torch.arange(6), torch.tensor([3, 7])])  # every id of t0: its holder is asked none
        exchange = ReplicatedExchange(plan, model, comm, 8, replicas)
        exchange.unique = (True, True)
    embedded, _ = exchange.forward(batch, 0)
    sum((e * w).sum() for e, w in zip(embedded, weights)).backward()
    if name == "unique":
        cold = torch.unique(values[1][~torch.isin(values[1], torch.tensor([3, 7]))])
        assert [exchange.answers(t, 0) for t in (0, 1)] == [0, cold.numel()]
    after = [s.storage()[0][:, :4].clone() for s in model.shards]
    # the Adagrad states too: a first step's update does not see its gradient's scale, its state does
    states = [s.storage()[1].clone() for s in model.shards]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))  # both tables trained
    if name == "unique":  # the next step's rows bring the owner's sums: each copy has its row's bits
        assert not torch.equal(replicas.rows[1], after[1][[3, 7]])
        for hot in (None, [torch.arange(4), torch.tensor([3, 9])]):
            if hot is not None:  # other rows chosen with sums in flight: rebuilt, the sums dropped
                sum((e * w).sum() for e, w in zip(exchange.forward(batch, 0)[0], weights)).backward()
                replicas.rebuild(hot)
            exchange.forward(batch, 0)
            for t, s in enumerate(model.shards):
                assert torch.equal(replicas.rows[t], s.storage()[0][replicas.ids[t], :4]), t
                assert torch.equal(replicas.state[t], s.storage()[1][replicas.ids[t]]), t
    out[name] = [e.detach() for e in embedded] + after + states
for a, b in zip(out["plain"], out["unique"]):
    # bags pooled here, a row's gradient summed here and then by the holder's kernel: rounding apart
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
print("same")
dist.destroy_process_group()
"""


def test_unique_rows_on_one_rank_are_the_plain_exchange(tmp_path):
    """On one rank, with a table's every id replicated (its holder asked for no row at all) and
    another's ids asked as distinct rows, the embeddings and the updated rows are the plain
    exchange's, but for float rounding; the copies take the owner's sums in the next step's
    exchange, bit for bit."""
    done = run_python(ONE_RANK, tmp_path / "store")
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stdout[-2000:] + done.stderr[-3000:]
