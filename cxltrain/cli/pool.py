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
    for name, run, text in (("info", _run_pool_info, "show the superblock, both roots and every region"),
                            ("check", _run_pool_check, "validate every checksum and bound; exit 1 on a problem")):
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


def _report_json(report) -> dict:
    from ..pool.format import ROOT_RELAXED, SLOT_NAMES

    sb = report.superblock
    return {
        "path": report.path,
        "ok": report.ok,
        "in_use": report.in_use,
        "problems": report.problems,
        "file_size": report.file_size,
        "superblock": None if sb is None else {
            "version": sb.version, "uuid": sb.uuid.hex(), "pool_size": sb.pool_size, "created_ns": sb.created_ns,
            "dir_capacity": sb.dir_capacity, "data_offset": sb.data_offset, "region_align": sb.region_align,
            "row_align": sb.row_align},
        "roots": [{"slot": SLOT_NAMES[s.slot], "state": s.state, "reason": s.reason,
                   **({"seq": s.root.seq, "dir_count": s.root.dir_count, "batch": s.root.batches_done,
                       "ring_generation": s.root.ring_generation, "ring_start": s.root.ring_start,
                       "ring_start_seq": s.root.ring_start_seq,
                       "dense_slot": s.root.dense_slot_name, "dense_batch": s.root.dense_batch,
                       "relaxed": bool(s.root.flags & ROOT_RELAXED)}
                      if s.root else {})}
                  for s in report.slots],
        "batch": None if report.root is None else report.root.batches_done,
        "regions": [{"name": r.name, "kind": r.kind.name.lower(), "dtype": r.dtype.numpy.name, "shape": list(r.shape),
                     "offset": r.offset, "size": r.size, "row_stride": r.row_stride} for r in report.regions],
        **({"members": [_report_json(m) for m in report.members]} if report.members else {}),
        **({"caches": caches} if (caches := _caches(report)) else {}),
    }


def _caches(report) -> list[dict]:
    from ..pool.cache_format import describe

    return describe(report.path, report.regions)


def _inspect_or_fail(path: str):
    from ..pool.info import inspect

    report = inspect(path)
    if report.superblock is None or report.root is None:
        raise CxlTrainError(f"{path}: {report.problems[0]}")
    return report


def _run_pool_info(args) -> int:
    if run_dir.is_run_dir(args.path):
        return dist_cli.run_pool_info(args.path, args.json)
    report = _inspect_or_fail(args.path)
    if not args.json:  # with --json, stdout is the JSON alone
        _print_pool_info(report)
    return _finish_report(report, args.json)


def _print_pool_info(report) -> None:
    from ..pool.format import ROOT_RELAXED, SLOT_NAMES

    sb = report.superblock
    print(f"pool {report.path}: format v{sb.version}, {sb.pool_size:,} bytes, uuid {sb.uuid.hex()}")
    for s in report.slots:
        detail = (f"seq {s.root.seq}, batch {s.root.batches_done}, {s.root.dir_count} regions" if s.root
                  else s.reason or "never written")
        if s.root is not None and s.root.dense_slot:
            detail += (f", dense snapshot in slot {s.root.dense_slot_name} (batch {s.root.dense_batch}), undo ring "
                       f"generation {s.root.ring_generation} from offset {s.root.ring_start}"
                       + (", relaxed (the dense state may trail the embeddings)" if s.root.flags & ROOT_RELAXED else ""))
        winner = " (current)" if s.root is not None and s.root == report.root else ""
        print(f"root {SLOT_NAMES[s.slot]}: {s.state}{winner}: {detail}")
    print(f"{'region':<24} {'kind':<18} {'dtype':<8} {'shape':<18} {'offset':>14} {'bytes':>14}")
    for r in report.regions:
        shape = "x".join(str(d) for d in r.shape)
        print(f"{r.name:<24} {r.kind.name.lower():<18} {r.dtype.numpy.name:<8} {shape:<18} {r.offset:>14,} {r.size:>14,}")
    for cache in _caches(report):  # a pool set's hot-row caches (docs/tiers.md)
        held = "?" if cache["held"] is None else f"{cache['held']:,}"
        print(f"hot-row cache of table {cache['table']}: {cache['rows']:,} rows, {held} held")
    for member in report.members:  # a pool set's capacity pools (docs/tiers.md)
        print("capacity pool of this set:")
        _print_pool_info(member)


def _say_in_use(report) -> None:
    if report.in_use and report.root is not None:
        print(f"note: {report.path} is in use by a writer; showing its last committed root (seq {report.root.seq}, "
              f"batch {report.root.batches_done})", file=sys.stderr)


def _finish_report(report, as_json: bool) -> int:
    """Problems to stderr, one line each; the JSON summary last; exit 1 if anything is wrong."""
    _say_in_use(report)
    for problem in report.problems:
        print(f"{report.path}: {problem}", file=sys.stderr)
    if as_json:
        print(json.dumps(_report_json(report)))
    return 0 if report.ok else EXIT_ERROR


def _run_pool_check(args) -> int:
    from ..checkpoint.offline import check_checkpoint
    from ..pool.info import inspect

    report = inspect(args.path)
    checkpoint = None
    if report.in_use:  # the writer changes the undo ring and the dense slots under us: not checked
        checkpoint = "undo records and dense snapshot not checked while a writer holds the pool"
    elif report.ok:  # then the checksums above the pool layer: live undo records, the dense snapshot
        try:
            checkpoint = check_checkpoint(args.path)
        except PoolError as e:
            report.problems.append(str(e).removeprefix(f"{args.path}: "))
    if report.ok and not args.json:
        print(f"ok: {report.path}: {len(report.regions)} regions, root seq {report.root.seq}, "
              f"batch {report.root.batches_done}"
              + (f"; {checkpoint}" if checkpoint else ""))
    return _finish_report(report, args.json)
