"""cxltrain.Runtime with a user's own model (not DLRM): the contract of docs/architecture.md §7, in one process.

Crash exactness with real kills is in test_checkpoint_crash.py; here the "crash" is an exception
(or a pool closed without its final commit), which leaves the pool exactly as a kill at that
moment would under SIGKILL.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cxltrain
from cxltrain.errors import CheckpointError, ConfigError, PoolError, RecoveryError
from cxltrain.pool.handle import Pool
from cxltrain.runtime.runtime import export_state, recover_pool
from cxltrain.tables.bag import PersistentEmbeddingBag
from cxltrain.tables.optim import SGD
from helpers import assert_same_export

ROWS, DIM, BATCH = 500, 4, 16


class TwoTower(nn.Module):
    """A small model of the user's own: two persistent tables (one SGD, one Adagrad), a dense net
    with dropout (so the RNG state matters), nested inside a container."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.towers = nn.ModuleDict({
            "user": PersistentEmbeddingBag(ROWS, DIM, name="user", optimizer=SGD(lr=0.5), seed=1),
            "item": PersistentEmbeddingBag(ROWS, DIM, name="item", seed=2, mode="mean")})
        self.head = nn.Sequential(nn.Linear(2 * DIM, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 1))

    def loss(self, batch) -> torch.Tensor:
        users, items, labels = batch
        x = torch.cat([self.towers["user"](users), self.towers["item"](items)], dim=1)
        return nn.functional.binary_cross_entropy_with_logits(self.head(x).squeeze(1), labels)


def make_batch(b: int):
    g = torch.Generator().manual_seed(1000 + b)
    users = torch.randint(0, 40, (BATCH, 2), generator=g)       # few rows: consecutive batches overlap
    items = torch.randint(0, ROWS, (BATCH, 3), generator=g)
    return users, items, torch.randint(0, 2, (BATCH,), generator=g).float()


def make_run():
    model = TwoTower()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def train_steps(path, stop, *, fail_at=None, dense_every=1, **kwargs):
    """Train batches up to `stop` on `path`; raise inside batch `fail_at` (after its backward)."""
    model, optimizer, scheduler = make_run()
    with cxltrain.Runtime(path, model, optimizer, schedulers=[scheduler], dense_every=dense_every, **kwargs) as rt:
        start = rt.start_batch
        for batch in rt.batches(make_batch, stop=stop):
            model.loss(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if rt.batch == fail_at:
                raise KeyboardInterrupt("crash")
    return rt, start


def state_of(path) -> dict:
    return export_state(str(path))


@pytest.mark.parametrize("dense_every", [1, 3])
def test_exception_mid_run_then_resume_is_exact(shm_dir, dense_every):
    path = shm_dir / "p.pool"
    with pytest.raises(KeyboardInterrupt):
        train_steps(path, 10, fail_at=7, dense_every=dense_every)
    committed = 7 if dense_every == 1 else 6   # batch 7 was in flight; with k=3 commits are at 3, 6
    recovered = state_of(path)
    assert recovered["batch"] == committed
    train_steps(shm_dir / "ref.pool", committed, dense_every=dense_every)
    assert_same_export(recovered, state_of(shm_dir / "ref.pool"))
    rt, start = train_steps(path, 10, dense_every=dense_every)
    assert start == committed and rt.recovered_batch == committed
    train_steps(shm_dir / "full.pool", 10, dense_every=dense_every)
    assert_same_export(state_of(path), state_of(shm_dir / "full.pool"))


def test_export_keys_follow_the_module_tree(shm_dir):
    train_steps(shm_dir / "p.pool", 2)
    state = state_of(shm_dir / "p.pool")
    assert {"towers.user.weight", "towers.item.weight", "towers.item.optimizer_state", "head.0.weight"} <= set(state["model"])
    assert "towers.user.optimizer_state" not in state["model"]   # SGD keeps no state
    assert state["model"]["towers.item.weight"].shape == (ROWS, DIM)
    assert state["optimizers"][0]["param_groups"][0]["momentum"] == 0.9
    assert state["schedulers"][0]["last_epoch"] == 2


def test_leaving_normally_after_break_commits_the_batch_in_flight(shm_dir):
    model, optimizer, scheduler = make_run()
    with cxltrain.Runtime(shm_dir / "p.pool", model, optimizer) as rt:
        for batch in rt.batches(make_batch):     # endless: a callable has no num_batches
            model.loss(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            if rt.batch == 4:
                break
    assert state_of(shm_dir / "p.pool")["batch"] == 5
    with Pool.open(str(shm_dir / "p.pool"), writable=False) as pool:
        assert pool.root.batches_done == 5 and pool.root.dense_batch == 5


def test_stats_count_the_work(shm_dir):
    rt, _ = train_steps(shm_dir / "p.pool", 6, dense_every=2)
    s = rt.stats
    assert (s.batches, s.commits) == (6, 3)
    assert s.undo_bytes > 0 and s.dense_bytes > 0 and s.rows_persisted > 0 and s.capture_seconds > 0


def test_synchronous_and_pipelined_runs_end_bit_identical(shm_dir):
    sync, _ = train_steps(shm_dir / "s.pool", 6, pipeline=False)
    piped, _ = train_steps(shm_dir / "p.pool", 6)
    background, _ = train_steps(shm_dir / "b.pool", 6, background_capture=True)
    assert_same_export(state_of(shm_dir / "s.pool"), state_of(shm_dir / "p.pool"))
    assert_same_export(state_of(shm_dir / "b.pool"), state_of(shm_dir / "p.pool"))
    # where each capture ran: inside backward on the training thread, or handed over in forward
    assert piped.stats.training_capture_seconds > 0 == piped.stats.training_lookup_seconds
    assert background.stats.training_capture_seconds == 0 < background.stats.training_lookup_seconds
    assert background.stats.undo_bytes == piped.stats.undo_bytes == sync.stats.undo_bytes
    assert sync.stats.commit_lag_max == 0 and sync.stats.wait_seconds == 0   # nothing to wait for inline
    assert piped.stats.commit_lag_max <= 1 and piped.stats.commits == sync.stats.commits == 6
    assert piped.stats.to_json()["bytes_persisted_per_batch"] == sync.stats.to_json()["bytes_persisted_per_batch"] > 0


def test_gradient_lookups_outside_a_batch_are_refused(shm_dir):
    model, optimizer, _ = make_run()
    with cxltrain.Runtime(shm_dir / "p.pool", model, optimizer) as rt:
        with pytest.raises(CheckpointError, match="outside a batch"):
            model.loss(make_batch(0))
        with torch.no_grad():
            model.loss(make_batch(0))    # evaluation is fine
        assert rt.start_batch == 0


def test_misuse_is_refused_with_clear_errors(shm_dir):
    with pytest.raises(ConfigError, match="no PersistentEmbeddingBag"):
        cxltrain.Runtime(shm_dir / "p.pool", nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="checkpoint must be"):
        cxltrain.Runtime(shm_dir / "p.pool", TwoTower(), checkpoint="sometimes")
    train_steps(shm_dir / "p.pool", 2)
    other = TwoTower()
    other.head = nn.Linear(2 * DIM, 1)   # same tables, another dense net
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(RecoveryError, match="this run has 1 and 0"):
        with cxltrain.Runtime(shm_dir / "p.pool", other, optimizer):
            pass
    with pytest.raises(RecoveryError, match="dense parameters do not match this model .first difference: 'head.0.bias'"):
        with cxltrain.Runtime(shm_dir / "p.pool", other, optimizer,
                              schedulers=[torch.optim.lr_scheduler.StepLR(optimizer, 3)]):
            pass
    with pytest.raises(RecoveryError, match="other settings"):
        model, optimizer, _ = make_run()
        with cxltrain.Runtime(shm_dir / "m.pool", model, optimizer, metadata={"lr": 1}):
            pass
        with cxltrain.Runtime(shm_dir / "m.pool", model, optimizer, metadata={"lr": 2}):
            pass


def test_checkpoint_off_commits_only_at_the_end(shm_dir):
    path = shm_dir / "p.pool"
    with pytest.raises(KeyboardInterrupt):
        train_steps(path, 6, fail_at=3, checkpoint="off")
    with Pool.open(str(path), writable=False) as pool:
        assert pool.root.batches_done == -1   # tables changed in place with nothing to roll them back
    with pytest.raises(RecoveryError, match="no committed checkpoint"):
        recover_pool(str(path))
    rt, start = train_steps(path, 6, checkpoint="off")
    assert rt.restarted and start == 0 and rt.stats is None
    train_steps(shm_dir / "ref.pool", 6)
    assert_same_export(state_of(path), state_of(shm_dir / "ref.pool"))


def test_checkpoint_off_on_committed_batches_is_refused_unless_discarded(shm_dir):
    """An off run on a pool with committed batches would lose them to a crash."""
    path = shm_dir / "p.pool"
    train_steps(path, 3)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="holds 3 committed batches that --checkpoint off would put at risk"):
        train_steps(path, 6, checkpoint="off")
    assert path.read_bytes() == before
    rt, start = train_steps(path, 6, checkpoint="off", discard_checkpoint=True)
    assert start == 3 and rt.batch == 6


def test_export_needs_write_access_only_to_roll_back(shm_dir, monkeypatch):
    """A committed pool exports read-only; one with records to roll back in place
    says why it needs write access."""
    from cxltrain.runtime import runtime

    path = shm_dir / "p.pool"
    with pytest.raises(KeyboardInterrupt):
        train_steps(path, 6, fail_at=3)  # batch 3 uncommitted: its undo records are live
    before = path.read_bytes()
    monkeypatch.setattr(runtime.os, "access", lambda *args: False)  # as a user who may only read it
    with pytest.raises(RecoveryError, match=r"undo record\(s\) to roll back in place before it can be exported, "
                                            "which needs write access"):
        export_state(str(path))
    assert path.read_bytes() == before
    monkeypatch.undo()
    assert export_state(str(path))["batch"] == 3
    after_recovery = path.read_bytes()
    assert export_state(str(path))["batch"] == 3 and path.read_bytes() == after_recovery


def test_a_crash_while_creating_leaves_no_pool_under_the_name(shm_dir):
    from cxltrain.pool.format import BUILDING_MAGIC

    path = shm_dir / "p.pool"
    # what a run killed before its superblock leaves: the mark of an unfinished pool of ours
    (shm_dir / "p.pool.creating").write_bytes(BUILDING_MAGIC.to_bytes(8, "little") + bytes(4088))
    train_steps(path, 1)
    assert path.exists() and not (shm_dir / "p.pool.creating").exists()


def test_a_file_of_the_users_named_like_the_side_name_is_kept(shm_dir):
    """Only a provably half-built pool of ours is deleted."""
    path, theirs = shm_dir / "p.pool", shm_dir / "p.pool.creating"
    theirs.write_bytes(b"the user's own notes")
    with pytest.raises(PoolError, match="is in the way and is not a pool left unfinished by cxltrain"):
        train_steps(path, 1)
    assert theirs.read_bytes() == b"the user's own notes" and not path.exists()
def test_resuming_with_another_thread_count_says_exactness_is_not_promised(shm_dir):
    train_steps(shm_dir / "p.pool", 2)
    torch.set_num_threads(1)
    try:
        with pytest.warns(UserWarning, match="written with 2 torch threads, this run uses 1"):
            train_steps(shm_dir / "p.pool", 3)
    finally:
        torch.set_num_threads(2)


def test_backward_outside_the_batch_of_its_forward_is_refused_before_any_store(shm_dir):
    model, optimizer, _ = make_run()
    with cxltrain.Runtime(shm_dir / "p.pool", model, optimizer) as rt:
        losses = []
        for batch in rt.batches(make_batch, stop=2):
            losses.append(model.loss(batch))  # accumulated: batch 0's undo records are already reclaimed
            if rt.batch == 1:
                with pytest.raises(CheckpointError, match="lookup made in batch 0 ran in batch 1"):
                    sum(losses).backward(retain_graph=True)
        before = [t.weight.clone() for t in model.towers.values()]
        with pytest.raises(CheckpointError, match="lookup made in batch 1 ran in no batch"):
            losses[1].backward()  # after the loop
        for table, old in zip(model.towers.values(), before):
            assert torch.equal(table.weight, old)


def test_with_checkpoint_off_updates_outside_a_batch_are_refused_too(shm_dir):
    model, optimizer, _ = make_run()
    with cxltrain.Runtime(shm_dir / "p.pool", model, optimizer, checkpoint="off"):
        with pytest.raises(CheckpointError, match="outside a batch"):
            model.loss(make_batch(0)).backward()


def test_a_batch_left_before_it_did_anything_is_not_counted(shm_dir):
    model, optimizer, scheduler = make_run()
    with cxltrain.Runtime(shm_dir / "p.pool", model, optimizer, schedulers=[scheduler]) as rt:
        for batch, _ in zip(rt.batches(make_batch), range(3)):   # zip fetches a 4th batch, then stops
            model.loss(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    assert state_of(shm_dir / "p.pool")["batch"] == 3
    rt, start = train_steps(shm_dir / "p.pool", 4)
    assert start == 3


def test_a_runtime_can_be_entered_again_after_an_exception(shm_dir):
    model, optimizer, _ = make_run()
    rt = cxltrain.Runtime(shm_dir / "p.pool", model, optimizer)
    with pytest.raises(KeyboardInterrupt):
        with rt:
            for batch in rt.batches(make_batch, stop=5):
                model.loss(batch).backward()
                if rt.batch == 2:
                    raise KeyboardInterrupt
    with rt:
        assert rt.recovered_batch == 2
        for batch in rt.batches(make_batch, stop=4):
            model.loss(batch).backward()
    assert state_of(shm_dir / "p.pool")["batch"] == 4


def test_bad_arguments_are_config_errors(shm_dir):
    for kwargs, match in (({"pool_size": "1G"}, "pool_size must be a positive integer"),
                          ({"dense_every": True}, "dense_every must be a positive integer"),
                          ({"metadata": ["x"]}, "metadata must be a dict")):
        with pytest.raises(ConfigError, match=match):
            cxltrain.Runtime(shm_dir / "p.pool", TwoTower(), **kwargs)
    with pytest.raises(ConfigError, match="optimizers must be"):
        cxltrain.Runtime(shm_dir / "p.pool", TwoTower(), [42])


def test_a_table_of_another_optimizer_is_refused(shm_dir):
    train_steps(shm_dir / "p.pool", 1)
    model = nn.Module()
    model.item = PersistentEmbeddingBag(ROWS, DIM, name="item", optimizer=SGD(lr=0.1))
    model.user = PersistentEmbeddingBag(ROWS, DIM, name="user", optimizer=SGD(lr=0.1))
    with pytest.raises(RecoveryError, match="has optimizer state in the pool"):
        with cxltrain.Runtime(shm_dir / "p.pool", model):
            pass


def test_wait_durable_returns_once_the_commit_handed_over_is_durable(shm_dir):
    model, optimizer, scheduler = make_run()
    with cxltrain.Runtime(shm_dir / "p.pool", model, optimizer, schedulers=[scheduler]) as rt:
        batches = rt.batches(make_batch, stop=3)
        for _ in range(2):
            model.loss(next(batches)).backward()
            optimizer.step()
            optimizer.zero_grad()
        # batch 1 is in flight; batch 0's commit was handed to the worker when the loop asked for batch 1
        assert rt.wait_durable() >= 0 and rt.pool.root.batches_done == 1 and rt.stats.commits == 1


def _two_batches(path, lr: float, stop: int = 2, **kwargs) -> tuple[cxltrain.Runtime, torch.optim.Optimizer]:
    """Batches up to `stop` on `path` with the head's SGD built at `lr`; (the Runtime, the SGD)."""
    model = TwoTower()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=lr)
    with cxltrain.Runtime(path, model, optimizer, **kwargs) as rt:
        for batch in rt.batches(make_batch, stop=stop):
            model.loss(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    return rt, optimizer


def test_a_learning_rate_the_snapshot_replaces_is_reported(shm_dir, recwarn):
    path = shm_dir / "lr.pool"
    _two_batches(path, 0.1)
    with pytest.warns(UserWarning, match=r"the snapshot's learning rate 0.1 replaces the 0.3 SGD was built with"):
        _, optimizer = _two_batches(path, 0.3)
    assert optimizer.param_groups[0]["lr"] == 0.1
    recwarn.clear()
    _, kept = _two_batches(path, 0.3, keep_given_lr=True)   # a run that changes its learning rate
    assert kept.param_groups[0]["lr"] == 0.3 and not [w for w in recwarn if "learning rate" in str(w.message)]
    train_steps(shm_dir / "scheduled.pool", 4)
    train_steps(shm_dir / "scheduled.pool", 8)   # StepLR moved the rate, its base stayed: nothing to report
    assert not [w for w in recwarn if "learning rate" in str(w.message)]


def test_mutable_metadata_may_change_on_resume_and_every_other_difference_is_named(shm_dir):
    path = shm_dir / "meta.pool"
    _two_batches(path, 0.1, metadata={"seed": 1, "rows": 5, "lr": 0.1})
    rt, _ = _two_batches(path, 0.1, 3, metadata={"seed": 1, "rows": 5, "lr": 0.2}, mutable_metadata=("lr",))
    assert rt.resumed_metadata == {"seed": 1, "rows": 5, "lr": 0.1}
    assert export_state(str(path))["metadata"] == {"seed": 1, "rows": 5, "lr": 0.2}   # batch 3's snapshot
    with pytest.raises(RecoveryError, match=r"other settings \(rows 5 vs 6, seed 1 vs 2\)"):
        _two_batches(path, 0.1, metadata={"seed": 2, "rows": 6, "lr": 0.2})
