"""Several hosts, simulated on this machine: torchrun agents, one worker each, meeting at a c10d
rendezvous on 127.0.0.1 (docs/distributed.md, "Several hosts"), optionally with one worker
SIGKILLed at a moment of the caller's. What tests/test_multi_agent.py and tools/multi_agent_kills.py
run; the group's restarts are counted from the worker processes the agents started.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from .processes import alive, children, rank_of

STARTED = "rank(s): training from batch 0"  # rank 0's line once the fresh group is open
POLL_S = 0.05


@dataclass
class AgentsRun:
    """What one run of the agents did: each agent's exit status (None: still running at the
    deadline, then killed) and output (its worker's included), and every worker process seen."""

    returncodes: list[int | None]
    outputs: list[str]
    workers: set[int] = field(default_factory=set)
    killed: int | None = None  # the worker SIGKILLed, if any

    @property
    def attempts(self) -> int:
        """How many times the group was started: one worker per agent per attempt."""
        return len(self.workers) // len(self.returncodes)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range: the rendezvous binds it
    seconds later, and until then any process's outgoing connection could take a port of that range
    (the agents would then fail to bind it and the rendezvous with them)."""
    low = _ephemeral_low()
    below = range(max(1024, low - 8192), low)
    # not the process's `random`: seeded alike (seed_everything), two processes would pick alike
    for port in random.SystemRandom().sample(below, min(64, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address: the store listens on all of them
            except OSError:
                continue  # taken: another listener there
            return port
    with socket.socket() as s:  # no room below the range (an unusual ip_local_port_range)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def agent_command(endpoint: str, run_id: str, nnodes: int, max_restarts: int, pool: str,
                  train_args: list[str]) -> list[str]:
    """One host's command: torchrun's agent of one worker running `cxltrain train`."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            "-m", "cxltrain", "train", "--pool", pool, *train_args]


def run_agents(pools: list[str], train_args: list[str], *, kill_after: float | None = None, victim: int = 1,
               max_restarts: int = 3, timeout_s: float = 240.0) -> AgentsRun:
    """Start one agent per entry of `pools` (that agent's --pool: one folder for all, as on a shared
    file system, or one each, as on hosts that share none) and wait for them. kill_after: seconds
    after the fresh group started training when the worker of rank `victim` is SIGKILLed."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    agents = [subprocess.Popen(agent_command(f"127.0.0.1:{port}", f"cxltrain-{port}", len(pools), max_restarts,
                                             pool, train_args),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for pool in pools]
    outputs: list[list[str]] = [[] for _ in agents]
    readers = [threading.Thread(target=lambda a=a, out=out: out.extend(a.stdout), daemon=True)
               for a, out in zip(agents, outputs)]
    for reader in readers:
        reader.start()
    run = AgentsRun([None] * len(agents), [])
    deadline, started, timed_out = time.monotonic() + timeout_s, None, [True] * len(agents)
    try:
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            workers = [w for a in agents for w in children(a.pid)]
            run.workers.update(workers)
            if started is None and any(STARTED in line for out in outputs for line in list(out)):
                started = time.monotonic()
            if kill_after is not None and run.killed is None and started is not None \
                    and time.monotonic() - started >= kill_after:
                run.killed = next((w for w in workers if rank_of(w) == victim), None)
                if run.killed is not None:
                    os.kill(run.killed, signal.SIGKILL)
            time.sleep(POLL_S)
        timed_out = [a.poll() is None for a in agents]
    finally:
        for a in agents:  # past the deadline: nothing of this run may outlive it
            if a.poll() is None:
                for worker in children(a.pid):
                    if alive(worker):
                        os.kill(worker, signal.SIGKILL)
                a.kill()
            a.wait()
        for reader in readers:
            reader.join(timeout=10)
    run.returncodes = [None if late else a.returncode for a, late in zip(agents, timed_out)]
    run.outputs = ["".join(out) for out in outputs]
    return run
