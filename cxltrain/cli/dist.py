"""The command line's distributed half: `train` on several ranks, and `recover`, `export`,
`pool info` and `import` on a run's directory. The one-rank commands hand over here (small hooks)."""

from __future__ import annotations

import json
import os
import sys
import threading

from ..errors import ConfigError, CxlTrainError
from ..runtime import manifest as run_dir

LAUNCHER_OPTIONS = ("--nproc-per-node", "--max-restarts")


def add_train_options(p) -> None:
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="train on N ranks of this machine (torch.distributed.run; --pool names a directory holding "
                        "one pool per rank and a manifest); under torchrun, its own --nproc-per-node decides")
    p.add_argument("--max-restarts", type=int, default=3, metavar="R",
                   help="with --nproc-per-node: times torchrun restarts the group after a rank dies (default 3)")
    p.add_argument("--sharding", default="auto", metavar="KIND[,KIND...]",
                   help="distributed runs: auto (default), table-wise, row-wise or data-parallel, for every table or "
                        "one per table")
    p.add_argument("--replicate-hot", default="auto", metavar="auto|off|FRACTION",
                   help="distributed runs: copy the most looked-up rows of the sharded tables on every rank, so their "
                        "lookups stay local, and send the other ids as bags or as distinct rows, per table: auto "
                        "(default: the rows and exchanges a cost model over the data's profile and the measured "
                        "links says send the fewest bytes), off (no copies, bags), or that fraction of each table's "
                        "rows (docs/distributed.md)")
    p.add_argument("--dist-timeout", type=float, default=60.0, metavar="S",
                   help="distributed runs: seconds a collective may wait for a peer before the rank gives up "
                        "(default 60)")


def distributed(args) -> bool:
    return args.nproc_per_node is not None or "TORCHELASTIC_RUN_ID" in os.environ


def config_of(args):
    from ..jobs.config import TrainConfig
    from .data import resolve_train_data

    fields = resolve_train_data(args)
    for flag, given in (("per-table --rows", fields["table_rows"] is not None), ("--metrics", fields["metrics"]),
                        ("--eval-every", fields["eval_every"]),
                        ("--capacity-pool", getattr(args, "capacity_pool", None) is not None)):  # train's only
        if given:
            raise ConfigError(f"{flag} is not supported by distributed runs (docs/distributed.md)")
    return TrainConfig(pool=args.pool, data=args.data, batch_size=args.batch_size, dim=args.dim, seed=args.seed,
                       checkpoint=args.checkpoint, dense_every=args.dense_every, mode=args.mode,
                       pipeline=args.pipeline, background_capture=args.background_capture,
                       sparse_lr=args.sparse_lr, dense_lr=args.dense_lr, optimizer=args.optimizer,
                       bottom_mlp=args.bottom_mlp, top_mlp=args.top_mlp, **fields)


def run_train(args, argv: list[str]) -> int:
    if not args.pool:
        raise ConfigError("a distributed run needs --pool DIR (a directory for one pool per rank and the manifest)")
    if "TORCHELASTIC_RUN_ID" not in os.environ and args.nproc_per_node != 1:
        return _launch(args, argv)
    from ..jobs.sharded_train import run_rank
    from .stop import end_rank_on_signal

    if args.nproc_per_node == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        _launch_checks(args, 1)  # one rank runs in this process: no launcher, no port
    elif threading.current_thread() is threading.main_thread():
        end_rank_on_signal()  # the agent's SIGTERM ends a rank at once, or soon where it is blocked
    from ..placement.replication import parse_setting

    result = run_rank(config_of(args), args.pool, sharding=args.sharding, timeout_s=args.dist_timeout,
                      progress=not args.no_progress, replicate_hot=parse_setting(args.replicate_hot))
    progress, group = result.progress, result.group
    if group.rank == 0:
        if progress.steps:
            print(f"trained batches {progress.start_batch}-{progress.batch - 1} on {group.world_size} rank(s) "
                  f"in {result.timings.seconds:.1f} s ({result.timings.seconds * 1000 / progress.steps:.1f} ms a "
                  f"step, {group.bytes_sent_per_batch / 1024:.1f} KiB sent per batch by rank 0); "
                  f"loss {result.quality.first_loss:.4f} -> {result.quality.final_loss:.4f}")
            if group.bytes_exchanged_per_batch is not None and group.predicted_bytes_per_batch is not None:
                print(f"exchanged {group.bytes_exchanged_per_batch / 1024:,.1f} KiB per timed batch by every rank "
                      f"(the cost model predicted {group.predicted_bytes_per_batch / 1024:,.1f} KiB); "
                      f"{group.replicated_rows:,} row(s) replicated")
        print(f"every rank's pool is committed at batch {progress.batch} ({args.pool})")
        if args.json:
            print(json.dumps(result.to_json()))
    return 0


def _launch(args, argv: list[str]) -> int:
    """Check what can be checked here (one line, no restarts), then run under torch.distributed.run."""
    _launch_checks(args, args.nproc_per_node)
    from ..jobs.sharded_train import launch

    return launch(_without_launcher_options(argv), args.nproc_per_node, args.max_restarts)


def _launch_checks(args, n: int) -> None:
    from ..jobs.sharded_settings import check_config, plan_for, settings_for
    from .common import check_memory

    if n < 1 or args.max_restarts < 0:
        raise ConfigError("--nproc-per-node must be >= 1 and --max-restarts >= 0")
    from ..placement.replication import parse_setting

    config = config_of(args)
    check_config(config, n)
    parse_setting(args.replicate_hot)  # refused here, in one line, before any rank starts
    check_memory(config, n)  # before any rank builds its model or makes its pool
    if run_dir.is_run_dir(args.pool):
        run_dir.check(args.pool, run_dir.read(args.pool), n, plan_for(config, n, args.sharding),
                      settings_for(config, args.sharding))
    elif os.path.exists(args.pool) and (not os.path.isdir(args.pool) or os.listdir(args.pool)):
        raise ConfigError(f"{args.pool}: exists and is not a distributed run's directory (no {run_dir.MANIFEST}); "
                          "a run of several ranks needs a directory of its own")


def _without_launcher_options(argv: list[str]) -> list[str]:
    """`train`'s arguments, without the command and the options the launcher consumed."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "train" and not out and i == argv.index("train"):
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCHER_OPTIONS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run_recover(path: str, as_json: bool) -> int:
    m = run_dir.read(path)  # refused here, before torch starts
    run_dir.check(path, m, m["world_size"], None, None)
    from ..runtime.group_recovery import recover_dir
    from ..runtime.run_check import refuse_damaged_run_dir

    refuse_damaged_run_dir(path)

    done = recover_dir(path)
    moved = [r for r in done if r.target != r.batch]
    print(f"recovered {path}: every rank at batch {done[0].batch} ({len(done)} rank(s); "
          f"{sum(r.records_restored for r in done)} undo records rolled back"
          + (f"; rank(s) {', '.join(str(r.rank) for r in moved)} brought back from a later commit)" if moved else ")"))
    if as_json:
        print(json.dumps({"batch": done[0].batch, "ranks": [r.__dict__ for r in done]}))
    return 0


def run_export(path: str, out: str, save, as_json: bool) -> int:
    from ..jobs.reshard import streamed_export_dir

    state = streamed_export_dir(path)
    save(state, out)
    print(f"exported {path} at batch {state['batch']} to {out} ({len(state['model'])} model tensors)")
    if as_json:
        print(json.dumps({"path": path, "out": out, "batch": state["batch"]}))
    return 0


def run_pool_info(path: str, as_json: bool) -> int:
    from ..placement.sharding import ShardingPlan
    from ..pool.info import inspect
    from ..runtime.run_check import check_run_dir

    m = run_dir.read(path)
    problems = check_run_dir(path).problems
    if problems and not as_json:  # the listing of a damaged run would only mislead: one line
        more = len(problems) - 1
        raise CxlTrainError(problems[0] + (f" (and {more} more problem(s): `cxltrain pool check` lists them)"
                                           if more else ""))
    ranks = []
    for r in range(m["world_size"]):
        pool = run_dir.pool_path(path, r)
        report = inspect(pool) if os.path.exists(pool) else None
        root = None if report is None else report.root
        ranks.append({"rank": r, "pool": pool, "batch": None if root is None else root.batches_done,
                      "problems": ["missing"] if report is None else list(report.problems)})
    if as_json:
        print(json.dumps({"run": m["run"], "world_size": m["world_size"], "state": m["state"], "plan": m["plan"],
                          "ranks": ranks}))
    else:
        print(f"{path}: distributed run {m['run']}, {m['world_size']} rank(s), {m['state']}")
        print(ShardingPlan.from_json(m["plan"]).describe())
        for r in ranks:
            print(f"  rank {r['rank']}: {r['pool']}, committed at batch {r['batch']}"
                  + (f"; {r['problems'][0]}" if r["problems"] else ""))
    return _say_problems(problems)


def run_pool_check(path: str, as_json: bool) -> int:
    """`pool check DIR`: every rank pool, and the manifest against each; exit 1 on a problem."""
    from ..runtime.run_check import check_run_dir

    found = check_run_dir(path)
    if not found.problems and not as_json:
        m = run_dir.read(path)
        print(f"ok: {path}: {m['world_size']} rank(s) of run {m['run']}, {m['state']}"
              + ("" if found.batch is None else f", every rank recoverable to batch {found.batch}"))
    if as_json:
        print(json.dumps({"path": path, "ok": not found.problems, "problems": found.problems, "batch": found.batch}))
    return _say_problems(found.problems)


def _say_problems(problems: list[str]) -> int:
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


# The TrainConfig fields that `import --nproc-per-node` takes: those that shape the tables and the run.
IMPORT_FIELDS = ("steps", "batch_size", "num_tables", "rows", "dim", "seed", "pooling", "zipf_exponent", "dense_every")


def add_import_options(i) -> None:
    """`cxltrain import`'s options for a distributed run's directory (recover_export.py adds the command)."""
    from ..jobs.config import TrainConfig

    d = TrainConfig()
    i.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="make a distributed run's directory (PATH) for N ranks, the tables re-sharded onto them; "
                        "then train it with the same options (docs/distributed.md)")
    from .options import config_options

    for field, option in config_options():  # train's flags, the values read as plainly as before
        if field.name in IMPORT_FIELDS:
            i.add_argument(option.flag, type=int if field.type == "int" else float, default=field.default,
                           dest=field.name, help=f"with --nproc-per-node: as for train (default {field.default})")
    i.add_argument("--sharding", default="auto", help="with --nproc-per-node: as for train (default auto)")
    i.set_defaults(data=None, checkpoint=d.checkpoint, mode=d.mode, pipeline=d.pipeline,
                   background_capture=False, epochs=None, eval_every=d.eval_every, eval_batches=d.eval_batches,
                   metrics=None, prefetch=d.prefetch, default_num_tables=d.num_tables, sparse_lr=d.sparse_lr,
                   dense_lr=d.dense_lr, optimizer=d.optimizer, bottom_mlp=d.bottom_mlp, top_mlp=d.top_mlp)


def run_import(args) -> int:
    """`cxltrain import OUT.pt DIR --nproc-per-node N`: args.source, args.path as recover_export.py names them."""
    from ..jobs.reshard import import_state

    n = args.nproc_per_node
    if n < 1:
        raise ConfigError("--nproc-per-node must be >= 1")
    args.pool = args.path
    g = import_state(args.source, args.path, config_of(args), n, args.sharding)
    print(f"imported {args.source} at batch {g} into {args.path}: {n} rank(s); continue with "
          f"`cxltrain train --nproc-per-node {n} --pool {args.path}` and the same options")
    if args.json:
        print(json.dumps({"dir": args.path, "batch": g, "world_size": n}))
    return 0


def run_bench(args) -> int:
    import sys

    from ..bench.dist import format_text, run

    results = run(args.quick, log=lambda line: print(f"bench: {line}", file=sys.stderr, flush=True))
    print(format_text(results))
    if args.json:
        print(json.dumps(results.to_json()))
    return 0
