"""PyTorch data for `rt.batches`: lists, generators, any iterable, and torch DataLoaders.

A run resumed at batch b must see exactly the batches an uninterrupted run saw from b on, so a
source is read from batch b by seeking where it can:

- an object with `.batch(b)`, or a callable b -> batch: asked for b (cxltrain's own sources);
- a sequence (list, tuple): item b;
- a DataLoader over a map-style dataset whose sampler is a ResumableSampler: the sampler is moved
  to batch b and the loader iterated from there, its workers and prefetching as usual;
- a stateful loader (one with state_dict/load_state_dict, as torchdata's StatefulDataLoader) that
  the Runtime commits with every batch (`Runtime(..., schedulers=[..., loader])`): restored on
  resume to where the committed batch left it, then iterated;
- anything else iterable (a generator, a DataLoader with torch's sequential sampler, an
  IterableDataset): read from its start on a fresh run; resuming it past batch 0 is refused with
  one line, since skipping items of a source that cannot seek would silently train on other data.
  A DataLoader with shuffle=True is refused at once, on a fresh run too: no resume could find its
  order again.

Global batch b of a ResumableSampler's loader is batch b % P of epoch b // P (P = len(loader)): an
epoch's order is a permutation drawn from (seed, epoch) alone, so each epoch reshuffles and every
position can be found again.

    loader = DataLoader(dataset, batch_size=512, sampler=ResumableSampler(dataset, shuffle=True, seed=0))
    for epoch in range(3):
        for batch in rt.batches(loader):      # the rest of the epoch the run is in
            ...
    for batch in rt.batches(loader, stop=3 * len(loader)):  # or all three epochs in one loop
        ...
"""

from __future__ import annotations

import collections.abc
import itertools
from typing import Callable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from ..errors import ConfigError


class ResumableSampler(Sampler[int]):
    """Indices of a map-style dataset, one epoch per pass, that can start at any batch.

    Args:
        data_source: the dataset (or its length).
        shuffle: each epoch is a permutation drawn from (seed, epoch); False: 0, 1, 2, ...
        seed: the permutations' seed.
    """

    def __init__(self, data_source, *, shuffle: bool = False, seed: int = 0) -> None:
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return self.length - self.start

    def order(self, epoch: int) -> torch.Tensor:
        """The dataset indices [len] of epoch `epoch`."""
        if not self.shuffle:
            return torch.arange(self.length)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.length, generator=generator)

    def seek(self, epoch: int, start: int) -> None:
        """The next pass yields epoch `epoch` from its `start`-th index on."""
        self.epoch, self.start = int(epoch), int(start)

    def __iter__(self) -> Iterator[int]:
        epoch, start = self.epoch, self.start
        self.epoch, self.start = epoch + 1, 0  # a plain second pass is the next epoch
        yield from self.order(epoch)[start:].tolist()


def batches_from(source, start: int, stop: int | None, *, committed: bool = False
                 ) -> tuple[Callable | None, Iterator | None, int | None]:
    """How `rt.batches` reads `source` from batch `start`: (get(b), None, stop) for a source it asks
    by index, or (None, iterator of the batches start, start+1, ..., stop) for one it iterates.
    committed: the source's state_dict is committed with every batch (restored to `start` already)."""
    if hasattr(source, "batch"):
        return source.batch, None, stop if stop is not None else getattr(source, "num_batches", None)
    if callable(source):
        return source, None, stop if stop is not None else getattr(source, "num_batches", None)
    if isinstance(source, collections.abc.Sequence):
        return source.__getitem__, None, min(len(source), stop) if stop is not None else len(source)
    if isinstance(source, DataLoader) and _resumable(source):
        sampler = source.batch_sampler.sampler
        per_epoch = (sampler.length // source.batch_size if source.drop_last
                     else -(-sampler.length // source.batch_size))
        if per_epoch == 0:
            raise ConfigError("rt.batches: the DataLoader yields no batches")
        end = (start // per_epoch + 1) * per_epoch if stop is None else stop  # a stop past the epoch: the next ones
        return None, _epochs(source, sampler, per_epoch, start, end), end
    if isinstance(source, DataLoader) and isinstance(source.sampler, RandomSampler) and not committed:
        # refused now, not at the resume it could not survive: another run draws another order
        raise ConfigError("rt.batches: a DataLoader with shuffle=True draws a new order every run, so a run resumed "
                          "after a crash would train on other batches; give it sampler=cxltrain.data."
                          "ResumableSampler(dataset, shuffle=True, seed=...) instead")
    if not isinstance(source, collections.abc.Iterable):
        raise ConfigError(f"rt.batches: a {type(source).__name__} is not a data source: give an iterable "
                          "(list, generator, DataLoader), an object with .batch(b), or a callable b -> batch")
    if start and not (committed and hasattr(source, "state_dict") and hasattr(source, "load_state_dict")):
        raise ConfigError(f"rt.batches: the pool resumes at batch {start}, and a {type(source).__name__} cannot "
                          "seek there; use a DataLoader with cxltrain.data.ResumableSampler, a list, a source with "
                          ".batch(b), or a stateful loader given to the Runtime with its schedulers")
    return None, iter(source), stop


def _epochs(loader: DataLoader, sampler: "ResumableSampler", per_epoch: int, start: int, stop: int) -> Iterator:
    """Batches start .. stop - 1 of a ResumableSampler's loader, epoch after epoch (per_epoch each):
    the sampler is moved to each epoch's first batch wanted, then the loader iterated."""
    b = start
    while b < stop:
        epoch, position = divmod(b, per_epoch)
        sampler.seek(epoch, position * loader.batch_size)
        for item in itertools.islice(loader, min(stop, (epoch + 1) * per_epoch) - b):
            b += 1
            yield item


def _resumable(loader: DataLoader) -> bool:
    """A map-style loader batching a ResumableSampler's indices with torch's BatchSampler."""
    batches = loader.batch_sampler
    return (loader.batch_size is not None and type(batches) is BatchSampler
            and isinstance(batches.sampler, ResumableSampler))
