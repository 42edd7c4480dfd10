"""What every command shares: exit codes, the one-line-error parser, and option value types."""

from __future__ import annotations

import argparse
import re
import signal
from typing import Callable

from ..errors import ConfigError

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the command, not a usage dump."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # "-1G", "-inf", "-.5" are values to validate with our own message, not unknown options
        # (argparse itself only takes "-1" and "-1.5" as values)
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive finite number")
    return value


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64M', '2G', '4096' → bytes (binary multiples)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 64M, 2G)")
    number, unit = int(match.group(1)), match.group(2).upper()
    return number << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(config, ranks: int = 1) -> None:
    """A run whose model and batch cannot fit in memory is refused, with the figures, before it is
    OOM-killed minutes later. `ranks` processes each hold the model and their slice of the batch."""
    import dataclasses

    needed = config.memory_bytes() if ranks == 1 else \
        ranks * dataclasses.replace(config, batch_size=max(1, config.batch_size // ranks)).memory_bytes()
    available = _mem_available()
    if available is not None and needed > available:
        where = "" if ranks == 1 else f" on {ranks} ranks"
        raise ConfigError(f"this run needs about {needed / 1e9:,.1f} GB of memory for its model and one batch{where} "
                          f"(--batch-size {config.batch_size}, --num-tables {config.num_tables}, --dim {config.dim}, "
                          f"--pooling {config.pooling}), "
                          f"but {available / 1e9:,.1f} GB is available (MemAvailable); make them smaller")
