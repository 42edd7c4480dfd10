"""The command line's data side: `train`'s file-data options, `data convert`, `eval` and `plot`.

The file-data options themselves are TrainConfig fields (options.py adds them); options.py calls
`resolve_train_data` before building the TrainConfig; main.py calls `add_commands` from build_parser. Imports stay lazy (the
command line starts without torch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import ConfigError

CRITEO_TABLES = 26
SYNTHETIC_STEPS = 400


def parse_rows(text: str) -> int | tuple[int, ...]:
    """--rows: one count for every table, or one per table ("40000000,39060,...")."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a comma-separated list of them") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text}: every row count must be at least 1")
    return values[0] if len(values) == 1 else tuple(values)


def resolve_train_data(args) -> dict:
    """The TrainConfig fields the data options decide, after refusing what means nothing for the data."""
    if args.data is not None:
        for flag, value in (("--pooling", args.pooling), ("--zipf", args.zipf_exponent)):
            if value is not None:
                raise ConfigError(f"{flag} shapes synthetic data only; a Criteo file has one id per table per "
                                  "sample and its own distribution (leave it out with --data)")
    elif args.epochs is not None:
        raise ConfigError("--epochs needs file data (--data): synthetic data is endless; use --steps")
    if args.epochs is not None and args.steps is not None:
        raise ConfigError("give --steps or --epochs, not both (--epochs sets the steps)")
    num_tables = args.num_tables if args.num_tables is not None else (
        CRITEO_TABLES if args.data is not None else args.default_num_tables)
    rows, table_rows = args.rows, None
    if isinstance(rows, tuple):
        if len(rows) != num_tables:
            raise ConfigError(f"--rows lists {len(rows)} row counts but there are {num_tables} tables")
        rows, table_rows = max(rows), rows
    fields = {"num_tables": num_tables, "rows": rows, "table_rows": table_rows, "epochs": args.epochs,
              "eval_every": args.eval_every, "eval_batches": args.eval_batches, "metrics": args.metrics,
              "prefetch": args.prefetch, "steps": args.steps if args.steps is not None else SYNTHETIC_STEPS}
    if args.pooling is not None:
        fields["pooling"] = args.pooling
    if args.zipf_exponent is not None:
        fields["zipf_exponent"] = args.zipf_exponent
    return fields


def add_commands(sub, positive_int, non_negative_int) -> None:
    _add_data(sub)
    _add_eval(sub, positive_int, non_negative_int)
    _add_plot(sub)


# -- data convert ----------------------------------------------------------------------------------

def _add_data(sub) -> None:
    d = sub.add_parser("data", help="prepare Criteo data for training (convert raw files to columns)",
                       description="Prepare Criteo data: `data convert` parses raw Criteo files once into a "
                                   "folder of numpy columns that `train --data FOLDER` reads by batch with no "
                                   "parsing, at any --rows and --seed.")
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(d))
    dsub.required = True
    c = dsub.add_parser("convert", help="raw Criteo files (plain or .gz, e.g. day_0 .. day_23) -> a columnar folder",
                        description="Parse SRC files in order (raw tab-separated or CSV layout, plain or gzipped) "
                                    "into OUT/: dense.npy, sparse.npy, labels.npy, the exception files and "
                                    "manifest.json. The categorical values are kept as they are and hashed to "
                                    "rows when training reads them, so one conversion serves every --rows and "
                                    "--seed.")
    c.add_argument("paths", nargs="+", metavar="PATH", help="source files, then the output folder last")
    # Conversion once took these; a script that still passes them gets a line saying why not.
    c.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    c.add_argument("--seed", default=None, help=argparse.SUPPRESS)
    c.add_argument("--json", action="store_true", help="print the manifest as the last line")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(run=_run_convert)


def _run_convert(args) -> int:
    from tqdm import tqdm

    from ..data.converted import convert
    from ..data.stream import file_size

    for flag in ("rows", "seed"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"data convert takes no --{flag}: the folder keeps the categorical values and "
                              f"serves any --{flag}; give it to `train`")
    if len(args.paths) < 2:
        raise ConfigError("data convert: give one or more source files, then the output folder")
    *sources, out = args.paths
    total = sum(file_size(s) for s in sources)
    bar = tqdm(total=total, desc="convert", unit="B", unit_scale=True, disable=None if not args.no_progress else True,
               file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    try:
        manifest = convert(sources, out, progress=bar.update)
    finally:
        bar.close()
    print(f"converted {len(sources)} file(s), {manifest['lines']:,} lines, into {out}")
    if args.json:
        print(json.dumps(manifest))
    return 0


# -- eval ------------------------------------------------------------------------------------------

def _add_eval(sub, positive_int, non_negative_int) -> None:
    e = sub.add_parser("eval", help="AUC and log loss of a pool's model on data (read-only: never writes the pool)",
                       description="Evaluate the model committed in POOL on batches of --data (a raw Criteo file, "
                                   "a converted folder or TorchRec's day_N_*.npy folder), read with the settings the pool was trained with. "
                                   "The pool is opened read-only; a pool with a batch to roll back is refused "
                                   "(run `cxltrain recover` first).")
    e.add_argument("pool", metavar="POOL")
    e.add_argument("--data", required=True, metavar="PATH",
                   help="raw Criteo file, converted folder or folder in TorchRec's npy layout")
    e.add_argument("--batches", type=positive_int, default=None, metavar="N",
                   help="evaluate the last N batches of the data, trained on or not (default: the batches "
                        "the pool's run never trained on)")
    e.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    e.set_defaults(run=_run_eval)


def _run_eval(args) -> int:
    from ..jobs.evaluate import evaluate_pool

    result = evaluate_pool(args.pool, args.data, batches=args.batches)
    print(f"{args.pool} at batch {result['batch']}: AUC {result['auc']:.4f}, log loss {result['logloss']:.4f} "
          f"on {result['batches']} batches ({result['samples']:,} samples) of {args.data}: {result['which']}")
    if args.json:
        print(json.dumps(result))
    return 0


# -- plot ------------------------------------------------------------------------------------------

def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="draw the loss and evaluation curves of a --metrics file (needs matplotlib)",
                       description="Draw the training loss, the held-out log loss and the held-out AUC against "
                                   "steps from a `train --metrics` JSONL file into a PNG, one line per run "
                                   "(matplotlib: `pip install cxltrain[bench]`).")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--out", metavar="PNG", help="where the picture goes (default FILE with .png)")
    p.set_defaults(run=_run_plot)


def _run_plot(args) -> int:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plot needs matplotlib, which is not installed (pip install 'cxltrain[bench]')") from None
    from ..jobs.metrics_log import split_runs

    points = _read_metrics(args.file)
    runs = split_runs(points)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = args.out or os.path.splitext(args.file)[0] + ".png"
    figure, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    panels = (("loss", "training loss", None), ("eval_logloss", "held-out log loss", "o"),
              ("eval_auc", "held-out AUC", "o"))
    for n, run in enumerate(runs, 1):
        label = f"run {n}" + (f" (pool {run[0]['run'][:8]})" if run[0].get("run") else "")
        for ax, (key, _, marker) in zip(axes, panels):
            drawn = [p for p in run if p.get(key) is not None]
            ax.plot([p["step"] for p in drawn], [p[key] for p in drawn], marker=marker, label=label)
    for ax, (_, ylabel, _) in zip(axes, panels):
        ax.set_ylabel(ylabel)
    evaluated = sum(p.get("eval_auc") is not None for p in points)
    if not evaluated:
        axes[1].text(0.5, 0.5, "no evaluations (train --eval-every N)", ha="center", transform=axes[1].transAxes)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole batches
    if len(runs) > 1:
        axes[0].legend(fontsize=8)
    figure.suptitle(f"{os.path.basename(args.file)}: {len(runs)} run(s), {len(points)} lines")
    figure.tight_layout()
    try:
        figure.savefig(out)
    except OSError as e:
        raise ConfigError(f"{out}: cannot write: {e.strerror}") from None
    finally:
        plt.close(figure)
    print(f"plot: {out} ({len(runs)} run(s), {len(points)} points, {evaluated} evaluations)")
    return 0


def _read_metrics(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    points = []
    for n, line in enumerate(lines, 1):
        try:
            point = json.loads(line)
            float(point["step"]), float(point["loss"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path}, line {n}: not a metrics line of `train --metrics`") from None
        points.append(point)
    if not points:
        raise ConfigError(f"{path}: no metrics lines")
    return points
