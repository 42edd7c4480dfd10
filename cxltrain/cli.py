"""The `cxltrain` command line.

Every command has --help, prints a machine-readable summary as its last stdout line with --json,
and on bad input prints one line, `cxltrain: error: ...`, to stderr and exits non-zero (2 for
usage errors, 1 for everything else) — never a traceback for an error it can name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from typing import Callable, Sequence

from .errors import CxlTrainError
from .knobs import KNOBS

EXIT_ERROR = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the command, not a usage dump."""

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
    from .config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train DLRM with its tables in a persistent pool (the main job)",
                       description="Train DLRM on deterministic synthetic Criteo-like data, embedding tables in a "
                                   "persistent pool (by default an emulated CXL pool on /dev/shm).")
    p.add_argument("--pool", metavar="PATH", help="pool file or DAX device (default: an emulated CXL pool in "
                                                 "/dev/shm, or the temp folder)")
    p.add_argument("--data", metavar="FILE", help="raw Criteo file (tab-separated label, I1..I13, C1..C26; "
                                                 "Kaggle train.txt, Terabyte day_N) instead of synthetic data; "
                                                 "--rows is then the hash buckets per categorical feature")
    p.add_argument("--steps", type=_positive_int, default=d.steps, help=f"total batches of the run (default {d.steps})")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help=f"default {d.batch_size}")
    p.add_argument("--num-tables", type=_positive_int, default=d.num_tables, help=f"default {d.num_tables}")
    p.add_argument("--rows", type=_positive_int, default=d.rows, help=f"rows per table (default {d.rows:,})")
    p.add_argument("--dim", type=_positive_int, default=d.dim, help=f"embedding dim (default {d.dim})")
    p.add_argument("--seed", type=_non_negative_int, default=d.seed, help=f"default {d.seed}")
    p.add_argument("--pooling", type=_positive_int, default=d.pooling,
                   help=f"ids per table per sample (default {d.pooling})")
    p.add_argument("--zipf", type=_positive_float, default=d.zipf_exponent, dest="zipf_exponent",
                   help=f"Zipf exponent of the id distribution (default {d.zipf_exponent})")
    p.add_argument("--checkpoint", choices=("undo", "off"), default=d.checkpoint,
                   help="undo: every batch durable, a crash costs at most the batch in flight (default); "
                        "off: the pool is consistent only when the run ends")
    p.add_argument("--dense-every", type=_positive_int, default=d.dense_every, metavar="K",
                   help=f"dense snapshot and commit every K batches (default {d.dense_every})")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_train)


def _run_train(args) -> int:
    from .emulation import default_pool_path
    from .config import TrainConfig
    from .trainer import train

    config = TrainConfig(pool=args.pool, data=args.data, steps=args.steps, batch_size=args.batch_size, num_tables=args.num_tables,
                         rows=args.rows, dim=args.dim, seed=args.seed, pooling=args.pooling,
                         zipf_exponent=args.zipf_exponent, checkpoint=args.checkpoint, dense_every=args.dense_every)
    config.validate()
    path = args.pool
    if path is None:
        from .trainer import pool_bytes

        path = default_pool_path(pool_bytes(config))
        if not path.startswith("/dev/shm/") and os.path.isdir("/dev/shm"):
            print(f"note: /dev/shm has no room for the pool; using {path} (not memory-backed: slower, "
                  "and not an emulated CXL device)", file=sys.stderr)
    table_gb = args.num_tables * args.rows * args.dim * 4 / 1e9
    print(f"pool {path}: {args.num_tables} tables x {args.rows:,} rows x {args.dim} dims "
          f"({table_gb:.2f} GB), batch {args.batch_size}, {args.steps} steps", flush=True)
    result = train(config, pool_path=path, progress=not args.no_progress, on_ready=_say_where_training_starts)
    if result.steps == 0:
        print(f"nothing to train: the pool is at batch {result.batch}, --steps is {args.steps}")
    else:
        s = result.split_ms
        print(f"trained {result.steps} batches in {result.seconds:.1f} s ({result.steps_per_s:.1f} steps/s) "
              f"on {result.device}; loss {result.first_loss:.4f} -> {result.final_loss:.4f}")
        print(f"step {s.total:.1f} ms = data {s.data:.1f} + embedding forward {s.embedding_forward:.1f} "
              f"+ embedding backward/update {s.embedding_backward_update:.1f} + checkpoint {s.checkpoint:.1f} "
              f"+ MLP {s.mlp:.1f}; {result.rows_updated_per_batch:,.0f} rows updated per batch")
    if result.checkpoint == "undo":
        print(f"checkpoint: every batch durable (undo log + dense snapshot every {args.dense_every}); "
              f"the pool is committed at batch {result.batch}")
    if result.train_auc is None:
        pass
    elif result.eval_auc is None:
        print(f"final AUC {result.train_auc:.4f} (last batches; the data file has no batches left to hold out)")
    else:
        print(f"final AUC {result.eval_auc:.4f} (held-out), {result.train_auc:.4f} (last batches); "
              f"eval logloss {result.eval_logloss:.4f}")
    if args.json:
        print(json.dumps(result.to_json()))
    return 0


def _say_where_training_starts(rt) -> None:
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
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=_run_export)


def _recovered(path: str, report, seconds: float) -> str:
    return (f"recovered {path} to batch {report.batch} in {seconds * 1000:.1f} ms (rolled back "
            f"{report.records_restored} undo records, {report.rows_restored:,} rows, of "
            f"{report.batches_rolled_back} uncommitted batch(es))")


def _run_recover(args) -> int:
    from .runtime import recover_pool

    report = recover_pool(args.path)
    print(_recovered(args.path, report, report.seconds))
    if args.json:
        print(json.dumps(report.to_json()))
    return 0


def _run_export(args) -> int:
    import torch

    from .runtime import export_state

    if os.path.exists(args.out):
        raise CxlTrainError(f"{args.out}: already exists; not overwriting it")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.access(folder, os.W_OK | os.X_OK):  # before recovery writes to the pool
        raise CxlTrainError(f"{args.out}: cannot write into {folder}")
    state = export_state(args.path)
    partial = f"{args.out}.partial"
    try:
        with open(partial, "xb") as f:
            torch.save(state, f)
        os.replace(partial, args.out)  # never a half-written export under the asked-for name
    except OSError as e:
        if os.path.exists(partial):
            os.unlink(partial)
        raise CxlTrainError(f"{args.out}: cannot write: {e.strerror}") from None
    tensors = len(state["model"])
    print(f"exported {args.path} at batch {state['batch']} to {args.out} ({tensors} model tensors)")
    if args.json:
        print(json.dumps({"path": args.path, "out": args.out, "batch": state["batch"]}))
    return 0


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
    from .devices import is_char_device
    from .pool import Pool

    size = args.size
    if size is None and not is_char_device(args.path):
        size = parse_size("64M")
    with Pool.create(args.path, size) as pool:
        summary = {"path": pool.path, "size": pool.superblock.pool_size, "device": pool.device.kind,
                   "uuid": pool.superblock.uuid.hex()}
    print(f"created {args.path}: {summary['size']:,} bytes on {summary['device']}")
    if args.json:
        print(json.dumps(summary))
    return 0


def _report_json(report) -> dict:
    sb = report.superblock
    return {
        "path": report.path,
        "ok": report.ok,
        "problems": report.problems,
        "file_size": report.file_size,
        "superblock": None if sb is None else {
            "version": sb.version, "uuid": sb.uuid.hex(), "pool_size": sb.pool_size, "created_ns": sb.created_ns,
            "dir_capacity": sb.dir_capacity, "data_offset": sb.data_offset, "region_align": sb.region_align,
            "row_align": sb.row_align},
        "roots": [{"slot": "AB"[s.slot], "state": s.state, "reason": s.reason,
                   **({"seq": s.root.seq, "dir_count": s.root.dir_count, "batch": s.root.batch,
                       "ring_generation": s.root.ring_generation, "ring_start": s.root.ring_start,
                       "ring_start_seq": s.root.ring_start_seq,
                       "dense_slot": " AB"[s.root.dense_slot].strip() or None, "dense_batch": s.root.dense_batch}
                      if s.root else {})}
                  for s in report.slots],
        "batch": None if report.root is None else report.root.batch,
        "regions": [{"name": r.name, "kind": r.kind.name.lower(), "dtype": r.dtype.numpy.name, "shape": list(r.shape),
                     "offset": r.offset, "size": r.size, "row_stride": r.row_stride} for r in report.regions],
    }


def _inspect_or_fail(path: str):
    from .pool import inspect

    report = inspect(path)
    if report.superblock is None or report.root is None:
        raise CxlTrainError(f"{path}: {report.problems[0]}")
    return report


def _run_pool_info(args) -> int:
    report = _inspect_or_fail(args.path)
    sb = report.superblock
    print(f"pool {report.path}: format v{sb.version}, {sb.pool_size:,} bytes, uuid {sb.uuid.hex()}")
    for s in report.slots:
        detail = (f"seq {s.root.seq}, batch {s.root.batch}, {s.root.dir_count} regions" if s.root
                  else s.reason or "never written")
        if s.root is not None and s.root.dense_slot:
            detail += (f", dense snapshot in slot {' AB'[s.root.dense_slot]} (batch {s.root.dense_batch}), undo ring "
                       f"generation {s.root.ring_generation} from offset {s.root.ring_start}")
        winner = " (current)" if s.root is not None and s.root == report.root else ""
        print(f"root {'AB'[s.slot]}: {s.state}{winner}: {detail}")
    print(f"{'region':<24} {'kind':<18} {'dtype':<8} {'shape':<18} {'offset':>14} {'bytes':>14}")
    for r in report.regions:
        shape = "x".join(str(d) for d in r.shape)
        print(f"{r.name:<24} {r.kind.name.lower():<18} {r.dtype.numpy.name:<8} {shape:<18} {r.offset:>14,} {r.size:>14,}")
    return _finish_report(report, args.json)


def _finish_report(report, as_json: bool) -> int:
    """Problems to stderr, one line each; the JSON summary last; exit 1 if anything is wrong."""
    for problem in report.problems:
        print(f"{report.path}: {problem}", file=sys.stderr)
    if as_json:
        print(json.dumps(_report_json(report)))
    return 0 if report.ok else EXIT_ERROR


def _run_pool_check(args) -> int:
    from .pool import inspect

    report = inspect(args.path)
    if report.ok:
        print(f"ok: {report.path}: {len(report.regions)} regions, root seq {report.root.seq}, batch {report.root.batch}")
    return _finish_report(report, args.json)


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
    b.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    from .bench.plot import require_matplotlib, save_plot
    from .bench.report import format_text
    from .bench.suite import full_plan, quick_plan, run_bench

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
        print(json.dumps(results))
    return 0


# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cxltrain", description="Train recommendation models whose embedding tables live in "
                                                  "persistent memory (PMEM, CXL, or an emulated CXL pool).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_train(sub)
    _add_recover_export(sub)
    _add_pool(sub)
    _add_bench(sub)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"cxltrain: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    warnings.showwarning = _one_line_warning
    try:
        KNOBS.validate()
        return run(args)
    except CxlTrainError as e:
        print(f"cxltrain: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("cxltrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
