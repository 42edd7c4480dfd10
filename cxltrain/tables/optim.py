"""Fused sparse optimizers for PersistentEmbeddingBag: applied inside backward, on unique rows only.

Each optimizer says how many state columns a table row needs (stored in the pool next to the
weights, region `<table>.optim`, shape [rows, K]) and applies one fused update per batch: straight
from the lookups and their bags' gradients, duplicates reduced, each unique row updated once.

    table = PersistentEmbeddingBag(1000, 16, name="t0", optimizer=RowWiseAdagrad(lr=0.05))
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import ConfigError
from ..kernels import ops as row_ops


@dataclasses.dataclass(frozen=True)
class SGD:
    """Plain SGD: w -= lr * g. No state (K = 0)."""

    lr: float = 0.01
    state_columns = 0

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)

    def initial_state(self) -> float:
        return 0.0

    def update(self, weight: torch.Tensor, state: torch.Tensor | None, indices: torch.Tensor,
               grad_out: torch.Tensor, offsets: torch.Tensor | None = None,
               per_sample_weights: torch.Tensor | None = None, mode: str = "sum", undo=None,
               cached: row_ops.CachedRows | None = None, file_rows: row_ops.FileRows | None = None) -> torch.Tensor:
        """The fused update from a batch's lookups (kernels.ops.sparse_update); returns rows [U].
        weight [R, P], indices [N], grad_out [B, D] (D <= P), offsets [B] or None (B = N); undo:
        the undo records the kernel writes as it goes (ops.UndoChunks), or None; cached: the
        table's hot-row cache (row map and slots), whose rows are updated in their slots; file_rows:
        the file the table rows are written to instead of stored through the mapping (ops.FileRows)."""
        return row_ops.sparse_update("sgd", weight, None, indices, grad_out, offsets, per_sample_weights, mode,
                                     lr=self.lr, undo=undo, cached=cached, file_rows=file_rows)


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad:
    """Row-wise Adagrad: one accumulator per row (K = 1), the standard for DLRM embedding tables."""

    lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    state_columns = 1

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_positive("eps", self.eps)
        if not math.isfinite(self.initial_accumulator_value) or self.initial_accumulator_value < 0:
            raise ConfigError(f"initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}")

    def initial_state(self) -> float:
        return self.initial_accumulator_value

    def update(self, weight: torch.Tensor, state: torch.Tensor | None, indices: torch.Tensor,
               grad_out: torch.Tensor, offsets: torch.Tensor | None = None,
               per_sample_weights: torch.Tensor | None = None, mode: str = "sum", undo=None,
               cached: row_ops.CachedRows | None = None, file_rows: row_ops.FileRows | None = None) -> torch.Tensor:
        """As SGD.update, with state [R, 1]."""
        return row_ops.sparse_update("rowwise_adagrad", weight, state, indices, grad_out, offsets,
                                     per_sample_weights, mode, lr=self.lr, eps=self.eps, undo=undo, cached=cached,
                                     file_rows=file_rows)


SparseOptimizer = SGD | RowWiseAdagrad


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


class TableLR:
    """Changes the tables' learning rate between batches, as torch's LambdaLR does for dense ones:
    after `step()` number n, each table's lr is its base lr times lr_lambda(n). Give it to the
    Runtime with the dense schedulers (`schedulers=[..., table_lr]`): its state is then part of every
    committed snapshot, and a resumed run puts back the lrs the committed batch trained with.

        table_lr = TableLR(model.tables, lambda n: 0.5 ** (n // 100))
        with cxltrain.Runtime(path, model, dense_opt, schedulers=[table_lr]) as rt:
            for batch in rt.batches(data):
                ...; table_lr.step()
    """

    def __init__(self, tables, lr_lambda) -> None:
        self.tables = list(tables)
        if not self.tables:
            raise ConfigError("TableLR needs at least one table")
        self.lr_lambda = lr_lambda
        self.base_lrs = [table.optimizer.lr for table in self.tables]
        self.last_step = 0

    def step(self) -> None:
        self.last_step += 1
        self._set([base * float(self.lr_lambda(self.last_step)) for base in self.base_lrs])

    def get_last_lr(self) -> list[float]:
        return [table.optimizer.lr for table in self.tables]

    def _set(self, lrs: list[float]) -> None:
        for table, lr in zip(self.tables, lrs):
            # the optimizers are frozen values: a new one per change, never a write another table sees
            table.optimizer = dataclasses.replace(table.optimizer, lr=lr)

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "base_lrs": list(self.base_lrs), "lrs": self.get_last_lr()}

    def load_state_dict(self, state: dict) -> None:
        if len(state["lrs"]) != len(self.tables):
            raise ConfigError(f"TableLR state holds {len(state['lrs'])} tables' lrs, this one has {len(self.tables)}")
        self.last_step, self.base_lrs = int(state["last_step"]), [float(x) for x in state["base_lrs"]]
        self._set([float(x) for x in state["lrs"]])
