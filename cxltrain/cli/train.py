"""`cxltrain train` (one rank; dist.py takes several) and `cxltrain plan`, which takes its options."""

from __future__ import annotations

import json
import os
import sys

from .. import knobs
from ..errors import ConfigError
from ..knobs import KNOBS
from . import dist as dist_cli
from . import stop
from .common import check_memory, positive_float
from .emulation import add_emulation_options, check_emulated, emulation_knobs
from .options import add_config_options, config_fields
from .resume import given_options, take_stored


def add_train(sub) -> None:
    from ..jobs.config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train DLRM with its tables in a persistent pool (the main job)",
                       description="Train DLRM on deterministic synthetic Criteo-like data, embedding tables in a "
                                   "persistent pool (by default an emulated CXL pool on /dev/shm).")
    add_config_options(p)  # the TrainConfig fields that carry an option (jobs/config.py)
    add_emulation_options(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--profile", action="store_true", help="after the run, where a batch's time went, per phase, "
                                                          "from the step split and the checkpoint's counters")
    p.set_defaults(run=_run_train, default_num_tables=d.num_tables, train_parser=p)
    dist_cli.add_train_options(p)  # --nproc-per-node, --sharding, ...: docs/distributed.md
    return p


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
    if not os.access(folder, os.W_OK):  # EROFS or no permission: "free" space there means nothing
        raise ConfigError(f"{path}: cannot create the pool: {folder} is not writable (a read-only file system, "
                          "or no permission)")
    if pool_size > free:
        raise ConfigError(f"{path}: not enough space for the pool: it needs {pool_size:,} bytes, "
                          f"{free:,} are free in {folder}")


def train_config(args):
    """The TrainConfig of `train`'s (and `plan`'s) options."""
    from ..jobs.config import TrainConfig

    return TrainConfig(**config_fields(args))


def _run_train(args) -> int:
    if dist_cli.distributed(args):  # several ranks: docs/distributed.md
        if args.profile:
            raise ConfigError("--profile profiles one process; leave it out with several ranks")
        with knobs.override(**emulation_knobs(args)):
            return dist_cli.run_train(args, args.argv)
    from ..devices import resolve_backend
    from ..emulation import default_pool_path
    from ..emulation.cxl import SHM, memory_dir
    from ..jobs.profile import measured, measured_text, profile_text
    from ..jobs.resume import lr_change, stored_metadata
    from ..jobs.train import pool_bytes, train
    from ..jobs.train_text import result_lines

    with knobs.override(**emulation_knobs(args)):  # the re-point writes the primary: on the modelled device
        moved = _repoint_capacity_pool(args)
    stored = stored_metadata(args.pool) if args.pool is not None else None
    # a pool that holds a run resumes it: the options left out are its own (cli/resume.py)
    taken = [] if stored is None else take_stored(args, given_options(args.train_parser, args.argv[1:]), stored,
                                                   args.pool)
    if moved is not None:
        args.capacity_pool = moved
    config = train_config(args)
    config.validate()
    check_memory(config)  # first: a model too big for memory must not even be built
    emulation = emulation_knobs(args)
    pool_size = pool_bytes(config)
    path = args.pool or default_pool_path(pool_size)
    check_emulated(path, emulation)
    _check_pool_space(path, pool_size)
    # validated; what the run is, said once the pool is open and recovered (on_ready), so that a run
    # refused on the way there prints its one line and nothing before it
    notes = []
    if args.pool is None and not path.startswith(SHM + "/") and memory_dir() == SHM:
        notes.append(f"note: /dev/shm has no room for the pool; using {path} (not memory-backed: slower, "
                     "and not an emulated CXL device)")
    rows = config.rows_per_table()
    table_gb = sum(rows) * args.dim * 4 / 1e9
    shown = f"{rows[0]:,}" if len(set(rows)) == 1 else f"up to {max(rows):,}"
    length = f"{config.epochs} epoch(s)" if config.epochs is not None else f"{config.steps} steps"
    banner = [f"pool {path}: {config.num_tables} tables x {shown} rows x {args.dim} dims "
              f"({table_gb:.2f} GB), batch {args.batch_size}, {length}"]
    if taken:
        banner.append(f"resuming with the pool's settings: {' '.join(taken)}")
    change = lr_change(stored, config) if stored is not None else None

    def on_ready(rt) -> None:
        for note in notes:
            print(note, file=sys.stderr)
        if (KNOBS.power_loss or KNOBS.persist_bandwidth) and resolve_backend(path) == "emulated":
            from ..emulation.cxl import describe_model

            banner.append(f"emulated device models {describe_model()}")
        print("\n".join(banner), flush=True)
        if change is not None and rt.resumed_metadata is not None:
            print(f"learning rate changed on resume: {_lr_text(*change)}, from batch {rt.start_batch} "
                  "(recorded in the pool with its next commit: a later resume keeps it)", flush=True)
        _say_where_training_starts(rt)

    with knobs.override(**emulation):
        result = train(config, pool_path=path, progress=not args.no_progress, on_ready=on_ready,
                       stop=stop.current.requested)
    for line in result_lines(result, config):
        print(line)
    figures = measured(result) if args.profile else None
    if args.profile:
        print(profile_text(result))
        if figures is not None:
            print(measured_text(figures))
    if args.json:
        print(json.dumps({**result.to_json(), **({"measured": figures} if args.profile else {})}))
    return 0


def _repoint_capacity_pool(args) -> str | None:
    """A set whose capacity pool was moved: `--capacity-pool NEW` re-points it (pool/repoint.py),
    said in one line. Returns the capacity pool a resume without the option must take: the path
    the set records, which a re-point changed and its snapshot's remembered settings may not yet."""
    from ..pool.repoint import recorded_paths, repoint

    if args.pool is None or not os.path.exists(args.pool):
        return None
    if args.capacity_pool is not None:
        said = repoint(args.pool, args.capacity_pool)
        if said is not None:
            print(said, flush=True)
        return None
    recorded = recorded_paths(args.pool)
    return recorded[0] if len(recorded) == 1 else None


def _lr_text(before: dict, after: dict) -> str:
    """"--lr 0.001 -> 0.01" for each learning rate that changed."""
    flags = {"dense_lr": "--lr", "sparse_lr": "--sparse-lr"}
    return ", ".join(f"{flags[name]} {before[name]:g} -> {after[name]:g}" for name in before
                     if before[name] != after[name])


def _say_where_training_starts(rt) -> None:
    stop.current.arm()  # from here a SIGTERM stops the loop at a batch boundary
    if rt.restarted:
        print(f"note: {rt.path} held these tables but no committed checkpoint (a run with --checkpoint off was "
              "interrupted); training restarts at batch 0", file=sys.stderr)
    if rt.recovered_batch is not None:
        print(f"{rt.recovery.describe(rt.path, rt.recovery_seconds)}; resuming at batch {rt.start_batch}",
              flush=True)
    else:
        print(f"training from batch {rt.start_batch}", flush=True)


def add_plan(sub, train) -> None:
    p = sub.add_parser("plan", help="print where a pool set's tables would go, without training",
                       description="Print the placement plan `train` would use with the same options (docs/"
                                   "planner.md): per table its tier, the hot rows cached in the fast tier and "
                                   "the expected hit rate; for a new set, the cache size and write-back interval "
                                   "a step model chooses from the measured tiers, and the train command that "
                                   "uses them; for an existing pool set, the plan it stores. "
                                   "Takes train's options (a train command line with plan in place of train); "
                                   "those that do not decide the plan are ignored. Never writes a pool.")
    for action in train._actions:  # the same options as train, spelled and checked once
        if action.dest != "help":
            p._add_action(action)
    p.add_argument("--no-measure", action="store_false", dest="measure",
                   help="do not measure the tiers, and so choose no cache size or write-back interval")
    p.add_argument("--fast-step-ms", type=positive_float, default=None, metavar="MS",
                   help="the step with every table in the fast tier, for the step model (default: measured by a "
                        "short run of the model with smaller tables)")
    p.set_defaults(run=_run_plan, default_num_tables=train.get_default("default_num_tables"))


def _run_plan(args) -> int:
    from ..emulation import default_pool_path
    from ..jobs.planning import measure_tiers, plan_for
    from ..jobs.step_plan import choose_configuration
    from ..jobs.train import build_model, build_source
    from ..placement.planner import format_plan
    from ..placement.step_model import format_choice

    config = train_config(args)
    config.validate()
    if config.capacity_pool is None:
        raise ConfigError("plan places tables in a pool set: give --capacity-pool (and --fast-bytes)")
    path = args.pool or default_pool_path(0)
    plan = plan_for(config, build_model(config), build_source(config), path)
    if plan is None:
        raise ConfigError(f"{path}: this pool set was made without a placement plan: every table is in its "
                          "capacity pool")
    if args.measure:  # the probes write beside the pools
        for option, target in (("--pool", path), ("--capacity-pool", config.capacity_pool)):
            folder = os.path.dirname(os.path.abspath(target))
            if not os.path.isdir(folder):
                raise ConfigError(f"{option} {target}: no such folder {folder} (plan measures the tier there)")
    tiers = measure_tiers(path, config.capacity_pool) if args.measure else None
    print(format_plan(plan, tiers))
    choice = None
    if os.path.exists(path):
        print("an existing pool set keeps its plan: no cache size or write-back interval to choose")
    elif not args.measure:
        print("no cache size or write-back interval chosen: --no-measure")
    else:
        choice = choose_configuration(config, build_model(config), build_source(config), path, args.fast_step_ms)
        print(format_choice(choice.priced, choice.chosen, choice.fast_step_how))
        print(f"to train with it: cxltrain train {' '.join(_train_argv(args.argv, choice.chosen))}")
    if args.json:
        print(json.dumps({"pool": path, "plan": plan.to_json(), "tiers": tiers,
                          "choice": None if choice is None else choice.to_json()}))
    return 0


def _train_argv(argv: list[str], chosen) -> list[str]:
    """`plan`'s options as `train` takes them, with the chosen --cache-rows and --write-back-every."""
    from ..placement.step_model import train_options

    dropped = {"--json": 0, "--no-measure": 0, "--fast-step-ms": 1, "--cache-rows": 1, "--write-back-every": 1}
    kept, skip = [], 0
    for arg in argv[1:]:
        name = arg.split("=", 1)[0]
        if skip:
            skip -= 1
        elif name in dropped:
            skip = dropped[name] if "=" not in arg else 0
        else:
            kept.append(arg)
    return [*kept, *train_options(chosen).split()]
