"""tools/: the lab's instruments (tools/README.md) import and run, so a rename in the package
cannot rot them silently. tools/ is not a package: its scripts run as files, so tests import them
by name with tools/ on the path."""

from __future__ import annotations

import glob
import importlib
import os
import sys
from pathlib import Path

import pytest

from cxltrain.bench.suite import scratch_dir

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


def test_replacement_pairs_prints_a_line_per_run_and_leaves_no_pool(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["replacement_pairs.py", "--quick", "--every", "2", "1000",
                                      "--capacity-dir", str(tmp_path)])
    tool("replacement_pairs").main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0].strip() for line in lines[1:]] == [
        "all fast", "10% cached, steal 16", "the same, re-placed every 2", "the same, re-placed every 1000"], lines
    assert all("ms/step" in line for line in lines[1:]) and "the stealing run" in lines[-1]
    assert os.listdir(tmp_path) == []
    assert not glob.glob(os.path.join(scratch_dir(), "cxltrain-replacement-*"))  # the fast tier's pools
