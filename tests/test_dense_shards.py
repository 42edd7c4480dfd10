"""A group's dense snapshot in slices (docs/distributed.md, "Dense slices"): each rank makes only its
1/W of the replicated dense state durable, keeps its slices of every batch the group may recover to,
and the whole is put together from every rank's slice of one batch G, bit for bit; a slice missing,
of another batch, or a rank pool of the format before slices is refused in one line.

The kill-and-restart runs that end bit-identical to an uninterrupted run (a rank past G recovering
from its own slice of G, then training on) are tests/test_dist.py's; here one killed 2-rank run
(rank 1 SIGKILLed before its root names batch 5, rank 0 committed it: G = 4) is damaged in copies.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections import OrderedDict

import pytest
import torch
from torch import nn

from cxltrain.checkpoint import codec, dense, dense_slices, layout, slots
from cxltrain.errors import CheckpointError, PoolVersionError, RecoveryError
from cxltrain.jobs.reshard import DENSE_PREFIX, export_dir
from cxltrain.pool import format as fmt
from cxltrain.pool.handle import Pool, RegionSpec
from cxltrain.runtime import manifest as run_dir
from helpers import cxltrain, shm_tempdir
from test_dist import killed_between_commits

CHILD_TIMEOUT = 240


def _whole_tree(metadata: dict) -> dict:
    """A dense snapshot tree as DenseState.capture makes it: an MLP and its Adam state after a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 13)).sum().backward()
    opt.step()
    return dense.DenseState(model, [opt], [], {}, metadata).capture(3)


def _slices(whole: dict, world_size: int) -> list[dict]:
    out = []
    for r in range(world_size):
        piece = dense_slices.slice_of(whole, r, world_size)
        out.append({**piece, "metadata": {"run": "R", "rank": r, "slices": world_size}})
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_slices_are_cut_alike_and_merge_back_bit_for_bit(world_size):
    whole = _whole_tree({"run": "R", "rank": 0, "slices": world_size})
    pieces = _slices(whole, world_size)
    assert pieces == _slices(whole, world_size)  # from the tree alone: every rank cuts it alike
    keys = [set(p["model"]) for p in pieces]
    assert sum(len(k) for k in keys) == len(whole["model"]) and set().union(*keys) == set(whole["model"])
    sizes = [len(codec.encode(p)) for p in pieces]
    if world_size > 1:
        assert max(sizes) < 0.8 * len(codec.encode(whole)), sizes
    merged = dense_slices.merge(pieces, 0, "D")
    assert codec.encode(merged) == codec.encode(whole)  # the same tree, in its own order, bit for bit


def test_merging_refuses_slices_of_another_batch_run_or_cut():
    whole = _whole_tree({})
    pieces = _slices(whole, 2)
    with pytest.raises(RecoveryError, match="D: rank 1's dense slice is of batch 2, rank 0's of batch 3: the dense "
                                            "state is rebuilt only from slices of one batch"):
        dense_slices.merge([pieces[0], {**pieces[1], "batch": 2}], 0, "D")
    with pytest.raises(RecoveryError, match="rank 1's dense slice is not slice 1 of 2 of this run"):
        dense_slices.merge([pieces[0], {**pieces[1], "metadata": {**pieces[1]["metadata"], "run": "S"}}], 0, "D")
    other = {**_slices(whole, 3)[1], "metadata": pieces[1]["metadata"]}  # a cut for 3 ranks overlaps
    with pytest.raises(RecoveryError, match="the ranks' dense slices overlap"):
        dense_slices.merge([pieces[0], other], 0, "D")


def _three_slot_pool(path: str, held: list[int], root_slot: int) -> Pool:
    """A group rank's pool whose slots 1-3 hold snapshots of the batches `held`, its root naming
    `root_slot` (and that slot's batch)."""
    pool = Pool.create(path, 8 << 20, incompat=fmt.INCOMPAT_DENSE_SLICES)
    pool.add_regions([RegionSpec(layout.RING_REGION, fmt.RegionKind.UNDO_RING, "uint8", (1 << 20,)),
                      *(RegionSpec(name, fmt.RegionKind.DENSE_SLOT, "uint8", (1 << 20,))
                        for name in (*layout.DENSE_REGIONS, layout.SLICE_REGION))])
    tree = _whole_tree({})
    for slot, batch in enumerate(held, 1):
        dense.write_snapshot(pool, slot, batch, {**tree, "batch": batch})
    pool.commit(batches_done=held[root_slot - 1], dense_slot=root_slot, dense_batch=held[root_slot - 1])
    return pool


def test_a_rank_keeps_its_slices_of_every_batch_the_group_may_recover_to(shm_dir):
    """U3d: its slice of G (or the newest below it) and those above stay; one slot is overwritten."""
    with _three_slot_pool(str(shm_dir / "r.pool"), [3, 4, 5], root_slot=3) as pool:
        assert dense.free_slot(pool, agreed=4) == 1       # batch 3: G = 4 can never go back to it
        assert dense.free_slot(pool, agreed=None) == 1    # no G yet: the oldest but the root's
        with pytest.raises(CheckpointError, match="every dense slot holds a slice the group may still recover to"):
            dense.free_slot(pool, agreed=3)               # 3 (G), 4 and 5: none may go
        # rolled back to 4 (a peer was at 4): the slice of 5 is of an abandoned future
        pool.commit(batches_done=4, dense_slot=2, dense_batch=4)
        assert dense.free_slot(pool, agreed=4) == 3
        dense.drop_abandoned_slices(pool)
        assert slots.held_batches(pool) == {1: 3, 2: 4, 3: None}


def test_one_process_keeps_alternating_two_slots(shm_dir):
    """One process's pool is unchanged: two slots, the one its root does not name is overwritten."""
    pool = Pool.create(str(shm_dir / "one.pool"), 8 << 20)
    with pool:
        pool.add_regions([RegionSpec(name, fmt.RegionKind.DENSE_SLOT, "uint8", (1 << 20,))
                          for name in layout.DENSE_REGIONS])
        pool.commit(batches_done=2, dense_slot=1, dense_batch=2)
        assert dense.free_slot(pool, agreed=1) == 2 and pool.superblock.incompat == 0


# ---------------------------------------------------------------------------------------------
# One killed 2-rank run, damaged in copies.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed():
    """A 2-rank run killed between the ranks' commits, not restarted: rank 0 at 5, rank 1 at 4."""
    with shm_tempdir("cxltrain-dense-shards-") as folder:
        run = f"{folder}/run"
        done = killed_between_commits(run)
        assert done.returncode != 0, done.stdout
        held = []
        for rank in range(2):
            with Pool.open(run_dir.pool_path(run, rank), writable=False) as pool:
                held.append(pool.root.batches_done)
        assert held == [5, 4], (held, done.stderr[-3000:])
        yield run


@pytest.fixture
def run(killed, shm_dir):
    copy = shm_dir / "run"
    shutil.copytree(killed, copy)
    return copy


def _root_slice(run, rank: int) -> dict:
    with Pool.open(run_dir.pool_path(str(run), rank), writable=False) as pool:
        return dense.read_snapshot(pool, pool.root.dense_slot, pool.root.dense_batch)


def test_each_rank_makes_only_its_slice_durable_and_keeps_its_slice_of_g(run):
    rank0, rank1 = _root_slice(run, 0), _root_slice(run, 1)
    assert (rank0["batch"], rank1["batch"]) == (5, 4)
    assert rank0["model"] and rank1["optimizers"][0]["state"]
    assert not set(rank0["model"]) & set(rank1["model"])
    with Pool.open(run_dir.pool_path(str(run), 0), writable=False) as pool:
        assert pool.superblock.incompat & fmt.INCOMPAT_DENSE_SLICES
        assert 4 in slots.held_batches(pool).values()  # past G, it still holds its slice of G
    state = export_dir(str(run))  # every rank to G = 4, the dense state from both slices
    assert state["batch"] == 4
    assert {DENSE_PREFIX + k for k in state["model"] if ".embedding_bags." not in k} \
        == set(rank0["model"]) | set(rank1["model"])  # the two slices: the whole dense model


def _files(run) -> dict:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir())}


def test_a_missing_slice_of_g_is_refused_in_one_line_with_nothing_written(run, shm_dir):
    with Pool.open(run_dir.pool_path(str(run), 0)) as pool:  # rank 0's slice of G = 4 lost
        slot = next(s for s, b in slots.held_batches(pool).items() if b == 4)
        pool.device.copy_persist(slots.slot_region(pool, slot).offset, bytes(layout.DENSE_HEADER.size))
    before = _files(run)
    for command in (["export", run, shm_dir / "out.pt"], ["recover", run], ["pool", "check", run]):
        done = cxltrain(*command, timeout=CHILD_TIMEOUT)
        assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout, done.stderr
        out = (done.stderr or done.stdout).strip().splitlines()
        assert "rank 0 cannot reach batch 4: its pool holds its dense slices of batches 3, 5 only" in out[0], out
    assert len(cxltrain("export", run, shm_dir / "out.pt").stderr.strip().splitlines()) == 1
    assert _files(run) == before and not (shm_dir / "out.pt").exists()


def test_a_rank_pool_from_before_dense_slices_is_refused_in_one_line(run, shm_dir, monkeypatch):
    path = run_dir.pool_path(str(run), 1)
    with Pool.open(path) as pool:  # as a build before slices made it: no feature bit
        sb = dataclasses.replace(pool.superblock, incompat=0)
        pool.device.copy_persist(fmt.SUPERBLOCK_OFFSET, sb.pack())
    done = cxltrain("export", run, shm_dir / "out.pt", timeout=CHILD_TIMEOUT)
    assert done.returncode != 0 and done.stderr.strip() == (
        f"cxltrain: error: rank 1: {path}: holds the whole dense state, as a cxltrain before dense slices wrote a "
        "rank's pool; recover, export or resume it with that version"), done.stderr
    # and a build without slices refuses a rank pool with them, rather than read a slice as the whole
    monkeypatch.setattr(fmt, "KNOWN_INCOMPAT_FEATURES", 0)
    with pytest.raises(PoolVersionError, match=r"incompat bits 0x1\); upgrade cxltrain"):
        Pool.open(run_dir.pool_path(str(run), 0), writable=False)


def test_a_rank_pool_exports_alone_once_every_rank_is_at_one_batch(run, shm_dir):
    """`cxltrain export DIR/rank-r.pool`: its tables, the dense state from every rank's slice of one
    batch; with the ranks at 5 and 4 it is refused in one line, after `recover DIR` it exports."""
    out = shm_dir / "rank1.pt"
    done = cxltrain("export", run_dir.pool_path(str(run), 1), out, timeout=CHILD_TIMEOUT)
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "rank 0's dense slice is of batch 5, rank 1's of batch 4" in done.stderr and not out.exists()
    assert cxltrain("recover", run, timeout=CHILD_TIMEOUT).returncode == 0
    done = cxltrain("export", run_dir.pool_path(str(run), 1), out, timeout=CHILD_TIMEOUT)
    assert done.returncode == 0, done.stderr
    alone, whole = torch.load(out, weights_only=True), export_dir(str(run))
    assert alone["batch"] == whole["batch"] == 4
    dense_keys = [k for k in alone["model"] if k.startswith(DENSE_PREFIX)]
    assert dense_keys and all(torch.equal(alone["model"][k], whole["model"][k[len(DENSE_PREFIX):]]) for k in dense_keys)
    assert repr(alone["optimizers"]) == repr(whole["optimizers"])
    assert isinstance(alone["model"], (dict, OrderedDict))
