"""`--metrics FILE`: one JSON line every N training steps, appended (a resumed run goes on).

    {"step": 20, "position": "epoch 0, batch 19", "loss": 0.4712, "steps_per_s": 21.3,
     "eval_auc": 0.7012, "eval_logloss": 0.4698}

`loss` is the mean training loss of the steps since the previous line; eval_auc and eval_logloss
are present on the lines of steps that evaluated on the held-out batches (--eval-every).
`cxltrain plot FILE` draws the curves.
"""

from __future__ import annotations

import json
import os
import time

from ..errors import ConfigError


def check_metrics_path(path: str | None) -> None:
    """Refuse a metrics file that could not be written, before the run touches its pool: MetricsLog
    opens it only once the pool is open and recovered. Creates nothing."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "Is a directory"
    elif not os.path.isdir(folder):
        problem = "No such file or directory"
    elif not os.access(path if os.path.exists(path) else folder, os.W_OK):
        problem = "Permission denied"
    else:
        return
    raise ConfigError(f"{path}: cannot write the metrics file: {problem}")


class MetricsLog:
    """Writes a line every `every` steps to `path` (None: writes nothing)."""

    def __init__(self, path: str | None, every: int, data) -> None:
        self.every, self.data = every, data
        self._losses: list[float] = []
        self._since = time.perf_counter()
        self._file = None
        if path is not None:
            try:
                self._file = open(path, "a", encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"{path}: cannot write the metrics file: {e.strerror}") from None

    def step(self, b: int, loss: float, evaluated: tuple[float | None, float | None] | None) -> None:
        """After run batch b (its loss; (AUC, log loss) when it evaluated)."""
        if self._file is None:
            return
        self._losses.append(loss)
        if (b + 1) % self.every and evaluated is None:
            return
        now = time.perf_counter()
        line = {"step": b + 1, "position": self.data.position(b), "loss": sum(self._losses) / len(self._losses),
                "steps_per_s": len(self._losses) / max(now - self._since, 1e-9)}
        if evaluated is not None:
            line["eval_auc"], line["eval_logloss"] = evaluated
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self._losses, self._since = [], now

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
