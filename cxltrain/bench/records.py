"""Typed records of `cxltrain bench`: what one job measured, and the rows of the results.

Code that reads a figure reads an attribute, so a misspelt name fails loudly instead of reading a
missing key. Each record still prints the JSON layout `cxltrain bench --json` has always printed:
`to_json()` leaves out the fields marked `optional()` while they are None (keys that a row has
only sometimes), and spreads a `flattened()` record's keys into its parent's. Torch-free, like
the rest of what the command line imports before measuring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_OMIT_NONE = "omit_none"
_FLATTEN = "flatten"


def optional() -> Any:
    """A field whose key is absent from the JSON while it is None."""
    return dataclasses.field(default=None, metadata={_OMIT_NONE: True})


def flattened() -> Any:
    """A nested record (or None) whose keys sit in its parent's JSON object."""
    return dataclasses.field(default=None, metadata={_OMIT_NONE: True, _FLATTEN: True})


def _json_value(value):
    if isinstance(value, Record):
        return value.to_json()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


class Record:
    """Base of the bench's dataclasses: their JSON form, and back (for what crosses processes)."""

    def to_json(self) -> dict:
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.metadata.get(_OMIT_NONE):
                continue
            if field.metadata.get(_FLATTEN):
                out.update(value.to_json())
            else:
                out[field.name] = _json_value(value)
        return out

    @classmethod
    def from_json(cls, fields: dict):
        """From a flat JSON object; keys the record has no field for are left out, and a field
        with no default must be there."""
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields
                      or f.default is dataclasses.MISSING})


@dataclasses.dataclass
class Unmeasured(Record):
    """A measurement that has no figures, and why."""

    reason: str


# ---------------------------------------------------------------------------------------------
# What one job measured (worker.py); they cross the process boundary as JSON
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class OursSteps(Record):
    """One `cxltrain.jobs.train.train` run's timed steps."""

    mean_ms: float
    split_ms: dict                     # trainer.StepSplit as JSON
    checkpoint_stats: dict | None      # CheckpointStats.to_json() (None: checkpoints off)
    row_bytes: int                     # bytes a commit flushes per updated row (padded weights + state)
    timed_steps: int

    def bytes_written_per_batch(self) -> float:
        """Undo records, dense snapshots and flushed rows, per committed batch."""
        stats = self.checkpoint_stats
        if not stats or not stats["batches"]:
            return 0.0
        written = stats["undo_bytes"] + stats["dense_bytes"] + stats["rows_persisted"] * self.row_bytes
        return written / stats["batches"]


@dataclasses.dataclass
class PlainSteps(Record):
    """plain.train_steps: a plain-PyTorch run, checkpoint cost included."""

    mean_ms: float
    median_ms: float
    state_bytes: int                   # a full checkpoint
    overlap_steps: int                 # the most steps one asynchronous save ran behind training


@dataclasses.dataclass
class PairedTiming(Record):
    """paired.paired_steps: ours without checkpoints and with a method, in alternating blocks."""

    base_ms: float
    method_ms: float
    ratio: float
    median_block_ratio: float
    block_ratios: list[float]
    blocks: int
    block_steps: int
    ratio_low: float | None = optional()   # interval.ratio_interval of the blocks: how sure the ratio is
    ratio_high: float | None = optional()  # (None: too few blocks for one)


@dataclasses.dataclass
class EmbeddingTiming(Record):
    """embedding.measure: median ms of one lookup + update over all tables."""

    ms: float
    mlookups_per_s: float


@dataclasses.dataclass
class SavedCheckpoint(Record):
    """A full plain checkpoint written with torch.save and with dcp.save."""

    state_bytes: int
    torch_save_seconds: float
    dcp_save_seconds: float


@dataclasses.dataclass
class LoadTime(Record):
    """Seconds to read a full checkpoint back into a fresh model, inside its process."""

    seconds: float


@dataclasses.dataclass
class RecoveredPool(Record):
    """What the bench reads of `cxltrain recover --json`."""

    seconds: float
    rows_restored: int
    batches_rolled_back: int


@dataclasses.dataclass
class Bandwidth(Record):
    """Copy and row-gather bandwidth, GB/s (bandwidth.py)."""

    bytes: int
    numpy_1_thread_gbps: float
    torch_gbps: float                  # a torch copy with `threads` threads
    threads: int
    rows: int
    row_bytes: int
    gather_gbps: float
    note: str

    def to_json(self) -> dict:
        # the torch figure's key names its thread count, as it always has
        return {"bytes": self.bytes, "numpy_1_thread_gbps": self.numpy_1_thread_gbps,
                f"torch_{self.threads}_threads_gbps": self.torch_gbps, "threads": self.threads,
                "rows": self.rows, "row_bytes": self.row_bytes, "gather_gbps": self.gather_gbps, "note": self.note}

    @classmethod
    def from_json(cls, fields: dict) -> Bandwidth:
        threads = fields["threads"]
        rest = {k: v for k, v in fields.items() if k != f"torch_{threads}_threads_gbps"}
        return cls(**rest, torch_gbps=fields[f"torch_{threads}_threads_gbps"])


# ---------------------------------------------------------------------------------------------
# `cxltrain bench --dist` (dist.py): rank 0's view of distributed `cxltrain train` runs
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DistSteps(Record):
    """One distributed run's timed steps."""

    ms_per_step: float                          # mean, after the warm-up
    bytes_exchanged_per_batch: float | None     # every rank's sends to the others (None: no timed batch)


@dataclasses.dataclass
class DistRow(Record):
    """One world size, every batch durable (undo) and checkpointing off, side by side."""

    ranks: int
    undo: DistSteps
    off: DistSteps
    strict_overhead: float                      # undo / off - 1
    overhead_low: float | None = optional()     # its 95% interval (interval.py), over the paired blocks
    overhead_high: float | None = optional()
    blocks: int | None = optional()             # blocks of each run, taking turns (dist_paired.py)
    block_steps: int | None = optional()
    durable_mb: list[list[float]] | None = optional()  # per rank: [dense snapshot, table rows + undo] MB a batch
    phase_ms: list[list[float]] | None = optional()    # per rank: [undo capture, batch end, commit] ms a batch


@dataclasses.dataclass
class DistPaired(Record):
    """dist_paired.run: one world size, checkpointing off and every batch durable side by side in
    each rank's process; rank 0's block times, and what the ranks sent each other per batch."""

    ranks: int
    timing: PairedTiming                        # off the baseline, durable the method
    off_bytes_per_batch: float
    durable_bytes_per_batch: float
    stats: dict | None                          # the durable run's CheckpointStats.to_json(), rank 0's
    durable_mb: list[list[float]] | None = optional()  # per rank: [dense snapshot, table rows + undo] MB a batch
    phase_ms: list[list[float]] | None = optional()    # per rank: [undo capture, batch end, commit] ms a batch

    @classmethod
    def from_json(cls, fields: dict) -> DistPaired:
        return cls(**{**fields, "timing": PairedTiming.from_json(fields["timing"])})


@dataclasses.dataclass
class DistRecovery(Record):
    """The group's recovery after a kill, as rank 0 timed it."""

    recovered_batch: int | None
    seconds: float


@dataclasses.dataclass
class DistResults(Record):
    """What `cxltrain bench --dist` measured."""

    options: list[str]                          # the `train` options of every run
    cores: int | None
    runs: list[DistRow]
    recovery: DistRecovery
    single: PairedTiming | None = optional()    # one process, the same model, side by side, in the same bench
