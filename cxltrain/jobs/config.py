"""The main job's configuration: torch-free, so the command line starts fast."""

from __future__ import annotations

import dataclasses
import os

from ..errors import ConfigError
from ..modes import CHECKPOINTS, MODES, STRICT, UNDO

DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd")

# Held-out evaluation batches are drawn from batch 2**40 on (training_data.EVAL_FIRST_BATCH): training stays below.
MAX_STEPS = (1 << 40) - 1
MAX_ROWS = 1 << 32   # the synthetic ids' hash keeps rows x multiplier below 2**64 (data/common.py)
MAX_SEED = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class Option:
    """How a TrainConfig field is given on the command line (`train`, `plan`; cli/options.py builds
    the parser from these). help may name the field's {default}. kind: how the value is read —
    text, positive, non_negative, positive_float, size (64M, 2G), rows (one count or one per
    table), widths (comma-separated positive integers), choice (one of `choices`), switch (a flag that sets True), no_switch (one that sets False).
    unset: the option's own default is None, the value then decided from others (cli/data.py)."""

    flag: str
    help: str
    kind: str = "text"
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    unset: bool = False
    group: str | None = None


FILE_DATA = "file data and evaluation (docs/criteo.md)"


def option(default, flag: str, help: str, **how):
    """A TrainConfig field with its command-line option (Option's fields as keywords)."""
    return dataclasses.field(default=default, metadata={"option": Option(flag, help, **how)})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # pool path; None = the emulated CXL default (/dev/shm)
    pool: str | None = option(None, "--pool", "pool file or DAX device (default: an emulated CXL pool in "
                                              "/dev/shm, or the temp folder)", metavar="PATH")
    # raw Criteo file; None = synthetic Criteo-like batches
    data: str | None = option(None, "--data", "raw Criteo file (tab-separated label, I1..I13, C1..C26; "
                                              "Kaggle train.txt, Terabyte day_N; plain or .gz), a folder "
                                              "made by `cxltrain data convert`, or one TorchRec's "
                                              "preprocessing wrote (day_N_dense/sparse/labels.npy), "
                                              "instead of synthetic data; "
                                              "all 26 tables unless --num-tables; "
                                              "--rows is then the hash buckets per categorical feature",
                              metavar="PATH")
    steps: int = option(400, "--steps", "total batches of the run (default {default}; 0 sets the pool up and trains "
                                  "nothing)", kind="non_negative", unset=True)
    batch_size: int = option(2048, "--batch-size", "default {default}", kind="positive")
    num_tables: int = option(8, "--num-tables", "default {default}; with --data, 26 (all of Criteo's categorical "
                                                "features)", kind="positive", unset=True)
    rows: int = option(1_000_000, "--rows", "rows per table: one count, or one per table comma-separated "
                                            "(default {default:,})", kind="rows")
    dim: int = option(64, "--dim", "embedding dim (default {default})", kind="positive")
    seed: int = option(0, "--seed", "default {default}", kind="non_negative")
    pooling: int = option(1, "--pooling", "synthetic data: ids per table per sample (default {default})",
                          kind="positive", unset=True)
    zipf_exponent: float = option(1.05, "--zipf", "synthetic data: Zipf exponent of the id distribution "
                                                  "(default {default})", kind="positive_float", unset=True)
    # the learning rates may change when a pool is resumed (recorded in its snapshots: lr_changes)
    sparse_lr: float = option(0.05, "--sparse-lr", "learning rate of the tables' row-wise Adagrad (default {default})",
                              kind="positive_float", metavar="LR")
    dense_lr: float = option(1e-3, "--lr", "learning rate of the MLPs' optimizer (default {default})",
                             kind="positive_float", metavar="LR")
    optimizer: str = option("adam", "--optimizer", "the MLPs' optimizer: adam (default), adagrad or sgd (the tables "
                                                   "always use row-wise Adagrad)", kind="choice",
                            choices=DENSE_OPTIMIZERS)
    bottom_mlp: tuple[int, ...] = option((512, 256), "--bottom-mlp", "hidden widths of the bottom MLP, comma-separated "
                                                                     "(default 512,256)", kind="widths",
                                         metavar="W,W")
    top_mlp: tuple[int, ...] = option((512, 256), "--top-mlp", "hidden widths of the top MLP, comma-separated "
                                                               "(default 512,256)", kind="widths", metavar="W,W")
    checkpoint: str = option(UNDO, "--checkpoint",
                             "undo: every batch durable, a crash costs at most the batch in flight (default); "
                             "off: the pool is consistent only when the run ends", kind="choice", choices=CHECKPOINTS)
    # checkpoint "off" may put a pool's committed batches at risk
    discard_checkpoint: bool = option(False, "--discard-checkpoint",
                                      "with --checkpoint off, accept a pool that holds committed batches: a crash "
                                      "during the run then restarts at batch 0 (refused without it)", kind="switch")
    dense_every: int = option(1, "--dense-every",
                              "dense snapshot every K batches (default {default}); strict mode commits with it: "
                              "a crash then loses at most K batches (recovery stays exact), and a row touched by "
                              "several of a window's K batches gets one undo record, so fewer undo bytes per batch "
                              "(docs/speed.md)", kind="positive", metavar="K")
    # (docs/architecture.md §4)
    mode: str = option(STRICT, "--mode",
                       "strict: recovery is exact, embeddings and dense state commit together (default); "
                       "relaxed: embeddings commit every batch, the dense state every K batches, so after a "
                       "crash it may be up to K batches older (cheaper, not exact)", kind="choice", choices=MODES)
    pipeline: bool = option(True, "--no-pipeline",
                            "checkpoint on the training thread (undo capture and commits on the critical path) "
                            "instead of a background worker", kind="no_switch")
    background_capture: bool = option(False, "--background-capture",
                                      "the background worker also captures undo records (during forward) and "
                                      "flushes updated rows (during the next batch), instead of the training thread "
                                      "around each update: pays off where the worker has a core of its own; on 2 "
                                      "cores it costs more", kind="switch")
    fused_capture: bool = True         # undo capture inside each table's update where it can (False: two passes)
    # (docs/gpu.md)
    device: str = option("cpu", "--device",
                         "where the MLPs, lookups and updates run: cpu (default), cuda (the tables stay in the pool, "
                         "which the GPU reads and writes over the link), or auto (cuda when a GPU and CuPy are "
                         "there)", kind="choice", choices=("cpu", "cuda", "auto"))
    device_cache_rows: int | None = option(None, "--device-cache-rows",
                                           "with a GPU: hot rows of each table held in GPU memory (default: every "
                                           "row when the tables fit in half the GPU's free memory, else two "
                                           "batches' worth of unique rows; 0: none)", kind="non_negative",
                                           metavar="N")
    # file data, evaluation, metrics (docs/criteo.md)
    table_rows: tuple[int, ...] | None = None  # rows of each table (from --rows); None: `rows` for every table
    epochs: int | None = option(None, "--epochs", "with --data: passes over the file's batches (less the held-out "
                                                  "ones); sets the steps", kind="positive", group=FILE_DATA)
    eval_every: int = option(0, "--eval-every", "evaluate AUC and log loss on held-out batches every N steps (with "
                                                "--data: the file's last --eval-batches batches, never trained on)",
                             kind="non_negative", metavar="N", group=FILE_DATA)
    eval_batches: int = option(4, "--eval-batches", "held-out batches evaluated (default {default})",
                               kind="positive", metavar="K", group=FILE_DATA)
    # JSONL file: a line of metrics every eval_every (else 10) steps
    metrics: str | None = option(None, "--metrics", "write a JSON line of metrics every --eval-every (else 10) "
                                                    "steps; a file holds one run (a resume goes on with it, another "
                                                    "run's file is refused); `cxltrain plot FILE`", metavar="FILE",
                                 group=FILE_DATA)
    prefetch: int = option(2, "--prefetch", "batches made ahead on a background thread (default {default}; 0: on the "
                                            "training thread)", kind="non_negative", metavar="N", group=FILE_DATA)
    # a pool set (docs/tiers.md)
    capacity_pool: str | None = option(None, "--capacity-pool",
                                       "a pool set: the tables live in this capacity pool on block storage (SSD, "
                                       "disk), everything else in --pool, the fast tier (docs/tiers.md)",
                                       metavar="PATH")
    # None: 0 for a new set, the stored plan's on a restart
    fast_bytes: int | None = option(None, "--fast-bytes",
                                    "with --capacity-pool: the fast tier's room for whole tables and cached hot rows, "
                                    "given to the planner (docs/planner.md; default 0: every table in the capacity "
                                    "pool)", kind="size", metavar="SIZE")
    # None: planning.PROFILE_BATCHES
    profile_batches: int | None = option(None, "--profile-batches",
                                         "with --capacity-pool: batches of the data the planner profiles (default 16)",
                                         kind="positive", metavar="N")
    # None: as the planner decides (the stored plan's on a restart)
    cache_rows: int | None = option(None, "--cache-rows",
                                    "with --capacity-pool: hot rows of each table cached in the fast tier, "
                                    "persistently (docs/tiers.md; default: as the planner decides from --fast-bytes); "
                                    "kept by the set", kind="positive", metavar="N")
    # None: the write_back_every knob
    write_back_every: int | None = option(None, "--write-back-every",
                                          "with --capacity-pool: write the capacity pages back and sync them every "
                                          "N batches; commits in between make the cold rows durable by redo records "
                                          "in the fast tier (docs/tiers.md; default 16, the knob's; 1: sync at every commit)",
                                          kind="positive", metavar="N")
    cache_replace_every: int = option(0, "--cache-replace-every",
                                      "re-place the hot-row caches every N batches from the lookups counted since "
                                      "(evicted rows written back; default: never)", kind="non_negative", metavar="N")

    # what a resumed run must share with the run that wrote the pool (the learning rates excepted:
    # LR_SETTINGS may change on resume)
    TRAJECTORY = ("data", "batch_size", "num_tables", "rows", "dim", "seed", "pooling", "zipf_exponent",
                  "sparse_lr", "dense_lr", "bottom_mlp", "top_mlp")
    LR_SETTINGS = ("sparse_lr", "dense_lr")
    # options each invocation decides for itself: how fast, where, and a one-time consent; every
    # other option is remembered by the pool (run_settings) and taken from it on resume when left out
    PER_INVOCATION = ("pool", "discard_checkpoint", "pipeline", "background_capture", "device",
                      "device_cache_rows", "prefetch", "fast_bytes", "profile_batches", "cache_rows")
    # metadata keys a resumed run may change (Runtime mutable_metadata): its learning rates and their
    # history, the remembered settings, the metrics' running averages (metrics_log.py)
    MUTABLE_METADATA = (*LR_SETTINGS, "lr_changes", "settings", "metrics")

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
        if self.optimizer != "adam":
            metadata["optimizer"] = self.optimizer
        return metadata

    def run_settings(self) -> dict:
        """The remembered options outside the trajectory ({field: value}; "data" is the file's
        path here): what `train --pool P` alone resumes with (cli/resume.py)."""
        trajectory = set(self.TRAJECTORY) - {"data"}
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if "option" in f.metadata and f.name not in self.PER_INVOCATION and f.name not in trajectory}
        for name in ("data", "metrics", "capacity_pool"):  # a resume from another folder finds them
            if settings[name] is not None:
                settings[name] = os.path.abspath(settings[name])
        return settings

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
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ConfigError(f"steps must be a non-negative integer, got {self.steps!r}")
        positive = {"batch_size": self.batch_size, "num_tables": self.num_tables,
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
        if self.device_cache_rows is not None and self.device == "cpu":
            raise ConfigError("--device-cache-rows sizes a GPU's hot-row cache: it needs --device cuda or auto")
        if not isinstance(self.cache_replace_every, int) or self.cache_replace_every < 0:
            raise ConfigError(f"--cache-replace-every must be an integer >= 0, got {self.cache_replace_every!r}")
        for name in ("sparse_lr", "dense_lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if self.optimizer not in DENSE_OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {', '.join(DENSE_OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("bottom_mlp", "top_mlp"):
            widths = getattr(self, name)
            if not widths or not all(isinstance(w, int) and w >= 1 for w in widths):
                raise ConfigError(f"{name} must be one or more positive widths, got {widths!r}")

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
