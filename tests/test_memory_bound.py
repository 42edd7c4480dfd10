"""Tables larger than memory (docs/tiers.md): training inside a memory cgroup (v1) whose limit is
smaller than the tables, killed, resumed, and exported bit-equal to an uninterrupted run.

The cgroup charges everything the run holds: its anonymous memory (torch alone is ~270 MB here),
the emulated fast tier's tmpfs pages (ring, dense slots) and the capacity pool's page cache. So
the tables must outgrow a limit that still holds the process: 1.28 GB of tables (3x) under 400 MiB,
which makes this a slow test (the tables are written to the disk, then read back page by page).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from cxltrain.faults import CRASH_ENV, CrashPoint
from cxltrain.runtime.runtime import export_state
from helpers import assert_same_export, cxltrain, cxltrain_command, shm_tempdir

CGROUP_ROOT = "/sys/fs/cgroup/memory"
LIMIT = 400 << 20
TABLES, ROWS, DIM, STEPS = 4, 1_250_000, 64, 6
ARGS = ["--num-tables", TABLES, "--rows", ROWS, "--dim", DIM, "--batch-size", 512, "--steps", STEPS, "--no-progress"]


@pytest.fixture
def cgroup():
    """A memory cgroup of our own with LIMIT, removed afterwards; skipped where none can be made."""
    if not os.path.isdir(CGROUP_ROOT) or not os.access(CGROUP_ROOT, os.W_OK):
        pytest.skip(f"needs cgroup v1's memory controller writable at {CGROUP_ROOT} (root)")
    path = os.path.join(CGROUP_ROOT, f"cxltrain-test-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup at {path}: {e}")
    try:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(LIMIT))
        yield path
    finally:
        os.rmdir(path)  # the children have exited: the group is empty


def in_cgroup(group: str, *args, env=None):
    """`cxltrain args...` run inside `group` (the shell joins it, then execs the command)."""
    command = " ".join(f"'{a}'" for a in [*cxltrain_command(), *map(str, args)])
    script = f"echo $$ > {group}/cgroup.procs && exec {command}"
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


def stat(group: str, name: str) -> int:
    with open(os.path.join(group, name)) as f:
        return int(f.read().split()[0])


@pytest.mark.slow
def test_tables_larger_than_the_memory_limit_train_resume_and_match(cgroup):
    table_bytes = TABLES * ROWS * DIM * 4
    assert table_bytes >= 3 * LIMIT  # the bound: tables of at least 3x the memory limit
    disk = tempfile.mkdtemp(prefix="cxltrain-mem-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    try:
        with shm_tempdir("cxltrain-mem-") as fast:
            reference = cxltrain("train", "--pool", f"{fast}/ref.pool", "--capacity-pool", f"{disk}/ref.cap", *ARGS,
                                 timeout=900)
            assert reference.returncode == 0, reference.stderr
            expected = export_state(f"{fast}/ref.pool")
            os.unlink(f"{fast}/ref.pool")
            os.unlink(f"{disk}/ref.cap")

            run = ["train", "--pool", f"{fast}/m.pool", "--capacity-pool", f"{disk}/m.cap", *ARGS]
            killed = in_cgroup(cgroup, *run, env={CRASH_ENV: f"{CrashPoint.COMMIT_AFTER_ROOT}:3"})
            assert killed.returncode == -9 or killed.returncode == 137, killed.stderr
            resumed = in_cgroup(cgroup, *run)
            assert resumed.returncode == 0 and "resuming at batch 3" in resumed.stdout, resumed.stderr
            assert stat(cgroup, "memory.max_usage_in_bytes") <= LIMIT
            with open(os.path.join(cgroup, "memory.oom_control")) as f:
                assert "oom_kill 0" in f.read()  # nothing was killed for memory: the limit held the run
            assert_same_export(export_state(f"{fast}/m.pool"), expected)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
