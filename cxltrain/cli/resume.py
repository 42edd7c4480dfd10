"""`train --pool P` on a pool that holds a run: the options left out are the pool's (jobs/resume.py
reads them), and those given that the run cannot change are refused together, in one line.

    $ cxltrain train --pool p.pool
    resuming with the pool's settings: --steps 30 --batch-size 256 --num-tables 3 --rows 2000 ...

The learning rates may change on resume (--lr, --sparse-lr): said in one line, and recorded in the
pool with the batch they take over at, so that a later resume goes on with them.
"""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from .options import config_options

UNSET = object()


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The TrainConfig fields `argv` (train's own arguments) gives explicitly, default or not."""
    namespace = argparse.Namespace(**{field.name: UNSET for field, _ in config_options()})
    parser.parse_known_args(argv, namespace)  # argparse fills in defaults only where nothing is there
    return {name for name, value in vars(namespace).items() if value is not UNSET}


def remembered(stored: dict) -> dict:
    """{TrainConfig field: value in its option's form} of what a pool's metadata stores."""
    from ..jobs.config import TrainConfig

    values = dict(stored.get("settings") or {})
    synthetic = values.get("data") is None and stored.get("data") is None
    for name in TrainConfig.TRAJECTORY:
        if name in stored and name != "data" and (synthetic or name not in ("pooling", "zipf_exponent")):
            values[name] = stored[name]
    if "table_rows" in stored:
        values["rows"] = tuple(stored["table_rows"])
    for name in ("bottom_mlp", "top_mlp"):
        if name in values:
            values[name] = tuple(values[name])
    values["optimizer"] = stored.get("optimizer", "adam")
    if "eval_batches" in stored:
        values["eval_batches"] = stored["eval_batches"]
    if values.get("epochs") is not None:  # the steps then follow from the epochs
        values.pop("steps", None)
    return values


def fixed(stored: dict) -> set[str]:
    """The fields a resumed run must share with the pool's (its learning rates may change)."""
    from ..jobs.config import TrainConfig

    names = set(TrainConfig.TRAJECTORY) - {"data"} - set(TrainConfig.LR_SETTINGS)
    return names | {"optimizer"} | ({"eval_batches"} if "eval_batches" in stored else set())


def shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else f"{value}"


def take_stored(args: argparse.Namespace, given: set[str], stored: dict, path: str) -> list[str]:
    """Fill `args` with the pool's settings where `given` leaves them out; returns those that are
    not their option's default as options ("--rows 2000", in option order). Refuses, in one line
    naming every one, the options given that differ from the pool's where a resumed run cannot
    change them."""
    values = remembered(stored)
    if stored.get("data") is not None and "data" not in values and "data" not in given:
        raise ConfigError(f"{path}: was trained on a data file whose path it does not store (written by an older "
                          "cxltrain): give --data")
    flags = {field.name: option.flag for field, option in config_options()}
    defaults = {field.name: field.default for field, _ in config_options()}
    differ = [f"{flags[name]} {shown(getattr(args, name))} (the pool's: {shown(values[name])})"
              for name in flags if name in given and name in fixed(stored) and name in values
              and _normal(getattr(args, name)) != _normal(values[name])]
    if differ:
        raise ConfigError(f"{path}: was written by a run with other settings: {', '.join(differ)}; leave them out "
                          "to resume with the pool's, or use another pool")
    taken = []
    steps_given = given & {"steps", "epochs"}
    for name, flag in flags.items():
        if name in given or name not in values or (steps_given and name in ("steps", "epochs")):
            continue
        setattr(args, name, values[name])
        if values[name] is not None and values[name] != defaults[name]:
            taken.append(f"{flag} {shown(values[name])}")
    return taken


def _normal(value):
    return tuple(value) if isinstance(value, list) else value
