"""A rank pool's own record of its shard (docs/distributed.md): the run, the rank, the world size,
and for each table the rank holds a part of, its sharding and its rows [lo, hi). Written into the
pool at its creation, before its first commit; every read-only command of a run folder compares it
with the manifest before using anything (run_check.py). Shapes alone cannot tell a row-wise table's
halves apart, nor a copy of another rank's pool of the same shape: this record can. Torch-free.

    write(pool, manifest, rank)                  # into rank `rank`'s pool, being created
    problems(path, report, manifest, rank)       # [] or one line: the record against the manifest
"""

from __future__ import annotations

from ..placement.sharding import ShardingPlan
from ..pool.format import RegionKind
from ..pool.info import PoolReport
from ..pool.shard_format import SHARD_BYTES, SHARD_REGION, pack_shard, read_shard
from . import manifest as run_dir


def expected(manifest: dict, rank: int) -> dict:
    """The record rank `rank`'s pool of the run `manifest` describes holds."""
    plan = ShardingPlan.from_json(manifest["plan"])
    return {"run": manifest["run"], "rank": rank, "world_size": manifest["world_size"],
            "tables": [{"name": t.name, "kind": t.kind, "rows": list(t.rows_of(rank))}
                       for t in plan.tables if rank in t.ranks]}


def write(pool, manifest: dict, rank: int) -> None:
    """The record, into `pool` (being created: its first commit makes the region live)."""
    region = pool.add_region(SHARD_REGION, RegionKind.BLOB, "uint8", (SHARD_BYTES,))
    pool.device.copy_persist(region.offset, pack_shard(expected(manifest, rank), pool.superblock.uuid))


def problems(path: str, report: PoolReport, manifest: dict, rank: int) -> list[str]:
    """What differs between the record in the pool at `path` (inspected whole: `report`) and the
    manifest's rank `rank`, in one line; [] when they agree."""
    region = next((r for r in report.regions if r.name == SHARD_REGION), None)
    if region is None:  # a run folder from before the record: its shapes and snapshots are still checked
        return [] if manifest["format"] != run_dir.FORMAT else [
            f"holds no record of its own shard ({SHARD_REGION}), which every rank pool of a {run_dir.FORMAT} run "
            "holds from its creation"]
    differs = _difference(read_shard(path, region, report.superblock.uuid), expected(manifest, rank), rank)
    return [differs] if differs else []


def _difference(record: dict, want: dict, rank: int) -> str | None:
    if record == want:
        return None
    if any(record.get(k) != want[k] for k in ("run", "rank", "world_size")):
        return (f"is not rank {rank}'s pool of this run (its own record: rank {record.get('rank')} of the "
                f"{record.get('world_size')}-rank run {record.get('run')}; the manifest: {want['world_size']} ranks, "
                f"run {want['run']})")
    held = {t.get("name"): t for t in record.get("tables", ()) if isinstance(t, dict)}
    for table in want["tables"]:
        has = held.pop(table["name"], None)
        if has != table:
            return (f"holds {_rows(has)} of table {table['name']!r}, the manifest gives rank {rank} {_rows(table)}")
    if held:
        name = sorted(map(str, held))[0]
        return f"holds {_rows(held[name])} of table {name!r}, which the manifest gives rank {rank} no part of"
    return "its record of its own shard differs from the manifest"


def _rows(table: dict | None) -> str:
    if table is None:
        return "no part"
    try:
        lo, hi = table["rows"]
        return f"rows {lo:,}-{hi - 1:,} ({table['kind']})"
    except (KeyError, TypeError, ValueError):
        return f"a part described as {table!r}"
