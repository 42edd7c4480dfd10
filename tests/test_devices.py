"""Each device backend maps, persists and reopens a pool the same way."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from cxltrain.devices import libpmem, resolve_backend
from cxltrain.devices.mounts import mount_of
from cxltrain.errors import DeviceError
from cxltrain.knobs import KNOBS, override
from cxltrain.pool.format import RegionKind
from cxltrain.pool.handle import Pool

BACKENDS = ["msync", "emulated"] + (["pmem"] if libpmem.load() is not None else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_round_trip(shm_dir, tmp_path, backend):
    folder = shm_dir if backend == "emulated" else tmp_path
    path = str(folder / f"{backend}.pool")
    with Pool.create(path, 1 << 20, backend=backend) as pool:
        assert pool.device.kind == {"emulated": "emulated-cxl"}.get(backend, backend)
        pool.add_region("r", RegionKind.BLOB, "float64", (100, 3), aligned_rows=True)
        pool.array("r")[:] = np.arange(300, dtype=np.float64).reshape(100, 3)
        pool.device.flush(pool.region("r").offset, 100)
        pool.device.drain()
        pool.persist_region("r")
        pool.device.copy_persist(pool.region("r").offset, np.array([-1.0]))
        pool.commit(batches_done=3)
    with Pool.open(path, backend=backend) as pool:
        assert pool.root.batches_done == 3
        assert pool.array("r")[0, 0] == -1.0 and pool.array("r")[99, 2] == 299.0


def test_auto_picks_emulated_on_tmpfs_and_a_file_backend_elsewhere(shm_dir, tmp_path):
    mount = mount_of(str(shm_dir))
    if mount is None or not mount.is_memory_backed:
        pytest.skip("/dev/shm is not a memory-backed file system here")
    assert resolve_backend(str(shm_dir / "x.pool"), "auto") == "emulated"
    if not mount_of(str(tmp_path)).is_memory_backed:
        expected = "pmem" if libpmem.load() is not None else "msync"
        assert resolve_backend(str(tmp_path / "x.pool"), "auto") == expected


def test_knob_override_restores_even_on_error(shm_dir):
    before = KNOBS.device
    with pytest.raises(RuntimeError):
        with override(device="msync"):
            assert resolve_backend(str(shm_dir / "x.pool")) == "msync"
            raise RuntimeError("boom")
    assert KNOBS.device == before
    with pytest.raises(DeviceError, match="unknown device backend"):
        resolve_backend("x", "nvme")


def test_device_rejects_out_of_range_persist(shm_dir):
    with Pool.create(str(shm_dir / "r.pool"), 1 << 20) as pool:
        with pytest.raises(ValueError, match="outside the mapping"):
            pool.device.persist((1 << 20) - 10, 20)


@pytest.mark.skipif(libpmem.load() is None, reason="PMDK's libpmem is not installed")
def test_pmem_is_pmem_force_switches_to_cache_line_flushes(tmp_path):
    """PMEM_IS_PMEM_FORCE is libpmem's own switch, read when the library loads: check it in a child."""
    path = tmp_path / "f.pool"
    probe = ("import sys; from cxltrain.pool.handle import Pool; "
             "p = Pool.create(sys.argv[1], 1 << 20, backend='pmem'); print(p.device.is_pmem); p.close()")
    results = {}
    for force in ("0", "1"):
        if path.exists():
            path.unlink()
        out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PMEM_IS_PMEM_FORCE": force})
        assert out.returncode == 0, out.stderr
        results[force] = out.stdout.strip()
    assert results == {"0": "False", "1": "True"}


def test_default_pool_falls_back_to_the_temp_folder_when_shm_is_too_small(monkeypatch):
    import tempfile

    from cxltrain import emulation
    from cxltrain.emulation import cxl

    monkeypatch.setattr(cxl, "pool_name", lambda: f"cxltrain-test-{os.getpid()}.pool")
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    assert emulation.default_pool_dir(1 << 20) == "/dev/shm"
    assert emulation.default_pool_dir(1 << 60) == tempfile.gettempdir()
    with override(pool_dir="/somewhere"):
        assert emulation.default_pool_path() == f"/somewhere/{cxl.pool_name()}"


# Every device model the backends and the emulation's knobs make: (backend, knobs).
DEVICE_MODELS = [(backend, {}) for backend in BACKENDS] + [
    ("emulated", {"power_loss": 1}), ("emulated", {"power_loss": 1, "domain": "eadr"}),
    ("emulated", {"power_loss": 1, "domain": "none"})]


@pytest.mark.parametrize("native_kernels", [1, 0])
@pytest.mark.parametrize("backend, model", DEVICE_MODELS)
def test_a_device_counts_what_it_is_asked_to_make_durable(shm_dir, tmp_path, backend, model, native_kernels):
    """The counters the cost model reads: the same requests count the same on every device, native
    row walk or Python one (a row set counts its runs of adjacent rows as flushes)."""
    from cxltrain.devices.registry import map_device

    path = (shm_dir if backend == "emulated" else tmp_path) / "counted"
    path.write_bytes(bytes(1 << 20))
    fd = os.open(path, os.O_RDWR)
    try:
        with override(native_kernels=native_kernels, **model):
            device = map_device(str(path), fd, 1 << 20, writable=True, backend=backend)
            device.flush(0, 100)
            device.drain()
            device.persist(4096, 64)
            device.copy_persist(8192, b"0123456789")
            device.persist_streamed(12288, 64)
            device.flush_rows(16384, 256, np.array([1, 2, 3, 9, 40], dtype=np.int64))  # runs: 1-3, 9, 40
            device.flush_rows(16384, 256, np.array([], dtype=np.int64))
            counted = device.counters.copy()
            device.close()
    finally:
        os.close(fd)
    assert (counted.flushes, counted.drains, counted.persisted_bytes) == (1 + 1 + 1 + 3, 1 + 1 + 1 + 1,
                                                                          100 + 64 + 10 + 64 + 5 * 256)
