"""How a PoolReport reads: `pool info`'s lines and the JSON of `pool info` and `pool check`."""

from __future__ import annotations

from .cache_format import describe
from .format import ROOT_RELAXED, SLOT_NAMES
from .info import PoolReport


def report_json(report: PoolReport) -> dict:
    """`pool info --json` and `pool check --json`: the report as plain data, members nested."""
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
        **({"members": [report_json(m) for m in report.members]} if report.members else {}),
        **({"caches": held} if (held := caches(report)) else {}),
    }


def caches(report: PoolReport) -> list[dict]:
    """The hot-row caches a pool set's primary holds (cache_format.describe)."""
    return describe(report.path, report.regions)


def report_lines(report: PoolReport) -> list[str]:
    """`pool info`: the superblock, both roots, every region, the caches, then each member's own."""
    lines = []
    sb = report.superblock
    lines.append(f"pool {report.path}: format v{sb.version}, {sb.pool_size:,} bytes, uuid {sb.uuid.hex()}")
    for s in report.slots:
        detail = (f"seq {s.root.seq}, batch {s.root.batches_done}, {s.root.dir_count} regions" if s.root
                  else s.reason or "never written")
        if s.root is not None and s.root.dense_slot:
            detail += (f", dense snapshot in slot {s.root.dense_slot_name} (batch {s.root.dense_batch}), undo ring "
                       f"generation {s.root.ring_generation} from offset {s.root.ring_start}"
                       + (", relaxed (the dense state may trail the embeddings)" if s.root.flags & ROOT_RELAXED else ""))
        winner = " (current)" if s.root is not None and s.root == report.root else ""
        lines.append(f"root {SLOT_NAMES[s.slot]}: {s.state}{winner}: {detail}")
    lines.append(f"{'region':<24} {'kind':<18} {'dtype':<8} {'shape':<18} {'offset':>14} {'bytes':>14}")
    for r in report.regions:
        shape = "x".join(str(d) for d in r.shape)
        lines.append(f"{r.name:<24} {r.kind.name.lower():<18} {r.dtype.numpy.name:<8} {shape:<18} {r.offset:>14,} {r.size:>14,}")
    for cache in caches(report):  # a pool set's hot-row caches (docs/tiers.md)
        held = "?" if cache["held"] is None else f"{cache['held']:,}"
        lines.append(f"hot-row cache of table {cache['table']}: {cache['rows']:,} rows, {held} held")
    for member in report.members:  # a pool set's capacity pools (docs/tiers.md)
        lines += ["capacity pool of this set:", *report_lines(member)]
    return lines
