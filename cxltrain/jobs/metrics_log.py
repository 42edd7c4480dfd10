"""`--metrics FILE`: one JSON line every N training steps, of one run (its pool), crash or not.

    {"step": 20, "position": "epoch 0, batch 19", "loss": 0.4712, "steps_per_s": 21.3,
     "eval_auc": 0.7012, "eval_logloss": 0.4698, "run": "6f1c..."}

`loss` is the mean training loss of the steps since the previous line; eval_auc and eval_logloss
are present on the lines of steps that evaluated on the held-out batches (--eval-every); `run` is
the pool's UUID. `cxltrain plot FILE` draws the curves.

A resumed run's lines equal an uninterrupted run's (steps_per_s aside, a clock's): a line is written
before its batch commits, so on resume the lines of steps above the recovered batch are cut off (a
crash left them, or half of one); the running sum behind the next line's mean is stored with every
snapshot (the Runtime's metadata, "metrics") and taken back. A file holding another run's lines is
refused, never appended to.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from ..errors import ConfigError, CxlTrainError
from ..pool.handle import Pool

STATE_KEY = "metrics"  # the Runtime metadata key of the running state (TrainConfig.MUTABLE_METADATA)


def refuse_another_run(path: str, why: str) -> ConfigError:
    return ConfigError(f"{path}: holds the metrics of another run ({why}); a metrics file holds one run: give "
                       "another --metrics file, or remove this one")


def check_new_run(path: str | None) -> None:
    """Before a new pool is made: its run's metrics file must be new or empty."""
    if path is not None and os.path.isfile(path) and os.path.getsize(path) > 0:
        raise refuse_another_run(path, "this run starts a new pool")


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
    """Writes a line every `every` steps to `path` (None: writes nothing, but keeps the running
    state, so that a later resume with --metrics starts exact). `run`: the pool's UUID (hex);
    `start_batch`: where this run starts; `resumed`: the state the pool's snapshot stored."""

    def __init__(self, path: str | None, every: int, data, *, run: str, start_batch: int,
                 resumed: dict | None = None) -> None:
        self.every, self.data, self.run = every, data, run
        self._loss_sum, self._steps = 0.0, 0
        if resumed is not None and resumed.get("batch") == start_batch:  # else (relaxed mode): from here
            self._loss_sum, self._steps = float(resumed["loss_sum"]), int(resumed["steps"])
        self._timed, self._since = 0, time.perf_counter()
        self._file = None
        if path is not None:
            try:
                self._file = _open_at(path, run, start_batch)
            except OSError as e:
                raise ConfigError(f"{path}: cannot write the metrics file: {e.strerror}") from None

    def step(self, b: int, loss: float, evaluated: tuple[float | None, float | None] | None) -> None:
        """After run batch b (its loss; (AUC, log loss) when it evaluated)."""
        # one running sum, in batch order, whether or not the run was interrupted: the same mean bits
        self._loss_sum += loss
        self._steps += 1
        self._timed += 1
        if (b + 1) % self.every and evaluated is None:
            return
        now = time.perf_counter()
        line = {"step": b + 1, "position": self.data.position(b), "loss": self._loss_sum / self._steps,
                "steps_per_s": self._timed / max(now - self._since, 1e-9)}
        if evaluated is not None:
            line["eval_auc"], line["eval_logloss"] = evaluated
        line["run"] = self.run
        if self._file is not None:
            try:
                self._file.write(json.dumps(line) + "\n")
                self._file.flush()
                os.fsync(self._file.fileno())  # durable before batch b commits: a resume never misses it
            except OSError as e:  # a full disk, say: the batch is not committed, a resume cuts the torn line
                path, self._file = self._file.name, self._discard(self._file)
                raise CxlTrainError(f"{path}: cannot write the metrics file: {e.strerror or e}; stopped before batch "
                                    f"{b + 1} committed (the pool resumes from its last commit)") from None
        self._loss_sum, self._steps, self._timed, self._since = 0.0, 0, 0, now

    def state(self, batches_done: int) -> dict:
        """The running state after `batches_done` batches, for the snapshot that commits them."""
        return {"batch": batches_done, "loss_sum": self._loss_sum, "steps": self._steps}

    @staticmethod
    def _discard(file) -> None:
        """Close a file whose write failed, dropping what its buffer still holds."""
        with contextlib.suppress(OSError):
            file.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def split_runs(lines: list[dict]) -> list[list[dict]]:
    """A metrics file's lines, one list per run: a run ends where the next line names another run
    or does not step forward (files written before lines named their run, appended run after run)."""
    runs: list[list[dict]] = []
    for line in lines:
        if not runs or line.get("run") != runs[-1][-1].get("run") or line["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(line)
    return runs


def check_own_run(path: str | None, pool_path: str) -> None:
    """Before an existing pool is opened (and recovery writes it): a metrics file that holds another
    run's lines is refused."""
    if path is None or not os.path.isfile(path):
        return
    with Pool.open(pool_path, writable=False) as pool:
        run = pool.superblock.uuid.hex()
    try:
        with open(path, "rb") as f:
            _kept_bytes(f, path, run, None)
    except OSError:
        return  # unreadable: opening it to write says so


def _open_at(path: str, run: str, start_batch: int):
    """`path` opened for appending after its last line of step <= start_batch, the lines after it
    (and a torn last line) cut off; lines of another run refused."""
    f = open(path, "a+b")
    try:
        keep = _kept_bytes(f, path, run, start_batch)
        if keep < f.seek(0, os.SEEK_END):
            f.truncate(keep)
            os.fsync(f.fileno())
        return open(path, "a", encoding="utf-8")
    finally:
        f.close()


def _kept_bytes(f, path: str, run: str, start_batch: int | None) -> int:
    """Bytes of the lines of `f` a run resumed at `start_batch` keeps (None: every whole line);
    ConfigError for a line of another run, or not a metrics line."""
    f.seek(0)
    keep = 0
    for n, raw in enumerate(f, 1):
        if not raw.endswith(b"\n"):
            break  # a line torn by a crash
        try:
            line = json.loads(raw)
            step = int(line["step"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path}, line {n}: not a metrics line of `train --metrics`; give another "
                              "--metrics file") from None
        if line.get("run") != run:
            named = f"is of run {line['run']}" if line.get("run") else "names no run"
            raise refuse_another_run(path, f"line {n} {named}, this pool's is {run}")
        if start_batch is not None and step > start_batch:
            break  # written before a batch that never committed: the resumed run writes it again
        keep += len(raw)
    return keep
