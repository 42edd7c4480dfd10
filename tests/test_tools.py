"""tools/: the lab's instruments (tools/README.md) import and run, so a rename in the package
cannot rot them silently. tools/ is not a package: its scripts run as files, so tests import them
by name with tools/ on the path."""

from __future__ import annotations

import importlib
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
