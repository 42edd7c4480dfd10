"""The emulated device's power-loss model (knob power_loss, CXLTRAIN_POWER_LOSS=1).

Each test runs a child that stores, persists some of it, and SIGKILLs itself; the parent then reads
the file's bytes directly. With the model on, the file holds exactly the persisted cache lines; with
it off, a kill loses nothing (the page cache is the media) — the contrast that shows the model, not
the kill, is what loses unpersisted stores.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from cxltrain.errors import ConfigError
from cxltrain.knobs import KNOBS, override
from cxltrain.pool.handle import Pool
from cxltrain.pool.info import inspect
from helpers import run_python

SIZE = 64 << 10
OLD = 0xAA  # what the file holds before the child runs

# Maps the file the way a pool does (backend "emulated", so the test does not depend on /dev/shm
# being tmpfs), runs the test's body, then dies as a power cut would.
PRELUDE = """
import os, signal, sys
import numpy as np
from cxltrain.devices.registry import map_device
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
dev = map_device(path, fd, os.fstat(fd).st_size, writable=True, backend="emulated")
print(repr(dev), flush=True)
"""
DIE = "\nos.kill(os.getpid(), signal.SIGKILL)\n"


def run_child(body: str, path, power_loss: str = "1", env: dict | None = None) -> str:
    """Run PRELUDE + body in a child that SIGKILLs itself; returns its stdout."""
    out = run_python(PRELUDE + body + DIE, path, env={"CXLTRAIN_POWER_LOSS": power_loss, **(env or {})})
    assert out.returncode == -signal.SIGKILL, out.stderr
    return out.stdout


def old_file(folder, name="dev.pool") -> str:
    path = folder / name
    path.write_bytes(bytes([OLD]) * SIZE)
    return str(path)


def file_bytes(path) -> np.ndarray:
    return np.frombuffer(open(path, "rb").read(), dtype=np.uint8)


STORES = """
dev.array[0:4096] = 1
dev.persist(0, 4096)                    # persisted
dev.array[8192:8292] = 2                # never persisted
dev.array[4096:4160] = 3
dev.persist(4096, 64)
dev.array[4096:4160] = 4                # overwrites a persisted line, not persisted again
print(int(dev.array[8192]), int(dev.array[4096]), flush=True)  # the process sees its own stores
"""


def test_persisted_stores_survive_and_unpersisted_ones_are_gone(shm_dir):
    path = old_file(shm_dir)
    out = run_child(STORES, path)
    assert "power-loss" in out and out.split("\n")[1] == "2 4"
    data = file_bytes(path)
    assert (data[0:4096] == 1).all()
    assert (data[4096:4160] == 3).all()        # the persisted value, not the later store
    assert (data[8192:8292] == OLD).all()      # gone: the file shows the old bytes
    assert (data[4160:8192] == OLD).all() and (data[8292:] == OLD).all()


def test_without_power_loss_the_same_unpersisted_stores_survive_the_kill(shm_dir):
    path = old_file(shm_dir)
    out = run_child(STORES, path, power_loss="0")
    assert "power-loss" not in out
    data = file_bytes(path)
    assert (data[8192:8292] == 2).all()        # survived: SIGKILL alone loses nothing
    assert (data[4096:4160] == 4).all()


def test_persist_rounds_out_to_whole_cache_lines(shm_dir):
    path = old_file(shm_dir)
    run_child("""
dev.array[64:128] = 7
dev.array[128:192] = 8
dev.persist(100, 1)          # one byte: its whole line [64, 128) goes, the next line does not
dev.array[960:1152] = 9
dev.persist(1023, 2)         # straddles a boundary: lines [960, 1024) and [1024, 1088), not [1088, 1152)
dev.array[2048:2112] = 5
dev.persist(2048, 0)         # nothing
""", path)
    data = file_bytes(path)
    assert (data[64:128] == 7).all()
    assert (data[128:192] == OLD).all()
    assert (data[960:1088] == 9).all()
    assert (data[1088:1152] == OLD).all()
    assert (data[2048:2112] == OLD).all()


def test_copy_persist_lands_exactly(shm_dir):
    path = old_file(shm_dir)
    run_child("""
dev.copy_persist(4100, bytes(range(1, 201)))
dev.copy_persist(8192, np.array([1.5, -2.25, 3.0], dtype=np.float64))
""", path)
    data = file_bytes(path)
    assert data[4100:4300].tolist() == list(range(1, 201))
    assert (data[4096:4100] == OLD).all() and (data[4300:8192] == OLD).all()  # line-mates unchanged
    assert data[8192:8216].view(np.float64).tolist() == [1.5, -2.25, 3.0]
    assert (data[8216:] == OLD).all()


def test_pool_killed_after_a_commit_opens_with_the_committed_root(shm_dir):
    path = shm_dir / "train.pool"
    body = """
from cxltrain.pool.handle import Pool
from cxltrain.pool.format import RegionKind
pool = Pool.create(sys.argv[1], 1 << 20, backend="emulated")
print(repr(pool.device), flush=True)
pool.add_region("t0.weight", RegionKind.TABLE_WEIGHTS, "float32", (100, 16), aligned_rows=True)
pool.array("t0.weight")[:] = 1.5
pool.persist_region("t0.weight")
pool.add_region("t1.weight", RegionKind.TABLE_WEIGHTS, "float32", (100, 16), aligned_rows=True)
pool.array("t1.weight")[:] = 2.5   # written, never persisted
pool.commit(batches_done=5)
"""
    out = subprocess.run([sys.executable, "-c", "import os, signal, sys\n" + body + DIE, str(path)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "CXLTRAIN_POWER_LOSS": "1"})
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert "power-loss" in out.stdout
    assert inspect(str(path)).ok
    with Pool.open(str(path), writable=False) as pool:
        assert pool.root.batches_done == 5 and list(pool.regions) == ["t0.weight", "t1.weight"]
        assert (pool.array("t0.weight") == 1.5).all()
        assert (pool.array("t1.weight") == 0.0).all()   # the unpersisted table is zeros after the kill


def test_the_media_holds_only_persisted_lines_while_the_process_runs(shm_dir):
    path = str(shm_dir / "live.pool")
    with override(power_loss=1):
        pool = Pool.create(path, 1 << 20, backend="emulated")
    with pool:
        dev = pool.device
        assert dev.kind == "emulated-cxl" and dev.power_loss and "power-loss" in repr(dev)
        offset = pool.superblock.data_offset
        dev.array[offset : offset + 128] = 6
        dev.persist(offset, 1)
        with open(path, "rb") as f:  # read() sees the file, i.e. the media
            f.seek(offset)
            seen = np.frombuffer(f.read(128), dtype=np.uint8)
        assert (seen[:64] == 6).all() and (seen[64:] == 0).all()
    with pytest.raises(ValueError, match="closed"):
        dev.persist(offset, 1)


def test_power_loss_knob_must_be_0_or_1(shm_dir):
    out = subprocess.run([sys.executable, "-c", "from cxltrain.knobs import KNOBS; KNOBS.validate()"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "CXLTRAIN_POWER_LOSS": "2"})
    assert out.returncode != 0 and "power_loss 2 must be 0 or 1" in out.stderr
    with pytest.raises(ConfigError, match="power_loss 2 must be 0 or 1"):
        dataclasses.replace(KNOBS, power_loss=2).validate()
    for value in (0, 1):
        dataclasses.replace(KNOBS, power_loss=value).validate()
    with override(power_loss=2), pytest.raises(ConfigError, match="power_loss 2"):
        Pool.create(str(shm_dir / "bad.pool"), 1 << 20, backend="emulated")
    assert not (shm_dir / "bad.pool").exists()


# ---------------------------------------------------------------------------------------------
# Persistence domains (knob `domain`, `train --power-loss --domain D`)
# ---------------------------------------------------------------------------------------------
def test_eadr_domain_keeps_every_store_without_a_flush(shm_dir):
    path = old_file(shm_dir)
    out = run_child(STORES, path, env={"CXLTRAIN_DOMAIN": "eadr"})
    assert "EADRCXLDevice" in out
    data = file_bytes(path)
    assert (data[0:4096] == 1).all()
    assert (data[8192:8292] == 2).all()      # never flushed, durable all the same: the caches persist
    assert (data[4096:4160] == 4).all()      # the last store, not the last persisted value


def test_volatile_domain_loses_even_persisted_stores(shm_dir):
    path = old_file(shm_dir)
    out = run_child(STORES, path, env={"CXLTRAIN_DOMAIN": "none"})
    assert "VolatileCXLDevice" in out
    assert (file_bytes(path) == OLD).all()   # power gone: volatile memory keeps nothing


def test_volatile_domain_keeps_everything_when_the_process_closes_normally(shm_dir):
    path = old_file(shm_dir)
    body = STORES + "dev.close()\nprint('closed', flush=True)\n"
    run_child(body, path, env={"CXLTRAIN_DOMAIN": "none"})
    data = file_bytes(path)
    assert (data[0:4096] == 1).all() and (data[8192:8292] == 2).all() and (data[4096:4160] == 4).all()


def test_domain_and_eviction_knobs_are_checked(shm_dir):
    with pytest.raises(ConfigError, match="persistence domain 'dram'"):
        dataclasses.replace(KNOBS, power_loss=1, domain="dram").validate()
    with pytest.raises(ConfigError, match="needs the power-loss model"):
        dataclasses.replace(KNOBS, power_loss=0, evict_rate=100).validate()
    with pytest.raises(ConfigError, match="needs the power-loss model"):
        dataclasses.replace(KNOBS, power_loss=1, domain="eadr", evict_rate=100).validate()
    with pytest.raises(ConfigError, match="evict_rate -1"):
        dataclasses.replace(KNOBS, power_loss=1, evict_rate=-1).validate()
    dataclasses.replace(KNOBS, power_loss=1, domain="adr", evict_rate=100).validate()
