"""A model's state is a PyTorch state: tables in state_dict() as views of the pool, load_state_dict
into a new pool, `cxltrain import` of our exports and of TorchRec state dicts."""

from __future__ import annotations

import os

import pytest
import torch

import cxltrain
from cxltrain.cli import main as cli_main
from cxltrain.data import SyntheticCriteo
from cxltrain.errors import ConfigError
from cxltrain.models import DLRM
from cxltrain.runtime.interop import to_torchrec
from cxltrain.runtime.runtime import export_state
from cxltrain.runtime.state_import import import_state
from helpers import assert_same_export

ROWS = [60, 40]
DATA = SyntheticCriteo(num_tables=2, rows=ROWS, batch_size=32, seed=2)
TABLE_KEYS = {f"embedding_bag_collection.embedding_bags.t{i}.{leaf}" for i in range(2)
              for leaf in ("weight", "optimizer_state")}

RING = 1 << 20  # a small undo ring: a test pool is created in milliseconds


def model() -> DLRM:
    return DLRM(embedding_rows=ROWS, embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,), seed=5)


def train(path: str, net: DLRM, stop: int, *, saved: dict | None = None) -> None:
    """Train `net` in the pool at `path` up to batch `stop` (Adam on the MLPs); with `saved`, put a
    copy of net.state_dict() taken inside the block there."""
    opt = torch.optim.Adam(net.dense_parameters(), lr=1e-2)
    with cxltrain.Runtime(path, net, opt, metadata={"run": "t"}, undo_ring_bytes=RING) as rt:
        for batch in rt.batches(DATA, stop=stop):
            net.loss(batch).backward()
            opt.step()
            opt.zero_grad()
        if saved is not None:
            state = net.state_dict()
            table = net.tables[0]
            assert state["embedding_bag_collection.embedding_bags.t0.weight"].data_ptr() == table.weight.data_ptr()
            saved.update({k: v.clone() for k, v in state.items()})


def test_state_dict_holds_the_tables_and_loads_into_a_new_pool(shm_dir):
    saved = {}
    train(os.path.join(shm_dir, "a.pool"), model(), 3, saved=saved)
    assert TABLE_KEYS <= set(saved)
    fresh = model()
    result = fresh.load_state_dict(saved)  # strict: every key matched, the tables' included
    assert not result.missing_keys and not result.unexpected_keys
    with cxltrain.Runtime(os.path.join(shm_dir, "b.pool"), fresh, [], undo_ring_bytes=RING) as rt:
        assert rt.start_batch == 0
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, saved[key]), key


def test_loading_into_a_live_pool_is_refused_untouched(shm_dir):
    path = os.path.join(shm_dir, "a.pool")
    saved = {}
    train(path, model(), 2, saved=saved)
    net = model()
    with cxltrain.Runtime(path, net, torch.optim.Adam(net.dense_parameters(), lr=1e-2), undo_ring_bytes=RING):
        before = net.tables[0].weight.clone()
        changed = {k: v + 1 for k, v in saved.items()}
        with pytest.raises(RuntimeError, match="outside any batch, uncovered by the undo log"):
            net.load_state_dict(changed)
        assert torch.equal(net.tables[0].weight, before)
    loaded = model()
    loaded.load_state_dict(saved)
    with pytest.raises(ConfigError, match="would replace the values load_state_dict"):
        with cxltrain.Runtime(path, loaded, [], undo_ring_bytes=RING):
            pass


def test_import_of_our_export_resumes_as_the_original(shm_dir):
    original, imported = os.path.join(shm_dir, "a.pool"), os.path.join(shm_dir, "b.pool")
    train(original, model(), 3)
    export = export_state(original)
    loaded = model().load_state_dict(export["model"])  # an export loads back into the model, strictly
    assert not loaded.missing_keys and not loaded.unexpected_keys
    assert import_state(export, imported, undo_ring_bytes=RING).batch == 3
    again = export_state(imported)
    assert_same_export(export, again)
    assert again["tables"] == export["tables"] and again["metadata"] == {"run": "t"}
    train(original, model(), 5)
    train(imported, model(), 5)
    assert_same_export(export_state(original), export_state(imported))


def test_import_of_a_torchrec_state_dict(shm_dir, tmp_path):
    original = os.path.join(shm_dir, "a.pool")
    train(original, model(), 2)
    export = export_state(original)
    flat = to_torchrec(export)
    assert "embedding_bags.t1.weight" in flat and not any("optimizer_state" in k for k in flat)
    source = str(tmp_path / "ebc.pt")
    torch.save(flat, source)
    pool = os.path.join(shm_dir, "b.pool")
    assert cli_main(["import", source, pool]) == 0
    net = model()
    with cxltrain.Runtime(pool, net, [], undo_ring_bytes=RING) as rt:
        assert rt.start_batch == 0
        state = net.state_dict()
        for i in range(2):
            key = f"embedding_bag_collection.embedding_bags.t{i}"
            assert torch.equal(state[f"{key}.weight"], export["model"][f"{key}.weight"])
            assert not state[f"{key}.optimizer_state"].any()  # Adagrad's accumulators start at 0
        assert torch.equal(state["top.0.weight"], export["model"]["top.0.weight"])


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"not a zip", "not a torch export"),
    ({"x": 1}, "not an export of cxltrain"),
    ({"model": {}, "batch": 0}, "names no tables"),
])
def test_bad_imports_say_one_line_and_build_nothing(content, message, tmp_path, shm_dir, capsys):
    source, pool = tmp_path / "in.pt", os.path.join(shm_dir, "p.pool")
    if isinstance(content, bytes):
        source.write_bytes(content)
    elif content is not None:
        torch.save(content, source)
    assert cli_main(["import", str(source), pool]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not os.path.exists(pool) and not os.path.exists(pool + ".creating")
