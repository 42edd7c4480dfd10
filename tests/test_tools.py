"""tools/: the lab's instruments (tools/README.md) import and run, so a rename in the package
cannot rot them silently. tools/ is not a package: its scripts run as files, so tests import them
by name with tools/ on the path."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
MODULES = sorted(path.stem for path in TOOLS.glob("*.py"))


def tool(name: str):
    """The module tools/<name>.py."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(name)


def test_the_readme_names_every_tool():
    readme = (TOOLS / "README.md").read_text()
    assert MODULES and all(f"{name}.py" in readme for name in MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_tool_imports_without_running(name):
    assert callable(tool(name).main)


def test_bench_tiers_runs_side_by_side_at_a_tiny_size(capsys):
    code = tool("bench_tiers").main(["--quick", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out.splitlines()[-1])
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["fast", "capacity", "capacity-off", "cache-2%", "cache-10%", "steal-10%"]
    assert rows["fast"]["ratio"] == 1.0
    # the hot-row cache serves a share of the lookups, more with more rows cached; no cache, no rate
    assert rows["capacity"]["hit_rate"] is None
    assert 0 < rows["cache-2%"]["hit_rate"] < rows["cache-10%"]["hit_rate"] < 1
    assert rows["steal-10%"]["hit_rate"] == rows["cache-10%"]["hit_rate"]  # the same cache; only the write-back differs
    assert all(row["ms_per_step"] > 0 for row in rows.values())
    # the fast tier (/dev/shm) does no block I/O and reads nothing ahead; the durable tiered set
    # writes its dirty pages every batch
    assert rows["fast"]["written_bytes_per_batch"] == 0 and rows["fast"]["pages_prefetched_per_batch"] == 0
    assert rows["capacity"]["written_bytes_per_batch"] > 0 and rows["capacity"]["pages_prefetched_per_batch"] > 0
    assert result["checkpoint_ratio"] > 0 and result["peak_rss_bytes"] > 0
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"cxltrain-tiers-{os.getpid()}")]
    assert not [name for name in os.listdir(result["capacity_dir"]) if name.startswith(f"cxltrain-tiers-{os.getpid()}")]
    code = tool("bench_tiers").main(["--capacity-dir", "/nonexistent/folder"])
    err = capsys.readouterr().err
    assert code == 1 and "--capacity-dir" in err and len(err.strip().splitlines()) == 1
