"""The README's Python example runs as written (with its pool path moved to a test folder)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 2, "the README lost a Python example"
    return blocks


def test_readme_runtime_example_runs_and_resumes(shm_dir):
    code = _blocks()[0].replace("/dev/shm/ctr.pool", str(shm_dir / "ctr.pool"))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["rt"].batch == 50 and namespace["rt"].start_batch == 0
    again: dict = {}
    exec(compile(code.replace("stop=50", "stop=60"), str(README), "exec"), again)
    assert again["rt"].recovered_batch == 50 and again["rt"].batch == 60


def test_readme_table_example_runs(shm_dir):
    code = _blocks()[1].replace("/dev/shm/example.pool", str(shm_dir / "example.pool"))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["out"].shape == (2, 64)
    assert namespace["pool"].closed
