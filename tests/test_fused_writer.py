"""The fused capture's undo writer (kernels/undo.c, cxltrain/checkpoint/fused.py): its record layout
is layout.py's, the one definition, and a native build that disagrees is refused before it writes;
its step lists are the only thing that orders a chunk's record."""

from __future__ import annotations

import struct

import pytest

from cxltrain.checkpoint import fused, layout, ordering
from cxltrain.errors import CheckpointError
from cxltrain.kernels import native, ops

needs_writer = pytest.mark.skipif(not ops.fused_available(), reason="no native undo writer (streamed stores)")


@needs_writer
def test_the_build_agrees_with_the_layout():
    fused.check_layout(native.lib())
    assert native.lib().UNDO_LAYOUT == layout.native_undo_layout()


@needs_writer
@pytest.mark.parametrize("change", ["seq-moved", "tail-mark-longer"])
def test_a_changed_python_layout_is_refused_at_load(monkeypatch, change):
    """Move a header field or grow the tail mark in layout.py without rebuilding the C writer: the
    check that runs before the writer's first use (fused.writer, called when a Checkpointer turns
    the fused capture on) refuses, naming what differs."""
    if change == "seq-moved":
        monkeypatch.setattr(layout, "UNDO_SEQ_AT", 24)
        message = "UNDO_SEQ_AT 16 in the build, 24 in layout.py"
    else:
        monkeypatch.setattr(layout, "TAIL_MARK", struct.Struct("<IIQQ44sI"))
        message = "TAIL_MARK_BYTES 64 in the build, 72 in layout.py"
    with pytest.raises(CheckpointError, match=message):
        fused.check_layout(native.lib())
    monkeypatch.setattr(fused, "_checked", set())  # as in a fresh process
    with pytest.raises(CheckpointError, match="rebuild it"):
        fused.writer()


@needs_writer
def test_planted_orders_are_other_step_lists():
    """Production and each planted fused bug differ only in their step list; each list has the
    payload, the header, the tail mark and the update once."""
    lists = {name: cls.fused_steps for name, cls in ordering.PLANTED_ORDERINGS.items()}
    production = ordering.Ordering.fused_steps
    assert production.index(fused.PERSIST_PAYLOAD) < production.index(fused.PERSIST_HEADER) \
        < production.index(fused.PERSIST_TAIL) < production.index(fused.UPDATE)
    changed = {name for name, steps in lists.items() if steps != production}
    assert changed == {"header-before-payload", "update-before-header"}
    for steps in lists.values():
        encoded = fused.encode_steps(steps, native.lib())
        assert len(encoded) == 2 * len(steps)
    with pytest.raises(ValueError, match="unknown undo step"):
        fused.encode_steps(("persist footer", fused.UPDATE), native.lib())
