"""The `cxltrain` command line.

Every command has --help, prints a machine-readable summary as its last stdout line with --json,
and on bad input prints one line, `cxltrain: error: ...`, to stderr and exits non-zero (2 for
usage errors, 1 for everything else) — never a traceback for an error it can name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import threading
import warnings
from typing import Callable, Sequence

from .. import knobs
from ..errors import ConfigError, CxlTrainError, PoolError, TrainingStopped
from ..knobs import KNOBS
from ..modes import CHECKPOINTS, MODES, STRICT, UNDO
from ..runtime import manifest as run_dir
from . import dist as dist_cli
from .data import add_commands, add_train_data_options, parse_rows, resolve_train_data

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the command, not a usage dump."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # "-1G", "-inf", "-.5" are values to validate with our own message, not unknown options
        # (argparse itself only takes "-1" and "-1.5" as values)
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive finite number")
    return value


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64M', '2G', '4096' → bytes (binary multiples)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 64M, 2G)")
    number, unit = int(match.group(1)), match.group(2).upper()
    return number << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]


# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------
def _add_train(sub) -> None:
    from ..jobs.config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train DLRM with its tables in a persistent pool (the main job)",
                       description="Train DLRM on deterministic synthetic Criteo-like data, embedding tables in a "
                                   "persistent pool (by default an emulated CXL pool on /dev/shm).")
    p.add_argument("--pool", metavar="PATH", help="pool file or DAX device (default: an emulated CXL pool in "
                                                 "/dev/shm, or the temp folder)")
    p.add_argument("--capacity-pool", metavar="PATH",
                   help="a pool set: the tables live in this capacity pool on block storage (SSD, disk), "
                        "everything else in --pool, the fast tier (docs/tiers.md)")
    p.add_argument("--fast-bytes", type=parse_size, metavar="SIZE",
                   help="with --capacity-pool: the fast tier's room for whole tables and cached hot rows, "
                        "given to the planner (docs/planner.md; default 0: every table in the capacity pool)")
    p.add_argument("--profile-batches", type=_positive_int, metavar="N",
                   help="with --capacity-pool: batches of the data the planner profiles (default 16)")
    p.add_argument("--cache-rows", type=_positive_int, metavar="N",
                   help="with --capacity-pool: hot rows of each table cached in the fast tier, persistently "
                        "(docs/tiers.md; default: as the planner decides from --fast-bytes); kept by the set")
    p.add_argument("--cache-replace-every", type=_non_negative_int, default=0, metavar="N",
                   help="re-place the hot-row caches every N batches from the lookups counted since "
                        "(evicted rows written back; default: never)")
    p.add_argument("--data", metavar="PATH", help="raw Criteo file (tab-separated label, I1..I13, C1..C26; "
                                                 "Kaggle train.txt, Terabyte day_N; plain or .gz) or a folder "
                                                 "made by `cxltrain data convert`, instead of synthetic data; "
                                                 "all 26 tables unless --num-tables; "
                                                 "--rows is then the hash buckets per categorical feature")
    p.add_argument("--steps", type=_positive_int, default=None, help=f"total batches of the run (default {d.steps})")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help=f"default {d.batch_size}")
    p.add_argument("--num-tables", type=_positive_int, default=None,
                   help=f"default {d.num_tables}; with --data, 26 (all of Criteo's categorical features)")
    p.add_argument("--rows", type=parse_rows, default=d.rows,
                   help=f"rows per table: one count, or one per table comma-separated (default {d.rows:,})")
    p.add_argument("--dim", type=_positive_int, default=d.dim, help=f"embedding dim (default {d.dim})")
    p.add_argument("--seed", type=_non_negative_int, default=d.seed, help=f"default {d.seed}")
    p.add_argument("--pooling", type=_positive_int, default=None,
                   help=f"synthetic data: ids per table per sample (default {d.pooling})")
    p.add_argument("--zipf", type=_positive_float, default=None, dest="zipf_exponent",
                   help=f"synthetic data: Zipf exponent of the id distribution (default {d.zipf_exponent})")
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default=d.checkpoint,
                   help="undo: every batch durable, a crash costs at most the batch in flight (default); "
                        "off: the pool is consistent only when the run ends")
    p.add_argument("--discard-checkpoint", action="store_true",
                   help="with --checkpoint off, accept a pool that holds committed batches: a crash during "
                        "the run then restarts at batch 0 (refused without it)")
    p.add_argument("--dense-every", type=_positive_int, default=d.dense_every, metavar="K",
                   help=f"dense snapshot every K batches (default {d.dense_every}); strict mode commits with it: "
                        "a crash then loses at most K batches (recovery stays exact), and a row touched by "
                        "several of a window's K batches gets one undo record, so fewer undo bytes per batch "
                        "(docs/speed.md)")
    p.add_argument("--mode", choices=MODES, default=d.mode,
                   help="strict: recovery is exact, embeddings and dense state commit together (default); "
                        "relaxed: embeddings commit every batch, the dense state every K batches, so after a "
                        "crash it may be up to K batches older (cheaper, not exact)")
    p.add_argument("--no-pipeline", action="store_false", dest="pipeline",
                   help="checkpoint on the training thread (undo capture and commits on the critical path) "
                        "instead of a background worker")
    p.add_argument("--background-capture", action="store_true",
                   help="the background worker also captures undo records (during forward) and flushes "
                        "updated rows (during the next batch), instead of the training thread around each "
                        "update: pays off where the worker has a core of its own; on 2 cores it costs more")
    add_train_data_options(p, _positive_int, _non_negative_int)
    _add_emulation_options(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_train, default_num_tables=d.num_tables)
    from .dist import add_train_options

    add_train_options(p)  # --nproc-per-node, --sharding, ...: docs/distributed.md
    return p


def _add_emulation_options(p) -> None:
    from ..knobs import DOMAINS

    g = p.add_argument_group("emulated CXL device (a pool on tmpfs/hugetlbfs; see README, Emulating CXL); "
                             "each option overrides its CXLTRAIN_* variable")
    g.add_argument("--power-loss", action="store_const", const=1, default=None,
                   help="model power loss: stores not persisted are lost when the process dies")
    g.add_argument("--domain", choices=DOMAINS, default=None,
                   help="with --power-loss, the persistence domain: adr (flush needed, the default), eadr "
                        "(caches persistent), none (volatile)")
    g.add_argument("--evict-rate", type=_non_negative_int, default=None, metavar="R",
                   help="with --power-loss (adr), write up to R random unpersisted cache lines per second "
                        "back early, some torn at 8-byte boundaries, as write-back caches do (default 0)")
    g.add_argument("--persist-bandwidth", type=_bandwidth, default=None, metavar="RATE",
                   help="cap persistence traffic at RATE bytes/s, e.g. 2.3G for one Optane DIMM's write "
                        "bandwidth (decimal units; default no cap)")


def _bandwidth(text: str) -> int:
    """'2.3G', '500M', '1e9' → bytes per second (decimal units, as bandwidths are quoted)."""
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    scale = units.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate (e.g. 2.3G, 500M)") from None
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite rate of at least 1 byte per second")
    return int(value)


def _emulation_knobs(args) -> dict:
    """The knobs the emulation options set: only those given, over the knobs' own values (and their
    CXLTRAIN_* variables). Checked together, as the device will see them."""
    given = {"power_loss": args.power_loss, "domain": args.domain, "evict_rate": args.evict_rate,
             "persist_bandwidth": args.persist_bandwidth}
    given = {name: value for name, value in given.items() if value is not None}
    with knobs.override(**given):
        KNOBS.validate()
        if "domain" in given and not KNOBS.power_loss:
            raise ConfigError("--domain needs --power-loss (or CXLTRAIN_POWER_LOSS=1): without the power-loss "
                              "model every store survives, whatever the domain")
    return given


def _check_emulated(path: str, given: dict) -> None:
    """Refuses emulation options for a pool that the emulated device would not map."""
    from ..devices import resolve_backend

    if given and resolve_backend(path) != "emulated":
        raise ConfigError(f"--power-loss, --domain, --evict-rate and --persist-bandwidth model an emulated CXL pool; {path} is not "
                          f"on tmpfs/hugetlbfs (it maps with the {resolve_backend(path)} backend)")


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(config) -> None:
    """A run whose model and batch cannot fit in memory is refused, with the figures, before it is
    OOM-killed minutes later."""
    needed, available = config.memory_bytes(), _mem_available()
    if available is not None and needed > available:
        raise ConfigError(f"this run needs about {needed / 1e9:,.1f} GB of memory for its model and one batch "
                          f"(--batch-size {config.batch_size}, --num-tables {config.num_tables}, --dim {config.dim}, "
                          f"--pooling {config.pooling}), "
                          f"but {available / 1e9:,.1f} GB is available (MemAvailable); make them smaller")


def _check_pool_space(path: str, pool_size: int) -> None:
    """A new pool file that cannot fit in its folder is refused, with the figures, before any work."""
    from ..devices import is_char_device
    from ..emulation.cxl import free_bytes

    if os.path.exists(path) or is_char_device(path):
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = free_bytes(folder)
    except OSError:
        return  # no such folder: creating the pool says so
    if pool_size > free:
        raise ConfigError(f"{path}: not enough space for the pool: it needs {pool_size:,} bytes, "
                          f"{free:,} are free in {folder}")


def train_config(args):
    """The TrainConfig of `train`'s (and `plan`'s) options."""
    from ..jobs.config import TrainConfig

    return TrainConfig(pool=args.pool, data=args.data, batch_size=args.batch_size, dim=args.dim, seed=args.seed,
                       checkpoint=args.checkpoint, dense_every=args.dense_every,
                       mode=args.mode, pipeline=args.pipeline, background_capture=args.background_capture,
                       discard_checkpoint=args.discard_checkpoint, capacity_pool=args.capacity_pool,
                       fast_bytes=args.fast_bytes, profile_batches=args.profile_batches, cache_rows=args.cache_rows,
                       cache_replace_every=args.cache_replace_every,
                       **resolve_train_data(args))


def _run_train(args) -> int:
    if dist_cli.distributed(args):  # several ranks: docs/distributed.md
        with knobs.override(**_emulation_knobs(args)):
            return dist_cli.run_train(args, args.argv)
    from ..checkpoint.stats import summary_line
    from ..devices import resolve_backend
    from ..emulation import default_pool_path
    from ..emulation.cxl import SHM, memory_dir
    from ..jobs.train import pool_bytes, train

    config = train_config(args)
    config.validate()
    _check_memory(config)  # first: a model too big for memory must not even be built
    emulation = _emulation_knobs(args)
    pool_size = pool_bytes(config)
    path = args.pool or default_pool_path(pool_size)
    _check_emulated(path, emulation)
    _check_pool_space(path, pool_size)
    # validated: from here on, what the run does
    if args.pool is None and not path.startswith(SHM + "/") and memory_dir() == SHM:
        print(f"note: /dev/shm has no room for the pool; using {path} (not memory-backed: slower, "
              "and not an emulated CXL device)", file=sys.stderr)
    rows = config.rows_per_table()
    table_gb = sum(rows) * args.dim * 4 / 1e9
    shown = f"{rows[0]:,}" if len(set(rows)) == 1 else f"up to {max(rows):,}"
    length = f"{config.epochs} epoch(s)" if config.epochs is not None else f"{config.steps} steps"
    print(f"pool {path}: {config.num_tables} tables x {shown} rows x {args.dim} dims "
          f"({table_gb:.2f} GB), batch {args.batch_size}, {length}", flush=True)
    with knobs.override(**emulation):
        if (KNOBS.power_loss or KNOBS.persist_bandwidth) and resolve_backend(path) == "emulated":
            from ..emulation.cxl import describe_model

            print(f"emulated device models {describe_model()}", flush=True)
        result = train(config, pool_path=path, progress=not args.no_progress, on_ready=_say_where_training_starts,
                       stop=_sigterm.requested)
    progress, timings, quality, checkpoint = result.progress, result.timings, result.quality, result.checkpoint
    if progress.steps == 0:
        limit = f"--epochs {config.epochs}" if config.epochs is not None else f"--steps {config.steps}"
        print(f"nothing to train: the pool is at batch {progress.batch}, the end of {limit}")
    else:
        s = timings.split_ms
        print(f"trained {progress.steps} batches in {timings.seconds:.1f} s ({timings.steps_per_s:.1f} steps/s) "
              f"on {result.pool.device}; loss {quality.first_loss:.4f} -> {quality.final_loss:.4f}")
        if result.pool.early_writebacks is not None:
            print(f"early write-back: {result.pool.early_writebacks:,} unpersisted cache lines reached the media "
                  "before their flush")
        print(f"step {s.total:.1f} ms = data {s.data:.1f} + embedding forward {s.embedding_forward:.1f} "
              f"+ embedding backward/update {s.embedding_backward_update:.1f} + checkpoint {s.checkpoint:.1f} "
              f"+ MLP {s.mlp:.1f}; {result.pool.rows_updated_per_batch:,.0f} rows updated per batch")
    if result.pool.cost_model is not None:
        modelled = ", ".join(f"{name} {ms:.2f}" for name, ms in result.pool.cost_model["ms_per_batch"].items())
        print(f"pool traffic per batch modelled on real memory (ms; emulation/costmodel.py): {modelled}")
    if checkpoint.method == UNDO:
        dense_part = "" if args.mode == STRICT else f", relaxed: dense state every {args.dense_every}"
        where = ("pipelined, capture and row flushes on the worker" if args.background_capture
                 else "pipelined" if args.pipeline else "synchronous")
        print(f"checkpoint: every batch durable ({where}{dense_part}); "
              f"the pool is committed at batch {progress.batch}")
        if checkpoint.stats is not None:
            print(summary_line(checkpoint.stats))
    if quality.train_auc is None:
        pass
    elif quality.eval_auc is None:
        print(f"final AUC {quality.train_auc:.4f} (last batches; the data file has no batches left to hold out)")
    else:
        print(f"final AUC {quality.eval_auc:.4f} (held-out), {quality.train_auc:.4f} (last batches); "
              f"eval logloss {quality.eval_logloss:.4f}")
    if args.json:
        print(json.dumps(result.to_json()))
    return 0


def _say_where_training_starts(rt) -> None:
    _sigterm.arm()  # from here a SIGTERM stops the loop at a batch boundary
    if rt.restarted:
        print(f"note: {rt.path} held these tables but no committed checkpoint (a run with --checkpoint off was "
              "interrupted); training restarts at batch 0", file=sys.stderr)
    if rt.recovered_batch is not None:
        print(f"{_recovered(rt.path, rt.recovery, rt.recovery_seconds)}; resuming at batch {rt.start_batch}",
              flush=True)
    else:
        print(f"training from batch {rt.start_batch}", flush=True)


# ---------------------------------------------------------------------------------------------
# recover | export
# ---------------------------------------------------------------------------------------------
def _add_recover_export(sub) -> None:
    r = sub.add_parser("recover", help="roll a pool back to its last committed batch",
                       description="Roll a pool back to its last committed batch (what `train` does on start), "
                                   "and report it.")
    r.add_argument("path")
    r.add_argument("--json", action="store_true")
    r.set_defaults(run=_run_recover)
    e = sub.add_parser("export", help="write the recovered model as a plain torch state dict",
                       description="Recover a pool and write its model as a plain state dict: every table's "
                                   "weights and optimizer state, the dense parameters and optimizer state, and "
                                   "the committed batch under \"batch\". Read it with torch.load(OUT, "
                                   "weights_only=True).")
    e.add_argument("path")
    e.add_argument("out", help="output file (.pt); must not exist")
    e.add_argument("--format", choices=("cxltrain", "torchrec"), default="cxltrain",
                   help="torchrec: one flat state dict, tables keyed embedding_bags.<table>.weight as in TorchRec's "
                        "EmbeddingBagCollection, plus the dense weights; no optimizer state (docs/torchrec.md)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=_run_export)


def _add_import(sub) -> None:
    i = sub.add_parser("import", help="build a new pool from an export (ours, or a TorchRec EBC state dict)",
                       description="Build the pool PATH (which must not exist) from OUT.pt: an export of cxltrain (any "
                                   "format), or a TorchRec EmbeddingBagCollection state dict plus dense weights. "
                                   "The pool is committed at the export's batch; a Runtime or `cxltrain train` "
                                   "with the same options resumes it there (docs/torchrec.md). With --nproc-per-node N, "
                                   "PATH is a distributed run's directory instead, the tables re-sharded onto N "
                                   "ranks (docs/distributed.md).")
    i.add_argument("source", metavar="OUT.pt")
    i.add_argument("path", metavar="PATH", help="the new pool, or with --nproc-per-node the new run's directory "
                                                "(must not exist)")
    i.add_argument("--sparse-optimizer", choices=("adagrad", "sgd"), default="adagrad",
                   help="the tables' optimizer when the export holds no optimizer state (TorchRec's): its state "
                        "columns start at their initial value (default adagrad)")
    i.add_argument("--json", action="store_true")
    dist_cli.add_import_options(i)
    i.set_defaults(run=_run_import)


def _run_import(args) -> int:
    if args.nproc_per_node is not None:
        return dist_cli.run_import(args)
    from ..runtime.state_import import import_file

    report = import_file(args.source, args.path, state_columns=1 if args.sparse_optimizer == "adagrad" else 0)
    print(f"imported {args.source} ({report.source} format) into {report.path}: {len(report.tables)} tables, "
          f"committed at batch {report.batch}")
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    return 0


def _recovered(path: str, report, seconds: float) -> str:
    return (f"recovered {path} to batch {report.batch} in {seconds * 1000:.1f} ms (rolled back "
            f"{report.records_restored} undo records, {report.rows_restored:,} rows, of "
            f"{report.batches_rolled_back} uncommitted batch(es))"
            + (f"; dense state from batch {report.dense_batch}, {report.dense_lag} batch(es) behind the embeddings "
               "(relaxed mode)" if report.dense_lag else ""))


def _run_recover(args) -> int:
    from ..checkpoint.offline import process_seconds, recover_pool  # no torch: recovery copies bytes

    if run_dir.is_run_dir(args.path):
        return dist_cli.run_recover(args.path, args.json)
    report = recover_pool(args.path)
    process = process_seconds()
    print(_recovered(args.path, report, report.seconds)
          + ("" if process is None else f"; {process:.2f} s since the process started"))
    if args.json:
        print(json.dumps({**report.to_json(), "process_seconds": process}))
    return 0


def _run_export(args) -> int:
    from ..runtime.runtime import export_state

    if os.path.exists(args.out):
        raise CxlTrainError(f"{args.out}: already exists; not overwriting it")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.access(folder, os.W_OK | os.X_OK):  # before recovery writes to the pool
        raise CxlTrainError(f"{args.out}: cannot write into {folder}")
    if run_dir.is_run_dir(args.path):
        return dist_cli.run_export(args.path, args.out, _save_export, args.json)
    state = export_state(args.path)
    if args.format == "torchrec":
        from ..runtime.interop import to_torchrec

        state = {"batch": state["batch"], "model": to_torchrec(state)}
    _save_export(state["model"] if args.format == "torchrec" else state, args.out)
    tensors = len(state["model"])
    print(f"exported {args.path} at batch {state['batch']} to {args.out} ({tensors} model tensors)")
    if args.json:
        print(json.dumps({"path": args.path, "out": args.out, "batch": state["batch"]}))
    return 0


def _save_export(state: dict, out: str) -> None:
    """torch.save into a file of this run's own beside OUT, linked to OUT once whole: OUT is never
    half-written, never overwritten, and the temporary file goes on every exit (a full disk, Ctrl-C)."""
    import tempfile

    import torch

    folder = os.path.dirname(os.path.abspath(out))
    try:
        fd, partial = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".partial", dir=folder)
    except OSError as e:
        raise CxlTrainError(f"{out}: cannot write: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.link(partial, out)  # unlike a rename, never replaces an OUT that appeared meanwhile
    except FileExistsError:
        raise CxlTrainError(f"{out}: already exists; not overwriting it") from None
    except OSError as e:
        raise CxlTrainError(f"{out}: cannot write: {e.strerror}") from None
    except RuntimeError:  # torch's zip writer reports a short write as an "enforce fail", errno lost
        from ..emulation.cxl import free_bytes

        raise CxlTrainError(f"{out}: cannot write: the write failed part-way (is the disk full? "
                            f"{free_bytes(folder):,} bytes free in {folder})") from None
    finally:
        os.unlink(partial)


# ---------------------------------------------------------------------------------------------
# pool create | info | check
# ---------------------------------------------------------------------------------------------
def _add_pool(sub) -> None:
    p = sub.add_parser("pool", help="create, inspect and check pools",
                       description="Create, inspect and check pools.")
    psub = p.add_subparsers(dest="pool_command", metavar="{create,info,check}", parser_class=_Parser)
    psub.required = True
    c = psub.add_parser("create", help="create an empty pool", description="Create an empty pool.")
    c.add_argument("path")
    c.add_argument("--size", type=parse_size, help="pool size, e.g. 64M, 2G (default 64M for a file, the whole "
                                                    "device for a DAX device)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=_run_pool_create)
    for name, run, text in (("info", _run_pool_info, "show the superblock, both roots and every region"),
                            ("check", _run_pool_check, "validate every checksum and bound; exit 1 on a problem")):
        q = psub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ". Never writes.")
        q.add_argument("path")
        q.add_argument("--json", action="store_true")
        q.set_defaults(run=run)


def _run_pool_create(args) -> int:
    from ..devices import is_char_device
    from ..pool.handle import Pool

    size = args.size
    if size is None and not is_char_device(args.path):
        size = parse_size("64M")
    with Pool.create(args.path, size) as pool:
        summary = {"path": pool.path, "size": pool.superblock.pool_size, "device": pool.device.kind,
                   "uuid": pool.superblock.uuid.hex(), "persistent_memory": pool.device.is_pmem}
    print(f"created {args.path}: {summary['size']:,} bytes on {_device_words(pool.device)}")
    if args.json:
        print(json.dumps(summary))
    return 0


def _device_words(device) -> str:
    """The backend, and whether the media is persistent memory: the pmem backend also maps ordinary files
    (persisted with msync then), which must not read as "on pmem"."""
    if device.kind in ("pmem", "msync") and not device.is_pmem:
        return f"an ordinary file, not persistent memory ({device.kind} backend, persisted with msync)"
    return device.kind


def _report_json(report) -> dict:
    from ..pool.format import ROOT_RELAXED, SLOT_NAMES

    sb = report.superblock
    return {
        "path": report.path,
        "ok": report.ok,
        "in_use": report.in_use,
        "problems": report.problems,
        "file_size": report.file_size,
        "superblock": None if sb is None else {
            "version": sb.version, "uuid": sb.uuid.hex(), "pool_size": sb.pool_size, "created_ns": sb.created_ns,
            "dir_capacity": sb.dir_capacity, "data_offset": sb.data_offset, "region_align": sb.region_align,
            "row_align": sb.row_align},
        "roots": [{"slot": SLOT_NAMES[s.slot], "state": s.state, "reason": s.reason,
                   **({"seq": s.root.seq, "dir_count": s.root.dir_count, "batch": s.root.batches_done,
                       "ring_generation": s.root.ring_generation, "ring_start": s.root.ring_start,
                       "ring_start_seq": s.root.ring_start_seq,
                       "dense_slot": s.root.dense_slot_name, "dense_batch": s.root.dense_batch,
                       "relaxed": bool(s.root.flags & ROOT_RELAXED)}
                      if s.root else {})}
                  for s in report.slots],
        "batch": None if report.root is None else report.root.batches_done,
        "regions": [{"name": r.name, "kind": r.kind.name.lower(), "dtype": r.dtype.numpy.name, "shape": list(r.shape),
                     "offset": r.offset, "size": r.size, "row_stride": r.row_stride} for r in report.regions],
        **({"members": [_report_json(m) for m in report.members]} if report.members else {}),
        **({"caches": caches} if (caches := _caches(report)) else {}),
    }


def _caches(report) -> list[dict]:
    from ..pool.cache_format import describe

    return describe(report.path, report.regions)


def _inspect_or_fail(path: str):
    from ..pool.info import inspect

    report = inspect(path)
    if report.superblock is None or report.root is None:
        raise CxlTrainError(f"{path}: {report.problems[0]}")
    return report


def _run_pool_info(args) -> int:
    if run_dir.is_run_dir(args.path):
        return dist_cli.run_pool_info(args.path, args.json)
    report = _inspect_or_fail(args.path)
    if not args.json:  # with --json, stdout is the JSON alone
        _print_pool_info(report)
    return _finish_report(report, args.json)


def _print_pool_info(report) -> None:
    from ..pool.format import ROOT_RELAXED, SLOT_NAMES

    sb = report.superblock
    print(f"pool {report.path}: format v{sb.version}, {sb.pool_size:,} bytes, uuid {sb.uuid.hex()}")
    for s in report.slots:
        detail = (f"seq {s.root.seq}, batch {s.root.batches_done}, {s.root.dir_count} regions" if s.root
                  else s.reason or "never written")
        if s.root is not None and s.root.dense_slot:
            detail += (f", dense snapshot in slot {s.root.dense_slot_name} (batch {s.root.dense_batch}), undo ring "
                       f"generation {s.root.ring_generation} from offset {s.root.ring_start}"
                       + (", relaxed (the dense state may trail the embeddings)" if s.root.flags & ROOT_RELAXED else ""))
        winner = " (current)" if s.root is not None and s.root == report.root else ""
        print(f"root {SLOT_NAMES[s.slot]}: {s.state}{winner}: {detail}")
    print(f"{'region':<24} {'kind':<18} {'dtype':<8} {'shape':<18} {'offset':>14} {'bytes':>14}")
    for r in report.regions:
        shape = "x".join(str(d) for d in r.shape)
        print(f"{r.name:<24} {r.kind.name.lower():<18} {r.dtype.numpy.name:<8} {shape:<18} {r.offset:>14,} {r.size:>14,}")
    for cache in _caches(report):  # a pool set's hot-row caches (docs/tiers.md)
        held = "?" if cache["held"] is None else f"{cache['held']:,}"
        print(f"hot-row cache of table {cache['table']}: {cache['rows']:,} rows, {held} held")
    for member in report.members:  # a pool set's capacity pools (docs/tiers.md)
        print("capacity pool of this set:")
        _print_pool_info(member)


def _say_in_use(report) -> None:
    if report.in_use and report.root is not None:
        print(f"note: {report.path} is in use by a writer; showing its last committed root (seq {report.root.seq}, "
              f"batch {report.root.batches_done})", file=sys.stderr)


def _finish_report(report, as_json: bool) -> int:
    """Problems to stderr, one line each; the JSON summary last; exit 1 if anything is wrong."""
    _say_in_use(report)
    for problem in report.problems:
        print(f"{report.path}: {problem}", file=sys.stderr)
    if as_json:
        print(json.dumps(_report_json(report)))
    return 0 if report.ok else EXIT_ERROR


def _run_pool_check(args) -> int:
    from ..checkpoint.offline import check_checkpoint
    from ..pool.info import check_rows, inspect

    if run_dir.is_run_dir(args.path):
        return dist_cli.run_pool_check(args.path, args.json)
    report = inspect(args.path)
    checkpoint = None
    if report.in_use:  # the writer changes the undo ring and the dense slots under us: not checked
        checkpoint = "undo records and dense snapshot not checked while a writer holds the pool"
    elif report.ok:  # then the checksums above the pool layer: live undo records, the dense snapshot
        try:
            checkpoint = check_checkpoint(args.path)
        except PoolError as e:
            report.problems.append(str(e).removeprefix(f"{args.path}: "))
    check_rows(report)
    if report.ok and not args.json:
        print(f"ok: {report.path}: {len(report.regions)} regions, root seq {report.root.seq}, "
              f"batch {report.root.batches_done}"
              + (f"; {checkpoint}" if checkpoint else ""))
    return _finish_report(report, args.json)


# ---------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------
def _add_devices(sub) -> None:
    d = sub.add_parser("devices", help="list PMEM/CXL devices on this machine and the pool train uses",
                       description="List real PMEM and CXL memory (ndctl/daxctl when installed, -o dax mounts, "
                                   "/dev/dax* and /dev/pmem*, NUMA nodes without CPUs) and the pool `train` uses "
                                   "when no --pool is given. Never writes.")
    d.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    d.set_defaults(run=_run_devices)


def _gib(size: int | None) -> str:
    return "?" if size is None else f"{size / (1 << 30):.1f} GiB"


def _run_devices(args) -> int:
    from ..devices.discovery import discover
    from ..jobs.config import TrainConfig
    from ..jobs.train import pool_bytes

    # the default train config's pool size decides whether /dev/shm has room for it, as in `train`
    report = discover(required_bytes=pool_bytes(TrainConfig()))
    if report.devices:
        print(f"{'kind':<13} {'path':<24} {'size':>11} {'numa':>4}  {'source':<7} note")
        for d in report.devices:
            numa = "-" if d.numa_node is None else str(d.numa_node)
            print(f"{d.kind:<13} {d.path or '-':<24} {_gib(d.size):>11} {numa:>4}  {d.source:<7} {d.note}")
        print("looked at:")
    else:
        print("no PMEM or CXL memory found on this machine; looked at:")
    for line in report.checked:
        print(f"  {line}")
    t = report.train
    print(f"train uses {t.pool_path} when no --pool is given: {t.backend} backend on {t.fs_type or 'unknown'}, "
          f"{_gib(t.free_bytes)} free" + ("; --pool PATH puts it on a device above" if report.devices else ""))
    print("  libpmem: " + ("loaded: persist is a cache-line flush + fence" if t.libpmem else
                          "not installed: persist on the emulated device does nothing (the page is the media)"))
    pages = (f"{t.hugepages_free} of {t.hugepages_total} free ({t.hugepage_bytes >> 20} MiB each)" if t.hugepages_total
             else "none reserved (vm.nr_hugepages = 0)")
    print(f"  huge pages: {pages}; hugetlbfs mounts: {', '.join(t.hugetlbfs_mounts) or 'none'}")
    if args.json:
        print(json.dumps(report.to_json()))
    return 0


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------
def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="measure checkpointing, recovery and table throughput against PyTorch baselines",
                       description="Measure, on one model, data set and machine: training step time under each "
                                   "checkpointing method (ours strict and relaxed, torch.save and DCP async_save "
                                   "every k batches) with the batches a crash loses; recovery time against table "
                                   "size; embedding lookup+update throughput against nn.EmbeddingBag and "
                                   "torchrec/FBGEMM; the machine's copy bandwidth. Takes 5-10 minutes.")
    b.add_argument("--json", action="store_true", help="print the results as JSON as the last line")
    b.add_argument("--plot", metavar="FILE.png", help="plot step-time ratio against batches lost per crash "
                                                      "(needs matplotlib: the `bench` extra)")
    b.add_argument("--quick", action="store_true", help="a tiny model, in seconds: checks the bench runs, "
                                                        "its figures mean nothing")
    b.add_argument("--dist", action="store_true", help="distributed runs instead: step time strict vs off, bytes "
                                                       "exchanged per batch at 1, 2 and 4 ranks, and the group's "
                                                       "recovery after a kill (docs/distributed.md)")
    b.add_argument("--tiers", action="store_true",
                   help="only the tiers, side by side: all tables in the fast tier, in the capacity tier, and "
                        "the capacity tier with checkpoint off (docs/planner.md)")
    b.add_argument("--capacity-dir", metavar="DIR",
                   help="with --tiers: the folder on block storage for the capacity pools (default /var/tmp)")
    b.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    if args.dist:
        return dist_cli.run_bench(args)
    from ..bench.plot import require_matplotlib, save_plot
    from ..bench.report import format_text
    from ..bench.suite import full_plan, quick_plan, run_bench

    if args.tiers:
        return _run_bench_tiers(args)
    if args.plot is not None:
        require_matplotlib()  # before minutes of measuring, not after
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.access(folder, os.W_OK | os.X_OK):
            raise CxlTrainError(f"{args.plot}: cannot write into {folder}")
    results = run_bench(quick_plan() if args.quick else full_plan(),
                        log=lambda line: print(f"bench: {line}", file=sys.stderr, flush=True))
    print(format_text(results))
    if args.plot is not None:
        save_plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(results.to_json()))
    return 0


def _run_bench_tiers(args) -> int:
    from ..bench.suite import scratch_dir
    from ..bench.tiers import DEFAULT_CAPACITY_DIR, default_plan, format_tiers, quick_plan, run_tiers

    capacity_dir = args.capacity_dir or DEFAULT_CAPACITY_DIR
    if not os.path.isdir(capacity_dir) or not os.access(capacity_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{capacity_dir}: not a folder this user may write (--capacity-dir)")
    result = run_tiers(quick_plan() if args.quick else default_plan(), scratch_dir(), capacity_dir)
    print(format_tiers(result))
    if args.json:
        print(json.dumps(result.to_json()))
    return 0


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------
def add_plan(sub, train) -> None:
    p = sub.add_parser("plan", help="print where a pool set's tables would go, without training",
                       description="Print the placement plan `train` would use with the same options (docs/"
                                   "planner.md): per table its tier, the hot rows cached in the fast tier and "
                                   "the expected hit rate; for an existing pool set, the plan it stores. "
                                   "Takes train's options (a train command line with plan in place of train); "
                                   "those that do not decide the plan are ignored. Never writes a pool.")
    for action in train._actions:  # the same options as train, spelled and checked once
        if action.dest != "help":
            p._add_action(action)
    p.add_argument("--no-measure", action="store_false", dest="measure",
                   help="do not measure the tiers' free space and read speed")
    p.set_defaults(run=_run_plan, default_num_tables=train.get_default("default_num_tables"))


def _run_plan(args) -> int:
    from ..emulation import default_pool_path
    from ..jobs.planning import measure_tiers, plan_for
    from ..jobs.train import build_model, build_source
    from ..placement.planner import format_plan

    config = train_config(args)
    config.validate()
    if config.capacity_pool is None:
        raise ConfigError("plan places tables in a pool set: give --capacity-pool (and --fast-bytes)")
    path = args.pool or default_pool_path(0)
    plan = plan_for(config, build_model(config), build_source(config), path)
    if plan is None:
        raise ConfigError(f"{path}: this pool set was made without a placement plan: every table is in its "
                          "capacity pool")
    tiers = measure_tiers(path, config.capacity_pool) if args.measure else None
    print(format_plan(plan, tiers))
    if args.json:
        print(json.dumps({"pool": path, "plan": plan.to_json(), "tiers": tiers}))
    return 0


# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="cxltrain", description="Train recommendation models whose embedding tables live in "
                                                  "persistent memory (PMEM, CXL, or an emulated CXL pool).")
    parser.add_argument("--version", action="version", version=f"cxltrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    train = _add_train(sub)
    add_plan(sub, train)
    _add_recover_export(sub)
    _add_import(sub)
    _add_pool(sub)
    _add_devices(sub)
    _add_crashtest(sub)
    _add_bench(sub)
    add_commands(sub, _positive_int, _non_negative_int)
    return parser


# ---------------------------------------------------------------------------------------------
# crashtest
# ---------------------------------------------------------------------------------------------
def _add_crashtest(sub) -> None:
    from ..faults import PLANTED

    c = sub.add_parser("crashtest", help="kill training at random moments and protocol points; prove recovery exact",
                       description="Run training in a child process, kill it (at random moments, at named points of "
                                   "the persistence protocol, at random device flushes, during recovery), recover, "
                                   "compare the export with an uninterrupted run bit for bit, resume and compare "
                                   "again. Exits non-zero on any mismatch, keeping the pool and printing the "
                                   "commands that replay it.")
    c.add_argument("--trials", type=_positive_int, default=50, help="trials to run (default 50)")
    c.add_argument("--seed", type=_non_negative_int, default=None, help="plan of the trials (default: random, printed)")
    c.add_argument("--trial", type=_non_negative_int, default=None, metavar="K",
                   help="run only trial K of the seed's plan (to replay one)")
    c.add_argument("--plant", choices=PLANTED, default="",
                   help="plant a bug that breaks a persistence rule, to see the torture catch it")
    c.add_argument("--fail-fast", action="store_true", help="stop at the first mismatch")
    c.add_argument("--keep", metavar="DIR", help="where failing pools and logs are kept (default: a folder in "
                                                 "the temp dir named after the seed)")
    _add_emulation_options(c)
    c.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(run=_run_crashtest)


def _run_crashtest(args) -> int:
    import random
    import time

    from tqdm import tqdm

    from ..jobs.crashtest import DeviceModel, Torture, summary

    with knobs.override(**_emulation_knobs(args)):
        device = DeviceModel(bool(KNOBS.power_loss), KNOBS.domain, KNOBS.evict_rate, KNOBS.persist_bandwidth)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    with knobs.override(threads=1):  # references and resumes in this process, as in the children
        torture = Torture(trials=args.trials, device=device, seed=seed, plant=args.plant, only=args.trial,
                          fail_fast=args.fail_fast, keep_dir=args.keep)
        from ..emulation.cxl import describe_model

        with knobs.override(**device.knobs(0)):
            model = describe_model()
        print(f"crashtest: seed {seed}, {1 if args.trial is not None else args.trials} trial(s), device models "
              f"{model}" + (f", planted bug {args.plant}" if args.plant else ""), flush=True)
        started = time.perf_counter()
        bar = tqdm(total=1 if args.trial is not None else args.trials, desc="crashtest", unit="trial",
                   disable=None if not args.no_progress else True, file=sys.stderr, dynamic_ncols=True)
        exact = [0]

        def show(result) -> None:
            exact[0] += result.exact
            bar.update(1)
            bar.set_postfix(exact=exact[0], refresh=False)
            if not result.exact:
                bar.write(f"trial {result.plan.number}: MISMATCH ({result.plan.describe()}; recovered batch "
                          f"{result.recovered_batch}): {result.problems[0]}", file=sys.stderr)

        try:
            results = torture.run(show)
        finally:
            bar.close()
            torture.close()
    report = summary(results, time.perf_counter() - started)
    kinds = ", ".join(f"{k} {v['exact']}/{v['trials']}" for k, v in report["by_kind"].items())
    print(f"{report['exact']}/{report['trials']} exact in {report['seconds']:.0f} s ({kinds}; "
          f"{report['killed']} killed mid-run, recovered batches {report['recovered_batches']})")
    for result in results:
        if not result.exact:
            print(f"trial {result.plan.number} ({result.plan.describe()}) differs; replay with:")
            for line in torture.replay_commands(result.plan):
                print(f"  {line}")
    if args.json:
        print(json.dumps({"seed": seed, "device_model": model, "plant": args.plant or None, **report}))
    return 0 if report["exact"] == report["trials"] else EXIT_ERROR


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"cxltrain: warning: {message}", file=sys.stderr)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, where it stops the process at once: cleaned up after as Ctrl-C is."""


class _StopOnSigterm:
    """SIGTERM handler. Once training runs (`arm`), it asks the loop to stop at the next batch
    boundary, where the pool is committed; before that, or on a second SIGTERM, it stops at once."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def __call__(self, signum, frame) -> None:
        if self.armed and not self.requested.is_set():
            self.requested.set()
            return
        raise _Terminated()


_sigterm = _StopOnSigterm()


def _silence_stdout() -> None:
    """The reader of stdout went away (`cxltrain ... | head`): later writes, and the flush at exit,
    go nowhere instead of raising BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    # Before torch (imported lazily by the commands) starts OpenMP: libgomp's default spin-waiting
    # made runs 5-12x slower where other processes share the cores. A user's own value stays.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a distributed launch passes them on
    run: Callable[[argparse.Namespace], int] = args.run
    warnings.showwarning = _one_line_warning
    global _sigterm
    _sigterm = _StopOnSigterm()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm) if in_main_thread else None
    try:
        KNOBS.validate()
        return run(args)
    except TrainingStopped as e:  # asked for, not an error
        print(f"cxltrain: {e}", file=sys.stderr)
        return EXIT_TERMINATED
    except CxlTrainError as e:
        print(f"cxltrain: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except _Terminated:
        print("cxltrain: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("cxltrain: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
