"""`cxltrain bench --gpu`: cxltrain's GPU placements against plain PyTorch with its tables in GPU memory,
side by side in one process, and the GPU's gather bandwidth over the link (DESIGN §9).

For each pooling L (1 and 20), seven runs of the same DLRM shapes on the same batches (gpu_runs.py
says each): torch with nn.EmbeddingBag tables on the GPU; cxltrain with every row in GPU memory, with
the rows in the mapped pool and no cache, and with the pool plus a hot-row cache of two batches'
lookups, each with durability on (checkpoint "undo") and off. All seven are open at once and take
turns in blocks of K steps (gpu_runs.interleave); a run's ms/step is the median of its blocks, its
ratio to torch (and an "on" run's ratio to its "off" twin) is the ratio of the summed block times, with
the 95% bootstrap interval of interval.py. Then the gather bandwidth (gpu_gather.py).

Shapes (GpuShapes): F tables of R rows x D, batch B, Zipf-distributed synthetic ids. The hot-row cache
holds each table's 2 B L most looked-up rows of the first batches (jobs/planning.device_cache_ids, as
`cxltrain train --device cuda` picks them: planning.hot_list_batches, 2^20 lookups a table), which
include the first timed batches (at pooling 1, all of them), as they would in training.

    results = run(GpuShapes(), torch.device("cuda"), log=print)
    print(format_text(results))

On the CPU (`--device cpu`, for tests) the same runs go through torch's row kernels; the figures then
say nothing about a GPU, and the gather bandwidth is skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import statistics
import tempfile
from typing import Callable

import torch

from ..jobs.config import TrainConfig
from ..jobs.planning import device_cache_ids
from ..jobs.train import build_source
from . import gpu_runs
from .gpu_gather import gather_bandwidth
from .interval import interval_text, ratio_interval


@dataclasses.dataclass(frozen=True)
class GpuShapes:
    rows: int = 1_000_000
    num_tables: int = 8
    dim: int = 64
    batch_size: int = 2048
    zipf: float = 1.05
    bottom_mlp: tuple[int, ...] = (512, 256)
    top_mlp: tuple[int, ...] = (512, 256)
    poolings: tuple[int, ...] = (1, 20)
    blocks: int = 12                 # timed blocks of each run
    block_steps: int = 5             # K steps a block
    warmup_blocks: int = 2           # blocks dropped first (allocator, cuBLAS, kernel compiles, page faults)
    gather_rows: int = 327_680       # N: batch 2048 x pooling 20 x 8 tables
    gather_repeats: int = 10

    def config(self, pooling: int, device: torch.device) -> TrainConfig:
        return TrainConfig(rows=self.rows, num_tables=self.num_tables, dim=self.dim, batch_size=self.batch_size,
                           zipf_exponent=self.zipf, bottom_mlp=self.bottom_mlp, top_mlp=self.top_mlp,
                           pooling=pooling, device=device.type, steps=self.steps)

    @property
    def steps(self) -> int:
        """Batches each run trains."""
        return (self.warmup_blocks + self.blocks) * self.block_steps


# A tiny model, in seconds: checks the path, its figures mean nothing. 10 blocks: ratio_interval's minimum.
QUICK = GpuShapes(rows=2000, num_tables=2, dim=16, batch_size=16, bottom_mlp=(16,), top_mlp=(16,), blocks=10,
                  block_steps=1, warmup_blocks=1, gather_rows=8192, gather_repeats=3)


def _ratio(base: list[float], method: list[float]) -> dict:
    low, high = ratio_interval(base, method) or (None, None)
    return {"ratio": sum(method) / sum(base), "low": low, "high": high}


def _open_runs(shapes: GpuShapes, config: TrainConfig, device: torch.device, batches: list, cached: dict,
               folder: str, stack, log) -> tuple[list, list[str | None]]:
    """Every variant's run at config.pooling, opened on `stack` (None and its error where it failed)."""
    runs, errors = [], []
    for variant in gpu_runs.VARIANTS:
        log(f"pooling {config.pooling}: {variant.name} ({variant.label(device)})")
        try:
            if variant.durable is None:
                runs.append(gpu_runs.TorchRun(config, device, batches))
            else:
                pool = os.path.join(folder, f"l{config.pooling}-{variant.name}.pool")
                runs.append(gpu_runs.OursRun(config, device, batches, pool, variant.durable,
                                             cached[variant.tables], stack))
            errors.append(None)
        except Exception as e:  # out of GPU memory, say: the other runs are still worth measuring
            runs.append(None)
            errors.append(gpu_runs.failure(e))
            log(f"pooling {config.pooling}: {variant.name} failed: {errors[-1]}")
    return runs, errors


def _measure_pooling(shapes: GpuShapes, pooling: int, device: torch.device, folder: str, log) -> list[dict]:
    """The seven runs at pooling `pooling`, timed side by side: one record each, in VARIANTS order."""
    config = shapes.config(pooling, device)
    source = build_source(config)
    log(f"pooling {pooling}: {shapes.steps} batches, the hot rows of each table")
    batches = [source.batch(b) for b in range(shapes.steps)]  # made once: data costs no run anything
    model = gpu_runs.ours_model(config)  # the tables' names and sizes
    cached = {"all": {table.name: torch.arange(table.num_embeddings) for table in model.tables}, "pool": {},
              "cache": device_cache_ids(dataclasses.replace(config, device_cache_rows=2 * config.batch_size * pooling),
                                        model, source, device)}
    with contextlib.ExitStack() as stack:
        runs, errors = _open_runs(shapes, config, device, batches, cached, folder, stack, log)
        timed = gpu_runs.interleave(runs, blocks=shapes.blocks, warmup_blocks=shapes.warmup_blocks,
                                    block_steps=shapes.block_steps, sync=gpu_runs.sync(device),
                                    log=lambda line: log(f"pooling {pooling}: {line}"), errors=errors)
        for run, error in zip(runs, timed.errors):
            if error is None:
                run.finish()
    by_name = {v.name: (s if e is None else None) for v, s, e in zip(gpu_runs.VARIANTS, timed.seconds, timed.errors)}
    return [_record(shapes, pooling, device, variant, run, by_name, delta, error)
            for variant, run, delta, error in zip(gpu_runs.VARIANTS, runs, timed.deltas, timed.errors)]


def _record(shapes: GpuShapes, pooling: int, device: torch.device, variant: gpu_runs.Variant, run, by_name: dict,
            delta: list[float] | None, error: str | None) -> dict:
    """One run's figures (the JSON's "steps" entry); None where it or its comparison failed."""
    record = {"pooling": pooling, "variant": variant.name, "label": variant.label(device), "tables": variant.tables,
              "durable": variant.durable, "error": error, "cached_rows": None, "last_loss": None,
              "ms_per_step": None, "block_ms": None, "to_torch": None, "to_off": None, "split_ms": None}
    if error is not None:
        return record
    blocks = by_name[variant.name]
    record.update(cached_rows=run.cached_rows, last_loss=None if run.loss is None else float(run.loss),
                  ms_per_step=statistics.median(blocks) * 1000.0 / shapes.block_steps,
                  block_ms=[s * 1000.0 for s in blocks])
    if by_name["torch"] is not None:
        record["to_torch"] = _ratio(by_name["torch"], blocks)
    if variant.durable and by_name[f"{variant.tables}-off"] is not None:
        record["to_off"] = _ratio(by_name[f"{variant.tables}-off"], blocks)
    if delta is not None:
        record["split_ms"] = gpu_runs.split_ms(delta, sum(blocks), shapes.blocks * shapes.block_steps)
    return record


def run(shapes: GpuShapes, device: torch.device, *, quick: bool = False,
        log: Callable[[str], None] = lambda line: None) -> dict:
    """Every figure of `cxltrain bench --gpu` (the JSON it prints). Pools go to a fresh folder in
    $CXLTRAIN_POOL_DIR, else /dev/shm (memory the GPU can map), removed afterwards."""
    torch.manual_seed(0)
    base = os.environ.get("CXLTRAIN_POOL_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    scratch = tempfile.mkdtemp(prefix="cxltrain-gpu-bench-", dir=base)
    try:
        steps = []
        for pooling in shapes.poolings:
            steps += _measure_pooling(shapes, pooling, device, scratch, log)
            shutil.rmtree(scratch, ignore_errors=True)  # memory-backed: hold one pooling's pools at most
            os.makedirs(scratch, exist_ok=True)
            gc.collect()  # the runs' models hold GPU caches (every row, for "all") inside reference cycles
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if device.type == "cuda":
            log(f"gather bandwidth: {shapes.gather_rows:,} rows")
            try:
                gather = gather_bandwidth(rows=shapes.rows, dim=shapes.dim, count=shapes.gather_rows,
                                          repeats=shapes.gather_repeats, folder=scratch, device=device, log=log)
            except Exception as e:  # the step figures above still stand
                gather = {"error": gpu_runs.failure(e)}
        else:
            gather = {"skipped": f"it needs CUDA, and the runs above ran on the {device.type.upper()}"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "quick": quick, "shapes": dataclasses.asdict(shapes),
            "sparse_optimizer": f"SGD lr {TrainConfig.sparse_lr} (torch and cxltrain alike); Adam on the MLPs",
            "steps": steps, "gather": gather}


def failures(results: dict) -> int:
    """Runs (and the gather) that failed: the command exits non-zero after printing the rest."""
    return sum(r["error"] is not None for r in results["steps"]) + ("error" in results["gather"])


def _ratio_text(ratio: dict | None) -> str:
    if ratio is None:
        return "-"
    if ratio["low"] is None:  # fewer blocks than an interval needs
        return f"{ratio['ratio']:.3f}"
    return f"{ratio['ratio']:.3f} [{interval_text(ratio['low'], ratio['high'])}]"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_text(results: dict) -> str:
    """The table: one line per run per pooling, then where cxltrain's steps went, then the gather."""
    s = results["shapes"]
    lines = [f"GPU bench on {results['device']}{' (quick: the figures mean nothing)' if results['quick'] else ''}: "
             f"{s['num_tables']} tables x {s['rows']:,} rows x dim {s['dim']}, batch {s['batch_size']}, "
             f"Zipf {s['zipf']}, pooling L; sparse optimizer {results['sparse_optimizer']}",
             f"each run: {_count(s['blocks'], 'block')} of {_count(s['block_steps'], 'step')}, the runs taking "
             f"turns ({_count(s['warmup_blocks'], 'warm-up block')} dropped); ms/step: the median block's; "
             "ratios: summed block times, 95% bootstrap interval",
             f"{'L':>3}  {'run':<32} {'durable':>7} {'ms/step':>8}  {'x torch [95%]':<22} {'x off [95%]':<22} "
             f"{'last loss':>10}"]
    for r in results["steps"]:
        durable = "-" if r["durable"] is None else ("on" if r["durable"] else "off")
        head = f"{r['pooling']:>3}  {r['label']:<32} {durable:>7}"
        if r["error"] is not None:
            lines.append(f"{head} failed: {r['error']}")
            continue
        loss = "-" if r["last_loss"] is None else f"{r['last_loss']:.6f}"
        to_torch = "1" if r["variant"] == "torch" else _ratio_text(r["to_torch"])
        lines.append(f"{head} {r['ms_per_step']:>8.2f}  {to_torch:<22} {_ratio_text(r['to_off']):<22} {loss:>10}")
    lines.append("where a cxltrain step went (ms, host clock: lookup, update, checkpointing on the training "
                 "thread, the rest: MLPs, Adam, copies, waits)")
    for r in results["steps"]:
        if r["split_ms"] is not None:
            split = "  ".join(f"{k} {v:.2f}" for k, v in r["split_ms"].items())
            lines.append(f"{r['pooling']:>3}  {r['variant']:<10} {split}")
    g = results["gather"]
    if "skipped" in g:
        lines.append(f"gather bandwidth: skipped: {g['skipped']}")
    elif "error" in g:
        lines.append(f"gather bandwidth: failed: {g['error']}")
    else:
        lines.append(f"gather bandwidth, {g['rows']:,} uniform random {g['row_bytes']}-byte rows "
                     f"({g['bytes'] / 1e6:.1f} MB) from a registered mapping in {g['folder']} ({g['kernel']}), "
                     f"median of {g['repeats']}: sorted by id {g['sorted_gb_s']:.1f} GB/s, batch order "
                     f"{g['batch_order_gb_s']:.1f} GB/s; pinned host-to-device copy {g['pinned_copy_gb_s']:.1f} GB/s")
    return "\n".join(lines)
