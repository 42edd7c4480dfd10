"""Shared fixtures. Every randomized test logs its seed (pytest -s shows it; failures print it)."""

from __future__ import annotations

import faulthandler
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import TEST_TIMEOUT_S, shm_tempdir


@pytest.fixture(autouse=True, scope="session")
def _fixed_threads():
    torch.set_num_threads(2)


@pytest.fixture(autouse=True, scope="session")
def _temporary_folder_of_the_session(tmp_path_factory):
    """$TMPDIR, for this process and every command and rank it starts: a folder under pytest's own
    (kept for the last few runs, as tmp_path is), so what a killed launcher or torchrun's agent
    leaves in it never piles up in /tmp."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
        patch.setattr(tempfile, "tempdir", None)  # read again from $TMPDIR
        yield


# A test that hangs (a dead rank's collective, a child that never exits) must not hang the suite: past
# its limit the process dumps every thread's stack and exits, which fails the test (xdist reports
# the worker crashed and goes on with a new one). Subprocesses have their own timeouts as well.
SLOW_TEST_TIMEOUT_S = 4 * TEST_TIMEOUT_S


@pytest.fixture(autouse=True)
def _test_timeout(request):
    limit = SLOW_TEST_TIMEOUT_S if request.node.get_closest_marker("slow") else TEST_TIMEOUT_S
    faulthandler.dump_traceback_later(limit, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


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
