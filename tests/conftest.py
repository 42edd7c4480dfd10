"""Shared fixtures. Every randomized test logs its seed (pytest -s shows it; failures print it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import shm_tempdir


@pytest.fixture(autouse=True, scope="session")
def _fixed_threads():
    torch.set_num_threads(2)


@pytest.fixture
def shm_dir():
    """A private folder on the memory-backed file system (the emulated CXL device's home)."""
    with shm_tempdir("cxltrain-test-") as path:
        yield Path(path)


@pytest.fixture(params=["emulated", "file"])
def pool_path(request, shm_dir, tmp_path):
    """A pool path on each kind of storage: memory-backed (emulated CXL) and an ordinary file."""
    folder = shm_dir if request.param == "emulated" else tmp_path
    return str(folder / "test.pool")
