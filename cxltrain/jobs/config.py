"""The main job's configuration: torch-free, so the command line starts fast."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..modes import CHECKPOINTS, MODES, STRICT, UNDO

# Held-out evaluation batches are drawn from batch 2**40 on (training_data.EVAL_FIRST_BATCH): training stays below.
MAX_STEPS = (1 << 40) - 1
MAX_ROWS = 1 << 32   # the synthetic ids' hash keeps rows x multiplier below 2**64 (data/common.py)
MAX_SEED = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    pool: str | None = None            # pool path; None = the emulated CXL default (/dev/shm)
    data: str | None = None            # raw Criteo file; None = synthetic Criteo-like batches
    steps: int = 400                   # total batches of the run
    batch_size: int = 2048
    num_tables: int = 8
    rows: int = 1_000_000              # rows per table
    dim: int = 64
    seed: int = 0
    pooling: int = 1                   # ids per table per sample
    zipf_exponent: float = 1.05
    sparse_lr: float = 0.05            # row-wise Adagrad on the tables
    dense_lr: float = 1e-3             # Adam on the MLPs
    bottom_mlp: tuple[int, ...] = (512, 256)
    top_mlp: tuple[int, ...] = (512, 256)
    checkpoint: str = UNDO             # "undo": every batch durable; "off": consistent only at the end
    dense_every: int = 1               # dense snapshot every k batches (strict: and commit)
    mode: str = STRICT                 # "strict": exact recovery; "relaxed": embeddings every batch,
                                       # dense state every dense_every batches (docs/architecture.md §4)
    pipeline: bool = True              # commits on a background worker; False: on the training thread
    background_capture: bool = False   # undo captures and row flushes on the worker too (a spare core)
    fused_capture: bool = True         # undo capture inside each table's update where it can (False: two passes)
    discard_checkpoint: bool = False   # checkpoint "off" may put a pool's committed batches at risk
    # file data, evaluation, metrics (docs/criteo.md)
    table_rows: tuple[int, ...] | None = None  # rows of each table; None: `rows` for every table
    epochs: int | None = None          # file data: passes over its training batches (sets steps)
    eval_every: int = 0                # evaluate on the held-out batches every N steps (0: at the end only)
    eval_batches: int = 4              # held-out batches (file data: its last ones, with epochs or eval_every)
    metrics: str | None = None         # JSONL file: a line of metrics every eval_every (else 10) steps
    prefetch: int = 2                  # batches made ahead on a background thread (0: on the training thread)
    capacity_pool: str | None = None   # a pool set's capacity pool on block storage: the tables live there
    fast_bytes: int | None = None      # with a capacity pool: the fast tier's budget for whole tables and
                                       # cached rows (planner.py); None: 0 for a new set, the stored plan's on a restart
    profile_batches: int | None = None # batches profiled to plan a new set (None: planning.PROFILE_BATCHES)
    cache_rows: int | None = None      # with a capacity pool: hot rows each capacity table caches in the fast
                                       # tier (cache.py); None: as the planner decides (the stored plan's on a restart)
    cache_replace_every: int = 0       # re-place the hot-row caches every N batches from running counts (0: never)

    # what a resumed run must share with the run that wrote the pool
    TRAJECTORY = ("data", "batch_size", "num_tables", "rows", "dim", "seed", "pooling", "zipf_exponent",
                  "sparse_lr", "dense_lr", "bottom_mlp", "top_mlp")

    def run_metadata(self, data_fingerprint: str | None = None) -> dict:
        """The settings that decide the training trajectory, stored with every dense snapshot. The
        data file counts by its content (`data_fingerprint`: CriteoFile.fingerprint), not its path."""
        metadata = {name: getattr(self, name) for name in self.TRAJECTORY}
        if self.data is not None:
            metadata["data"] = data_fingerprint
        # only where set, so pools written before these settings existed still resume
        if self.table_rows is not None:
            metadata["table_rows"] = list(self.table_rows)
        if self.data is not None and (self.epochs is not None or self.eval_every):
            metadata["eval_batches"] = self.eval_batches   # which file batches training reads
        return metadata

    def memory_bytes(self) -> int:
        """A generous estimate of the memory a step takes outside the pool: the dense parameters with
        their gradients and Adam's two moments, and one batch's inputs, activations and gradients.
        Arithmetic only, so an absurd model is refused before it is built."""
        vectors = self.num_tables + 1  # the embeddings and the bottom MLP's output
        interactions = vectors * (vectors - 1) // 2
        bottom = [13, *self.bottom_mlp, self.dim]
        top = [self.dim + interactions, *self.top_mlp, 1]
        parameters = sum(a * b + b for widths in (bottom, top) for a, b in zip(widths, widths[1:]))
        activations = sum(bottom) + sum(top) + vectors * self.dim + interactions  # floats per sample
        ids = self.num_tables * self.pooling  # int64 ids and offsets per sample
        return 4 * 4 * parameters + self.batch_size * (3 * 4 * activations + 2 * 8 * ids) + 2 * 8 * interactions

    def validate(self) -> None:
        positive = {"steps": self.steps, "batch_size": self.batch_size, "num_tables": self.num_tables,
                    "rows": self.rows, "dim": self.dim, "pooling": self.pooling, "dense_every": self.dense_every}
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name, value, most in (("steps", self.steps, MAX_STEPS), ("rows", self.rows, MAX_ROWS),
                                  ("dense_every", self.dense_every, MAX_STEPS), ("seed", self.seed, MAX_SEED)):
            if value > most:
                raise ConfigError(f"{name} must be at most {most:,}, got {value:,}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if not self.zipf_exponent > 0:
            raise ConfigError(f"zipf exponent must be > 0, got {self.zipf_exponent}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.checkpoint not in CHECKPOINTS:
            raise ConfigError(f"checkpoint must be one of {', '.join(CHECKPOINTS)}, got {self.checkpoint!r}")
        self._validate_file_data()
        if self.cache_rows is not None:
            if self.capacity_pool is None:
                raise ConfigError("--cache-rows caches a capacity pool's hot rows: it needs --capacity-pool")
            if not isinstance(self.cache_rows, int) or not 1 <= self.cache_rows <= min(self.rows_per_table()):
                raise ConfigError(f"--cache-rows must be an integer from 1 to the rows of a table "
                                  f"({min(self.rows_per_table()):,}), got {self.cache_rows!r}")
        if not isinstance(self.cache_replace_every, int) or self.cache_replace_every < 0:
            raise ConfigError(f"--cache-replace-every must be an integer >= 0, got {self.cache_replace_every!r}")
        for name in ("sparse_lr", "dense_lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")

    def _validate_file_data(self) -> None:
        if self.table_rows is not None:
            if len(self.table_rows) != self.num_tables:
                raise ConfigError(f"rows has {len(self.table_rows)} entries but there are {self.num_tables} tables")
            for t, rows in enumerate(self.table_rows):
                if not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS:
                    raise ConfigError(f"rows of table {t} must be an integer from 1 to {MAX_ROWS:,}, got {rows!r}")
        for name, low in (("eval_every", 0), ("eval_batches", 1), ("prefetch", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.epochs is not None:
            if self.data is None:
                raise ConfigError("epochs need file data (--data): synthetic data is endless; use --steps")
            if not isinstance(self.epochs, int) or self.epochs < 1:
                raise ConfigError(f"epochs must be a positive integer, got {self.epochs!r}")

    def rows_per_table(self) -> tuple[int, ...]:
        """Rows of each table: table_rows, or `rows` for every one."""
        return self.table_rows if self.table_rows is not None else (self.rows,) * self.num_tables
