"""`cxltrain import OUT.pt POOL`: a new pool from an export, as if the run had trained it there.

Reads any export of ours (runtime.export_state, `cxltrain export`) or a TorchRec-style flat state
dict (`embedding_bags.<table>.weight` keys plus dense weights: interop.py), and builds POOL: one
table region pair per table (weights [R, D], optimizer state [R, K]), the undo ring, the two dense
slots holding the export's dense parameters, optimizer and scheduler state, table map and
metadata, and a root that commits them at the export's batch. A Runtime (or `cxltrain train` with
the options that made the export) then resumes it at that batch.

Protocol-safe by construction: the pool is built under a side name, and every region and the dense
snapshot are durable before the root names them (checkpoint/new_pool.py); it gets POOL's name only then. A
crash while importing leaves no pool under POOL. What an export lacks is not invented: RNG states
(never exported) are the importing process's, and a TorchRec state dict brings no optimizer state
(the tables' state starts at the optimizer's initial value, the dense optimizers' list is empty).
"""

from __future__ import annotations

import dataclasses
import os
import zipfile

import torch

from ..checkpoint import codec, first_commit, layout
from ..errors import ConfigError, CxlTrainError, PoolError
from ..knobs import KNOBS
from ..pool.format import RegionKind, pool_size_for
from ..pool.handle import Pool, RegionSpec, publish, remove_stale
from ..tables import cache as hot_cache
from ..tables.bag import region_names
from .interop import TORCHREC_PREFIX, from_torchrec
from .runtime import DEFAULT_UNDO_RING_BYTES


@dataclasses.dataclass(frozen=True)
class ImportReport:
    path: str
    batch: int
    tables: dict[str, tuple[int, int]]   # table name -> (rows, dim)
    source: str                          # "cxltrain", "torchrec", or either's DCP folder: "dcp"


def import_file(source: str, path: str, *, state_columns: int = 1,
                undo_ring_bytes: int = DEFAULT_UNDO_RING_BYTES) -> ImportReport:
    """Build the pool `path` (must not exist) from the export file `source` (module docstring).
    state_columns: optimizer-state columns of tables whose export holds none (TorchRec's: 1 for
    row-wise Adagrad, our DLRM's default; 0 for SGD). A folder is read as a DCP checkpoint (dcp.read)."""
    if os.path.isdir(source):
        state, ours = load_dcp(source)
        report = import_state(state, path, state_columns=state_columns, source=source, undo_ring_bytes=undo_ring_bytes,
                              foreign=not ours)
        return dataclasses.replace(report, source="dcp")
    try:
        # mapped, not read: a table's bytes are paged in as _fill copies it, a chunk at a time
        state = torch.load(source, weights_only=True, map_location="cpu", mmap=zipfile.is_zipfile(source))
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except Exception as e:  # a torn or foreign file: one line, never a traceback
        raise ConfigError(f"{source}: not a torch export ({type(e).__name__}: {str(e).splitlines()[0][:120]})") \
            from None
    return import_state(state, path, state_columns=state_columns, source=source, undo_ring_bytes=undo_ring_bytes)


def load_dcp(source: str) -> tuple[dict, bool]:
    """(the DCP checkpoint folder `source` as an export, whether cxltrain wrote it): the one reader
    both imports (a pool, jobs.reshard's run folder) take a DCP source through."""
    from . import dcp

    return dcp.read(source)


def import_state(state, path: str, *, state_columns: int = 1, source: str = "the export",
                 undo_ring_bytes: int = DEFAULT_UNDO_RING_BYTES, foreign: bool = False) -> ImportReport:
    """Build the pool `path` from an export already loaded (see import_file). foreign: it came from
    TorchRec in our layout (a DCP checkpoint's), so a table without optimizer state gets
    `state_columns` of them, as a TorchRec state dict's does."""
    kind = "torchrec" if foreign else "cxltrain"
    if isinstance(state, dict) and "model" not in state and any(
            isinstance(k, str) and k.startswith(TORCHREC_PREFIX) for k in state):
        state, kind = from_torchrec(state), "torchrec"
    tree, tables = _snapshot_and_tables(state, source, state_columns if kind == "torchrec" else 0)
    if os.path.lexists(path):
        raise PoolError(f"{path}: already exists; import builds a new pool")
    building = path + ".creating"
    remove_stale(building)
    specs = _region_specs(tables)
    slot_bytes = 2 * codec.lay_out(tree).nbytes + (1 << 20)  # room for the dense optimizers' state to grow
    specs += [RegionSpec(layout.RING_REGION, RegionKind.UNDO_RING, "uint8", (undo_ring_bytes,)),
              *(RegionSpec(name, RegionKind.DENSE_SLOT, "uint8", (slot_bytes,)) for name in layout.DENSE_REGIONS)]
    size = pool_size_for([s.nbytes(KNOBS.row_align) for s in specs], KNOBS.dir_capacity, KNOBS.region_align)
    try:
        pool = Pool.create(building, size)
    except CxlTrainError as e:
        raise type(e)(str(e).replace(building, path)) from None
    try:
        _fill(pool, specs, tables, tree)
        publish(pool, path)
    except BaseException:
        pool.close()
        os.unlink(pool.path)  # never leave a half-built pool behind
        raise
    pool.close()
    return ImportReport(path, tree["batch"], {name: tuple(t[0].shape) for name, t in tables.items()}, kind)


def _snapshot_and_tables(state, source: str, absent_state_columns: int):
    """(the dense snapshot tree, {table name: (weights [R, D], optimizer state [R, K] or None, K)})."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ConfigError(f"{source}: not an export of cxltrain nor a TorchRec EmbeddingBagCollection state dict")
    paths = state.get("tables")
    if not isinstance(paths, dict) or not paths:
        raise ConfigError(f"{source}: names no tables (an export of an older cxltrain?): export the pool again")
    model = dict(state["model"])
    tables = {}
    for path, name in paths.items():
        prefix = f"{path}." if path else ""
        weight = model.pop(f"{prefix}weight", None)
        optim = model.pop(f"{prefix}optimizer_state", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            raise ConfigError(f"{source}: table {name!r} has no 2-D float weights under {prefix}weight")
        if optim is not None and (optim.dim() != 2 or optim.shape[0] != weight.shape[0]):
            raise ConfigError(f"{source}: table {name!r}: optimizer state {list(optim.shape)} does not fit "
                              f"weights {list(weight.shape)}")
        columns = optim.shape[1] if optim is not None else absent_state_columns
        tables[name] = (weight, optim, columns)  # converted to float32 as they are copied (_fill)
    batch = state.get("batch", 0)
    if not isinstance(batch, int) or batch < 0:
        raise ConfigError(f"{source}: batch must be a non-negative int, got {batch!r}")
    tree = {"batch": batch, "model": model, "optimizers": list(state.get("optimizers", [])),
            "schedulers": list(state.get("schedulers", [])), "rng": codec.capture_rng(), "tables": dict(paths),
            "metadata": dict(state.get("metadata") or {}), "threads": torch.get_num_threads()}
    return tree, tables


def _region_specs(tables: dict) -> list[RegionSpec]:
    specs = []
    for name, (weight, _, columns) in tables.items():
        weight_region, state_region = region_names(name)
        specs.append(RegionSpec(weight_region, RegionKind.TABLE_WEIGHTS, "float32", tuple(weight.shape),
                                aligned_rows=True))
        if columns:
            specs.append(RegionSpec(state_region, RegionKind.TABLE_OPTIM_STATE, "float32", (weight.shape[0], columns)))
    return specs


def _fill(pool: Pool, specs: list[RegionSpec], tables: dict, tree: dict) -> None:
    pool.add_regions(specs)
    for name, (weight, optim, columns) in tables.items():
        weight_region, state_region = region_names(name)
        _copy_rows(pool, weight_region, weight)
        if columns:
            # absent: the initial accumulator of row-wise Adagrad (0), as a new table starts
            _copy_rows(pool, state_region, optim)
    first_commit(pool, tree["batch"], tree)


def _copy_rows(pool: Pool, region: str, rows: torch.Tensor | None) -> None:
    """Region `region` [R, C] := rows [R, C] as float32 (None: zeros), a chunk of rows at a time, each
    persisted: memory holds a chunk, whatever the table's size (the export is mapped, not read)."""
    target = pool.array(region)
    step = max(1, hot_cache.CHUNK_BYTES // (target.shape[1] * target.itemsize))
    r = pool.region(region)
    for first in range(0, target.shape[0], step):
        last = min(target.shape[0], first + step)
        target[first:last] = 0.0 if rows is None else rows[first:last].to(torch.float32).numpy()
        pool.device.persist(r.offset + first * r.row_stride, (last - first) * r.row_stride)
