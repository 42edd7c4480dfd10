"""A normal install, as from PyPI: the wheel built from this tree, installed into a fresh virtual
environment outside it, runs `train`, `export` and a 2-rank `train` from a folder outside the tree.
An editable install (`make setup`) reads the source tree and so hides a package the build left out.

The environment sees torch, numpy and tqdm where this interpreter has them (a .pth file naming their
folders, which works whether this interpreter is a virtual environment or not), and nothing needs
the network: the wheel is built without build isolation where the setuptools here can build one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# folder of the repository -> where it is installed, under site-packages
HOMES = {"cxltrain": Path("cxltrain"), "emulation": Path("cxltrain/emulation"), "kernels": Path("cxltrain/kernels")}
SMALL = ["--steps", "6", "--rows", "2000", "--num-tables", "3", "--dim", "16", "--batch-size", "96", "--no-progress"]
TIMEOUT = 240


def _run(command: list, cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run `command` in `cwd` with no PYTHONPATH (nothing may lead back to the source tree)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env=env)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _builds_offline() -> bool:
    """Whether the setuptools here builds a wheel without fetching anything: >= 70.1 does alone,
    >= 64 with the wheel package."""
    check = ("import setuptools, sys\n"
             "v = tuple(int(p) for p in setuptools.__version__.split('.')[:2])\n"
             "try:\n    import wheel  # noqa: F401\n    ok = v >= (64, 0)\n"
             "except ImportError:\n    ok = v >= (70, 1)\n"
             "sys.exit(0 if ok else 1)")
    return subprocess.run([sys.executable, "-c", check], capture_output=True).returncode == 0


def _copy_tree(dest: Path) -> Path:
    """The source tree without build outputs: a stale build/ would put old files into the wheel."""
    top = {".git", ".venv", "build", "dist", ".pytest_cache", ".hypothesis"}

    def ignore(folder, names):
        at_top = Path(folder).resolve() == ROOT
        return [n for n in names if (at_top and n in top) or n == "__pycache__" or n.endswith((".so", ".pool"))
                or n.endswith(".egg-info")]

    return Path(shutil.copytree(ROOT, dest, ignore=ignore))


def _dependency_folders() -> list[str]:
    """The folders this interpreter imports torch, numpy and tqdm from."""
    import numpy
    import tqdm

    return sorted({str(Path(m.__file__).resolve().parent.parent) for m in (torch, numpy, tqdm)})


def _installed_environment(tmp: Path) -> Path:
    """Build the wheel, make a virtual environment, install the wheel into it; its python."""
    source = _copy_tree(tmp / "src")
    isolation = ["--no-build-isolation"] if _builds_offline() else []
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", tmp / "wheels", source], tmp,
         timeout=600)
    [wheel] = (tmp / "wheels").glob("cxltrain-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"], tmp).stdout.strip())
    (site / "cxltrain-test-deps.pth").write_text("".join(f"{d}\n" for d in _dependency_folders()))
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], tmp)
    return python


def _source_modules() -> list[Path]:
    """Every Python file of the three folders, as installed under site-packages."""
    return sorted(HOMES[folder] / path.relative_to(ROOT / folder)
                  for folder in HOMES for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts)


def _native_extensions() -> list[str]:
    """The C extensions built in the source tree (by `make setup`): the wheel must have them too."""
    return sorted({p.name.split(".")[0] for p in (ROOT / "kernels").glob("_*.so")})


def test_a_normal_install_trains_exports_and_trains_on_two_ranks(tmp_path, shm_dir):
    python = _installed_environment(tmp_path)
    work = tmp_path / "work"  # outside the tree, so no import can come from it
    work.mkdir()
    where = json.loads(_run([python, "-c", "import json, cxltrain, cxltrain.emulation, cxltrain.kernels, sysconfig; "
                                           "print(json.dumps([cxltrain.__file__, sysconfig.get_paths()['platlib']]))"],
                            work).stdout)
    installed, site = Path(where[0]), Path(where[1])
    assert installed == site / "cxltrain" / "__init__.py", f"cxltrain imported from {installed}, not the install"
    assert site.resolve().is_relative_to((tmp_path / "venv").resolve())
    missing = [str(m) for m in _source_modules() if not (site / m).is_file()]
    assert not missing, f"not installed: {missing}"
    for extension in _native_extensions():
        assert list((site / "cxltrain" / "kernels").glob(f"{extension}.*.so")), f"{extension} not built into the wheel"

    cxltrain = python.parent / "cxltrain"
    trained = _run([cxltrain, "train", "--pool", shm_dir / "one.pool", *SMALL, "--json"], work)
    assert json.loads(trained.stdout.strip().splitlines()[-1])["batch"] == 6
    _run([cxltrain, "export", shm_dir / "one.pool", work / "one.pt"], work)
    assert torch.load(work / "one.pt", weights_only=True)["batch"] == 6

    run = shm_dir / "run"
    _run([cxltrain, "train", "--nproc-per-node", "2", "--pool", run, *SMALL,
          "--sharding", "table-wise,row-wise,data-parallel", "--dist-timeout", "30"], work)
    _run([cxltrain, "export", run, work / "two.pt"], work)
    assert torch.load(work / "two.pt", weights_only=True)["batch"] == 6
