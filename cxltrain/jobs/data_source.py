"""What a training run reads: its batches, how many, and the held-out batches it evaluates on.

Synthetic data is endless: evaluation uses batches far past any training batch. A file (a raw
Criteo file or a converted folder, see cxltrain/data/files.py) is finite:

- with `--epochs E` or `--eval-every N`, its last `eval_batches` batches are held out (never
  trained on) and training reads the others; `--epochs E` sets the steps to E passes over them,
  run batch b being file batch b mod (batches − held out), so the data position (epoch, batch) is
  exact on resume;
- otherwise training reads batches 0..steps−1 and evaluates on the (up to 4) batches after them.
"""

from __future__ import annotations

import dataclasses

from ..data import SyntheticCriteo
from ..data.batch import BatchSource
from ..data.files import Epochs, open_criteo
from ..errors import ConfigError
from .config import TrainConfig

# Held-out evaluation batches of synthetic data are drawn far past any training batch index.
EVAL_FIRST_BATCH = 1 << 40
EVAL_BATCHES = 4


@dataclasses.dataclass
class TrainingData:
    train: BatchSource          # run batch b = train.batch(b)
    steps: int                  # batches of the run
    evaluation: BatchSource     # where the held-out batches come from
    heldout: range              # their numbers in `evaluation`

    def position(self, b: int) -> str:
        """Where run batch b is in the data, for messages: "batch b" or "epoch e, batch i"."""
        if isinstance(self.train, Epochs):
            epoch, i = self.train.position(b)
            return f"epoch {epoch}, batch {i}"
        return f"batch {b}"


def training_data(config: TrainConfig) -> TrainingData:
    if config.data is None:
        source = SyntheticCriteo(num_tables=config.num_tables, rows=config.rows_per_table(),
                                 batch_size=config.batch_size, seed=config.seed, pooling=config.pooling,
                                 zipf_exponent=config.zipf_exponent)
        return TrainingData(source, config.steps, source,
                            range(EVAL_FIRST_BATCH, EVAL_FIRST_BATCH + config.eval_batches))
    source = open_criteo(config.data, batch_size=config.batch_size, rows=config.rows_per_table(),
                         num_tables=config.num_tables, seed=config.seed)
    n = source.num_batches
    what = f"{config.data}: holds {n} batches of {config.batch_size}"
    if config.epochs is None and not config.eval_every:
        if n < config.steps:
            raise ConfigError(f"{what}, fewer than --steps {config.steps}")
        return TrainingData(source, config.steps, source, range(config.steps, min(config.steps + EVAL_BATCHES, n)))
    k = config.eval_batches
    if n <= k:
        raise ConfigError(f"{what}; {k} are held out for evaluation (--eval-batches), leaving none to train on")
    heldout = range(n - k, n)
    if config.epochs is None:
        if n - k < config.steps:
            raise ConfigError(f"{what}, {k} held out for evaluation: {n - k} to train on, fewer than "
                              f"--steps {config.steps}")
        return TrainingData(source, config.steps, source, heldout)
    train = Epochs(source, range(0, n - k), config.epochs)
    return TrainingData(train, train.num_batches, source, heldout)
