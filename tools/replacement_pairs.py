"""Whether re-placing the hot-row cache pays: the bench's tiered model with 10% of its rows cached
and stealing (write-back every 16 batches, as `bench --tiers`' steal-10%), trained side by side in
one process with the same set re-placing its caches every K batches (`--cache-replace-every K`, one
run per K given), and the all-fast baseline. Timed from the batch after the hot lists' profile, as
the bench times; a K past the last timed batch counts the lookups and never re-places.

    python tools/replacement_pairs.py [--every 16 64] [--capacity-dir /var/tmp] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile

from cxltrain.bench.interval import interval_text, ratio_interval
from cxltrain.bench.paired import paired_runs
from cxltrain.bench.suite import scratch_dir
from cxltrain.bench.tiers import STEAL_EVERY, default_plan, io_counters, quick_plan
from cxltrain.jobs.planning import hot_list_batches

CACHED = 0.10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=int, nargs="+", default=[16, 64], help="re-placement intervals K, a run each")
    p.add_argument("--capacity-dir", default="/var/tmp", help="a folder on the disk for the capacity pools")
    p.add_argument("--quick", action="store_true", help="seconds, for tests: the figures mean nothing")
    a = p.parse_args()
    if any(k < 1 for k in a.every):
        p.error("--every: each K must be at least 1")
    plan = quick_plan() if a.quick else default_plan()
    base = plan.config
    stealing = {"cache_rows": max(1, int(base.rows * CACHED)), "write_back_every": STEAL_EVERY}
    disk = tempfile.mkdtemp(prefix="cxltrain-replacement-", dir=a.capacity_dir)
    fast = tempfile.mkdtemp(prefix="cxltrain-replacement-", dir=scratch_dir())  # memory-backed, as the bench's
    names = ["all fast", f"{CACHED:.0%} cached, steal {STEAL_EVERY}", *(f"the same, re-placed every {k}" for k in a.every)]
    configs = [base, dataclasses.replace(base, capacity_pool=os.path.join(disk, "steal.cap"), **stealing),
               *(dataclasses.replace(base, capacity_pool=os.path.join(disk, f"every-{k}.cap"), cache_replace_every=k,
                                     **stealing) for k in a.every)]
    pools = [os.path.join(fast, f"{i}.pool") for i in range(len(configs))]
    try:
        runs = paired_runs(configs, pools, warmup=plan.warmup, blocks=plan.blocks, block_steps=plan.block_steps,
                           probe=io_counters, first_batch=hot_list_batches(base))
    finally:
        for folder in (disk, fast):
            shutil.rmtree(folder, ignore_errors=True)
    steps = plan.blocks * plan.block_steps
    print(f"{base.num_tables} tables x {base.rows:,} rows x {base.dim}, batch {base.batch_size}, "
          f"{plan.blocks} blocks of {plan.block_steps} steps each, side by side")
    stealing_blocks = runs[1].block_seconds
    for i, (name, run) in enumerate(zip(names, runs)):
        seconds, io = run.block_seconds, run.probe_totals
        hits = f"{io['hits'] / io['lookups']:.1%}" if io.get("lookups") else "-"
        against = "" if i < 2 else (f"  {sum(seconds) / sum(stealing_blocks):.2f}x the stealing run "
                                    f"({interval_text(*(ratio_interval(stealing_blocks, seconds) or (None, None)))})")
        print(f"{name:<32} {1000 * sum(seconds) / steps:7.1f} ms/step  hit rate {hits:>6}  "
              f"{io.get('write_bytes', 0.0) / steps / 1e6:6.2f} MB written/batch{against}")


if __name__ == "__main__":
    main()
