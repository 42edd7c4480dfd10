"""`cxltrain recover`, `pool check` and `pool info` start without importing torch
(cxltrain.checkpoint.offline), and still recover exactly: the pool they roll back equals what the
in-process Runtime's recovery gives.

Each command runs in a child Python through cli.main; the child reports whether torch (or
anything of it) reached sys.modules by the time the command returned.
"""

from __future__ import annotations

import json

import pytest

from helpers import assert_same_export, run_python
from test_runtime import state_of, train_steps

CHILD = """
import sys
from cxltrain import cli
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
""".replace("import sys", "import json, sys", 1)


def run_cli(*args) -> tuple[list[str], dict]:
    done = run_python(CHILD, *args, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return lines[:-1], json.loads(lines[-1])


@pytest.fixture
def interrupted(shm_dir):
    """A pool whose run raised inside batch 4 (after its backward): batch 4's records are live."""
    path = shm_dir / "p.pool"
    with pytest.raises(KeyboardInterrupt):
        train_steps(path, 6, fail_at=4)
    return path


def test_recover_check_and_info_import_no_torch(interrupted, shm_dir):
    reference = shm_dir / "ref.pool"
    reference.write_bytes(interrupted.read_bytes())
    for command in (["pool", "info", str(interrupted)], ["pool", "check", str(interrupted)]):
        _, result = run_cli(*command)
        assert result == {"code": 0, "torch": []}, command
    out, result = run_cli("recover", str(interrupted), "--json")
    assert result == {"code": 0, "torch": []}
    report = json.loads(out[-1])
    assert report["batch"] == 4 and report["records_restored"] >= 1 and report["process_seconds"] > 0
    assert "since the process started" in out[0]
    # the torch-free recovery leaves the pool where the Runtime's own recovery does
    assert_same_export(state_of(interrupted), state_of(reference))


def test_check_without_torch_still_refuses_a_damaged_snapshot(interrupted):
    from cxltrain.checkpoint import layout
    from cxltrain.pool.handle import Pool

    with Pool.open(str(interrupted)) as pool:
        region = pool.region(layout.DENSE_REGIONS[pool.root.dense_slot - 1])
        pool.device.array[region.offset + layout.DENSE_HEADER.size + 40] ^= 0x10  # a payload bit
    done = run_python(CHILD, "pool", "check", str(interrupted), timeout=120)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"code": 1, "torch": []}
    assert "payload checksum mismatch" in done.stderr
