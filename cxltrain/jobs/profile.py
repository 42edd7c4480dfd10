"""`cxltrain train --profile`: where a batch's time goes, from the counters every run keeps.

Two sources, no timers of its own: the trainer's step split (StepSplit, mean ms per step after
warm-up) and the checkpointer's running totals (CheckpointStats.to_json(), over every batch the
run ended). The training thread's checkpoint phases are what slows the step; the capture and
commit work is counted on whichever thread ran it, so it overlaps them where that was the
training thread (no --pipeline, no --background-capture).
"""

from __future__ import annotations

from ..placement.step_model import COMPARABLE
from .train import TrainResult

# (CheckpointStats field, what it is), in the order a batch meets them
TRAINING_THREAD = (
    ("training_lookup_seconds", "forward: captures handed to the worker"),
    ("training_capture_seconds", "backward: undo capture"),
    ("training_flush_seconds", "backward: updated rows flushed"),
    ("capture_wait_seconds", "backward: waiting for a late capture"),
    ("training_boundary_seconds", "batch end: boundary (the commit itself when inline)"),
    ("lag_wait_seconds", "batch end: waiting for the previous commit"),
    ("ring_wait_seconds", "early commits: the undo ring was nearly full"),
)
ANY_THREAD = (
    ("capture_seconds", "capture: old rows into the ring, persisted"),
    ("commit_seconds", "commit: rows and snapshot persisted, root written"),
    ("write_back_seconds", "capacity write-back beside the commits (a stealing set)"),
)
BYTES = (("undo_bytes", "undo records"), ("dense_bytes", "dense snapshots"), ("row_bytes", "table rows"))


def profile_text(result: TrainResult) -> str:
    """The profile of one finished run, one phase a line (ms per batch; MB per batch for bytes)."""
    s = result.timings.split_ms
    lines = ["profile: step split, mean ms per step after warm-up",
             *(f"  {ms:>9.2f}  {what}" for ms, what in (
                 (s.data, "data"), (s.embedding_forward, "embedding forward"),
                 (s.embedding_backward_update, "embedding backward and update"),
                 (s.checkpoint, "checkpoint (the training thread's share)"),
                 (s.mlp, "MLP forward, backward, dense optimizer and the rest"), (s.total, "step")))]
    stats = result.checkpoint.stats
    if stats is None:
        return "\n".join([*lines, "profile: checkpoint off: no checkpoint phases"])
    batches = max(stats["batches"], 1)
    lines.append(f"profile: checkpoint, ms per batch over its {stats['batches']} batches (warm-up included)")
    lines += [f"  {1000 * stats[name] / batches:>9.2f}  training thread, {what}" for name, what in TRAINING_THREAD]
    lines += [f"  {1000 * stats[name] / batches:>9.2f}  any thread, {what}" for name, what in ANY_THREAD]
    lines += [f"  {stats[name] / batches / 1e6:>9.2f}  MB per batch made durable: {what}" for name, what in BYTES]
    return "\n".join(lines)


def measured(result: TrainResult) -> dict | None:
    """The run's figures under the names `cxltrain plan --json` predicts them (step_model.COMPARABLE),
    for a run on a pool set; None for one pool."""
    tiers, stats = result.pool.tiers, result.checkpoint.stats
    if tiers is None:
        return None
    batches = max(stats["batches"], 1) if stats else 1
    figures = {"step_ms": result.timings.split_ms.total, "cache_rows": tiers.cache_rows,
               "cache_hit_rate": tiers.cache_hit_rate, "miss_lookups_per_batch": tiers.miss_lookups_per_batch,
               "disk_bytes_written_per_batch": tiers.disk_bytes_written_per_batch,
               "redo_bytes_per_batch": stats["redo_bytes"] / batches if stats else 0.0,
               "write_back_every": tiers.write_back_every,
               "batches_per_write_back": batches / stats["write_backs"] if stats and stats["write_backs"] else None}
    return {name: figures[name] for name in COMPARABLE}


def measured_text(figures: dict) -> str:
    """measured()'s figures, one a line, as `cxltrain plan` prints its prediction's."""
    rate = "-" if figures["cache_hit_rate"] is None else f"{figures['cache_hit_rate']:.1%}"
    per_write_back = figures["batches_per_write_back"]
    return "\n".join([
        "profile: the capacity tier, as `cxltrain plan` predicts it (--json: \"measured\", its \"predicted\")",
        f"  {figures['step_ms']:>9.2f}  step ms", f"  {rate:>9}  cache hit rate",
        f"  {figures['miss_lookups_per_batch']:>9,.0f}  miss lookups per batch",
        f"  {figures['disk_bytes_written_per_batch'] / 1e6:>9.2f}  MB written to storage per batch",
        f"  {figures['redo_bytes_per_batch'] / 1e6:>9.2f}  MB of redo records per batch",
        f"  {figures['write_back_every']:>9}  write-back every (batches)",
        f"  {'-' if per_write_back is None else f'{per_write_back:.1f}':>9}  batches per write-back"])
