"""Helpers the test files share: comparisons, child processes, the command line, reference runs and
a generated Criteo file. Import them as `from helpers import ...` (pytest puts tests/ on sys.path:
the folder has no __init__.py, so its files are imported by their bare names)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cxltrain.data import Batch
from cxltrain.devices import libpmem
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.crashtest import References

# The emulated device lets a kernel persist its own stores (the fused capture) through libpmem;
# without libpmem (the GPU machine) only its power-loss model does, so tests that need that and no
# particular model take this one.
STREAMING_MODEL = 0 if libpmem.load() is not None else 1
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# past it a test dumps its threads and its xdist worker exits (conftest); slow tests get four times it
TEST_TIMEOUT_S = float(os.environ.get("CXLTRAIN_TEST_TIMEOUT", "300"))
SHARED_CRITEO_SAMPLE = SHARED_DATA / "criteo_sample.csv"   # CI checks shared/ out beside the repo


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------
def assert_same_batch(a: Batch, b: Batch) -> None:
    """Two batches are equal: same number, and every tensor (dense, labels, ids, offsets) equal."""
    assert a.index == b.index
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.labels, b.labels)
    assert len(a.values) == len(b.values) == len(a.offsets) == len(b.offsets)
    for x, y in zip(a.values + a.offsets, b.values + b.offsets):
        assert torch.equal(x, y)


def assert_same_export(a: dict, b: dict) -> None:
    """Two `export_state` results are equal: batch, every model tensor, optimizers and schedulers."""
    assert a["batch"] == b["batch"]
    assert a["model"].keys() == b["model"].keys()
    differ = [key for key in a["model"] if not torch.equal(a["model"][key], b["model"][key])]
    assert not differ, "tensors differ: " + "; ".join(_difference(key, a["model"][key], b["model"][key]) for key in differ)
    assert repr(a["optimizers"]) == repr(b["optimizers"]) and a["schedulers"] == b["schedulers"]


def _difference(key: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """How two tensors differ, for a failure message: every differing key with where, so a rare
    inexact recovery says which rows it touched (the first differing key alone would not)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{key} {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if a.dim() == 0:
        return f"{key} {a.item()!r} vs {b.item()!r}"
    unequal = a != b
    where = torch.nonzero(unequal.reshape(a.shape[0], -1).any(dim=1)).reshape(-1)
    gap = (a.double() - b.double()).abs().max().item()
    return f"{key} {int(unequal.sum())} element(s) in rows {where[:8].tolist()}, largest gap {gap:.3g}"


# ---------------------------------------------------------------------------------------------
# Folders and child processes
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def shm_tempdir(prefix: str):
    """A private folder on the memory-backed file system (the emulated CXL device's home), removed
    afterwards; an ordinary temporary folder where there is no /dev/shm."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def tier_folders(prefix: str):
    """(fast-tier folder on /dev/shm, capacity-tier folder on the disk), both removed afterwards."""
    disk = tempfile.mkdtemp(prefix=prefix, dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    try:
        with shm_tempdir(prefix) as fast:
            yield fast, disk
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def bare_set(fast: str, disk: str, name: str) -> str:
    """A pool set of two empty pools, made with the pool API alone; returns its capacity pool's path."""
    from cxltrain.devices.capacity import open_capacity
    from cxltrain.pool.handle import Pool

    with Pool.create(os.path.join(fast, f"{name}.pool"), 1 << 20) as primary:
        capacity = os.path.join(disk, f"{name}.cap")
        primary.add_member(Pool.create(capacity, 1 << 20, mapper=open_capacity))
    return capacity


def run_python(code: str, *args, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -c code args...` in a child with this environment plus `env`; output captured as text."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def run_and_kill(cmd: list[str], *, env: dict | None = None, kill_after: float | None = None,
                 ready_lines: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `cmd`; with kill_after, SIGKILL it that many seconds after it has printed `ready_lines`
    lines (its signal that the part worth killing is next). Output captured as text."""
    full_env = {**os.environ, **(env or {})}
    prefix = cxltrain_command()
    if FORK_COMMANDS and cmd[:len(prefix)] == prefix:
        proc = ForkedCommand(cmd[len(prefix):], full_env)
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
    if kill_after is not None:
        for _ in range(ready_lines):
            proc.stdout.readline()
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------
def cxltrain_command() -> list[str]:
    """The command that runs the command line: the installed script, or `python -m cxltrain`."""
    script = Path(sys.executable).with_name("cxltrain")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cxltrain"]


def cxltrain(*args, env=None, timeout=300, **popen) -> subprocess.CompletedProcess:
    """Run the command line; `popen`: more subprocess.run arguments (cwd=, user=, preexec_fn=)."""
    argv = [str(a) for a in args]
    full_env = {**os.environ, **(env or {})}
    if FORK_COMMANDS and set(popen) <= {"cwd"}:
        proc = ForkedCommand(argv, full_env, cwd=popen.get("cwd"))
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(cxltrain_command() + argv, proc.returncode, out, err)
    return subprocess.run(cxltrain_command() + argv, capture_output=True, text=True, timeout=timeout,
                          env=full_env, **popen)


# ---------------------------------------------------------------------------------------------
# Commands forked from a preloaded interpreter (tests/zygote.py says why and how)
# ---------------------------------------------------------------------------------------------
# CXLTRAIN_TEST_EXEC=1 starts every command as a new interpreter instead.
FORK_COMMANDS = os.environ.get("CXLTRAIN_TEST_EXEC", "0") != "1"


class _Zygote:
    """The zygote of this test process, started on first use and ended with the process."""

    _of_process: dict[int, _Zygote] = {}

    @classmethod
    def get(cls) -> _Zygote:
        if os.getpid() not in cls._of_process:
            cls._of_process[os.getpid()] = cls()
        return cls._of_process[os.getpid()]

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="cxltrain-zygote-")
        self.address = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py")), self.address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the test zygote did not start (exit {self.proc.wait()})")
        atexit.register(self.close)

    def close(self) -> None:
        self.proc.stdin.close()  # its signal to end
        self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


class ForkedCommand:
    """`cxltrain ARGV` as a process forked from the zygote, with subprocess.Popen's interface for
    what the tests use: pid, stdout/stderr (text pipes), poll, wait, communicate, send_signal, kill."""

    def __init__(self, argv: list[str], env: dict, cwd: str | os.PathLike | None = None) -> None:
        self.args = argv
        self.returncode: int | None = None
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_Zygote.get().address)
        request = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd())}
        socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], [stdin, out_write, err_write])
        for fd in (stdin, out_write, err_write):
            os.close(fd)
        self.stdout = open(out_read)
        self.stderr = open(err_read)
        self._received = b""
        self._readers: list[threading.Thread] = []
        self._output: dict[str, str] = {}
        self.pid = self._message(None)["pid"]

    def _message(self, timeout: float | None) -> dict:
        """The zygote's next message; TimeoutExpired when none comes within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            more = self._conn.recv(4096)
            if not more:
                raise RuntimeError("the test zygote went away")
            self._received += more
        line, _, self._received = self._received.partition(b"\n")
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._message(timeout)["returncode"]
            self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read both pipes to their end and wait; TimeoutExpired leaves the readers running."""
        if not self._readers:
            for name, pipe in (("out", self.stdout), ("err", self.stderr)):
                reader = threading.Thread(target=lambda n=name, p=pipe: self._output.__setitem__(n, p.read()),
                                          daemon=True)
                reader.start()
                self._readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.stdout.close()
        self.stderr.close()
        return self._output["out"], self._output["err"]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # ended and reaped by the zygote already: as Popen.send_signal, a no-op

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Reference runs
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def references(config: TrainConfig, folder: str) -> References:
    """Exports of uninterrupted runs of `config`, one per batch count, made once per folder."""
    return References(config, folder)


def reference_export(config: TrainConfig, batches: int, folder: str) -> dict:
    """Export of an uninterrupted run of `batches` batches of `config` on a fresh pool (cached)."""
    return references(config, folder)(batches)


# ---------------------------------------------------------------------------------------------
# A Criteo file of our own
# ---------------------------------------------------------------------------------------------
CRITEO_HEADER = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
C1_DISTINCT = 27   # distinct C1 values in a generated file (as in the shared sample's 200 lines)


def criteo_rows(lines: int = 200, seed: int = 0) -> list[list[str]]:
    """`lines` rows of the raw Criteo layout's 40 fields, deterministic from `seed`: a 0/1 label
    (about a quarter clicks), I1..I13 integers (some negative, some missing: ''), C1..C26 8-hex-digit
    hashes or '' (C1 never missing, with exactly C1_DISTINCT values, each used at least once)."""
    assert lines >= C1_DISTINCT
    rng = np.random.default_rng(seed)
    vocabularies = [[f"{int(v):08x}" for v in rng.integers(0, 1 << 32, size)]
                    for size in [C1_DISTINCT, *rng.integers(2, 500, 25)]]
    rows = []
    for i in range(lines):
        label = str(int(rng.random() < 0.25))
        ints = []
        for _ in range(13):
            kind = rng.random()
            ints.append("" if kind < 0.2 else str(-int(rng.integers(1, 4))) if kind < 0.25
                        else str(int(rng.integers(0, 10_000))))
        cats = [vocabularies[0][i] if i < C1_DISTINCT else str(rng.choice(vocabularies[0]))]
        for vocabulary in vocabularies[1:]:
            cats.append("" if rng.random() < 0.1 else str(rng.choice(vocabulary)))
        rows.append([label, *ints, *cats])
    return rows


def write_criteo(path: Path, lines: int = 200, seed: int = 0, layout: str = "raw") -> Path:
    """A generated Criteo file at `path` (see criteo_rows). layout "raw": what users have (Kaggle
    train.txt, Terabyte day_N: tab-separated, no header, integers as integers); "csv": the shared
    sample's layout (a header row, comma-separated, integers written as floats: `260.0`)."""
    rows = criteo_rows(lines, seed)
    if layout == "raw":
        text = "".join("\t".join(row) + "\n" for row in rows)
    elif layout == "csv":
        as_floats = [[r[0], *(f"{int(v)}.0" if v else "" for v in r[1:14]), *r[14:]] for r in rows]
        text = "".join(",".join(row) + "\n" for row in [list(CRITEO_HEADER), *as_floats])
    else:
        raise ValueError(f"layout must be 'raw' or 'csv', not {layout!r}")
    path.write_text(text)
    return path


def shared_criteo_sample() -> Path:
    """The real shared sample (CSV layout, with header); skips the test that asks where it is absent
    (CI checks shared/ out beside the repo; a copy of the tree elsewhere, as on the GPU machine, may not)."""
    if not SHARED_CRITEO_SAMPLE.is_file():
        pytest.skip(f"shared Criteo sample not found at {SHARED_CRITEO_SAMPLE} (shared/ sits beside the repo)")
    return SHARED_CRITEO_SAMPLE


def shared_sample_rows() -> list[list[str]]:
    """The shared sample's 200 real Criteo lines as lists of their 40 fields (CSV; counts as "260.0")."""
    lines = shared_criteo_sample().read_text().splitlines()[1:]
    return [line.split(",") for line in lines]


def write_torchrec_days(folder: Path, rows: list[list[str]], day_lines: list[int]) -> Path:
    """`rows` (lists of the 40 raw fields) as a folder in TorchRec's preprocessed layout: day_N_dense.npy
    [n, 13] float32 log(I + 3), day_N_sparse.npy [n, 26] int32 (the hex values' 32 bits), day_N_labels.npy
    [n, 1] int32, missing values 0 — the files, dtypes and shapes TorchRec's Criteo preprocessing writes.
    Day N holds the next day_lines[N] rows."""
    assert sum(day_lines) == len(rows)
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for day, count in enumerate(day_lines):
        part = rows[start:start + count]
        start += count
        counts = np.array([[int(float(v or "0")) for v in r[1:14]] for r in part], dtype=np.int32)
        sparse = np.array([[int(v or "0", 16) for v in r[14:40]] for r in part], dtype=np.uint32).view(np.int32)
        labels = np.array([[int(r[0])] for r in part], dtype=np.int32)
        np.save(folder / f"day_{day}_dense.npy", np.log((counts + 3).astype(np.float32)))
        np.save(folder / f"day_{day}_sparse.npy", sparse)
        np.save(folder / f"day_{day}_labels.npy", labels)
    return folder
