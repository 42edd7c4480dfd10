"""rt.batches over PyTorch data: lists, generators, DataLoaders; exact resume where the source can
seek, one line where it cannot; table learning rates changed by a scheduler, committed with the batch."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import cxltrain
from cxltrain.data import Batch, ResumableSampler, SyntheticCriteo
from cxltrain.errors import ConfigError
from cxltrain.models import DLRM
from cxltrain.runtime.runtime import export_state
from cxltrain.tables.optim import TableLR
from helpers import assert_same_export

ROWS = [50, 30]
SOURCE = SyntheticCriteo(num_tables=2, rows=ROWS, batch_size=40, seed=3)

RING = 1 << 20  # a small undo ring: a test pool is created in milliseconds


class Samples(Dataset):
    """Map-style: sample i = (dense [13], one id per table [2], label), cut from synthetic batches."""

    def __init__(self, n: int = 40) -> None:
        batch = SOURCE.batch(0)
        self.dense, self.labels = batch.dense[:n], batch.labels[:n]
        self.ids = torch.stack([v[o][:n] for v, o in zip(batch.values, batch.offsets)], dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.dense[i], self.ids[i], self.labels[i]


def collate(samples) -> Batch:
    dense, ids, labels = (torch.stack(x) for x in zip(*samples))
    offsets = torch.arange(len(samples))
    return Batch(-1, dense, tuple(ids.t().contiguous()), (offsets,) * 2, labels)


def loader(seed: int = 7) -> DataLoader:
    data = Samples()
    return DataLoader(data, batch_size=6, collate_fn=collate, sampler=ResumableSampler(data, shuffle=True, seed=seed))


class StatefulStream:
    """A stream that can say where it is and go back there, as torchdata's StatefulDataLoader does:
    state_dict() after yielding batch b says the next is b + 1."""

    def __init__(self, length: int = 6) -> None:
        self.position, self.length = 0, length

    def __iter__(self):
        while self.position < self.length:
            self.position += 1
            yield SOURCE.batch(self.position - 1)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def model() -> DLRM:
    return DLRM(embedding_rows=ROWS, embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,), seed=1)


class Crash(Exception):
    pass


def run(path: str, make_source, *, epochs: int = 1, stop: int | None = None, crash_at: int | None = None,
        lr_every: int | None = None) -> None:
    """Train `epochs` passes of rt.batches(make_source(), stop) in the pool at `path` (a resumed run
    still stops at `stop`); raise Crash right after
    batch `crash_at`'s backward (the batch stays uncommitted). lr_every: a TableLR halves the tables'
    lr every that many steps."""
    net = model()
    opt = torch.optim.Adam(net.dense_parameters(), lr=1e-2)
    schedulers = [TableLR(net.tables, lambda n: 0.5 ** (n // lr_every))] if lr_every else []
    source = make_source()
    if isinstance(source, StatefulStream):
        schedulers.append(source)  # its state is committed with every batch
    with cxltrain.Runtime(path, net, opt, schedulers=schedulers, undo_ring_bytes=RING) as rt:
        for _ in range(epochs):
            for batch in rt.batches(source, stop=stop):
                net.loss(batch).backward()
                opt.step()
                opt.zero_grad()
                for s in schedulers:
                    if hasattr(s, "step"):
                        s.step()
                if rt.batch == crash_at:
                    raise Crash


def same_after_crashes(shm_dir, make_source, crashes, **kwargs) -> None:
    """An uninterrupted run and one stopped at each of `crashes` then resumed end with equal exports."""
    whole, broken = os.path.join(shm_dir, "whole.pool"), os.path.join(shm_dir, "broken.pool")
    run(whole, make_source, **kwargs)
    for crash_at in crashes:
        with pytest.raises(Crash):
            run(broken, make_source, crash_at=crash_at, **kwargs)
    run(broken, make_source, **kwargs)
    assert_same_export(export_state(whole), export_state(broken))


def test_a_list_resumes_exactly(shm_dir):
    batches = [SOURCE.batch(b) for b in range(6)]
    same_after_crashes(shm_dir, lambda: batches, [3])


def test_a_dataloader_with_a_resumable_sampler_resumes_exactly_across_epochs(shm_dir):
    assert len(loader()) == 7  # 40 samples in batches of 6: the last is short
    same_after_crashes(shm_dir, loader, [9], epochs=2, stop=14)  # batch 2 of the second epoch


def test_a_stop_past_the_epoch_is_honoured_across_epochs_and_resumes_exactly(shm_dir):
    """stop=10 over 7-batch epochs: one loop trains 10 batches (it was cut to the epoch's 7), into the
    second epoch, and a crash in it resumes to the same end as epoch-by-epoch loops."""
    path = os.path.join(shm_dir, "s.pool")
    run(path, loader, stop=10)
    assert export_state(path)["batch"] == 10
    by_epochs = os.path.join(shm_dir, "e.pool")
    run(by_epochs, loader, epochs=2, stop=10)
    assert_same_export(export_state(path), export_state(by_epochs))
    same_after_crashes(shm_dir, loader, [8], stop=10)


def test_a_shuffled_dataloader_is_refused_when_the_run_starts(shm_dir):
    """Its order is drawn anew every run: no resume could find it again, so it is refused at batch 0,
    not after the crash (before: trained, then refused on resume)."""
    with pytest.raises(ConfigError, match=r"shuffle=True draws a new order every run.*ResumableSampler"):
        run(os.path.join(shm_dir, "r.pool"), lambda: DataLoader(Samples(), batch_size=8, shuffle=True,
                                                                  collate_fn=collate))


def test_each_epoch_is_reshuffled_and_a_pass_sees_every_sample():
    sampler = ResumableSampler(10, shuffle=True, seed=1)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    sampler.seek(1, 4)
    assert list(sampler) == second[4:]


def test_a_stateful_loader_committed_with_the_batches_resumes_exactly(shm_dir):
    same_after_crashes(shm_dir, StatefulStream, [2])


def test_a_generator_trains_from_the_start_and_refuses_to_resume_past_it(shm_dir):
    path = os.path.join(shm_dir, "g.pool")
    with pytest.raises(Crash):
        run(path, lambda: (SOURCE.batch(b) for b in range(5)), crash_at=2)
    with pytest.raises(ConfigError, match="resumes at batch 2, and a generator cannot seek there"):
        run(path, lambda: (SOURCE.batch(b) for b in range(5)))


def test_a_plain_dataloader_trains_too(shm_dir):
    path = os.path.join(shm_dir, "p.pool")
    run(path, lambda: DataLoader(Samples(), batch_size=8, collate_fn=collate))
    assert export_state(path)["batch"] == 5


def test_not_a_source_is_one_line(shm_dir):
    with pytest.raises(ConfigError, match="a int is not a data source"):
        run(os.path.join(shm_dir, "x.pool"), lambda: 5)


def test_table_learning_rates_follow_the_scheduler_through_a_crash(shm_dir):
    path = os.path.join(shm_dir, "lr.pool")
    with pytest.raises(Crash):
        run(path, lambda: [SOURCE.batch(b) for b in range(6)], crash_at=3, lr_every=2)
    assert export_state(path)["schedulers"][0]["lrs"] == [0.005, 0.005]  # 3 steps committed
    same_after_crashes(shm_dir, lambda: [SOURCE.batch(b) for b in range(6)], [4], lr_every=2)
