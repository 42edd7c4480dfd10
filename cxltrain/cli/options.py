"""The job's options, built from the TrainConfig fields that carry one (jobs/config.py Option): each
flag, its help and its check are written once, beside the setting they set."""

from __future__ import annotations

import argparse
import dataclasses

from .common import non_negative_int, parse_size, positive_float, positive_int
from .data import parse_rows, resolve_train_data


def parse_widths(text: str) -> tuple[int, ...]:
    """--bottom-mlp, --top-mlp: hidden layer widths, "512,256"."""
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of widths") from None
    if any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(f"{text}: every width must be at least 1")
    return widths


_READERS = {"positive": positive_int, "non_negative": non_negative_int, "positive_float": positive_float,
            "size": parse_size, "rows": parse_rows, "widths": parse_widths}


def config_options() -> list[tuple[dataclasses.Field, object]]:
    """(field, its Option) of every TrainConfig field given on the command line, in field order."""
    from ..jobs.config import TrainConfig

    return [(f, f.metadata["option"]) for f in dataclasses.fields(TrainConfig) if "option" in f.metadata]


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """Adds an option for each such field to `parser` (`train`'s), its value under the field's name."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for field, option in config_options():
        if option.group is not None and option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        target = parser if option.group is None else groups[option.group]
        how: dict = {"dest": field.name, "help": option.help.format(default=field.default)}
        if option.kind == "switch":
            how["action"] = "store_true"
        elif option.kind == "no_switch":
            how["action"] = "store_false"
        else:
            how["default"] = None if option.unset else field.default
            if option.kind == "choice":
                how["choices"] = option.choices
            elif option.kind != "text":
                how["type"] = _READERS[option.kind]
            if option.metavar is not None:
                how["metavar"] = option.metavar
        target.add_argument(option.flag, **how)


def config_fields(args: argparse.Namespace) -> dict:
    """The TrainConfig fields `args` gives: the options' values (one left unset keeps the field's
    default), then those the data options decide together (data.resolve_train_data)."""
    fields = {field.name: getattr(args, field.name) for field, option in config_options()
              if not (option.unset and getattr(args, field.name) is None)}
    return {**fields, **resolve_train_data(args)}
