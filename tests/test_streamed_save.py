"""The streamed export (runtime/streamed_save.py): byte for byte what torch.save writes, with the tables
read a chunk at a time, and an export whose memory is a chunk, not the tables."""

from __future__ import annotations

import dataclasses
import os
import tracemalloc
import warnings

import numpy as np
import pytest
import torch

from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import build_model, train
from cxltrain.pool.handle import Pool
from cxltrain.runtime import streamed_save
from cxltrain.runtime.runtime import export_state, open_export
from cxltrain.tables import bag as bag_module
from cxltrain.tables import cache as hot_cache
from cxltrain.tables.bag import PersistentEmbeddingBag
from helpers import cxltrain, tier_folders


def streamed(tensor: torch.Tensor, rows: int) -> streamed_save.Streamed:
    """`tensor` as a Streamed value yielding `rows` rows at a time."""
    def chunks():
        array = tensor.numpy()
        for first in range(0, array.shape[0], rows):
            yield array[first : first + rows]
    return streamed_save.Streamed(tuple(tensor.shape), tensor.dtype, chunks)


def saved(tmp_path, name: str, state, save) -> bytes:
    with open(tmp_path / name, "w+b") as f:
        save(state, f)
    return (tmp_path / name).read_bytes()


def test_a_streamed_state_is_written_byte_for_byte_as_torch_save_writes_it(tmp_path):
    generator = torch.Generator().manual_seed(0)
    weight, state = torch.randn(1000, 7, generator=generator), torch.rand(1000, 1, generator=generator)
    # a record whose bytes start like a zip data descriptor: torch's writer mixes them into its id
    lookalike = torch.zeros(3, 2)
    lookalike.view(-1).view(torch.int32)[:2] = torch.tensor([0x08074B50, 12345], dtype=torch.int32)
    dense = {"mlp.0.weight": torch.randn(4, 3, generator=generator), "steps": torch.arange(5)}
    rest = {"batch": 3, "optimizers": [{"state": {0: {"sum": torch.ones(2)}}, "groups": (1, 2)}], "tables": {"t": "t"}}
    whole = {**rest, "model": {**dense, "t.weight": weight, "t.optimizer_state": state, "l": lookalike}}
    parts = {**rest, "model": {**dense, "t.weight": streamed(weight, 33), "t.optimizer_state": streamed(state, 1000),
                               "l": streamed(lookalike, 1)}}
    expected = saved(tmp_path, "a.pt", whole, torch.save)
    assert saved(tmp_path, "b.pt", parts, streamed_save.save) == expected
    loaded = torch.load(tmp_path / "b.pt", weights_only=True)
    assert torch.equal(loaded["model"]["t.weight"], weight) and torch.equal(loaded["model"]["l"], lookalike)


def failing_chunks():
    yield np.zeros((4, 4), np.float32)
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize(("chunks", "error", "words"), [
    (lambda: iter([np.zeros((9, 4), np.float32)]), RuntimeError, "144 bytes streamed, 160 expected"),
    (failing_chunks, OSError, "No space left"),
])
def test_a_streamed_tensor_that_fails_raises_its_error_in_python(tmp_path, chunks, error, words):
    """Its chunks are read inside torch's writer (C, which an exception cannot cross: the process
    would abort); the error comes back out as itself."""
    bad = streamed_save.Streamed((10, 4), torch.float32, chunks)
    with open(tmp_path / "c.pt", "w+b") as f, pytest.raises(error, match=words):
        streamed_save.save({"t": bad, "after": torch.ones(3)}, f)


CONFIG = TrainConfig(steps=3, batch_size=64, num_tables=2, rows=40_000, dim=32)   # 2 x 5 MB of weights


@pytest.fixture(scope="module")
def cached_set():
    """A pool set trained with a hot-row cache: its capacity rows of the cached rows are stale."""
    with tier_folders("cxltrain-stream-") as (fast, disk):
        primary = os.path.join(fast, "s.pool")
        config = dataclasses.replace(CONFIG, capacity_pool=os.path.join(disk, "s.cap"), cache_rows=2_000)
        train(config, pool_path=primary, progress=False)
        yield primary, disk


def test_cxltrain_export_equals_torch_save_of_the_whole_export(cached_set, tmp_path):
    primary, _ = cached_set
    for form in ("cxltrain", "torchrec"):
        out = tmp_path / f"{form}.pt"
        done = cxltrain("export", "--format", form, primary, out)
        assert done.returncode == 0, done.stderr
        state = export_state(primary)  # every table in memory: what `export` wrote before it streamed
        if form == "torchrec":
            from cxltrain.runtime.interop import to_torchrec

            state = to_torchrec(state)
        assert out.read_bytes() == saved(tmp_path, f"{form}-whole.pt", state, torch.save)


def test_an_export_holds_a_chunk_of_the_tables_at_a_time(cached_set, tmp_path, monkeypatch):
    """numpy's buffers are traced by tracemalloc: the largest the export holds at once must be about a
    chunk, where a table is 5 MB (the whole-table export holds them all, and fails this)."""
    primary, _ = cached_set
    chunk = 256 << 10
    monkeypatch.setattr(hot_cache, "CHUNK_BYTES", chunk)
    with open_export(primary) as state:
        held = [v for v in state["model"].values() if isinstance(v, streamed_save.Streamed)]
        assert len(held) == 4 and max(v.nbytes for v in held) >= 16 * chunk
        tracemalloc.start()
        try:
            with open(tmp_path / "t.pt", "w+b") as f:
                streamed_save.save(state, f)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 4 * chunk, f"the export held {peak:,} bytes at once"
    with open(tmp_path / "whole.pt", "w+b") as f:
        torch.save(export_state(primary), f)
    assert (tmp_path / "t.pt").read_bytes() == (tmp_path / "whole.pt").read_bytes()


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def test_a_cached_tables_state_dict_is_its_merged_rows_and_costs_a_chunk_of_memory(cached_set, monkeypatch):
    """A cached table's weight and optimizer state are copies (cached rows from their slots): built a
    chunk at a time into a mapped file, they add about a chunk to the process's anonymous memory,
    where copies in memory add the 10 MB of weights."""
    primary, _ = cached_set
    monkeypatch.setattr(hot_cache, "CHUNK_BYTES", 256 << 10)
    expected = export_state(primary)["model"]
    config = dataclasses.replace(CONFIG, capacity_pool=None)
    model = build_model(config)
    with Pool.open(primary, writable=False) as pool, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's word on a read-only mapping: intended
        for table in model.modules():
            if isinstance(table, PersistentEmbeddingBag):
                table.attach(pool)
                table.cache = hot_cache.HotRowCache(table, pool)
        before = rss_anon()
        state = model.state_dict()
        grown = rss_anon() - before
        tables = [k for k in state if k.endswith((".weight", ".optimizer_state")) and "embedding_bags" in k]
        assert len(tables) == 4
        for key in tables:
            assert torch.equal(state[key], expected[key]), key
        del state
    assert grown < 4 << 20, f"state_dict() took {grown:,} bytes of anonymous memory"


def test_a_copy_that_cannot_have_its_file_is_made_in_memory(tmp_path):
    mapped = bag_module._file_backed(str(tmp_path / "t.cap"), (3, 2))
    assert not os.listdir(tmp_path)  # unlinked at once: the mapping alone keeps it
    in_memory = bag_module._file_backed(str(tmp_path / "missing" / "t.cap"), (3, 2))  # no such folder
    for copy in (mapped, in_memory):
        copy[:] = 1.0
        assert copy.shape == (3, 2) and float(copy.sum()) == 6.0
