"""The checkpointer's running totals (CheckpointStats) and the line `cxltrain train` prints of them."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CheckpointStats:
    """Running totals of the checkpointer's work. Work is counted on whichever thread does it;
    the training thread's share is the *_wait and training_* fields."""

    batches: int = 0                 # batches ended
    commits: int = 0                 # roots written
    snapshots: int = 0               # dense snapshots written (= commits in strict mode)
    capture_seconds: float = 0.0     # U1: gathering old rows into the ring and persisting them
    commit_seconds: float = 0.0      # U2 + commit: persisting rows and the snapshot, writing the root
    undo_bytes: int = 0              # ring bytes written
    undo_rows: int = 0               # rows recorded in the ring
    undo_rows_skipped: int = 0       # rows updated without a record: recorded earlier in their commit window
    dense_bytes: int = 0             # encoded snapshot bytes written
    row_bytes: int = 0               # table bytes (weights and optimizer state) flushed at commits
    rows_persisted: int = 0          # table rows flushed at commits
    redo_bytes: int = 0              # ring bytes of redo records (a pool set's cold rows, new values)
    write_backs: int = 0             # write-backs (the capacity pools synced) counted by commits
    write_back_seconds: float = 0.0  # write-back thread: the syncs run beside the commits
    # a pool set's bytes written to the capacity pools' disks by syncs (the disk's own count, and the
    # members' roots' pages; None where a capacity pool's file system has no block device): those
    # run in a commit (forced: every sync without steal; stealing, an early or the last write-back,
    # and the roots) and those on the write-back's own thread, even where a commit then joins it
    capacity_forced_bytes: int | None = None
    capacity_written_back_bytes: int | None = None
    ring_full_commits: int = 0       # commits taken early because the ring was nearly full
    ring_wait_seconds: float = 0.0   # training thread: what those early commits cost it
    ring_full_waits: int = 0         # worker: captures that found the ring full and first ran the
    ring_full_seconds: float = 0.0   # in-flight commit (back-pressure; a late capture's wait holds it)
    capture_wait_seconds: float = 0.0  # training thread, in backward: a capture was late (U1)
    lag_wait_seconds: float = 0.0    # training thread, at a batch end: the previous commit ran late
    commit_lag_max: int = 0          # batches the training thread was ahead of the durable root
    commit_lag_sum: int = 0          # (measured at each batch end, after handing its commit over)
    training_lookup_seconds: float = 0.0    # training thread, in forward: handing captures to the worker
    training_capture_seconds: float = 0.0   # training thread, in backward: undo captures (not background)
    training_flush_seconds: float = 0.0     # training thread, in backward: updated rows flushed (is_pmem)
    training_boundary_seconds: float = 0.0  # training thread at batch ends (the commit itself when inline)

    @property
    def wait_seconds(self) -> float:
        """The training thread's waits for the worker: late captures, ring full, commit lag."""
        return self.capture_wait_seconds + self.lag_wait_seconds + self.ring_wait_seconds

    @property
    def training_seconds(self) -> float:
        """All the time the checkpointer took from the training thread."""
        return (self.training_lookup_seconds + self.training_capture_seconds + self.training_flush_seconds
                + self.capture_wait_seconds + self.training_boundary_seconds)

    def to_json(self) -> dict:
        per_batch = max(self.batches, 1)
        return {**dataclasses.asdict(self),
                "wait_ms_per_batch": 1000.0 * self.wait_seconds / per_batch,
                "bytes_persisted_per_batch": (self.row_bytes + self.undo_bytes + self.redo_bytes + self.dense_bytes) / per_batch,
                "commit_lag_mean": self.commit_lag_sum / per_batch}


def summary_line(stats: dict) -> str:
    """One line for `train`, from CheckpointStats.to_json()."""
    return (f"checkpoint: training thread waited {stats['wait_ms_per_batch']:.2f} ms/batch, "
            f"{stats['bytes_persisted_per_batch'] / 2**20:.2f} MiB persisted/batch, commit lag "
            f"{stats['commit_lag_mean']:.2f} batches (max {stats['commit_lag_max']}), {stats['commits']} commits, "
            f"{stats['snapshots']} dense snapshots" + _write_backs(stats))


def _write_backs(stats: dict) -> str:
    """A stealing pool set's write-backs (commits that synced the capacity pools), when it deferred any."""
    every = stats.get("write_backs", 0)
    return f", {every} capacity write-backs" if every and every < stats["commits"] else ""
