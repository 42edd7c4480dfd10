"""`cxltrain bench`: the whole path on a tiny model, the plain-PyTorch baseline, the method table."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from cxltrain.bench import dist as dist_bench
from cxltrain.bench import dist_paired, methods, plain
from cxltrain.bench.records import (
    DistRecovery,
    DistResults,
    DistRow,
    DistSteps,
    EmbeddingTiming,
    OursSteps,
    PairedTiming,
    PlainSteps,
    Unmeasured,
)
from cxltrain.bench.report import targets
from cxltrain.bench.results import (
    BenchResults,
    EmbeddingRow,
    Machine,
    Recovery,
    RecoverySize,
    StepRow,
    StepTiming,
)
from cxltrain.bench.suite import _step_row
from cxltrain.bench.worker import config_to_json
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import build_model, build_source
from helpers import TEST_TIMEOUT_S
from test_cli import assert_one_line_error, cxltrain

TINY = TrainConfig(batch_size=32, num_tables=2, rows=500, dim=8, bottom_mlp=(16,), top_mlp=(16,))


def test_quick_bench_end_to_end(shm_dir):
    """Every method, recovery size, contender and the bandwidth either has numbers or says why not,
    and nothing is left in the scratch folder."""
    plot = shm_dir / "plot.png"
    # ~30 s on an idle machine; the limit, just under the suite's per-test one (conftest), is for a
    # shared one (this checks results, not time): past it the test fails, not the xdist worker
    result = cxltrain("bench", "--quick", "--json", *(["--plot", plot] if _has_matplotlib() else []),
                      env={"CXLTRAIN_POOL_DIR": str(shm_dir)}, timeout=TEST_TIMEOUT_S - 20)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["quick"] and out["machine"]["threads"] == 2 and out["config"]["rows"] == 1000
    names = {m.name for m in methods.step_methods((1, 4))}
    assert {r["method"] for r in out["steps"]} == names
    for row in out["steps"]:
        method = next(m for m in methods.step_methods((1, 4)) if m.name == row["method"])
        assert "reason" not in row, row
        assert row["mean_ms"] > 0 and row["ratio"] > 0 and row["bytes_per_batch"] >= 0
        assert row["batches_lost"] == method.batches_lost(row.get("overlap_steps", 0))
    strict = next(r for r in out["steps"] if r["method"] == "ours-strict")
    assert strict["batches_lost"] == 1 and strict["bytes_per_batch"] > 0
    [size] = out["recovery"]["sizes"]
    for name in ("ours", "torch", "dcp"):
        assert size[f"{name}_seconds"] > 0 and size[f"{name}_process_seconds"] > size[f"{name}_seconds"], size
    # killed in batch 3's first table update: recovery undoes that batch, and batch 2 as well when its
    # commit was still in flight on the worker (the commit lag is at most one batch)
    assert size["ours_batches_rolled_back"] in (1, 2)
    assert out["recovery"]["nothing_process_seconds"] > 0
    assert {(r["contender"], r["optimizer"]) for r in out["embedding"]} == \
        {(c, o) for c in ("ours", "torch", "torchrec") for o in ("sgd", "adagrad")}
    for row in out["embedding"]:
        assert row.get("ms", 0) > 0 or row["reason"].startswith("not installed"), row
    assert out["bandwidth"]["numpy_1_thread_gbps"] > 0 and out["bandwidth"]["gather_gbps"] > 0
    assert [t["name"].split(":")[0] for t in out["targets"]][:3] == [
        "strict per-batch step time / no checkpoint (side by side in one process)",
        "recovery of 0.00 GB of tables, s", "recovery time, largest / smallest tables"]
    [paired] = out["paired"]
    assert paired["method"] == "ours-strict" and paired["base_ms"] > 0 and paired["method_ms"] > 0
    assert len(paired["block_ratios"]) == paired["blocks"] == 2 and out["targets"][0]["value"] == paired["ratio"]
    assert "ratio_low" not in paired and "interval -;" in result.stdout  # two blocks: too few for an interval
    assert "side by side in one process" in result.stdout
    assert "floors" not in out  # a lab instrument now: tools/bench_floors.py (tests/test_floors.py)
    assert "machine:" in result.stdout and "targets" in result.stdout
    assert "MISSED" not in result.stdout and "n/a (quick)" in result.stdout  # a tiny model misses nothing
    assert sorted(p.name for p in shm_dir.iterdir()) == (["plot.png"] if _has_matplotlib() else [])
    if _has_matplotlib():
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_bench_plot_refusals_are_one_line_and_immediate(tmp_path):
    where = tmp_path / "missing-folder" / "plot.png"
    result = cxltrain("bench", "--quick", "--plot", where)
    if _has_matplotlib():
        assert_one_line_error(result, match="cannot write into")
    else:
        assert_one_line_error(result, match="--plot needs matplotlib")
    assert result.stdout == ""  # refused before measuring anything


def test_plain_model_is_the_same_dlrm():
    """Same MLP weights and initial table values as `cxltrain train`'s model: the same logits."""
    ours = build_model(TINY)
    ours.materialize()
    theirs = plain.plain_model(TINY)
    batch = build_source(TINY).batch(0)
    with torch.no_grad():
        assert torch.equal(ours(batch), theirs(batch))
    assert all(isinstance(t, torch.nn.EmbeddingBag) and t.sparse for t in theirs.tables)


@pytest.mark.parametrize("kind", ["torch", "dcp"])
def test_full_checkpoint_round_trip(kind, shm_dir):
    """A full checkpoint read back into a fresh, uninitialised model: differs before, equal after."""
    model = plain.plain_model(TINY)
    opts = plain.optimizers(model, TINY)
    source = build_source(TINY)
    for b in range(2):
        model.loss(source.batch(b)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    opts[1].param_groups[0]["lr"] = 2.5e-4  # as an LR scheduler would have left it: not a tensor
    path = str(shm_dir / "ckpt")
    if kind == "torch":
        torch.save(plain.full_state(model, opts), path)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(plain.dcp_state(model, opts), checkpoint_id=path)
    fresh = plain.plain_model(TINY, initialize=False)
    fresh_opts = plain.optimizers(fresh, TINY)
    for table in fresh.tables:
        table.weight.data.zero_()
    assert not torch.equal(fresh.tables[0].weight, model.tables[0].weight)
    assert fresh_opts[1].param_groups[0]["lr"] != 2.5e-4
    (plain.load_torch_state if kind == "torch" else plain.load_dcp_state)(fresh, fresh_opts, path)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    adam, fresh_adam = opts[1].state_dict()["state"], fresh_opts[1].state_dict()["state"]
    assert all(torch.equal(adam[i]["exp_avg_sq"], fresh_adam[i]["exp_avg_sq"]) for i in adam)
    assert fresh_opts[1].param_groups[0]["lr"] == 2.5e-4


def test_periodic_saves_fall_in_the_timed_window(shm_dir):
    """torch.save every 2 over 4 timed steps writes twice: the window carries its cost."""
    path = str(shm_dir / "ckpt")
    saved = []
    real_save = torch.save
    try:
        torch.save = lambda state, f: saved.append(f) or real_save(state, f)
        result = plain.train_steps(TINY, save="torch", every=2, path=path, warmup=1, timed=4)
    finally:
        torch.save = real_save
    assert len(saved) == 2
    assert result.state_bytes > TINY.num_tables * TINY.rows * TINY.dim * 4  # tables, MLPs, Adam state
    assert not (shm_dir / "ckpt").exists()  # the checkpoint goes when the run ends


def test_batches_lost_per_method():
    by_name = {m.name: m for m in methods.step_methods((1, 100))}
    assert by_name["ours-off"].batches_lost() is None
    assert by_name["ours-strict"].batches_lost() == 1
    assert by_name["ours-relaxed"].batches_lost() == 100   # the dense state, dense_every batches old
    assert by_name["ours-sync-undo"].batches_lost() == 1
    assert by_name["plain"].batches_lost() is None
    assert by_name["plain-torch-100"].batches_lost(overlap_steps=7) == 100
    assert by_name["plain-dcp-100"].batches_lost(overlap_steps=7) == 107  # the save in flight too


def test_methods_need_the_fields_they_override():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for method in methods.step_methods():
        assert set(method.overrides) <= fields, method.name


def test_bytes_per_batch():
    strict = next(m for m in methods.step_methods() if m.name == "ours-strict")
    stats = {"batches": 4, "undo_bytes": 1000, "dense_bytes": 400, "rows_persisted": 10}
    row = _step_row(strict, OursSteps(mean_ms=5.0, split_ms={}, checkpoint_stats=stats, row_bytes=260,
                                      timed_steps=4))
    assert row.bytes_per_batch == (1000 + 400 + 10 * 260) / 4 and row.batches_lost == 1
    dcp = next(m for m in methods.step_methods() if m.name == "plain-dcp-100")
    row = _step_row(dcp, PlainSteps(mean_ms=5.0, median_ms=4.0, state_bytes=2000, overlap_steps=3))
    assert row.bytes_per_batch == 20 and row.batches_lost == 103


def test_targets_hold_and_miss():
    strict = StepTiming(mean_ms=5.2, median_ms=None, batches_lost=1, bytes_per_batch=0.0, ratio=1.04)
    results = BenchResults(
        machine=Machine(cpu="cpu", cores=2, memory_gib=8.0, torch="2", threads=2, python="3"), config=TINY,
        quick=True, scratch_dir="/dev/shm", paired=[], bandwidth=Unmeasured("not measured"),
        steps=[StepRow(method="ours-strict", label="ours, strict", pooling=1, baseline="ours-off", timing=strict)],
        recovery=Recovery(nothing_process_seconds=None, nothing_reason=None,
                          sizes=[RecoverySize(rows=1, table_gb=0.5, ours_seconds=0.05),
                                 RecoverySize(rows=2, table_gb=2.05, ours_seconds=0.4),
                                 RecoverySize(rows=3, table_gb=4.1, ours_seconds=0.2)]),
        embedding=[EmbeddingRow(contender="ours", optimizer="sgd", pooling=1, timing=EmbeddingTiming(3.0, 1.0)),
                   EmbeddingRow(contender="torch", optimizer="sgd", pooling=1, timing=EmbeddingTiming(2.0, 1.0))])
    held = {t.name: t.held for t in targets(results)}
    assert held == {"strict per-batch step time / no checkpoint": True,
                    "recovery of 2.05 GB of tables, s": True,
                    "recovery time, largest / smallest tables": False,     # 0.2 / 0.05 = 4x
                    "embedding sgd pooling 1: ours / nn.EmbeddingBag time": False}


def test_the_dist_bench_reads_train_json_into_typed_records_and_prints_its_layout():
    """`bench --dist` reads rank 0's `train --json` (one schema for one rank or many) into records
    whose JSON is the layout the dist bench has printed, and whose table names each world size."""
    summary = {"split_ms": {"total": 12.5}, "group": {"bytes_exchanged_per_batch": 2048.0}}
    steps = dist_bench._steps(summary)
    assert steps == DistSteps(ms_per_step=12.5, bytes_exchanged_per_batch=2048.0)
    results = DistResults(["--steps", "12"], 2, [DistRow(2, steps, DistSteps(10.0, None), strict_overhead=0.25)],
                          DistRecovery(recovered_batch=4, seconds=0.5))
    assert json.loads(json.dumps(results.to_json())) == {
        "options": ["--steps", "12"], "cores": 2,
        "runs": [{"ranks": 2, "undo": {"ms_per_step": 12.5, "bytes_exchanged_per_batch": 2048.0},
                  "off": {"ms_per_step": 10.0, "bytes_exchanged_per_batch": None}, "strict_overhead": 0.25}],
        "recovery": {"recovered_batch": 4, "seconds": 0.5}}
    text = dist_bench.format_text(results)
    assert "    2            12.5         10.0       25%                  2.0" in text, text
    assert "to batch 4 in 500 ms" in text


def test_the_dist_bench_prints_each_overhead_with_its_interval_beside_one_process():
    """Side by side: each world size's overhead with its interval, a world size beyond the cores
    marked as crowded, and the one-process figure of the same run."""
    timing = PairedTiming(base_ms=10.0, method_ms=10.4, ratio=1.04, median_block_ratio=1.04, block_ratios=[1.04] * 10,
                          blocks=10, block_steps=5, ratio_low=1.01, ratio_high=1.07)
    rows = [DistRow(r, DistSteps(12.5, 2048.0), DistSteps(10.0, 2048.0), strict_overhead=0.25, overhead_low=0.2,
                    overhead_high=0.3, blocks=10, block_steps=5, durable_mb=[[1.9, 0.61]] * r,
                    phase_ms=[[0.5, 1.25, 0.2]] * r) for r in (2, 4)]
    text = dist_bench.format_text(DistResults(["--steps", "12"], 2, rows, DistRecovery(4, 0.5), single=timing))
    assert ("2 rank(s), MB made durable a batch by each rank: dense snapshot 1.90 / 1.90, table rows and undo "
            "records 0.61 / 0.61\n") in text, text
    assert ("2 rank(s), ms a batch on each rank: undo capture 0.50 / 0.50, batch end 1.25 / 1.25, commit (worker) "
            "0.20 / 0.20\n") in text, text
    assert "    2            12.5         10.0       25%                  2.0         +20.0% to +30.0%\n" in text, text
    assert "+20.0% to +30.0% (more ranks than cores)" in text, text
    assert "one process, the same model: 10.4 / 10.0 ms/step, overhead 4% (+1.0% to +7.0%)" in text
    assert "10 blocks of 5 steps each" in text


def test_the_dist_side_by_side_runs_take_turns_and_commit_every_durable_batch(shm_dir):
    """dist_paired in this process as a group of one: both runs take their turns, the durable one
    commits every batch (warm-up and blocks), the off one none, and the ratio has its interval."""
    config = config_to_json(TINY)
    job = {"config": config, "dirs": [str(shm_dir / "off"), str(shm_dir / "durable")], "warmup": 1, "blocks": 10,
           "block_steps": 1}
    paired = dist_paired.run(job)
    assert paired.ranks == 1 and paired.timing.blocks == 10 and len(paired.timing.block_ratios) == 10
    assert paired.timing.ratio_low is not None and paired.timing.ratio_low <= paired.timing.ratio
    assert paired.stats["commits"] == paired.stats["batches"] == 1 + 10
    assert paired.durable_bytes_per_batch == paired.off_bytes_per_batch == 0.0  # one rank sends nobody anything
    row = dist_bench._row(paired)
    assert row.strict_overhead == pytest.approx(paired.timing.ratio - 1) and row.blocks == 10
    # one rank's slice is the whole dense state: every snapshot's bytes, per batch
    assert row.durable_mb == [[pytest.approx(paired.stats["dense_bytes"] / paired.stats["batches"] / 1e6),
                               pytest.approx((paired.stats["row_bytes"] + paired.stats["undo_bytes"])
                                             / paired.stats["batches"] / 1e6)]]
    assert row.phase_ms == [[pytest.approx(1000 * paired.stats[k] / paired.stats["batches"])
                             for k in ("training_capture_seconds", "training_boundary_seconds", "commit_seconds")]]


def _tiers_files() -> set[str]:
    return {os.path.join(folder, name) for folder in ("/dev/shm", "/var/tmp") for name in os.listdir(folder)
            if name.startswith("cxltrain-tiers-")}


def test_bench_tiers_runs_side_by_side_at_a_tiny_size(shm_dir):
    before = _tiers_files()
    done = cxltrain("bench", "--tiers", "--quick", "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["fast", "capacity", "capacity-off", "cache-2%", "cache-10%", "steal-10%"]
    assert rows["fast"]["ratio"] == 1.0
    # the hot-row cache serves a share of the lookups, more with more rows cached; no cache, no rate
    assert rows["capacity"]["hit_rate"] is None
    assert 0 < rows["cache-2%"]["hit_rate"] < rows["cache-10%"]["hit_rate"] < 1
    assert rows["steal-10%"]["hit_rate"] == rows["cache-10%"]["hit_rate"]  # the same cache; only the write-back differs
    assert all(row["ms_per_step"] > 0 for row in rows.values())
    # the fast tier (/dev/shm) does no block I/O and reads nothing ahead; the durable tiered set
    # writes its dirty pages every batch
    assert rows["fast"]["written_bytes_per_batch"] == 0 and rows["fast"]["pages_prefetched_per_batch"] == 0
    assert rows["capacity"]["written_bytes_per_batch"] > 0 and rows["capacity"]["pages_prefetched_per_batch"] > 0
    assert result["checkpoint_ratio"] > 0 and result["peak_rss_bytes"] > 0
    assert "tiers: 2 tables x 2,000 rows x 8" in done.stdout
    assert result["capacity_dir"] == "/var/tmp"
    assert _tiers_files() <= before  # its pools are removed


def test_tiers_ratios_carry_their_interval_once_there_are_enough_blocks():
    """Each setup's ratio to the all-fast blocks, and its 95% interval over the block pairs: around
    the ratio where there are MIN_BLOCKS pairs or more, none below (as --quick prints "-")."""
    from cxltrain.bench.interval import MIN_BLOCKS
    from cxltrain.bench.tiers import SETUPS, TiersResult, format_tiers, tier_rows

    factors = (1.0, 2.4, 1.4, 1.9, 1.5, 1.42)  # each setup's cost against the baseline, SETUPS' order
    g = torch.Generator().manual_seed(0)
    turns = (1.0 + torch.rand(MIN_BLOCKS + 2, generator=g)).tolist()  # the load of each turn, shared
    seconds = [[t * f * (1 + 0.05 * float(torch.rand(1, generator=g))) for t in turns] for f in factors]
    io = [{"hits": 9.0, "lookups": 10.0} if setup.cache_share else {} for setup in SETUPS]
    rows = tier_rows(seconds, io, block_steps=5)
    assert [row.name for row in rows] == [setup.name for setup in SETUPS]
    assert rows[0].ratio == 1.0 and rows[0].ratio_low == rows[0].ratio_high == 1.0
    for row, factor in zip(rows[1:], factors[1:]):
        assert row.ratio_low <= row.ratio <= row.ratio_high
        assert factor / 1.05 < row.ratio_low and row.ratio_high < factor * 1.05  # the blocks vary by 5%
    assert rows[1].hit_rate is None and rows[3].hit_rate == 0.9
    few = tier_rows([blocks[:MIN_BLOCKS - 1] for blocks in seconds], io, block_steps=5)
    assert all(row.ratio_low is None and row.ratio_high is None for row in few)
    result = TiersResult(rows, 1.1, 1 << 30, MIN_BLOCKS + 2, 5, "/var/tmp", dataclasses.asdict(TrainConfig()), 1.0, 1.2)
    text = format_tiers(result)
    assert f"{rows[-1].ratio_low:.3f}-{rows[-1].ratio_high:.3f}" in text and "1.10x (1.000-1.200)" in text
    assert TiersResult.from_json(json.loads(json.dumps(result.to_json()))).rows[-1]["ratio_low"] == rows[-1].ratio_low


def test_bench_tiers_refusals_are_one_line():
    for args in (["--tiers", "--capacity-dir", "/nonexistent/folder"], ["--capacity-dir", "/var/tmp"],
                 ["--tiers", "--dist"]):
        assert_one_line_error(cxltrain("bench", *args, timeout=60))
