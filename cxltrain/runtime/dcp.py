"""DCP checkpoints (torch.distributed.checkpoint) in and out, under TorchRec's keys.

A checkpoint written here is one flat DCP state dict:

    "embedding_bags.<table>.weight"                              [R, D]  the table (interop.to_torchrec)
    "state.embedding_bags.<table>.weight.<table>.momentum1"      [R]     row-wise Adagrad's accumulator,
                                                                         keyed as TorchRec's fused optimizer
    "<dense parameter path>"                                     tensor  the dense weights and buffers
    "cxltrain"                                                   bytes   torch.save of {"batch", "optimizers",
                                                                         "schedulers", "tables", "metadata"}

so `dcp.load(ebc.state_dict(), checkpoint_id=DIR)` fills an EmbeddingBagCollection of the same
configs on any world size (DCP reshards the saved row chunks into whatever the reader asks for),
and `cxltrain import DIR` rebuilds the pool or run folder it came from, dense optimizers included.

Writing holds a chunk per key, never a table: each table is planned as row chunks of CHUNK_BYTES
(DCP chunks, as a sharded save's shards are), and the planner reads a chunk from the pool only
when the writer asks for it. DCP's writer keeps the last tensor it wrote under each key until its
file is done, so memory is at most a chunk per table key, whatever the tables' size.

Reading takes any DCP checkpoint whose keys end in `embedding_bags.<table>.weight` (a TorchRec
EmbeddingBagCollection's, or a model holding one, such as TorchRec's DLRM under
`sparse_arch.embedding_bag_collection.`), with or without the fused optimizer's `momentum1`, as
an export (runtime.export_state's layout) that runtime.state_import and jobs.reshard build from.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import shutil
import tempfile
import warnings

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from ..errors import ConfigError, CxlTrainError
from .interop import DLRM_COLLECTION, TORCHREC_PREFIX
from .streamed_save import Streamed

EXTRA_KEY = "cxltrain"
STATE_PREFIX = "state."
MOMENTUM = "momentum1"
CHUNK_BYTES = 4 << 20   # a DCP chunk of a table: what writing holds per table key at most
METADATA_FILE = ".metadata"
_TABLE_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)embedding_bags\.(?P<name>[^.]+)\.weight$")


def to_dcp(export: dict) -> dict:
    """Our export (runtime.open_export / reshard.streamed_export_dir, tables Streamed or tensors)
    as the flat DCP state dict of the module docstring; tables stay as they are (Streamed: read when
    written)."""
    tables = export.get("tables")
    if not isinstance(tables, dict):
        raise ConfigError("the export names no tables (written by an older cxltrain): export the pool again")
    model = dict(export["model"])
    out = {}
    for path, name in tables.items():
        prefix = f"{path}." if path else ""
        key = f"{TORCHREC_PREFIX}{name}.weight"
        out[key] = model.pop(f"{prefix}weight")
        state = model.pop(f"{prefix}optimizer_state", None)
        if state is not None:
            out[f"{STATE_PREFIX}{key}.{name}.{MOMENTUM if state.shape[1] == 1 else 'optimizer_state'}"] = \
                _rows_as_vector(state) if state.shape[1] == 1 else state
    for key, tensor in model.items():
        if key.startswith((TORCHREC_PREFIX, STATE_PREFIX)) or key == EXTRA_KEY:
            raise ConfigError(f"dense key {key!r} collides with the checkpoint's table keys")
        out[key] = tensor
    extra = io.BytesIO()
    torch.save({k: export.get(k) for k in ("batch", "optimizers", "schedulers", "tables", "metadata")}, extra)
    out[EXTRA_KEY] = extra.getvalue()
    return out


def _rows_as_vector(state):
    """[R, 1] optimizer state as TorchRec's row-wise momentum1 [R] (the same bytes)."""
    if isinstance(state, Streamed):
        return Streamed((state.shape[0],), state.dtype, lambda: (c.reshape(-1) for c in state.chunks()))
    return state.reshape(-1)


def save(state: dict, directory: str) -> None:
    """Write the flat DCP state dict `state` (to_dcp's) as the checkpoint folder `directory` (which
    must not exist), in this process (no process group). It is written under a side name beside it
    and renamed once whole: `directory` never holds half a checkpoint, and the side folder goes on
    every exit (a full disk, Ctrl-C)."""
    parent = os.path.dirname(os.path.abspath(directory))
    try:
        partial = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.", suffix=".partial", dir=parent)
    except OSError as e:
        raise CxlTrainError(f"{directory}: cannot write: {e.strerror}") from None
    try:
        placeholders = {k: _placeholder(v) for k, v in state.items()}
        sources = {k: v for k, v in state.items() if isinstance(v, Streamed)}
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore")
            dcp.save(placeholders, storage_writer=dcp.FileSystemWriter(partial, sync_files=True),
                     planner=_StreamedPlanner(sources), no_dist=True)
        os.rename(partial, directory)  # refused when `directory` appeared meanwhile and is not empty
    except OSError as e:
        raise CxlTrainError(f"{directory}: cannot write: {e.strerror}") from None
    except CheckpointException as e:  # DCP's writer wraps what failed (a full disk: OSError)
        raise CxlTrainError(f"{directory}: cannot write: {_why(e)}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _why(e: BaseException) -> str:
    """One line for an error, DCP's CheckpointException by the first error it wraps."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))
        e = e[0] if isinstance(e, tuple) else e
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:120]}" if text else type(e).__name__


def _placeholder(value):
    """A Streamed value as torch.empty of its shape: address space the writer never touches (the
    planner hands it the pool's rows instead); anything else as it is."""
    return torch.empty(value.shape, dtype=value.dtype) if isinstance(value, Streamed) else value


class _StreamedPlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a Streamed value is planned as row chunks of
    CHUNK_BYTES and each chunk read from its source when the writer resolves it."""

    def __init__(self, sources: dict[str, Streamed]) -> None:
        super().__init__()
        self.readers = {key: _RowReader(source) for key, source in sources.items()}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            reader = self.readers.get(item.index.fqn)
            items.extend([item] if reader is None else _chunk_items(item, reader.rows_per_chunk))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        reader = self.readers.get(write_item.index.fqn)
        if reader is None:
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        return reader.rows(int(chunk.offsets[0]), int(chunk.sizes[0]))


def _chunk_items(item, rows_per_chunk: int) -> list:
    """The write item of a whole tensor [R, ...] as items of `rows_per_chunk` rows each."""
    size = item.tensor_data.size
    items = []
    for first in range(0, max(1, size[0]), rows_per_chunk):
        offsets = torch.Size([first, *[0] * (len(size) - 1)])
        sizes = torch.Size([min(rows_per_chunk, size[0] - first), *size[1:]])
        items.append(dataclasses.replace(
            item, index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=dataclasses.replace(item.tensor_data, chunk=ChunkStorageMetadata(offsets, sizes))))
    return items


class _RowReader:
    """Rows [first, first + n) of a Streamed value, read in order from its chunks (a request before
    the last one read starts them again: correct in any order, one pass when asked in order, as
    DCP's single-threaded writer asks)."""

    def __init__(self, source: Streamed) -> None:
        self.source = source
        row_bytes = max(1, source.nbytes // max(1, source.shape[0]))
        self.rows_per_chunk = max(1, CHUNK_BYTES // row_bytes)
        self.chunks, self.at, self.pending = None, 0, None

    def rows(self, first: int, n: int) -> torch.Tensor:
        if self.chunks is None or first < self.at:
            self.chunks, self.at, self.pending = iter(self.source.chunks()), 0, None
        out = []
        while n:
            if self.pending is None or len(self.pending) == 0:
                self.pending = np.ascontiguousarray(next(self.chunks))
            skip = min(len(self.pending), max(0, first - self.at))
            self.pending, self.at = self.pending[skip:], self.at + skip
            if skip or len(self.pending) == 0:
                continue
            take = self.pending[:n]
            out.append(take)
            self.pending, self.at, first, n = self.pending[len(take):], self.at + len(take), \
                first + len(take), n - len(take)
        return torch.from_numpy(np.concatenate(out) if len(out) > 1 else np.array(out[0]))


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def is_dcp_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


def read(directory: str) -> tuple[dict, bool]:
    """(the DCP checkpoint `directory` as an export (runtime.export_state's layout), in memory;
    whether cxltrain wrote it). Ours comes back with everything it was written with; a TorchRec one
    at batch 0, its tables at our DLRM's paths (a bare EmbeddingBagCollection's) or at its own (a
    model's), each table's momentum1 as its optimizer state where it has one, its other tensors as
    the dense state, and no dense optimizer state (torch's is keyed by parameter, not by path)."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory}: no such checkpoint folder")
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as e:  # a folder without DCP's metadata, or a torn one: one line
        raise ConfigError(f"{directory}: not a DCP checkpoint ({_why(e)})") from None
    tensors = {k: md for k, md in metadata.items() if not isinstance(md, BytesStorageMetadata)}
    weights = [k for k in tensors if _TABLE_KEY.match(k) and not _is_optimizer_key(k)]
    momentum = {}  # table weight key -> its optimizer state's key
    for key in tensors:
        found = _STATE_KEY.match(key)
        table = found and next((w for w in weights if w == found["param"] or w.endswith(f".{found['param']}")), None)
        if table:
            momentum[table] = key
    dense = [k for k in tensors if not _is_optimizer_key(k) and k not in weights]
    state = {k: torch.empty(tensors[k].size, dtype=tensors[k].properties.dtype) for k in dense}
    # the tables into mapped scratch files (unlinked at once): DCP copies each saved chunk in as it
    # reads it, the pages are the file's, and the import copies them into the pool a chunk at a time,
    # as it does from a mapped .pt file; memory holds chunks, not tables
    state.update({k: _scratch(tensors[k].size, tensors[k].properties.dtype) for k in weights + list(momentum.values())})
    if EXTRA_KEY in metadata:
        state[EXTRA_KEY] = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
        extra = state.pop(EXTRA_KEY, None)
        extra = None if extra is None else torch.load(io.BytesIO(extra), weights_only=True)
    except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
        raise ConfigError(f"{directory}: cannot read the DCP checkpoint ({_why(e)})") from None
    ours = isinstance(extra, dict) and isinstance(extra.get("tables"), dict)
    return _as_export(state, weights, momentum, extra if ours else None, directory), ours


def _scratch(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor [shape] mapped from a file in the temporary folder ($TMPDIR), the file
    already unlinked: its blocks go when the tensor does."""
    numel = int(np.prod(shape))
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    fd, path = tempfile.mkstemp(prefix="cxltrain-dcp-", suffix=".rows")
    try:
        # blocks reserved now: a full disk is this error, not a SIGBUS when DCP writes the mapping
        os.posix_fallocate(fd, 0, numel * torch.empty(0, dtype=dtype).element_size())
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    except OSError as e:
        raise CxlTrainError(f"{tempfile.gettempdir()}: no room to read the checkpoint's tables through "
                            f"({e.strerror}; set TMPDIR to a folder with room)") from None
    finally:
        os.close(fd)
        os.unlink(path)


# TorchRec's fused optimizer keys a table's state "state.<param path>.<table>.momentum1"; under a
# wrapping dict ("optim.state...") as well
_STATE_KEY = re.compile(r"^(?:.*\.)?state\.(?P<param>.+\.weight)\.[^.]+\.(?:momentum1|optimizer_state)$")


def _is_optimizer_key(key: str) -> bool:
    return key.startswith((STATE_PREFIX, "param_groups.")) or ".state." in key or ".param_groups." in key


def _as_export(state: dict, weights: list[str], momentum: dict[str, str], extra: dict | None,
               directory: str) -> dict:
    paths = {name: path for path, name in extra["tables"].items()} if extra else {}
    model, tables = {}, {}
    for key in weights:
        found = _TABLE_KEY.match(key)
        name = found["name"]
        if extra and name not in paths:
            raise ConfigError(f"{directory}: table {name!r} is not among the tables it names")
        path = paths[name] if extra else f"{found['prefix'] or DLRM_COLLECTION + '.'}{TORCHREC_PREFIX}{name}"
        tables[path] = name
        model[f"{path}.weight"] = state.pop(key)
        if key in momentum:
            opt = state.pop(momentum[key])
            model[f"{path}.optimizer_state"] = opt.reshape(-1, 1) if opt.dim() == 1 else opt
    if not tables:
        raise ConfigError(f"{directory}: no embedding_bags.<table>.weight keys: not a checkpoint of a TorchRec "
                          "EmbeddingBagCollection or of a model holding one")
    if extra and set(tables.values()) != set(paths):
        missing = sorted(set(paths) - set(tables.values()))
        raise ConfigError(f"{directory}: table(s) {', '.join(missing)} missing")
    model.update(state)
    if extra:  # the tables in the order the run named them
        return {**extra, "model": model, "tables": dict(extra["tables"])}
    return {"batch": 0, "model": model, "optimizers": [], "schedulers": [], "tables": tables, "metadata": {}}
