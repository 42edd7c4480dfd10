"""Tables larger than memory (docs/tiers.md): training inside a memory cgroup (v1) whose limit is
smaller than the tables, killed, resumed, and exported bit-equal to an uninterrupted run; and every
other command a user runs on such a pool (recover, pool check, eval, export, import) inside a limit
smaller than its tables too.

The cgroup charges everything the run holds: its anonymous memory (torch alone is ~270 MB here),
the emulated fast tier's tmpfs pages (ring, dense slots) and the capacity pool's page cache. So
the tables must outgrow a limit that still holds the process: 1.28 GB of tables (3x) under 400 MiB,
which makes this a slow test (the tables are written to the disk, then read back page by page).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from cxltrain.faults import CRASH_ENV, CrashPoint
from cxltrain.runtime.runtime import export_state
from helpers import assert_same_export, cxltrain, cxltrain_command, shm_tempdir, tier_folders, write_criteo

CGROUP_ROOT = "/sys/fs/cgroup/memory"
LIMIT = 400 << 20
GROUPS = itertools.count()
TABLES, ROWS, DIM, STEPS = 4, 1_250_000, 64, 6
ARGS = ["--num-tables", TABLES, "--rows", ROWS, "--dim", DIM, "--batch-size", 512, "--steps", STEPS, "--no-progress"]


@contextlib.contextmanager
def memory_cgroup(limit: int | None):
    """A memory cgroup of our own (limit in bytes, None: unlimited), removed afterwards; the test is
    skipped where none can be made."""
    if not os.path.isdir(CGROUP_ROOT) or not os.access(CGROUP_ROOT, os.W_OK):
        pytest.skip(f"needs cgroup v1's memory controller writable at {CGROUP_ROOT} (root)")
    path = os.path.join(CGROUP_ROOT, f"cxltrain-test-{os.getpid()}-{next(GROUPS)}")
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup at {path}: {e}")
    try:
        if limit is not None:
            with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit))
        yield path
    finally:
        os.rmdir(path)  # the children have exited: the group is empty


@pytest.fixture
def cgroup():
    with memory_cgroup(LIMIT) as path:
        yield path


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


# every command on a pool set of 192 MB of tables (3 x 250,000 rows x 64 floats) in the disk's capacity
# pool, some rows of each cached in the fast tier, inside a limit of HEADROOM more than the commands
# take on a tiny pool (Python and torch: measured, not guessed): a command that holds a table whole
# is killed there (the issue: `export` copied every table)
HEADROOM = 120 << 20
BIG = ["--num-tables", 3, "--rows", 250_000, "--dim", 64, "--batch-size", 512, "--cache-rows", 5_000, "--no-progress"]
TINY = ["--num-tables", 3, "--rows", 1_000, "--dim", 64, "--batch-size", 512, "--cache-rows", 100, "--no-progress"]


def peak_usage(pool: str, data, out: str) -> int:
    """The most memory `export` and `eval` of `pool` take at once (bytes: the cgroup's count)."""
    with memory_cgroup(None) as group:
        for args in (["export", pool, out], ["eval", pool, "--data", data, "--batches", 2]):
            done = in_cgroup(group, *args)
            assert done.returncode == 0, done.stderr
        return stat(group, "memory.max_usage_in_bytes")


@pytest.mark.slow
def test_every_command_runs_in_less_memory_than_the_tables(tmp_path):
    data = write_criteo(tmp_path / "day.txt", lines=1_200)
    with tier_folders("cxltrain-cmds-") as (fast, disk):
        tiny = cxltrain("train", "--pool", f"{fast}/tiny.pool", "--capacity-pool", f"{disk}/tiny.cap", *TINY,
                        "--steps", 2)
        assert tiny.returncode == 0, tiny.stderr
        limit = peak_usage(f"{fast}/tiny.pool", data, f"{disk}/tiny.pt") + HEADROOM
        assert 3 * 250_000 * 64 * 4 >= 3 * HEADROOM // 2  # the tables outgrow what the limit leaves free

        pool, ref = f"{fast}/big.pool", f"{disk}/ref.pt"
        trained = cxltrain("train", "--pool", pool, "--capacity-pool", f"{disk}/big.cap", *BIG, "--steps", 3)
        assert trained.returncode == 0, trained.stderr
        assert cxltrain("export", pool, ref).returncode == 0  # without a limit: what the limited one must equal
        # one batch more, killed before its commit: its stores are in the pool, for recover to roll back
        killed = cxltrain("train", "--pool", pool, "--capacity-pool", f"{disk}/big.cap", *BIG, "--steps", 4,
                          env={CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:1"})
        assert killed.returncode in (-9, 137), killed.stderr

        with memory_cgroup(limit) as group:
            for args in (["pool", "check", pool], ["recover", pool], ["pool", "check", pool],
                         ["eval", pool, "--data", data, "--batches", 2], ["export", pool, f"{disk}/out.pt"],
                         ["import", ref, f"{disk}/imported.pool"], ["export", f"{disk}/imported.pool",
                                                                     f"{disk}/imported.pt"]):
                done = in_cgroup(group, *args)
                assert done.returncode == 0, f"{args[0]}: {done.stderr}"
            with open(os.path.join(group, "memory.oom_control")) as f:
                assert "oom_kill 0" in f.read()  # nothing was killed for memory
            assert stat(group, "memory.max_usage_in_bytes") <= limit
        with open(ref, "rb") as a, open(f"{disk}/out.pt", "rb") as b:
            assert _same_bytes(a, b)  # the export under the limit is the one made without it, bit for bit
        expected = torch.load(ref, weights_only=True, mmap=True)
        imported = torch.load(f"{disk}/imported.pt", weights_only=True, mmap=True)
        assert imported["batch"] == expected["batch"] == 3
        assert all(torch.equal(imported["model"][k], expected["model"][k]) for k in expected["model"])


def _same_bytes(a, b, chunk: int = 16 << 20) -> bool:
    while True:
        x, y = a.read(chunk), b.read(chunk)
        if x != y:
            return False
        if not x:
            return True
