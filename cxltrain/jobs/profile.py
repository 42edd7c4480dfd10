"""`cxltrain train --profile`: where a batch's time goes, from the counters every run keeps.

Two sources, no timers of its own: the trainer's step split (StepSplit, mean ms per step after
warm-up) and the checkpointer's running totals (CheckpointStats.to_json(), over every batch the
run ended). The training thread's checkpoint phases are what slows the step; the capture and
commit work is counted on whichever thread ran it, so it overlaps them where that was the
training thread (no --pipeline, no --background-capture).
"""

from __future__ import annotations

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
