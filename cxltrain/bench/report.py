"""What `cxltrain bench` prints: the machine, the targets (docs/benchmarks.md), and one table per section.

The results (results.BenchResults; its to_json() is the --json output) hold:
    machine    cpu, cores, memory_gb, torch, threads, python
    config     the TrainConfig every measurement used
    steps      one row per (method, pooling): mean_ms (checkpoint cost included), median_ms, ratio
               (to its baseline), batches_lost (None: all), bytes_per_batch; or reason. Where a
               method ran several times (runs_ms: each run's mean, in run order), the row is its
               median run
    recovery   nothing_process_seconds, and per size: ours_seconds / ours_process_seconds,
               torch_seconds / torch_process_seconds, dcp_seconds / dcp_process_seconds (or *_reason)
    paired     one row per method run side by side with ours-off in one process (paired.py):
               base_ms, method_ms, ratio, median_block_ratio, block_ratios, ratio_low and ratio_high
               (the ratio's 95% bootstrap interval over the blocks: interval.py); or reason
    embedding  one row per (contender, optimizer, pooling): ms, mlookups_per_s (of the median run;
               runs_ms: every run's ms, in order, when there were several); or reason
    bandwidth  numpy_1_thread_gbps, torch_<n>_threads_gbps, gather_gbps; or reason
    targets    name, value, limit, held
"""

from __future__ import annotations

import os
import platform

from ..jobs.config import TrainConfig
from .interval import LEVEL, interval_text
from .records import Unmeasured
from .results import BenchResults, Machine, RecoverySize, Target

STRICT_RATIO_LIMIT = 1.05          # strict per-batch checkpointing: at most 5% on the step time
RECOVERY_SECONDS_LIMIT = 1.0       # recovering 2 GB of tables
RECOVERY_GROWTH_LIMIT = 2.0        # largest / smallest table size: recovery must not grow with it
RECOVERY_TARGET_GB = 2.0


def machine_info(threads: int) -> Machine:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Machine(cpu=cpu, cores=os.cpu_count(), memory_gib=round(memory_gb, 1), torch=torch.__version__,
                   threads=threads, python=platform.python_version())


def targets(results: BenchResults) -> list[Target]:
    """The bench's targets (docs/benchmarks.md), each with the value measured and whether it held
    (held None: not measured)."""
    out = []
    # judged side by side in one process where measured (separate runs differ by more than 5%)
    paired = next((r for r in results.paired if r.method == "ours-strict" and r.timing is not None), None)
    if paired is not None:
        name, ratio = "strict per-batch step time / no checkpoint (side by side in one process)", paired.timing.ratio
    else:
        first = [r for r in results.steps if r.pooling == results.steps[0].pooling]
        name = "strict per-batch step time / no checkpoint"
        strict = next((r.timing for r in first if r.method == "ours-strict" and r.timing is not None), None)
        ratio = None if strict is None else strict.ratio
    out.append(Target(name=name, value=ratio, limit=f"<= {STRICT_RATIO_LIMIT}", held=_held(ratio, STRICT_RATIO_LIMIT)))
    sizes = [s for s in results.recovery.sizes if s.ours_seconds is not None]
    near = min(sizes, key=lambda s: abs(s.table_gb - RECOVERY_TARGET_GB), default=None)
    near_gb, near_seconds = (RECOVERY_TARGET_GB, None) if near is None else (near.table_gb, near.ours_seconds)
    out.append(Target(name=f"recovery of {near_gb:.2f} GB of tables, s", value=near_seconds,
                      limit=f"<= {RECOVERY_SECONDS_LIMIT}", held=_held(near_seconds, RECOVERY_SECONDS_LIMIT)))
    growth = sizes[-1].ours_seconds / sizes[0].ours_seconds if len(sizes) > 1 else None
    out.append(Target(name="recovery time, largest / smallest tables", value=growth,
                      limit=f"<= {RECOVERY_GROWTH_LIMIT}", held=_held(growth, RECOVERY_GROWTH_LIMIT)))
    measured = {(r.contender, r.optimizer, r.pooling): r.timing.ms for r in results.embedding if r.timing is not None}
    for (contender, optimizer, pooling), ms in sorted(measured.items()):
        if contender != "ours":
            continue
        torch_ms = measured.get(("torch", optimizer, pooling))
        ratio = ms / torch_ms if torch_ms else None
        out.append(Target(name=f"embedding {optimizer} pooling {pooling}: ours / nn.EmbeddingBag time",
                          value=ratio, limit="<= 1.0", held=_held(ratio, 1.0)))
    return out


def _held(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _lost(batches: int | None) -> str:
    return "all" if batches is None else f"{batches}"


def format_text(results: BenchResults) -> str:
    m = results.machine
    lines = [f"machine: {m.cpu}, {m.cores} cores, {m.memory_gib} GiB, torch {m.torch}, {m.threads} torch threads",
             _config_line(results.config) + (" (--quick: a tiny model, not for figures)" if results.quick else ""),
             "", "training step (mean ms over the timed steps, checkpoint cost included; ratio to its baseline)",
             f"  {'method':<44} {'pool':>4} {'step ms':>8} {'ratio':>6} {'lost':>5} {'MB/batch':>9}"]
    for r in results.steps:
        t = r.timing
        if t is None:
            lines.append(f"  {r.label:<44} {r.pooling:>4}  {r.reason}")
            continue
        lines.append(f"  {r.label:<44} {r.pooling:>4} {t.mean_ms:>8.1f} {_num(t.ratio, '.2f'):>6} "
                     f"{_lost(t.batches_lost):>5} {t.bytes_per_batch / 1e6:>9.2f}")
        if t.runs_ms is not None:
            lines.append(f"  {'  runs (ms, in order; the row is the median)':<44} {r.pooling:>4}  "
                         + ", ".join(f"{ms:.1f}" for ms in t.runs_ms))
        if t.plain_over_ours_off is not None:
            lines.append(f"  {'  (PyTorch plain / ours no checkpoint)':<44} {r.pooling:>4} {'':>8} "
                         f"{t.plain_over_ours_off:>6.2f}")
    full = next((r.timing.full_checkpoint_bytes for r in results.steps
                 if r.timing is not None and r.timing.full_checkpoint_bytes is not None), None)
    if full is not None:
        lines.append(f"  a full checkpoint (tables, MLPs, optimizer state) is {full / 1e6:,.1f} MB")
    if results.paired:
        lines += ["", "side by side in one process: each method against ours, no checkpoint, in alternating blocks"]
        for r in results.paired:
            p = r.timing
            if p is None:
                lines.append(f"  {r.label:<44} {r.reason}")
                continue
            lines.append(f"  {r.label:<44} {p.method_ms:>6.1f} vs {p.base_ms:.1f} ms: {p.ratio:.3f} "
                         f"({LEVEL:.0%} interval {interval_text(p.ratio_low, p.ratio_high)}; {p.blocks} blocks of "
                         f"{p.block_steps} steps each; block ratios {min(p.block_ratios):.2f}-"
                         f"{max(p.block_ratios):.2f}, median {p.median_block_ratio:.3f})")
    lines += ["", "recovery (s in the process / whole process wall time, fresh process each)"]
    rec = results.recovery
    lines.append(f"  a process that loads nothing: {_num(rec.nothing_process_seconds, '.2f')} s"
                 + (f" ({rec.nothing_reason})" if rec.nothing_reason else ""))
    lines.append(f"  {'tables GB':>9}  {'ours (recover)':>18}  {'torch.load':>15}  {'DCP load':>15}")
    for s in rec.sizes:
        cells = [_pair(s, name) for name in ("ours", "torch", "dcp")]
        lines.append(f"  {s.table_gb:>9.2f}  {cells[0]:>18}  {cells[1]:>15}  {cells[2]:>15}")
        for name in ("ours", "torch", "dcp"):
            reason = getattr(s, f"{name}_reason")
            if reason is not None:
                lines.append(f"    {name}: {reason}")
    lines += ["", "embedding lookup + update (all tables, median ms per batch; million lookups/s; the median run)"]
    for r in results.embedding:
        what = f"  {r.contender:<9} {r.optimizer:<8} pooling {r.pooling:<3}"
        runs = f"   (runs {', '.join(f'{ms:.2f}' for ms in r.runs_ms)})" if r.runs_ms is not None else ""
        lines.append(f"{what} {r.timing.ms:>8.2f} ms {r.timing.mlookups_per_s:>7.2f} M/s{runs}" if r.timing is not None
                     else f"{what} {r.reason}")
    bw = results.bandwidth
    lines += ["", "copy bandwidth (GB/s, bytes copied per second)"]
    if isinstance(bw, Unmeasured):
        lines.append(f"  {bw.reason}")
    else:
        lines.append(f"  numpy copy 1 thread {bw.numpy_1_thread_gbps:.1f}; torch copy {bw.threads} threads "
                     f"{bw.torch_gbps:.1f}; row gather ({bw.rows:,} rows of "
                     f"{bw.row_bytes} B, {bw.note}) {bw.gather_gbps:.1f}")
    lines += ["", "targets"]
    for t in results.targets:
        # a quick run's tiny model says nothing about the targets: no verdict, not a false MISSED
        verdict = "n/a (quick)" if results.quick else {True: "held", False: "MISSED", None: "not measured"}[t.held]
        lines.append(f"  {t.name}: {_num(t.value, '.3f')} ({t.limit}): {verdict}")
    lines.append(f"bench took {results.seconds:.0f} s; its jobs used {results.job_cpu_seconds:.0f} s of CPU "
                 f"(wall time well above CPU time / {m.threads} threads means other load shared the machine)")
    return "\n".join(lines)


def _pair(entry: RecoverySize, name: str) -> str:
    """"seconds in the process / process seconds" of ours, torch or dcp, or "-"."""
    seconds = getattr(entry, f"{name}_seconds")
    if seconds is None:
        return "-"
    return f"{seconds:.3f} / {getattr(entry, f'{name}_process_seconds'):.2f}"


def _config_line(c: TrainConfig) -> str:
    return (f"config: {c.num_tables} tables x {c.rows:,} rows x {c.dim} dims fp32, batch {c.batch_size}, "
            f"zipf {c.zipf_exponent}, MLP 13-{'-'.join(map(str, c.bottom_mlp))}-{c.dim} / "
            f"{c.dim + (c.num_tables + 1) * c.num_tables // 2}-{'-'.join(map(str, c.top_mlp))}-1, seed {c.seed}")
