"""Each persistence rule of docs/architecture.md §4 (U1-U4) is enforced at a line tagged `# ORDERING U<n>: why`
(a rule enforced in parts: U<n>a, U<n>b, ...). The tags are counted here: every rule has one,
each is well-formed, and no rule or part is tagged twice, so a reader (or a reviewer of a change
that moves a line) finds every ordering the protocol rests on by grepping `ORDERING U`."""

from __future__ import annotations

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("cxltrain", "kernels", "emulation") for p in (ROOT / folder).rglob("*.py"))
TAG = re.compile(r"^\s*# ORDERING (U[1-4])([a-z]?): \S")
# where each tag sits: the coordinator, the commit pipeline, the ring, the ordering strategy, the table
WHERE = {
    "U1a": "cxltrain/checkpoint/ring.py",          # payload durable before the header that makes it valid
    "U1b": "cxltrain/checkpoint/checkpointer.py",  # tail mark durable before the table's first store
    "U1c": "cxltrain/tables/bag.py",                   # before_update (record durable) precedes the update
    "U1d": "cxltrain/checkpoint/checkpointer.py",  # a row left out of a record was recorded earlier in its window
    "U1e": "cxltrain/tables/cache.py",                    # hot-row cache: the slots' record durable before admission fills them
    "U1f": "cxltrain/tables/cache.py",                    # hot-row cache: the slots' record durable before the hits' update
    "U1g": "cxltrain/tables/cache.py",                    # hot-row cache: records durable before re-placement's write-back and refill
    "U1h": "kernels/ops.py",                       # fused capture: each chunk's record durable before its rows' update
    "U2a": "cxltrain/checkpoint/checkpointer.py",  # rows flushed at their update drained before hand-over
    "U2b": "cxltrain/checkpoint/ordering.py",      # rows persisted before the root
    "U2c": "cxltrain/checkpoint/commit.py",        # the dense snapshot sealed before the root
    "U2d": "cxltrain/checkpoint/commit.py",        # a pool set's capacity pools synced before the root
    "U3a": "cxltrain/checkpoint/commit.py",        # reclaim after the durable root
    "U3b": "cxltrain/checkpoint/ordering.py",      # distributed: never reclaim above the agreed G
    "U4": "cxltrain/checkpoint/checkpointer.py",   # capture from the rows after the previous update
}


def tags() -> list[tuple[str, str, int, str]]:
    """(tag, file, line number, line) of every comment that mentions ORDERING U."""
    found = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"#\s*ORDERING\s*U", line):
                match = TAG.match(line)
                tag = match.group(1) + match.group(2) if match else "malformed"
                found.append((tag, str(path.relative_to(ROOT)), number, line.strip()))
    return found


def test_every_tag_is_well_formed():
    malformed = [t for t in tags() if t[0] == "malformed"]
    assert malformed == [], "write tags as `# ORDERING U<n>[a-z]: why`"


def test_each_rule_is_tagged_once_per_part():
    counts = collections.Counter(t[0] for t in tags())
    assert {tag[:2] for tag in counts} == {"U1", "U2", "U3", "U4"}
    assert [tag for tag, n in counts.items() if n > 1] == []
    for rule in ("U1", "U2", "U3", "U4"):  # a rule is tagged whole or in parts, never both
        assert not (rule in counts and any(len(tag) == 3 and tag.startswith(rule) for tag in counts)), rule


def test_tags_sit_where_the_rules_are_enforced():
    assert {tag: path for tag, path, _, _ in tags()} == WHERE


def test_u1_holds_for_the_tables_by_call_order():
    """The table calls before_update (which returns once the undo record is durable) before its
    update stores anything (every lookup's backward goes through _guarded_update); the U1c tag is
    on that call."""
    lines = (ROOT / "cxltrain/tables/bag.py").read_text().splitlines()
    _, _, number, _ = next(t for t in tags() if t[0] == "U1c")
    after = lines[number:]
    call = next(i for i, line in enumerate(after) if not line.strip().startswith("#"))
    assert "before_update(" in after[call]
    update = next(i for i, line in enumerate(after) if "= update(undo)" in line)
    assert call < update


def test_the_old_comment_form_is_gone():
    old = [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.match(r"^\s*# U[1-4] —", line)]
    assert old == []
