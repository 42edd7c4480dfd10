"""How a TrainResult reads: the lines `cxltrain train` prints once a run is over."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..modes import STRICT, UNDO
from .config import TrainConfig

if TYPE_CHECKING:
    from .train import TrainResult


def result_lines(result: TrainResult, config: TrainConfig) -> list[str]:
    """The run's summary, a line per subject: what was trained, the step's split, the checkpoint,
    the model's quality (each only where the run has it)."""
    from ..checkpoint.stats import summary_line

    progress, timings, quality, checkpoint = result.progress, result.timings, result.quality, result.checkpoint
    lines = []
    if progress.steps == 0:
        limit = f"--epochs {config.epochs}" if config.epochs is not None else f"--steps {config.steps}"
        lines.append(f"nothing to train: the pool is at batch {progress.batch}, the end of {limit}")
    else:
        s = timings.split_ms
        lines.append(f"trained {progress.steps} batches in {timings.seconds:.1f} s ({timings.steps_per_s:.1f} "
                     f"steps/s) on {result.pool.device}; loss {quality.first_loss:.4f} -> {quality.final_loss:.4f}")
        if result.pool.compute_device != "cpu":
            lines.append(f"on {result.pool.compute_device}: MLPs, lookups and updates; "
                         f"{result.pool.device_cached_rows:,} rows cached in its memory, the pool written through")
        if result.pool.tiers is not None:
            lines.append(_tiers_line(result.pool.tiers))
        if result.pool.early_writebacks is not None:
            lines.append(f"early write-back: {result.pool.early_writebacks:,} unpersisted cache lines reached the "
                         "media before their flush")
        lines.append(f"step {s.total:.1f} ms = data {s.data:.1f} + embedding forward {s.embedding_forward:.1f} "
                     f"+ embedding backward/update {s.embedding_backward_update:.1f} + checkpoint "
                     f"{s.checkpoint:.1f} + MLP {s.mlp:.1f}; {result.pool.rows_updated_per_batch:,.0f} rows "
                     "updated per batch")
    if result.pool.cost_model is not None:
        modelled = ", ".join(f"{name} {ms:.2f}" for name, ms in result.pool.cost_model["ms_per_batch"].items())
        lines.append(f"pool traffic per batch modelled on real memory (ms; emulation/costmodel.py): {modelled}")
    if checkpoint.method == UNDO:
        dense_part = "" if config.mode == STRICT else f", relaxed: dense state every {config.dense_every}"
        where = ("pipelined, capture and row flushes on the worker" if config.background_capture
                 else "pipelined" if config.pipeline else "synchronous")
        lines.append(f"checkpoint: every batch durable ({where}{dense_part}); "
                     f"the pool is committed at batch {progress.batch}")
        if checkpoint.stats is not None:
            lines.append(summary_line(checkpoint.stats))
    if quality.train_auc is None:
        pass
    elif quality.eval_auc is None:
        lines.append(f"final AUC {quality.train_auc:.4f} (last batches; the data file has no batches left to hold out)")
    else:
        lines.append(f"final AUC {quality.eval_auc:.4f} (held-out), {quality.train_auc:.4f} (last batches); "
                     f"eval logloss {quality.eval_logloss:.4f}")
    return lines


def _tiers_line(tiers) -> str:
    """The capacity tier in one line: where, which tables, the caches, the storage traffic."""
    cached = ""
    if tiers.cache_rows:
        sizes = sorted(set(tiers.cache_rows.values()))
        rows = f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,}-{sizes[-1]:,}"
        cached = (f"; a hot-row cache of {rows} rows for each of {len(tiers.cache_rows)} in the fast tier, "
                  f"{tiers.cache_hit_rate:.1%} of their lookups hit")
    return (f"capacity tier: {tiers.capacity_pool} holds {len(tiers.capacity_tables)} table(s){cached}; "
            f"{tiers.disk_bytes_written_per_batch / 1e6:,.2f} MB written to and "
            f"{tiers.disk_bytes_read_per_batch / 1e6:,.2f} MB read from storage per batch" + _forced(tiers))


def _forced(tiers) -> str:
    """Of the bytes written, those the commits waited for (where the disk's count is known)."""
    if tiers.disk_bytes_forced_per_batch is None:
        return ""
    return f", {tiers.disk_bytes_forced_per_batch / 1e6:,.3f} MB a batch synced by the commits themselves"
