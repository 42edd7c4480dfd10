"""The Python examples of the docs run as written (with their pool paths moved to a test folder):
the README's `Runtime`, TorchRec and DataLoader examples, and the table example of docs/architecture.md;
and the docs' relative links lead somewhere."""

import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def _blocks(path: Path, count: int) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert len(blocks) == count, f"{path.relative_to(REPO)} lost a Python example"
    return blocks


def test_readme_runtime_example_runs_and_resumes(shm_dir):
    code = _blocks(README, 3)[0].replace("/dev/shm/ctr.pool", str(shm_dir / "ctr.pool"))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["rt"].batch == 50 and namespace["rt"].start_batch == 0
    again: dict = {}
    exec(compile(code.replace("stop=50", "stop=60"), str(README), "exec"), again)
    assert again["rt"].recovered_batch == 50 and again["rt"].batch == 60


def test_readme_torchrec_example_runs(shm_dir):
    code = _blocks(README, 3)[1].replace("/dev/shm/ebc.pool", str(shm_dir / "ebc.pool"))
    code = code.replace("ebc, [])", "ebc, [], undo_ring_bytes=1 << 20)")  # a small ring: created at once
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["rt"].batch == 20 and namespace["pooled"].values().shape == (2, 32)


def test_readme_resumable_loader_example_runs_and_resumes(shm_dir):
    code = _blocks(README, 3)[2].replace("/dev/shm/shuffled.pool", str(shm_dir / "shuffled.pool"))
    code = code.replace("table, [])", "table, [], undo_ring_bytes=1 << 20)")  # a small ring: created at once
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["rt"].batch == 24  # 3 epochs of 8 batches
    again: dict = {}
    exec(compile(code.replace("stop=3 *", "stop=4 *"), str(README), "exec"), again)
    assert again["rt"].recovered_batch == 24 and again["rt"].batch == 32


def test_architecture_table_example_runs(shm_dir):
    code = _blocks(ARCHITECTURE, 1)[0]
    code = code.replace("/dev/shm/example.pool", str(shm_dir / "example.pool"))
    namespace: dict = {}
    exec(compile(code, str(ARCHITECTURE), "exec"), namespace)
    assert namespace["out"].shape == (2, 64)
    assert namespace["pool"].closed


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache  # a page's headings, once for all the links to it
def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # headings, not code
    anchors, seen = set(), {}
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        slug = _anchor(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)  # a repeated heading gets -1, -2, ...
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_docs_links_reach_a_file_and_a_heading():
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            linked = (page.parent / target).resolve() if target else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} does not exist")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target}#{anchor} names no heading")
    assert not broken, "\n".join(broken)
