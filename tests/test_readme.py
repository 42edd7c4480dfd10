"""The README's Python example runs as written (with its pool path moved to a test folder)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(shm_dir):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README lost its Python example"
    code = blocks[0].replace("/dev/shm/example.pool", str(shm_dir / "example.pool"))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["out"].shape == (2, 64)
    assert namespace["pool"].closed
