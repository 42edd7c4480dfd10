"""Shared fixtures. Every randomized test logs its seed (pytest -s shows it; failures print it)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True, scope="session")
def _fixed_threads():
    torch.set_num_threads(2)


@pytest.fixture
def shm_dir():
    """A private folder on the memory-backed file system (the emulated CXL device's home)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="cxltrain-test-", dir=base)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["emulated", "file"])
def pool_path(request, shm_dir, tmp_path):
    """A pool path on each kind of storage: memory-backed (emulated CXL) and an ordinary file."""
    folder = shm_dir if request.param == "emulated" else tmp_path
    return str(folder / "test.pool")
