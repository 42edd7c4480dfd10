"""`cxltrain pool create | info | check`."""

from __future__ import annotations

import json
import sys

from ..errors import CxlTrainError, PoolError
from ..runtime import manifest as run_dir
from . import dist as dist_cli
from .common import EXIT_ERROR, Parser, parse_size


def add_pool(sub) -> None:
    p = sub.add_parser("pool", help="create, inspect and check pools",
                       description="Create, inspect and check pools.")
    psub = p.add_subparsers(dest="pool_command", metavar="{create,info,check}", parser_class=Parser)
    psub.required = True
    c = psub.add_parser("create", help="create an empty pool", description="Create an empty pool.")
    c.add_argument("path")
    c.add_argument("--size", type=parse_size, help="pool size, e.g. 64M, 2G (default 64M for a file, the whole "
                                                    "device for a DAX device)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=_run_pool_create)
    for name, run, text in (("info", _run_pool_info, "show the superblock, both roots and every region, after the "
                                                     "checks of `pool check` (a damaged pool: one line, exit 1)"),
                            ("check", _run_pool_check, "validate every checksum and bound and scan the rows for "
                                                       "non-finite values (rows carry no checksum); exit 1 on a problem")):
        q = psub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ". Never writes.")
        q.add_argument("path")
        q.add_argument("--json", action="store_true")
        q.set_defaults(run=run)


def _run_pool_create(args) -> int:
    from ..devices import is_char_device
    from ..pool.handle import Pool

    size = args.size
    if size is None and not is_char_device(args.path):
        size = parse_size("64M")
    with Pool.create(args.path, size) as pool:
        summary = {"path": pool.path, "size": pool.superblock.pool_size, "device": pool.device.kind,
                   "uuid": pool.superblock.uuid.hex(), "persistent_memory": pool.device.is_pmem}
    print(f"created {args.path}: {summary['size']:,} bytes on {_device_words(pool.device)}")
    if args.json:
        print(json.dumps(summary))
    return 0


def _device_words(device) -> str:
    """The backend, and whether the media is persistent memory: the pmem backend also maps ordinary files
    (persisted with msync then), which must not read as "on pmem"."""
    if device.kind in ("pmem", "msync") and not device.is_pmem:
        return f"an ordinary file, not persistent memory ({device.kind} backend, persisted with msync)"
    return device.kind


def _run_pool_info(args) -> int:
    if run_dir.is_run_dir(args.path):
        return dist_cli.run_pool_info(args.path, args.json)
    report, _ = _validated(args.path)
    from ..pool.report_text import report_json, report_lines

    if not report.ok and (not args.json or report.superblock is None or report.root is None):
        # the listing of a damaged pool would only mislead: one line
        more = len(report.problems) - 1
        raise CxlTrainError(f"{args.path}: {report.problems[0]}"
                            + (f" (and {more} more problem(s): `cxltrain pool check` lists them)" if more else ""))
    _say_in_use(report)
    if args.json:
        print(json.dumps(report_json(report)))
    else:
        print("\n".join(report_lines(report)))
    return 0 if report.ok else EXIT_ERROR


def _say_in_use(report) -> None:
    if report.in_use and report.root is not None:
        print(f"note: {report.path} is in use by a writer; showing its last committed root (seq {report.root.seq}, "
              f"batch {report.root.batches_done})", file=sys.stderr)


def _finish_report(report, as_json: bool) -> int:
    """Problems to stderr, one line each; the JSON summary last; exit 1 if anything is wrong."""
    from ..pool.report_text import report_json

    _say_in_use(report)
    for problem in report.problems:
        print(f"{report.path}: {problem}", file=sys.stderr)
    if as_json:
        print(json.dumps(report_json(report)))
    return 0 if report.ok else EXIT_ERROR


def _validated(path: str):
    """(the report of every check `pool check` makes, what was left unchecked or None): the pool
    layer's bounds and checksums, then the live undo records and the dense snapshot, then the rows."""
    from ..checkpoint.offline import check_checkpoint
    from ..pool.info import check_rows, inspect

    report = inspect(path)
    unchecked = None
    if report.in_use:  # the writer changes the undo ring and the dense slots under us: not checked
        unchecked = "undo records and dense snapshot not checked while a writer holds the pool"
    elif report.ok:  # then the checksums above the pool layer: live undo records, the dense snapshot
        try:
            unchecked = check_checkpoint(path)
        except PoolError as e:
            report.problems.append(str(e).removeprefix(f"{path}: "))
    check_rows(report)
    return report, unchecked


def _run_pool_check(args) -> int:
    if run_dir.is_run_dir(args.path):
        return dist_cli.run_pool_check(args.path, args.json)
    report, checkpoint = _validated(args.path)
    if report.ok and not args.json:
        print(f"ok: {report.path}: {len(report.regions)} regions, root seq {report.root.seq}, "
              f"batch {report.root.batches_done}"
              + (f"; {checkpoint}" if checkpoint else ""))
    return _finish_report(report, args.json)
