"""File data for training: a raw Criteo file, a converted folder or a folder in TorchRec's npy
layout; its held-out batches, epochs.

    source = open_criteo(path, batch_size=B, rows=rows, num_tables=T, seed=s)
    train = Epochs(source, batches=range(0, source.num_batches - 4), epochs=3)
    train.batch(b)        # batch b % len(batches) of the source, as batch b of the run
    train.position(b)     # (epoch, batch within the epoch)
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

from .batch import Batch, BatchSource
from .common import batch_indices, check_index, check_int
from .converted import ConvertedCriteo, is_converted
from .criteo import CriteoFile
from .torchrec_npy import TorchRecFolder, is_torchrec_folder


def open_criteo(path: str | os.PathLike, *, batch_size: int, rows: int | Sequence[int], num_tables: int,
                seed: int) -> CriteoFile | ConvertedCriteo | TorchRecFolder:
    """A folder TorchRec's preprocessing wrote (day_N_*.npy), a converted folder (`cxltrain data
    convert`), or a raw Criteo file, plain or gzipped."""
    if is_torchrec_folder(path):
        kind = TorchRecFolder
    else:
        kind = ConvertedCriteo if is_converted(path) else CriteoFile
    return kind(path, batch_size=batch_size, rows=rows, num_tables=num_tables, seed=seed)


class Epochs:
    """`epochs` passes over the source's batches `batches`, in order: run batch b is source batch
    batches[b % len(batches)], renumbered b (so a resumed run's data position is exact)."""

    def __init__(self, source: BatchSource, batches: range, epochs: int) -> None:
        if not batches:
            raise ValueError("Epochs needs at least one batch")
        self.source, self.range = source, batches
        self.epochs = check_int("epochs", epochs, 1)
        self.num_batches = len(batches) * self.epochs
        self.num_tables, self.num_dense = source.num_tables, source.num_dense
        self.fingerprint = getattr(source, "fingerprint", None)

    def position(self, b: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of run batch b, both from 0."""
        return divmod(check_index(b, self.num_batches), len(self.range))

    def batch(self, b: int) -> Batch:
        epoch, i = self.position(b)
        batch = self.source.batch(self.range[i])
        return Batch(index=b, dense=batch.dense, values=batch.values, offsets=batch.offsets, labels=batch.labels)

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        for b in batch_indices(start, stop, self.num_batches):
            yield self.batch(b)
