"""`cxltrain bench`: checkpointing, recovery and table throughput against PyTorch baselines."""

from __future__ import annotations

import json
import os
import sys

from ..errors import ConfigError, CxlTrainError
from . import dist as dist_cli
from .common import positive_int

GPU_ONLY = ("device", "rows", "blocks", "steps")  # options of --gpu alone


def add_bench(sub) -> None:
    b = sub.add_parser("bench", help="measure checkpointing, recovery and table throughput against PyTorch baselines",
                       description="Measure, on one model, data set and machine: training step time under each "
                                   "checkpointing method (ours strict and relaxed, torch.save and DCP async_save "
                                   "every k batches) with the batches a crash loses; recovery time against table "
                                   "size; embedding lookup+update throughput against nn.EmbeddingBag and "
                                   "torchrec/FBGEMM; the machine's copy bandwidth. Takes minutes.")
    b.add_argument("--json", action="store_true", help="print the results as JSON as the last line")
    b.add_argument("--plot", metavar="FILE.png", help="plot step-time ratio against batches lost per crash "
                                                      "(needs matplotlib: the `bench` extra)")
    b.add_argument("--quick", action="store_true", help="a tiny model, in seconds: checks the bench runs, "
                                                        "its figures mean nothing")
    b.add_argument("--dist", action="store_true", help="distributed runs instead: step time strict vs off, bytes "
                                                       "exchanged per batch at 1, 2 and 4 ranks, and the group's "
                                                       "recovery after a kill (docs/distributed.md)")
    b.add_argument("--tiers", action="store_true",
                   help="the tiers side by side instead: all tables in the fast tier, in a capacity pool on the "
                        "disk (durable, and with checkpoint off), and with the hottest 2%% and 10%% of rows in "
                        "the hot-row cache, forcing and stealing; step time, hit rate and bytes read and written "
                        "per batch (docs/tiers.md; a few minutes)")
    b.add_argument("--capacity-dir", metavar="DIR", default=None,
                   help="with --tiers: the folder on block storage for the capacity pools (default /var/tmp)")
    b.add_argument("--gpu", action="store_true",
                   help="GPU runs instead: plain PyTorch with its tables in GPU memory against cxltrain's tables in "
                        "GPU memory, in the mapped pool, and in the pool with a hot-row cache, durability on and "
                        "off, at pooling 1 and 20, side by side; and the GPU's gather bandwidth over the link "
                        "(needs CUDA and CuPy; about 3 minutes)")
    b.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="with --gpu: where the runs go (default cuda; cpu runs the same path through torch's row "
                        "kernels, for tests, and skips the gather bandwidth)")
    b.add_argument("--rows", type=positive_int, default=None, metavar="N",
                   help="with --gpu: rows per table (default 1,000,000)")
    b.add_argument("--blocks", type=positive_int, default=None, metavar="N",
                   help="with --gpu: timed blocks of each run (default 12; under 10, no intervals)")
    b.add_argument("--steps", type=positive_int, default=None, metavar="K",
                   help="with --gpu: steps a block (default 5)")
    b.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    given = [f"--{name}" for name in GPU_ONLY if getattr(args, name) is not None]
    if given and not args.gpu:
        raise ConfigError(f"{', '.join(given)}: only with --gpu")
    if args.capacity_dir is not None and not args.tiers:
        raise ConfigError("--capacity-dir: only with --tiers")
    chosen = [f"--{name}" for name in ("gpu", "dist", "tiers") if getattr(args, name)]
    if len(chosen) > 1 or (chosen and args.plot):
        raise ConfigError(f"{', '.join(chosen)}: each runs on its own (and without --plot)")
    if args.gpu:
        return _run_gpu_bench(args)
    if args.dist:
        return dist_cli.run_bench(args)
    if args.tiers:
        return _run_tiers_bench(args)
    from ..bench.plot import require_matplotlib, save_plot
    from ..bench.report import format_text
    from ..bench.suite import full_plan, quick_plan, run_bench

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


def _run_tiers_bench(args) -> int:
    from ..devices.capacity import disk_dir

    folder = args.capacity_dir or disk_dir()
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"bench --tiers: {folder}: not a folder this user may write (--capacity-dir)")
    from ..bench import tiers
    from ..bench.suite import scratch_dir

    result = tiers.run_tiers(tiers.quick_plan() if args.quick else tiers.default_plan(), scratch_dir(), folder)
    print(tiers.format_tiers(result))
    if args.json:
        print(json.dumps(result.to_json()))
    return 0


def _run_gpu_bench(args) -> int:
    """`bench --gpu`: refused in one line where CUDA or CuPy is missing (unless --device cpu)."""
    import dataclasses

    import torch

    from ..bench import gpu
    from ..devices.gpu_mapping import gpu_problem

    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and (problem := gpu_problem()) is not None:
        raise ConfigError(f"bench --gpu: {problem} (--device cpu runs the same path on the CPU)")
    shapes = gpu.QUICK if args.quick else gpu.GpuShapes()
    changes = {"rows": args.rows, "blocks": args.blocks, "block_steps": args.steps}
    shapes = dataclasses.replace(shapes, **{k: v for k, v in changes.items() if v is not None})
    results = gpu.run(shapes, device, quick=args.quick,
                      log=lambda line: print(f"bench: {line}", file=sys.stderr, flush=True))
    print(gpu.format_text(results))
    if args.json:
        print(json.dumps(results))
    failed = gpu.failures(results)
    if failed:
        print(f"cxltrain: error: bench --gpu: {failed} measurement(s) failed (their lines say why)", file=sys.stderr)
    return 1 if failed else 0
