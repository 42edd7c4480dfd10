"""The `cxltrain` command line.

Every command has --help, prints a machine-readable summary as its last stdout line with --json,
and on bad input prints one line, `cxltrain: error: ...`, to stderr and exits non-zero (2 for
usage errors, 1 for everything else) — never a traceback for an error it can name.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings
from typing import Callable, Sequence

from ..errors import CxlTrainError, TrainingStopped
from ..knobs import KNOBS, set_openmp_wait
from . import bench, crashtest, devices, pool, recover_export, stop, train
from .common import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Parser,
    non_negative_int,
    positive_int,
)
from .data import add_commands


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(prog="cxltrain", description="Train recommendation models whose embedding tables live in "
                                                  "persistent memory (PMEM, CXL, or an emulated CXL pool).")
    parser.add_argument("--version", action="version", version=f"cxltrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    train_parser = train.add_train(sub)
    train.add_plan(sub, train_parser)
    recover_export.add_recover_export(sub)
    recover_export.add_import(sub)
    pool.add_pool(sub)
    devices.add_devices(sub)
    crashtest.add_crashtest(sub)
    bench.add_bench(sub)
    add_commands(sub, positive_int, non_negative_int)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"cxltrain: warning: {message}", file=sys.stderr)


def _silence_stdout() -> None:
    """The reader of stdout went away (`cxltrain ... | head`): later writes, and the flush at exit,
    go nowhere instead of raising BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    set_openmp_wait(os.environ)
    # torch's C++ warnings (c10d's, where a rank cannot look up a host name, say) would come between
    # a refusal's one line and the user, once per rank and restart; errors still show
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a distributed launch passes them on
    run: Callable[[argparse.Namespace], int] = args.run
    warnings.showwarning = _one_line_warning
    handler = stop.install()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, handler) if in_main_thread else None
    try:
        KNOBS.validate()
        return run(args)
    except TrainingStopped as e:  # asked for, not an error
        print(f"cxltrain: {e}", file=sys.stderr)
        return EXIT_TERMINATED
    except CxlTrainError as e:
        from ..jobs.lifeline import rank_error

        line = f"cxltrain: error: {e}"
        if not rank_error(line):  # a rank's error goes to its launcher, which shows one line
            print(line, file=sys.stderr)
        if e.ends_process_at_once:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_ERROR)
        return EXIT_ERROR
    except KeyboardInterrupt as e:  # stop.Terminated included
        from ..jobs.lifeline import launcher_reports, stopped_by

        number = signal.SIGTERM if isinstance(e, stop.Terminated) else signal.SIGINT
        # a rank's agent passes it the launcher's signal, or SIGTERMs it when a peer failed: the
        # launcher says which, in one line
        if not launcher_reports():
            print(f"cxltrain: {stopped_by(number)}", file=sys.stderr)
        return EXIT_TERMINATED if number == signal.SIGTERM else EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
