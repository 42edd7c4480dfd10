"""DCP checkpoints (torch.distributed.checkpoint) in and out (docs/torchrec.md, "DCP checkpoints").

`cxltrain export --format dcp` of a pool, a pool set and a run folder is read by `dcp.load` on 1
rank and on 2 gloo ranks (children on 127.0.0.1 at a store this test hosts on a port the OS picks, timeouts on
both the group and the children), whole and row-sharded, equal to the plain export bit for bit; a
checkpoint `dcp.save`d under TorchRec's keys imports and trains; bad input is one line, exit 1,
nothing written.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp

import cxltrain
from cxltrain.cli import main as cli_main
from cxltrain.data import SyntheticCriteo
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.reshard import export_dir
from cxltrain.jobs.train import train
from cxltrain.models import DLRM
from cxltrain.runtime import dcp
from cxltrain.runtime.runtime import export_state
from cxltrain.runtime.streamed_save import Streamed
from helpers import assert_same_export, shm_tempdir, tier_folders
from helpers import cxltrain as cxltrain_cli

CONFIG = TrainConfig(steps=3, batch_size=64, num_tables=2, rows=3000, dim=16)
IMPORT_OPTIONS = ["--steps", "3", "--batch-size", "64", "--num-tables", "2", "--rows", "3000", "--dim", "16"]
CHILD_TIMEOUT = 120
RING = 1 << 20  # a small undo ring: a test pool is created in milliseconds
# dcp.save and dcp.load in one process, as these tests mean to
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def pool():
    """A pool trained 3 batches (2 tables of 3,000 x 16, row-wise Adagrad, Adam on the MLPs)."""
    with shm_tempdir("cxltrain-dcp-") as folder:
        path = os.path.join(folder, "a.pool")
        train(CONFIG, pool_path=path, progress=False)
        yield path


@pytest.fixture
def small_chunks(monkeypatch):
    """DCP chunks of 16 KiB: every table is written as many chunks (a row is 64 bytes)."""
    monkeypatch.setattr(dcp, "CHUNK_BYTES", 16 << 10)


def as_torchrec_keys(export: dict) -> dict[str, torch.Tensor]:
    """The plain export under the DCP checkpoint's keys (what dcp.load must give back)."""
    return {k: v for k, v in dcp.to_dcp(export).items() if k != dcp.EXTRA_KEY}


def export_dcp(source: str, out: str) -> None:
    assert cli_main(["export", source, out, "--format", "dcp"]) == 0


def load_plain(checkpoint: str) -> dict[str, torch.Tensor]:
    """dcp.load of every tensor of `checkpoint`, in this process, into plain tensors."""
    metadata = tdcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if hasattr(m, "size")}
    tdcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_export_loads_on_one_rank_as_the_plain_export(pool, tmp_path, small_chunks):
    out = str(tmp_path / "ck")
    export_dcp(pool, out)
    plain = export_state(pool)
    expected = as_torchrec_keys(plain)
    assert {"embedding_bags.t0.weight", "state.embedding_bags.t0.weight.t0.momentum1", "top.0.weight"} <= set(expected)
    metadata = tdcp.FileSystemReader(out).read_metadata().state_dict_metadata
    assert len(metadata["embedding_bags.t1.weight"].chunks) == 3000 * 64 // (16 << 10) + 1  # written chunk by chunk
    assert_same_tensors(load_plain(out), expected)
    back, ours = dcp.read(out)
    assert ours and back["tables"] == plain["tables"] and back["metadata"] == plain["metadata"]
    assert_same_export(back, plain)  # the dense optimizers' state too


def test_rows_are_read_in_any_order():
    """The writer asks for a table's chunks in order; any other order still reads the right rows."""
    table = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
    source = Streamed((50, 3), torch.float32, lambda: (table[i:i + 7] for i in range(0, 50, 7)))
    reader = dcp._RowReader(source)
    for first, n in [(0, 10), (10, 5), (3, 20), (40, 10), (49, 1), (0, 50)]:
        assert torch.equal(reader.rows(first, n), torch.from_numpy(table[first:first + n])), (first, n)


CHILD = r"""
import datetime, sys, torch
import torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
checkpoint, out, port, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
timeout = datetime.timedelta(seconds=30)
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # the test's: it outlives both ranks
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
metadata = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
whole = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if hasattr(m, "size")}
dcp.load(whole, checkpoint_id=checkpoint)
mesh = init_device_mesh("cpu", (2,))
rows = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in whole.items()
        if "embedding_bags." in k}
dcp.load(rows, checkpoint_id=checkpoint)  # DCP reshards the saved chunks into this rank's rows
torch.save({"whole": whole, "rows": {k: v.to_local() for k, v in rows.items()}}, f"{out}/rank{rank}.pt")
dist.barrier()  # neither rank tears its half of a pair down while the other still reads from it
del rows, mesh  # the mesh holds the group: kept past destroy, gloo's threads meet the exit
dist.destroy_process_group()
"""


def load_on_two_ranks(checkpoint: str, out: str) -> list[dict]:
    """dcp.load on two gloo ranks in children, meeting at a store whose server lives here (not in
    a rank that may exit first)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=CHILD_TIMEOUT))
    children = [subprocess.Popen([sys.executable, "-c", CHILD, checkpoint, out, str(server.port), str(rank)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        for child in children:
            output, _ = child.communicate(timeout=CHILD_TIMEOUT)
            assert child.returncode == 0, output[-3000:]
    finally:
        for child in children:
            child.kill()
            child.wait()
        del server
    return [torch.load(f"{out}/rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def test_two_gloo_ranks_load_it_whole_and_row_sharded(pool, tmp_path, small_chunks):
    out = str(tmp_path / "ck")
    export_dcp(pool, out)
    expected = as_torchrec_keys(export_state(pool))
    ranks = load_on_two_ranks(out, str(tmp_path))
    for loaded in ranks:
        assert_same_tensors(loaded["whole"], expected)
    for key, tensor in ranks[0]["rows"].items():
        half = (expected[key].shape[0] + 1) // 2  # Shard(0): the first rank takes the rounded-up half
        assert tensor.shape[0] == half
        assert torch.equal(torch.cat([tensor, ranks[1]["rows"][key]]), expected[key]), key


def test_a_pool_set_exports_as_its_plain_export(tmp_path, small_chunks):
    """A set's tables live in its capacity pool on the disk: the checkpoint reads them there."""
    with tier_folders("cxltrain-dcp-set-") as (fast, disk):
        primary = os.path.join(fast, "s.pool")
        train(dataclasses.replace(CONFIG, capacity_pool=os.path.join(disk, "s.cap")), pool_path=primary, progress=False)
        out = str(tmp_path / "ck")
        export_dcp(primary, out)
        assert_same_tensors(load_plain(out), as_torchrec_keys(export_state(primary)))


def test_a_run_folder_round_trips_through_dcp(pool, tmp_path, small_chunks):
    """A 2-rank run folder (made by import, as a training would leave it) out to DCP, and in again onto
    1 rank and into a pool: the same state, bit for bit, optimizers included."""
    plain = str(tmp_path / "g.pt")
    assert cli_main(["export", pool, plain]) == 0
    with shm_tempdir("cxltrain-dcp-run-") as folder:
        run, again, single = (os.path.join(folder, name) for name in ("run", "again", "single.pool"))
        assert cli_main(["import", plain, run, "--nproc-per-node", "2", *IMPORT_OPTIONS, "--sharding", "row-wise"]) == 0
        out = str(tmp_path / "ck")
        export_dcp(run, out)
        reference = export_dir(run)
        assert_same_tensors(load_plain(out), as_torchrec_keys({**reference, "metadata": None}))
        assert cli_main(["import", out, again, "--nproc-per-node", "1", *IMPORT_OPTIONS]) == 0
        assert_same_export(export_dir(again), reference)
        assert cli_main(["import", out, single]) == 0
        assert_same_export(export_state(single), reference)
        # --format torchrec on a run folder is TorchRec's layout too, as on a pool
        assert cli_main(["export", run, str(tmp_path / "tr.pt"), "--format", "torchrec"]) == 0
        assert cli_main(["export", pool, str(tmp_path / "tr-pool.pt"), "--format", "torchrec"]) == 0
        assert_same_tensors(torch.load(tmp_path / "tr.pt", weights_only=True),
                            torch.load(tmp_path / "tr-pool.pt", weights_only=True))


def train_run(run: str, steps: int) -> None:
    done = cxltrain_cli("train", "--nproc-per-node", 2, "--pool", run, *IMPORT_OPTIONS, "--steps", steps,
                        "--sharding", "row-wise", "--no-progress", "--dist-timeout", "30", timeout=CHILD_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_a_trained_run_folder_exports_and_trains_on(tmp_path):
    """`train --nproc-per-node 2` (torchrun) writes the run folder; its DCP checkpoint is its export,
    and imported onto 2 ranks again it trains on to the uninterrupted run's end, bit for bit."""
    with shm_tempdir("cxltrain-dcp-run-") as folder:
        run, again, uninterrupted = (os.path.join(folder, name) for name in ("run", "again", "uninterrupted"))
        out = str(tmp_path / "ck")
        train_run(run, 3)
        export_dcp(run, out)
        assert_same_tensors(load_plain(out), as_torchrec_keys({**export_dir(run), "metadata": None}))
        assert cli_main(["import", out, again, "--nproc-per-node", "2", *IMPORT_OPTIONS, "--steps", "5",
                         "--sharding", "row-wise"]) == 0
        train_run(again, 5)
        train_run(uninterrupted, 5)
        assert_same_export(export_dir(again), export_dir(uninterrupted))


# ---------------------------------------------------------------------------------------------
# A checkpoint TorchRec's user saved with dcp.save
# ---------------------------------------------------------------------------------------------
ROWS = [60, 40]
DATA = SyntheticCriteo(num_tables=2, rows=ROWS, batch_size=32, seed=2)


def small_model() -> DLRM:
    return DLRM(embedding_rows=ROWS, embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,), seed=5)


def torchrec_state(prefix: str = "") -> dict[str, torch.Tensor]:
    """An EBC's tables (t0 with row-wise Adagrad's momentum1 as TorchRec's fused optimizer keys it, t1
    without) and our DLRM's dense weights, as plain tensors under TorchRec's key names."""
    gen = torch.Generator().manual_seed(3)
    state = {f"{prefix}embedding_bags.t{i}.weight": torch.randn(rows, 8, generator=gen) for i, rows in enumerate(ROWS)}
    state[f"state.{prefix}embedding_bags.t0.weight.t0.momentum1"] = torch.rand(ROWS[0], generator=gen)
    dense = {k: v for k, v in small_model().state_dict().items() if "embedding_bags" not in k}
    state.update({k: torch.randn(v.shape, generator=gen) for k, v in dense.items()})
    return state


def test_a_dcp_saved_torchrec_checkpoint_imports_and_trains(tmp_path, shm_dir):
    saved = torchrec_state()
    checkpoint, pool = str(tmp_path / "ck"), str(shm_dir / "p.pool")
    tdcp.save(saved, checkpoint_id=checkpoint, no_dist=True)
    assert cli_main(["import", checkpoint, pool]) == 0
    net = small_model()
    with cxltrain.Runtime(pool, net, [], undo_ring_bytes=RING) as rt:
        assert rt.start_batch == 0
        state = net.state_dict()
        path = "embedding_bag_collection.embedding_bags"
        for i in range(2):
            assert torch.equal(state[f"{path}.t{i}.weight"], saved[f"embedding_bags.t{i}.weight"])
        assert torch.equal(state[f"{path}.t0.optimizer_state"][:, 0], saved["state.embedding_bags.t0.weight.t0.momentum1"])
        assert not state[f"{path}.t1.optimizer_state"].any()  # none saved: Adagrad's accumulator starts at 0
        assert torch.equal(state["top.0.weight"], saved["top.0.weight"])
        for batch in rt.batches(DATA, stop=2):
            net.loss(batch).backward()
    trained = export_state(pool)
    assert trained["batch"] == 2
    assert not torch.equal(trained["model"][f"{path}.t0.weight"], saved["embedding_bags.t0.weight"])


def test_a_model_holding_the_collection_keeps_its_paths(tmp_path, shm_dir):
    """TorchRec's DLRM keys its tables under its collection's path, its optimizer state (Adam's too)
    under "state.": the tables keep that path, Adam's state is not taken for dense weights."""
    prefix = "model.sparse_arch.embedding_bag_collection."
    saved = {**torchrec_state(prefix), "state.top.0.weight.exp_avg": torch.ones(1)}
    checkpoint, pool = str(tmp_path / "ck"), str(shm_dir / "p.pool")
    tdcp.save(saved, checkpoint_id=checkpoint, no_dist=True)
    assert cli_main(["import", checkpoint, pool]) == 0
    imported = export_state(pool)
    assert imported["tables"] == {f"{prefix}embedding_bags.t{i}": f"t{i}" for i in range(2)}
    assert torch.equal(imported["model"][f"{prefix}embedding_bags.t0.optimizer_state"][:, 0],
                       saved[f"state.{prefix}embedding_bags.t0.weight.t0.momentum1"])
    assert not any(k.startswith("state.") for k in imported["model"])


def test_torchrecs_own_collection_round_trips(pool, tmp_path, shm_dir):
    torchrec = pytest.importorskip("torchrec", reason="torchrec is not installed (`make bench-extras` installs it)")
    ebc = torchrec.EmbeddingBagCollection(tables=[
        torchrec.EmbeddingBagConfig(name=f"t{i}", num_embeddings=3000, embedding_dim=16, feature_names=[f"t{i}"])
        for i in range(2)], device=torch.device("cpu"))
    out = str(tmp_path / "ck")
    export_dcp(pool, out)
    state = ebc.state_dict()
    tdcp.load(state, checkpoint_id=out, no_dist=True)  # TorchRec's own keys, read by DCP into its EBC
    expected = export_state(pool)["model"]
    for i in range(2):
        assert torch.equal(state[f"embedding_bags.t{i}.weight"],
                           expected[f"embedding_bag_collection.embedding_bags.t{i}.weight"])
    theirs = str(tmp_path / "theirs")
    tdcp.save(ebc.state_dict(), checkpoint_id=theirs, no_dist=True)
    assert cli_main(["import", theirs, str(shm_dir / "p.pool")]) == 0
    imported = export_state(str(shm_dir / "p.pool"))["model"]
    assert torch.equal(imported["embedding_bag_collection.embedding_bags.t1.weight"], state["embedding_bags.t1.weight"])
    from torchrec.models.dlrm import DLRM as TorchRecDLRM

    dlrm = TorchRecDLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[32, 16],
                        over_arch_layer_sizes=[8, 1])
    theirs = str(tmp_path / "dlrm")
    tdcp.save(dlrm.state_dict(), checkpoint_id=theirs, no_dist=True)
    assert cli_main(["import", theirs, str(shm_dir / "dlrm.pool")]) == 0
    imported = export_state(str(shm_dir / "dlrm.pool"))
    path = "sparse_arch.embedding_bag_collection.embedding_bags"
    assert imported["tables"] == {f"{path}.t{i}": f"t{i}" for i in range(2)}
    for key, tensor in dlrm.state_dict().items():
        assert torch.equal(imported["model"][key], tensor), key


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 1, nothing written
# ---------------------------------------------------------------------------------------------
def _no_tables(folder):
    tdcp.save({"w": torch.ones(2)}, checkpoint_id=folder, no_dist=True)


def _a_table_missing(folder, pool):
    state = dcp.to_dcp(export_state(pool))
    del state["embedding_bags.t1.weight"]
    dcp.save(state, folder)


def _momentum_of_another_shape(folder):
    state = torchrec_state()
    state["state.embedding_bags.t0.weight.t0.momentum1"] = torch.ones(ROWS[0] + 1)
    tdcp.save(state, checkpoint_id=folder, no_dist=True)


def _torn(folder, pool):
    dcp.save(dcp.to_dcp(export_state(pool)), folder)
    with open(os.path.join(folder, "__0_0.distcp"), "r+b") as f:
        f.truncate(1000)


@pytest.mark.parametrize("make, message", [
    (lambda folder, pool: os.mkdir(folder), "not a DCP checkpoint"),
    (lambda folder, pool: _no_tables(folder), "no embedding_bags.<table>.weight keys"),
    (_a_table_missing, "table(s) t1 missing"),
    (lambda folder, pool: _momentum_of_another_shape(folder), "does not fit weights"),
    (_torn, "cannot read the DCP checkpoint"),
])
@pytest.mark.parametrize("into", ["pool", "run folder"])
def test_bad_checkpoints_say_one_line_and_build_nothing(make, message, into, pool, tmp_path, shm_dir, capsys):
    if into == "run folder" and "fit weights" in message:
        message = "table 0 is [60, 8]"  # the settings say 3,000 x 16: refused before the optimizer state
    folder, target = str(tmp_path / "ck"), str(shm_dir / "target")
    make(folder, pool)
    capsys.readouterr()
    options = ["--nproc-per-node", "1", *IMPORT_OPTIONS] if into == "run folder" else []
    assert cli_main(["import", folder, target, *options]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert os.listdir(shm_dir) == []


def test_export_refuses_an_existing_folder(pool, tmp_path, capsys):
    out = tmp_path / "ck"
    out.mkdir()
    assert cli_main(["export", pool, str(out), "--format", "dcp"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(out) == [] and os.listdir(tmp_path) == ["ck"]
