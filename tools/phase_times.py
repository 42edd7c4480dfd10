"""Where a strict batch's checkpoint time goes on the training thread, per function (docs/speed.md).

Runs `cxltrain train` on a fresh pool in /dev/shm with the given options, each of the functions
below wrapped in a timer, and prints the milliseconds per batch spent in each (and its calls per
batch). The wrappers add ~1 us a call; the functions nest (the fused layout holds the sort and the
placement; the boundary holds the dense snapshot), so the rows do not add up.

    .venv/bin/python tools/phase_times.py --pooling 1 --steps 150
    .venv/bin/python tools/phase_times.py --native --checkpoint off --pooling 1 --steps 150

--native also times every call into native code: the row kernels' extension and the emulated
device's persistence hooks (libpmem's flush, drain and copy). The same run with `--checkpoint off`
gives what an unchecked step spends there; the difference is what the checkpoint adds in native
code, and the rest of its overhead is Python.
"""

from __future__ import annotations

import collections
import os
import sys
import time

from cxltrain.checkpoint import checkpointer, codec, dense, ring
from cxltrain.cli import main as cli_main
from cxltrain.emulation import cxl
from cxltrain.kernels import native, ops

# (owner, attribute, what it is)
TIMED = (
    (checkpointer.Checkpointer, "_plan_fused", "fused layout, all of it"),
    (ops, "unique_rows_and_order", "  the lookups' sort (the kernel's, done once)"),
    (ring.UndoRing, "plan_chunks", "  placement and headers"),
    (ops, "_fused_plan", "kernel plan checks"),
    (ring.UndoRing, "land", "records taken in"),
    (checkpointer.Checkpointer, "after_update", "after each update: landing, and the row flush unless the kernel did it"),
    (checkpointer.Checkpointer, "end_batch", "batch boundary, all of it"),
    (dense.DenseState, "capture", "  dense state_dicts and RNG"),
    (codec.LayoutCache, "lay_out", "  snapshot layout"),
    (dense, "write_payload", "  snapshot copy and checksum"),
)


def native_calls() -> tuple:
    """(owner, attribute, label) of every native entry point a step can reach."""
    timed = []
    if native._LIB is not None:
        timed += [(native._LIB, name, f"native {name}") for name in sorted(dir(native._LIB))
                  if not name.startswith("_") and callable(getattr(native._LIB, name))]
    # the emulated device's persistence hooks: libpmem's flush, drain and non-temporal copy
    timed += [(cxl.EmulatedCXLDevice, name, f"device {name}")
              for name in ("_write_back", "_fence", "_store_persist", "_persist_streamed")]
    return tuple(timed)


def main() -> None:
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    timed_calls = TIMED
    if "--native" in sys.argv:
        sys.argv.remove("--native")
        timed_calls += native_calls()
    # the counters as each table update starts: batch 0 (warm-up and the pool's set-up) and the
    # last batch (the run's final commit, evaluation) are left out of the figures
    at_update: list[tuple[dict, dict]] = []
    update = ops.sparse_update

    def counted_update(*args, **kwargs):
        at_update.append((dict(seconds), dict(calls)))
        return update(*args, **kwargs)

    ops.sparse_update = counted_update
    for owner, name, label in timed_calls:
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
    tables = len(at_update) // steps
    if steps < 3 or not tables or len(at_update) != tables * steps:
        raise SystemExit(f"phase_times: {len(at_update)} table updates in what it took for {steps} batches; "
                         "give the run's length as `--steps N` (3 or more, two words), with tables that update")
    (seconds_0, calls_0), (seconds_1, calls_1) = at_update[tables], at_update[tables * (steps - 1)]
    batches = steps - 2
    print(f"{'ms per batch':>14}  calls/batch  (batches 1 to {steps - 2}, load {os.getloadavg()[0]:.2f})")
    for _, _, label in timed_calls:
        spent = seconds_1.get(label, 0.0) - seconds_0.get(label, 0.0)
        count = calls_1.get(label, 0) - calls_0.get(label, 0)
        if count:
            print(f"{1000 * spent / batches:14.3f}  {count / batches:11.1f}  {label}")


if __name__ == "__main__":
    main()
