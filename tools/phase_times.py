"""Where a strict batch's checkpoint time goes on the training thread, per function (docs/speed.md).

Runs `cxltrain train` on a fresh pool in /dev/shm with the given options, each of the functions
below wrapped in a timer, and prints the milliseconds per batch spent in each (and its calls per
batch). The wrappers add ~1 us a call; the functions nest (the fused layout holds the sort and the
placement; the boundary holds the dense snapshot), so the rows do not add up.

    .venv/bin/python tools/phase_times.py --pooling 1 --steps 150
"""

from __future__ import annotations

import collections
import os
import sys
import time

from cxltrain.checkpoint import checkpointer, codec, dense, ring
from cxltrain.cli import main as cli_main
from cxltrain.kernels import ops

# (owner, attribute, what it is)
TIMED = (
    (checkpointer.Checkpointer, "_plan_fused", "fused layout, all of it"),
    (ops, "unique_rows_and_order", "  the lookups' sort (the kernel's, done once)"),
    (ring.UndoRing, "plan_chunks", "  placement and headers"),
    (ops, "_fused_plan", "kernel plan checks"),
    (ring.UndoRing, "land", "records taken in"),
    (checkpointer.Checkpointer, "after_update", "row flushes"),
    (checkpointer.Checkpointer, "end_batch", "batch boundary, all of it"),
    (dense.DenseState, "capture", "  dense state_dicts and RNG"),
    (codec.LayoutCache, "lay_out", "  snapshot layout"),
    (dense, "write_payload", "  snapshot copy and checksum"),
)


def main() -> None:
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for owner, name, label in TIMED:
        timed = getattr(owner, name)

        def wrapper(*args, _timed=timed, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _timed(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - started
                calls[_label] += 1

        setattr(owner, name, wrapper)
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 400
    pool = f"/dev/shm/phase-times-{os.getpid()}.pool"
    sys.argv = ["cxltrain", "train", "--pool", pool, "--no-progress", *sys.argv[1:]]
    try:
        cli_main()
    finally:
        if os.path.exists(pool):
            os.unlink(pool)
    print(f"{'ms per batch':>14}  calls/batch  ({steps} batches, load {os.getloadavg()[0]:.2f})")
    for _, _, label in TIMED:
        print(f"{1000 * seconds[label] / steps:14.3f}  {calls[label] / steps:11.1f}  {label}")


if __name__ == "__main__":
    main()
