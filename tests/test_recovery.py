"""Recovery (cxltrain.checkpoint.recovery): it restores the live undo records and nothing else,
refuses a damaged record before writing anything, and ends the log at a torn header.

The "crash" is an exception in this process (test_runtime.py's run). Kills, including kills inside
recovery itself, are test_checkpoint_crash.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import cxltrain
from cxltrain.checkpoint import layout, ring
from cxltrain.errors import PoolCorruptError
from cxltrain.pool.handle import Pool
from cxltrain.runtime.runtime import recover_pool
from cxltrain.tables.bag import PersistentEmbeddingBag
from helpers import assert_same_export
from test_runtime import make_batch, make_run, state_of, train_steps


def test_a_corrupt_record_body_is_refused_before_anything_is_written(shm_dir):
    path = shm_dir / "p.pool"
    with pytest.raises(KeyboardInterrupt):
        train_steps(path, 5, fail_at=2)
    before = path.read_bytes()
    with Pool.open(str(path)) as pool:
        region = pool.region(layout.RING_REGION)
        start = pool.root.ring_start
        pool.device.array[region.offset + start + layout.UNDO_HEADER.size + 3] ^= 0x40  # a payload bit
        damaged = bytes(pool.device.array)
    with pytest.raises(PoolCorruptError, match="payload checksum mismatch"):
        recover_pool(str(path))
    assert path.read_bytes() == damaged != before


def _tear_last_header(path, *, unmark: bool = False) -> None:
    """Flip a bit in the header of batch 2's second record. unmark: also set the ring's tail mark
    back to what it was before that record was appended (the capture persists the mark right after
    the record), i.e. the state of a crash inside that record's append."""
    with Pool.open(str(path)) as pool:
        live = ring.scan(pool, pool.root.ring_generation, pool.root.ring_start, pool.root.ring_start_seq)
        assert len(live) == 2  # batch 2, both tables
        region = pool.region(layout.RING_REGION)
        pool.device.array[region.offset + live[1].offset + 40] ^= 1
        if unmark:
            tail = region.offset + layout.ring_record_bytes(region.size)
            for copy in range(layout.TAIL_COPIES):
                mark = layout.pack_tail_mark(pool.root.ring_generation, live[1].header.seq, pool.superblock.uuid, copy)
                pool.device.array[tail + copy * layout.TAIL_MARK.size : tail + (copy + 1) * layout.TAIL_MARK.size] = \
                    np.frombuffer(mark, dtype=np.uint8)


def test_a_torn_record_header_ends_the_log(shm_dir):
    """A header that never became valid: by U1 no store of its batch was issued, so recovery must
    stop there — shown by tearing the last record's header of a batch that died between forward
    (records written) and backward (no store), with the tail mark not yet covering that record (a
    crash inside its append), and recovering to the same batch. Captures in forward are the
    background ones (by default they happen in backward, right before each table's update)."""
    path = shm_dir / "p.pool"
    train_steps(path, 2)
    model, optimizer, scheduler = make_run()
    with pytest.raises(KeyboardInterrupt):
        with cxltrain.Runtime(path, model, optimizer, schedulers=[scheduler], background_capture=True) as rt:
            for batch in rt.batches(make_batch, stop=3):
                model.loss(batch)  # forward only: both tables' records of batch 2 are in the ring
                raise KeyboardInterrupt("crash")
    _tear_last_header(path, unmark=True)
    assert recover_pool(str(path)).records_restored == 1
    train_steps(shm_dir / "ref.pool", 2)
    assert_same_export(state_of(path), state_of(shm_dir / "ref.pool"))


def test_a_damaged_header_of_a_record_in_use_is_refused(shm_dir):
    """The same tear after batch 2's backward has stored into the rows: the tail mark covers the
    record, so the damage is refused instead of leaving the second table un-rolled-back."""
    path = shm_dir / "p.pool"
    with pytest.raises(KeyboardInterrupt):
        train_steps(path, 5, fail_at=2)
    _tear_last_header(path)
    damaged = path.read_bytes()
    with pytest.raises(PoolCorruptError, match="undo record 5 is damaged"):
        recover_pool(str(path))
    assert path.read_bytes() == damaged


def test_recovery_restores_only_the_live_records(shm_dir):
    """Whatever the table size, recovery restores the batch in flight's rows and nothing else."""
    for rows in (1_000, 400_000):
        model = nn.Module()
        model.t = PersistentEmbeddingBag(rows, 16, name="t", seed=1)
        with pytest.raises(KeyboardInterrupt):
            with cxltrain.Runtime(shm_dir / f"{rows}.pool", model) as rt:
                for batch in rt.batches(lambda b: torch.arange(b, b + 64) % rows, stop=3):
                    model.t(batch.view(8, 8)).sum().backward()
                    if rt.batch == 2:
                        raise KeyboardInterrupt
        report = recover_pool(str(shm_dir / f"{rows}.pool"))
        assert (report.batch, report.records_restored, report.rows_restored) == (2, 1, 64)
