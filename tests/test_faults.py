"""The crash-point and planted-fault registry (cxltrain/faults.py): every name a call site uses is
registered, and an unregistered one is refused rather than silently never firing."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

from cxltrain import faults, knobs
from cxltrain.emulation import cxl
from cxltrain.faults import CRASH_POINTS, PLANTED, CrashPoint, Planted
from cxltrain.jobs.crashtest import FLUSH_POINT, PROTOCOL_POINTS, RECOVERY_POINTS
from cxltrain.kernels import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("cxltrain", "kernels", "emulation") for p in (ROOT / folder).rglob("*.py")]


@pytest.fixture
def disarmed():
    yield
    faults.arm(None, "")


def test_every_literal_name_at_a_call_site_is_registered():
    """pool.py and emulation/ still spell some names as literals: each must be a registered one."""
    literal = re.compile(r"\b(?:crash_point|crash_armed|crash_due)\(\s*\"([^\"]+)\"")
    planted = re.compile(r"\bplanted\(\s*\"([^\"]+)\"")
    seen = {m for path in SOURCES for m in literal.findall(path.read_text())}
    assert seen <= CRASH_POINTS, seen - CRASH_POINTS
    plants = {m for path in SOURCES for m in planted.findall(path.read_text())}
    assert plants <= set(PLANTED), plants - set(PLANTED)
    assert cxl.FLUSH_POINT == FLUSH_POINT == CrashPoint.DEVICE_FLUSH


def test_crashtest_tortures_the_registered_points():
    assert set(PROTOCOL_POINTS) | set(RECOVERY_POINTS) <= CRASH_POINTS
    assert set(RECOVERY_POINTS) == {CrashPoint.RECOVER_MID, CrashPoint.RECOVER_BEFORE_ROOT,
                                    CrashPoint.RECOVER_AFTER_ROOT}
    assert Planted.ROOT_BEFORE_ENTRIES in PLANTED and len(set(PLANTED)) == len(PLANTED) == 15


def test_unregistered_names_are_refused(disarmed):
    with pytest.raises(ValueError, match="unknown crash point 'update:midd'"):
        faults.arm("update:midd:3")
    with pytest.raises(ValueError, match="unknown planted fault"):
        faults.arm(None, "skip-undo-persits")
    faults.arm(f"{CrashPoint.COMMIT_AFTER_ROOT}:1000")
    with pytest.raises(ValueError, match="not registered"):
        faults.crash_point("commit:after-rooot")
    faults.crash_point(CrashPoint.COMMIT_AFTER_ROOT)
    assert faults.reached() == 1


def test_unregistered_name_in_the_environment_fails_loudly():
    done = subprocess.run([sys.executable, "-c", "import cxltrain.faults"], capture_output=True, text=True,
                          env={"CXLTRAIN_CRASH_AT": "update:midd", "PATH": ""})
    assert done.returncode != 0 and "unknown crash point" in done.stderr


class Killed(Exception):
    pass


@pytest.mark.parametrize("native", [1, 0], ids=["c-kernel", "torch-kernel"])
def test_update_mid_stops_the_production_kernel_half_way(native, monkeypatch, disarmed):
    """CXLTRAIN_CRASH_AT=update:mid:N: the N-th fused update stops after half its unique rows (in the
    kernel's own loop), then the point fires; the updates before it run whole."""
    def die(name):
        if faults.crash_due(name):
            raise Killed
        faults.crash_point(name)

    monkeypatch.setattr(ops, "crash_point", die)
    faults.arm(f"{CrashPoint.UPDATE_MID}:2")
    indices = torch.tensor([9, 2, 5, 2, 7, 0, 9])      # unique rows 0 2 5 7 9
    with knobs.override(native_kernels=native):
        weight = torch.zeros(10, 4)
        rows = ops.sparse_update("sgd", weight, None, indices, torch.ones(7, 4), lr=1.0)
        assert rows.tolist() == [0, 2, 5, 7, 9] and faults.reached() == 1
        weight.zero_()
        with pytest.raises(Killed):
            ops.sparse_update("sgd", weight, None, indices, torch.ones(7, 4), lr=1.0)
    changed = (weight != 0).any(dim=1).nonzero().flatten().tolist()
    assert changed == [0, 2]  # the first half (5 // 2) of the sorted unique rows, and no other
