"""Whether a worker killed under two torchrun agents (several hosts, simulated: a c10d rendezvous on
127.0.0.1, one worker per agent) costs exactly one group restart and the run ends bit-exact: N
trials, each SIGKILLing rank 0's or rank 1's worker at a random moment of its training, the two
agents sharing one run folder or keeping one each (as hosts with no shared file system), each
run's export compared with the same run under one agent. Prints one line a trial and the count.

    python tools/multi_agent_kills.py N [--seed S] [--steps STEPS]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile

import torch

from cxltrain.jobs.agents import run_agents
from cxltrain.jobs.reshard import export_dir
from cxltrain.runtime import manifest as run_dir


def train_args(steps: int) -> list[str]:
    return ["--steps", str(steps), "--batch-size", "96", "--num-tables", "3", "--rows", "2000", "--dim", "16",
            "--sharding", "table-wise,row-wise,data-parallel", "--no-progress", "--dist-timeout", "30"]


def same_export(a: dict, b: dict) -> bool:
    return (a["batch"] == b["batch"] and a["model"].keys() == b["model"].keys()
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            and repr(a["optimizers"]) == repr(b["optimizers"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trials", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args()
    rng, train = random.Random(args.seed), train_args(args.steps)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = tempfile.mkdtemp(prefix="cxltrain-agent-kills-", dir=base)
    try:
        reference_dir = os.path.join(folder, "reference")
        done = subprocess.run([sys.executable, "-m", "cxltrain", "train", "--nproc-per-node", "2",
                               "--pool", reference_dir, *train], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(f"the reference run failed: {done.stderr.strip()}", file=sys.stderr)
            return 1
        reference = export_dir(reference_dir)
        good = 0
        for trial in range(args.trials):
            victim, shared, kill_after = rng.randrange(2), rng.random() < 0.5, rng.uniform(0.0, 2.0)
            trial_dir = os.path.join(folder, f"trial-{trial}")
            pools = [trial_dir] * 2 if shared else [f"{trial_dir}-host-0", f"{trial_dir}-host-1"]
            run = run_agents(pools, train, kill_after=kill_after, victim=victim)
            for rank, pool in enumerate(pools):  # every rank's pool in the first folder, as gathered from the hosts
                if pool != pools[0]:
                    shutil.copy(run_dir.pool_path(pool, rank), run_dir.pool_path(pools[0], rank))
            exact = run.ok and same_export(export_dir(pools[0]), reference)
            ok = exact and run.attempts == 2 and run.killed is not None
            good += ok
            print(f"trial {trial}: rank {victim} killed {kill_after:.2f} s into training, "
                  f"{'one shared folder' if shared else 'a folder per agent'}: agents exited {run.returncodes}, "
                  f"{run.attempts - 1} restart(s), {'exact' if exact else 'NOT exact'}{'' if ok else '  <-- FAILED'}",
                  flush=True)
            if not ok:
                for i, out in enumerate(run.outputs):
                    print(f"--- agent {i}:\n{out[-4000:]}", flush=True)
            for pool in set(pools):
                shutil.rmtree(pool, ignore_errors=True)
        print(f"{good} of {args.trials} trials exact with one group restart each")
        return 0 if good == args.trials else 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
