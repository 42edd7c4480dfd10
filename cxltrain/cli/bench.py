"""`cxltrain bench`: checkpointing, recovery and table throughput against PyTorch baselines."""

from __future__ import annotations

import json
import os
import sys

from ..errors import CxlTrainError
from . import dist as dist_cli


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
    b.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    if args.dist:
        return dist_cli.run_bench(args)
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
