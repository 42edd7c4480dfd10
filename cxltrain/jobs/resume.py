"""What a pool remembers of the run that wrote it: its settings (read before a resume, so that
`cxltrain train --pool P` alone goes on with them) and the learning rates it changed on the way.

The settings are the metadata of the pool's committed snapshot (TrainConfig.run_metadata, plus
"settings": TrainConfig.run_settings); a change of learning rate on resume is kept in it as

    "lr_changes": [{"batch": 30, "from": {"sparse_lr": 0.05, "dense_lr": 0.001},
                    "to": {"sparse_lr": 0.05, "dense_lr": 0.01}}, ...]
"""

from __future__ import annotations

import os

from ..checkpoint.recovery import has_checkpoint
from ..pool.handle import Pool
from .config import TrainConfig

# a snapshot's metadata holds `train` settings when it has these (a Runtime user's own may not)
REQUIRED = ("batch_size", "num_tables", "rows", "dim", "seed")


def stored_metadata(pool_path: str) -> dict | None:
    """The metadata of the pool's committed snapshot, read without writing (the pool may still
    hold a batch to roll back: the snapshot its root names is the one it resumes from). None
    where there is no pool file, no committed checkpoint, or no `train` settings in it."""
    if not os.path.exists(pool_path):
        return None
    from ..checkpoint import dense  # torch: decoding makes tensors

    with Pool.open(pool_path, writable=False) as pool:
        if not has_checkpoint(pool):
            return None
        metadata = dense.read_snapshot(pool, pool.root.dense_slot, pool.root.dense_batch)["metadata"]
    if not isinstance(metadata, dict) or any(name not in metadata for name in REQUIRED):
        return None
    return metadata


def lr_change(stored: dict, config: TrainConfig) -> tuple[dict, dict] | None:
    """(the pool's learning rates, this run's) where they differ; None where they are the same."""
    before = {name: stored[name] for name in TrainConfig.LR_SETTINGS if name in stored}
    after = {name: getattr(config, name) for name in before}
    return (before, after) if before != after else None


def record_lr_changes(rt, config: TrainConfig) -> None:
    """In a resumed run: a learning rate other than the pool's is recorded, with the batch it takes
    over at, in the history its next commits store (the Runtime put the run's rates in place)."""
    stored = rt.resumed_metadata
    if stored is None:
        return
    change = lr_change(stored, config)
    if change is not None:
        rt.update_metadata(lr_changes=[*stored.get("lr_changes", []),
                                       {"batch": rt.start_batch, "from": change[0], "to": change[1]}])
