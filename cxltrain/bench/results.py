"""The results of one `cxltrain bench` run, as suite.py collects them and report.py and plot.py
read them. `BenchResults.to_json()` is what `--json` prints (its layout: report.py's docstring);
field order here is key order there.
"""

from __future__ import annotations

import dataclasses

from ..jobs.config import TrainConfig
from .records import Bandwidth, EmbeddingTiming, PairedTiming, Record, Unmeasured, flattened, optional


@dataclasses.dataclass
class Machine(Record):
    cpu: str
    cores: int | None
    memory_gib: float
    torch: str
    threads: int                       # torch threads every job ran with
    python: str


@dataclasses.dataclass(kw_only=True)
class StepTiming(Record):
    """A measured method's step time (its median run), what a crash loses, what it writes."""

    mean_ms: float                     # checkpoint cost included
    median_ms: float | None            # of the steps (None: ours, which times means only)
    batches_lost: int | None           # the most batches a crash undoes (None: all)
    full_checkpoint_bytes: int | None = optional()   # plain methods
    bytes_per_batch: float
    overlap_steps: int | None = optional()           # DCP: the most steps one save ran behind
    runs_ms: list[float] | None = optional()         # every run's mean, in run order, when several
    ratio: float | None = optional()                 # to its baseline, when the baseline was measured
    plain_over_ours_off: float | None = optional()   # on ours-off's row: plain PyTorch / ours


@dataclasses.dataclass
class MethodRow(Record):
    """A checkpointing method (methods.py) as a table names it."""

    method: str
    label: str


@dataclasses.dataclass
class StepRow(MethodRow):
    """One (method, pooling) of the step-time table: its timing, or why there is none."""

    pooling: int
    baseline: str
    reason: str | None = optional()
    timing: StepTiming | None = flattened()


@dataclasses.dataclass
class PairedRow(MethodRow):
    """One method run side by side with ours-off in one process: its timing, or why there is none."""

    reason: str | None = optional()
    timing: PairedTiming | None = flattened()


@dataclasses.dataclass
class RecoverySize(Record):
    """Recovery at one table size: ours (`cxltrain recover` on a killed pool), torch.load, DCP
    load; each as seconds inside the process and the whole process's wall time, or a reason."""

    rows: int
    table_gb: float
    ours_reason: str | None = optional()
    ours_seconds: float | None = optional()
    ours_process_seconds: float | None = optional()
    ours_rows_restored: int | None = optional()
    ours_batches_rolled_back: int | None = optional()
    full_checkpoint_bytes: int | None = optional()
    torch_reason: str | None = optional()
    torch_seconds: float | None = optional()
    torch_process_seconds: float | None = optional()
    dcp_reason: str | None = optional()
    dcp_seconds: float | None = optional()
    dcp_process_seconds: float | None = optional()


@dataclasses.dataclass
class Recovery(Record):
    nothing_process_seconds: float | None   # a process that imports what a load imports, loads nothing
    nothing_reason: str | None
    sizes: list[RecoverySize]


@dataclasses.dataclass
class EmbeddingRow(Record):
    """One (contender, optimizer, pooling): the median run's timing, or why there is none."""

    contender: str
    optimizer: str
    pooling: int
    reason: str | None = optional()
    timing: EmbeddingTiming | None = flattened()
    runs_ms: list[float] | None = optional()    # every run's ms, in order, when there were several


@dataclasses.dataclass
class Target(Record):
    """A target of the bench (docs/benchmarks.md): the value measured and whether it held (None: not measured)."""

    name: str
    value: float | None
    limit: str
    held: bool | None


@dataclasses.dataclass
class BenchResults(Record):
    machine: Machine
    config: TrainConfig                # every measurement's model, data and batch
    quick: bool
    scratch_dir: str
    steps: list[StepRow]
    paired: list[PairedRow]
    recovery: Recovery
    embedding: list[EmbeddingRow]
    bandwidth: Bandwidth | Unmeasured
    seconds: float = 0.0               # the whole bench, wall time
    job_cpu_seconds: float = 0.0       # all its jobs' CPU time
    targets: list[Target] = dataclasses.field(default_factory=list)
