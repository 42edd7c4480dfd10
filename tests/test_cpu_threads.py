"""A fresh process's first VML call runs on two threads and keeps VML's accurate kernel
(kernels/cpu_threads.py; docs/testing.md, "A run's first VML call", has the rates measured).

oneMKL 2024.2 picks a VML function's kernel on its first call; when that call is split between
threads, one of them sometimes runs a low-accuracy kernel on its chunk. A process that sets its
threads through torch alone (`vml_probe.py plain`) then gets a first sqrt unlike its second; one
that sets them through cxltrain's set_cpu_threads never should. Each process is a new interpreter
(the choice is made once per process, and a fork inherits it)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = os.path.join(os.path.dirname(__file__), "vml_probe.py")
PROCESSES = 32
AT_ONCE = 4   # two threads each: more threads than cores, as in a loaded test run


def first_calls_differing(plain: bool, processes: int = PROCESSES, at_once: int = AT_ONCE) -> int:
    """How many of `processes` fresh probes saw their first sqrt differ from their second."""
    # libgomp's default wait policy (its threads spin a while for work) makes the race likeliest; cxltrain's
    # commands spin briefly, then sleep (knobs.set_openmp_wait), which makes it rarer, not impossible
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    command = [sys.executable, PROBE, *(["plain"] if plain else [])]
    differing, running, started = 0, [], 0
    while started < processes or running:
        while started < processes and len(running) < at_once:
            running.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
            started += 1
        probe = running.pop(0)
        out, _ = probe.communicate(timeout=120)
        assert probe.returncode == 0 and out.strip() in ("0", "1"), out
        differing += int(out.strip())
    return differing


def test_first_vml_call_after_set_cpu_threads_is_accurate():
    assert first_calls_differing(plain=False) == 0
