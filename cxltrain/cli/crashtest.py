"""`cxltrain crashtest`: kill training at random moments and protocol points; prove recovery exact."""

from __future__ import annotations

import json
import sys

from .. import knobs
from ..errors import ConfigError
from ..knobs import KNOBS
from .common import EXIT_ERROR, non_negative_int, positive_int
from .emulation import add_emulation_options, emulation_knobs

# where no terminal shows the bar (a torture of hours under nohup): a progress line this often
LOG_EVERY_S = 600.0


def add_crashtest(sub) -> None:
    from ..faults import DIST_PLANTED, PLANTED

    c = sub.add_parser("crashtest", help="kill training at random moments and protocol points; prove recovery exact",
                       description="Run training in a child process, kill it (at random moments, at named points of "
                                   "the persistence protocol, at random device flushes, during recovery), recover, "
                                   "compare the export with an uninterrupted run bit for bit, resume and compare "
                                   "again. Exits non-zero on any mismatch, keeping the pool and printing the "
                                   "commands that replay it.")
    c.add_argument("--mode", choices=("single", "set", "ranks"), default="single",
                   help="what is killed: one pool (default); a pool set, its capacity pool on the disk under "
                        "the capacity crash model, with a hot-row cache; or `train --nproc-per-node 2` run "
                        "folders (one rank, both, or the launcher killed)")
    c.add_argument("--trials", type=positive_int, default=None, help="trials to run (default 50)")
    c.add_argument("--seed", type=non_negative_int, default=None, help="plan of the trials (default: random, printed)")
    c.add_argument("--trial", type=non_negative_int, default=None, metavar="K",
                   help="run only trial K of the seed's plan (to replay one)")
    c.add_argument("--first", type=non_negative_int, default=0, metavar="K",
                   help="start at trial K of the seed's plan of --trials N: trials K to N-1 (one long plan run "
                        "in parts, one after another or side by side)")
    c.add_argument("--plant", choices=PLANTED + DIST_PLANTED, default="",
                   help="plant a bug that breaks a persistence rule, to see the torture catch it (the "
                        "distributed runs' bugs with --mode ranks)")
    c.add_argument("--fail-fast", action="store_true", help="stop at the first mismatch")
    c.add_argument("--keep", metavar="DIR", help="where failing pools and logs are kept (default: a folder in "
                                                 "the temp dir named after the seed)")
    e = c.add_argument_group("every crash state of one commit (instead of trials; docs/testing.md)")
    e.add_argument("--enumerate", action="store_true",
                   help="record one batch's update and commit on the crash-model devices, for one pool and for "
                        "a pool set, and recover every state a power loss may leave (sampled where too many)")
    e.add_argument("--samples", type=positive_int, default=None, metavar="S",
                   help="with --enumerate: at most S states per fence interval that has too many to try all "
                        "(default 24)")
    e.add_argument("--exhaustive-atoms", type=non_negative_int, default=None, metavar="W",
                   help="with --enumerate: try every subset of an interval's dirty words/pages when it has at "
                        "most W of them (default 8, at most 16)")
    add_emulation_options(c)
    c.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(run=_run_crashtest)


def _run_crashtest(args) -> int:
    if args.enumerate:
        return _run_enumeration(args)
    if args.samples is not None or args.exhaustive_atoms is not None:
        raise ConfigError("--samples and --exhaustive-atoms need --enumerate")
    args.trials = 50 if args.trials is None else args.trials
    if args.first and args.trial is not None:
        raise ConfigError("--first and --trial: give one or the other")
    asked = 1 if args.trial is not None else args.trials - args.first  # trials this run is to make
    import random
    import time

    from tqdm import tqdm

    from ..jobs.crashtest import DeviceModel, Torture, summary
    from ..jobs.crashtest_ranks import RankTorture

    with knobs.override(**emulation_knobs(args)):
        device = DeviceModel(bool(KNOBS.power_loss), KNOBS.domain, KNOBS.evict_rate, KNOBS.persist_bandwidth)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    with knobs.override(threads=1):  # references and resumes in this process, as in the children
        common = dict(trials=args.trials, device=device, seed=seed, only=args.trial, first=args.first,
                      fail_fast=args.fail_fast, keep_dir=args.keep)
        if args.mode == "ranks":
            torture = RankTorture(plant=args.plant, **common)
        else:
            torture = Torture(plant=args.plant, pool_set=args.mode == "set", **common)
        plant = torture.plant
        from ..emulation.cxl import describe_model

        with knobs.override(**device.knobs(0)):
            model = describe_model()
        part = f" (trials {args.first} to {args.trials - 1} of its plan)" if args.first else ""
        print(f"crashtest --mode {args.mode}: seed {seed}, {asked} trial(s){part}, "
              f"device models {model}" + (f", planted bug {plant}" if plant else ""), flush=True)
        started = time.perf_counter()
        bar = tqdm(total=asked, desc="crashtest", unit="trial",
                   disable=None if not args.no_progress else True, file=sys.stderr, dynamic_ncols=True)
        exact, done, logged = [0], [0], [started]

        def show(result) -> None:
            exact[0] += result.exact
            done[0] += 1
            bar.update(1)
            bar.set_postfix(exact=exact[0], refresh=False)
            now = time.perf_counter()
            if bar.disable and not args.no_progress and now - logged[0] >= LOG_EVERY_S:
                logged[0] = now
                print(f"crashtest: {done[0]} of {asked} trial(s) done, {exact[0]} exact, "
                      f"{done[0] / (now - started):.2f} trials/s", file=sys.stderr, flush=True)
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
    print(f"{report['exact']}/{report['trials']} exact in {report['seconds']:.0f} s, "
          f"{report['trials'] / max(report['seconds'], 1e-9):.2f} trials/s ({kinds}; "
          f"{report['killed']} killed mid-run, recovered batches {report['recovered_batches']})"
          + (f"; interrupted after {report['trials']} of {asked} trials" if report["trials"] < asked
             and not (args.fail_fast and report["exact"] < report["trials"]) else ""))
    for result in results:
        if not result.exact:
            print(f"trial {result.plan.number} ({result.plan.describe()}) differs; replay with:")
            for line in torture.replay_commands(result.plan):
                print(f"  {line}")
    if args.json:
        print(json.dumps({"seed": seed, "mode": args.mode, "device_model": model, "plant": plant or None,
                          "asked": asked, **report}))
    return 0 if report["exact"] == report["trials"] == asked else EXIT_ERROR


def _run_enumeration(args) -> int:
    import random

    from ..jobs.crash_states import EXHAUSTIVE_ATOMS, SAMPLES, enumerate_commit

    given = [flag for flag, value in (("--trials", args.trials), ("--trial", args.trial), ("--keep", args.keep),
                                      ("--power-loss", args.power_loss), ("--domain", args.domain),
                                      ("--evict-rate", args.evict_rate), ("--persist-bandwidth", args.persist_bandwidth))
             if value is not None] + (["--fail-fast"] if args.fail_fast else []) + (["--first"] if args.first else [])
    if given:
        raise ConfigError(f"--enumerate runs no trials and chooses its own device models: drop {', '.join(given)}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    samples = SAMPLES if args.samples is None else args.samples
    exhaustive = EXHAUSTIVE_ATOMS if args.exhaustive_atoms is None else args.exhaustive_atoms
    if exhaustive > 16:
        raise ConfigError(f"--exhaustive-atoms {exhaustive}: at most 16 (2^16 states an interval)")
    if samples < 2:
        raise ConfigError(f"--samples {samples}: at least 2 (a crash keeping nothing, and one keeping everything)")
    print(f"crashtest --enumerate: seed {seed}, every subset of up to {exhaustive} dirty atoms, else at most "
          f"{samples} states per fence interval" + (f", planted bug {args.plant}" if args.plant else ""), flush=True)
    outcomes = []
    for pool_set in (False, True):
        outcome = enumerate_commit(pool_set=pool_set, plant=args.plant, seed=seed, exhaustive_atoms=exhaustive,
                                   samples=samples)
        outcomes.append(outcome)
        print(outcome.line(), flush=True)
        for problem in outcome.inexact[:3]:
            print(f"  inexact: {problem}")
    if args.json:
        print(json.dumps({"seed": seed, "plant": args.plant or None, "samples": samples,
                          "exhaustive_atoms": exhaustive, "commits": [o.to_json() for o in outcomes]}))
    return 0 if not any(o.inexact for o in outcomes) else EXIT_ERROR


