"""`cxltrain bench --gpu` (bench/gpu.py): the runs side by side, their ratios and the gather bandwidth.
The CPU runs the very same path (`--device cpu`, torch's row kernels); the `gpu`-marked test runs it on
CUDA where there is one."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from cxltrain.bench import gpu_runs
from cxltrain.bench.gpu_gather import gather_bandwidth
from cxltrain.devices.gpu_mapping import gpu_problem
from helpers import cxltrain
from test_cli import assert_one_line_error


def quick_bench(shm_dir, *device) -> tuple[list[str], dict]:
    """(the text lines, the JSON) of `bench --gpu --quick --json` with its pools in shm_dir."""
    result = cxltrain("bench", "--gpu", *device, "--quick", "--json", env={"CXLTRAIN_POOL_DIR": str(shm_dir)},
                      timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert list(shm_dir.iterdir()) == []  # every pool removed
    return lines[:-1], json.loads(lines[-1])


def check_runs(lines: list[str], out: dict) -> None:
    """Every variant at every pooling, once, with finite ratios; the same trajectory in each."""
    names = [v.name for v in gpu_runs.VARIANTS]
    poolings = out["shapes"]["poolings"]
    assert [(r["pooling"], r["variant"]) for r in out["steps"]] == [(p, n) for p in poolings for n in names]
    for r in out["steps"]:
        assert r["error"] is None, r
        assert r["ms_per_step"] > 0 and len(r["block_ms"]) == out["shapes"]["blocks"]
        ratios = [r["to_torch"]] + ([r["to_off"]] if r["durable"] else [])
        for ratio in ratios:  # 10 blocks: every ratio has its interval
            assert all(math.isfinite(ratio[k]) and ratio[k] > 0 for k in ("ratio", "low", "high")), r
            assert ratio["low"] <= ratio["high"]
        assert (r["to_off"] is None) == (not r["durable"])
        assert (r["split_ms"] is None) == (r["variant"] == "torch")
        # one line of the table each: pooling, label, durability
        durable = {None: "-", True: "on", False: "off"}[r["durable"]]
        assert sum(line.split()[:1] == [str(r["pooling"])] and r["label"] in line and f" {durable} " in line
                   for line in lines) == 1, r["label"]
    for pooling in poolings:
        runs = [r for r in out["steps"] if r["pooling"] == pooling]
        torch_loss = runs[0]["last_loss"]
        for r in runs:  # SGD on both sides: every run trains the same model
            assert r["last_loss"] == pytest.approx(torch_loss, rel=1e-4), r["variant"]
        cached = {r["tables"]: r["cached_rows"] for r in runs}
        rows, lookups = out["shapes"]["rows"], 2 * out["shapes"]["batch_size"] * pooling
        assert cached["all"] == [rows] * out["shapes"]["num_tables"] and set(cached["pool"]) == {0}
        assert set(cached["cache"]) == {min(rows, lookups)}


def test_quick_gpu_bench_on_the_cpu(shm_dir):
    lines, out = quick_bench(shm_dir, "--device", "cpu")
    assert out["device"] == "cpu" and out["quick"]
    check_runs(lines, out)
    assert "skipped" in out["gather"] and lines[-1].startswith("gather bandwidth: skipped")


def test_gpu_bench_without_cuda_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert_one_line_error(cxltrain("bench", "--gpu", "--quick"), match="bench --gpu: ")
    assert_one_line_error(cxltrain("bench", "--rows", "100"), match="--rows: only with --gpu")


def test_gather_bandwidth_runs_on_cpu_tensors(shm_dir):
    g = gather_bandwidth(rows=3000, dim=64, count=4096, repeats=2, folder=str(shm_dir), device=torch.device("cpu"))
    assert g["rows"] == 4096 and g["row_bytes"] == 256 and g["bytes"] == 4096 * 256
    assert all(g[k] > 0 and math.isfinite(g[k]) for k in ("sorted_gb_s", "batch_order_gb_s", "pinned_copy_gb_s"))
    assert list(shm_dir.iterdir()) == []


class FakeRun:
    """A run whose block order and counters interleave() can be watched through."""

    def __init__(self, name: str, log: list, counted: bool, fails_at: int | None = None) -> None:
        self.name, self.log, self.counted, self.steps, self.fails_at = name, log, counted, 0, fails_at

    def step(self) -> None:
        if self.steps == self.fails_at:
            raise torch.OutOfMemoryError("CUDA out of memory.\nTried to allocate 2 GiB")
        self.steps += 1
        self.log.append(self.name)

    def settle(self) -> None:
        pass

    def counters(self):
        return (float(self.steps),) * 5 if self.counted else None


def test_interleave_rotates_the_first_run_and_drops_the_warmup():
    order: list[str] = []
    runs = [FakeRun("a", order, True), FakeRun("b", order, False), FakeRun("c", order, True)]
    timed = gpu_runs.interleave(runs, blocks=3, warmup_blocks=1, block_steps=2, sync=lambda: None)
    assert "".join(order[::2]) == "abc" + "bca" + "cab" + "abc"
    assert [len(s) for s in timed.seconds] == [3, 3, 3] and timed.errors == [None] * 3
    assert timed.deltas == [[6.0] * 5, None, [6.0] * 5]  # 3 timed blocks of 2 steps


def test_interleave_drops_a_failing_run_and_times_the_others():
    order: list[str] = []
    runs = [FakeRun("a", order, True), FakeRun("b", order, True, fails_at=3), None]
    timed = gpu_runs.interleave(runs, blocks=3, warmup_blocks=1, block_steps=2, sync=lambda: None,
                                errors=[None, None, "RuntimeError: failed to open"])
    assert timed.errors == [None, "OutOfMemoryError: CUDA out of memory.", "RuntimeError: failed to open"]
    assert [len(s) for s in timed.seconds] == [3, 0, 0] and timed.deltas[1:] == [None, None]
    assert order.count("a") == 8 and order.count("b") == 3


@pytest.mark.gpu
def test_quick_gpu_bench_on_cuda(shm_dir):
    if gpu_problem() is not None:
        pytest.skip(gpu_problem())
    lines, out = quick_bench(shm_dir)
    assert out["device"] != "cpu"
    check_runs(lines, out)
    g = out["gather"]
    assert "skipped" not in g, g
    assert all(g[k] > 0 and math.isfinite(g[k]) for k in ("sorted_gb_s", "batch_order_gb_s", "pinned_copy_gb_s"))


def test_a_failed_baseline_leaves_the_other_figures(shm_dir, monkeypatch):
    """The torch run fails (as out of GPU memory would): its lines say why, the ratios to it are
    missing, the rest is measured, and the command would exit non-zero."""
    from cxltrain.bench import gpu

    def fail(self):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gpu_runs.TorchRun, "step", fail)
    monkeypatch.setenv("CXLTRAIN_POOL_DIR", str(shm_dir))
    shapes = dataclasses.replace(gpu.QUICK, poolings=(20,))
    results = gpu.run(shapes, torch.device("cpu"), quick=True)
    failed, *ours = results["steps"]
    assert failed["error"] == "RuntimeError: CUDA out of memory" and failed["ms_per_step"] is None
    assert all(r["error"] is None and r["to_torch"] is None and r["ms_per_step"] > 0 for r in ours)
    assert all(math.isfinite(r["to_off"]["ratio"]) for r in ours if r["durable"])
    assert gpu.failures(results) == 1
    assert " failed: RuntimeError: CUDA out of memory" in gpu.format_text(results)
