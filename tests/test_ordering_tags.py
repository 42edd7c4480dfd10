"""Each persistence rule of docs/architecture.md §4 (U1-U4) is enforced at a line tagged `# ORDERING U<n>: why`
in Python or `/* ORDERING U<n>: why */` in C (a rule enforced in parts: U<n>a, U<n>b, ...). The tags
are counted here: every rule has one, each is well-formed, no rule or part is tagged twice, and each
sits right above the call that enforces it, so a reader (or a reviewer of a change that moves a
line) finds every ordering the protocol rests on by grepping `ORDERING U`."""

from __future__ import annotations

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("cxltrain", "kernels", "emulation") for suffix in ("*.py", "*.c", "*.h")
                 for p in (ROOT / folder).rglob(suffix))
TAG = re.compile(r"^\s*(?:#|/\*|//) ORDERING (U[1-4])([a-z]?): \S")
COMMENT = re.compile(r"^\s*(?:#|/\*|//|\*)")  # a comment line, or a C comment's continuation
# where each tag sits: the coordinator, the commit pipeline, the ring, the ordering strategy, the table
WHERE = {
    "U1a": "cxltrain/checkpoint/ring.py",          # payload durable before the header that makes it valid
    "U1b": "cxltrain/checkpoint/checkpointer.py",  # tail mark durable before the table's first store
    "U1c": "cxltrain/tables/bag.py",                   # before_update (record durable) precedes the update
    "U1d": "cxltrain/checkpoint/checkpointer.py",  # a row left out of a record was recorded earlier in its window
    "U1e": "cxltrain/tables/cache.py",                    # hot-row cache: the slots' record durable before admission fills them
    "U1f": "cxltrain/checkpoint/checkpointer.py",  # hot-row cache: the slots' record durable before the update stores into them
    "U1g": "cxltrain/tables/cache.py",                    # hot-row cache: records durable before re-placement's write-back and refill
    "U1h": "kernels/rows.c",                       # fused capture: each chunk's record durable before its rows' update
    "U1i": "cxltrain/checkpoint/ordering.py",      # fused capture: payload, then header, then tail mark, then rows
    "U1j": "cxltrain/tables/renorm.py",            # max_norm: the renormalised rows' record durable before forward stores them
    "U2a": "cxltrain/checkpoint/checkpointer.py",  # rows flushed at their update drained before hand-over
    "U2b": "cxltrain/checkpoint/ordering.py",      # rows persisted before the root
    "U2c": "cxltrain/checkpoint/commit.py",        # the dense snapshot sealed before the root
    "U2d": "cxltrain/checkpoint/commit.py",        # a pool set's capacity pools synced before the root
    "U2e": "cxltrain/tables/device_rows.py",       # GPU: the stores into the pool left the GPU before the rows are noted
    "U2f": "cxltrain/checkpoint/checkpointer.py",  # stealing set: a cold row's redo record durable before the batch ends
    "U3a": "cxltrain/checkpoint/commit.py",        # reclaim after the durable root
    "U3b": "cxltrain/checkpoint/ordering.py",      # distributed: never reclaim above the agreed G
    "U3c": "cxltrain/checkpoint/commit.py",        # stealing set: redo records live until a write-back synced them
    "U3d": "cxltrain/checkpoint/dense.py",         # distributed: a rank keeps its dense slices the group may recover to
    "U3e": "cxltrain/runtime/runtime.py",          # distributed: a rank's pool recovered alone only at the group's batch
    "U4": "cxltrain/checkpoint/checkpointer.py",   # capture from the rows after the previous update
}
# what the statement right below each tag calls: the call that enforces its rule
ENFORCED_BY = {
    "U1a": "device.copy_persist(",           # the header, persisted after the payload
    "U1b": "self.ring.mark_tail()",
    "U1c": "before_update(",
    "U1d": ".first_touches(",
    "U1e": "guard.log_before_write(",
    "U1f": "self._capture(",                 # unfused; fused, the kernel writes the slots' record (U1h)
    "U1g": "guard.log_before_write(",
    "U1h": "undo_next_chunk(",               # the chunk's record, before the loop's first store into it
    "U1i": "fused_steps = (PERSIST_PAYLOAD, PAYLOAD_STOP, PERSIST_HEADER, PERSIST_TAIL, HEADER_STOP, UPDATE)",
    "U1j": "guard.log_before_write(",
    "U2a": ".drain()",
    "U2b": "pipeline.seal_and_write_root(",  # after persist_rows (above the tag)
    "U2c": "self.pool.commit(",
    "U2d": "self._sync_members(",
    "U2e": ".synchronize()",
    "U2f": "self.ring.mark_tail()",
    "U3a": "self.ring.reclaim(",
    "U3b": "min(done, agreed)",
    "U3c": "min(self._keep_from, self.ordering.written_back(self))",
    "U3d": "keep = {root.dense_slot}",
    "U3e": "whole = _whole_dense(pool, snapshot)",
    "U4": "capture_source(",
}


def tags() -> list[tuple[str, str, int, str]]:
    """(tag, file, line number, line) of every comment that mentions ORDERING U."""
    found = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(#|/\*|//)\s*ORDERING\s*U", line):
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


def enforcing_statement(path: str, number: int) -> str:
    """The first two code lines after the tag on line `number` of `path` (a statement may wrap)."""
    lines = (ROOT / path).read_text().splitlines()[number:]
    code = [line.strip().rstrip("\\").strip() for line in lines if line.strip() and not COMMENT.match(line)]
    return " ".join(code[:2])


def test_each_tag_sits_right_above_the_call_that_enforces_it():
    """A tag that drifts away from its call (a line moved, a call renamed) fails here, in C too."""
    assert set(ENFORCED_BY) == set(WHERE)
    drifted = [f"{tag} {path}:{number}" for tag, path, number, _ in tags()
               if ENFORCED_BY[tag] not in enforcing_statement(path, number)]
    assert drifted == []


def test_the_c_tags_are_read():
    """The C sources are scanned (a tag in them counts), and the fused capture's C tag is there."""
    assert any(p.suffix == ".c" for p in SOURCES)
    assert [t for t in tags() if t[1].endswith(".c")] and "U1h" in {t[0] for t in tags() if t[1].endswith(".c")}


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
