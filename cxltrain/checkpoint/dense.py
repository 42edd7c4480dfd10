"""Dense snapshots: the state that does not live in the tables, in two alternating pool slots.

A snapshot is a tree (encoded by codec.py, no pickle) of:

    "batch"       batches the state has seen; also the data position (the next batch index)
    "model"       model.state_dict() under seam.dense_only(): the dense parameters and buffers
    "optimizers"  [optimizer.state_dict() for each dense optimizer], any torch optimizer
    "schedulers"  [scheduler.state_dict() for each LR scheduler]
    "rng"         torch, numpy and python RNG states
    "tables"      {module path: weight region name}: where each table sits in the model (export)
    "metadata"    the caller's JSON-like description of the run (e.g. the training config)
    "threads"     torch's CPU thread count: reductions, hence bits, may depend on it

A rank of a group snapshots only its slice of "model" and of the optimizers' per-parameter state
(dense_slices.py), in a pool of three slots (format.INCOMPAT_DENSE_SLICES); one process, all of it.

A slot is written payload first, header last, both persisted; the root that names the slot is
written after that (U2), so a slot a root names always holds the snapshot the root describes.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..errors import CheckpointError, PoolCorruptError, RecoveryError
from ..kernels import native
from ..pool.format import checksum_more
from ..pool.handle import Pool
from . import codec, dense_slices, layout, slots
from .seam import dense_only


class DenseState:
    """The dense part of a training run: what a snapshot captures and recovery puts back."""

    def __init__(self, model: torch.nn.Module, optimizers: list, schedulers: list, table_paths: dict[str, str],
                 metadata: dict | None, slice_of: tuple[int, int] | None = None) -> None:
        self.model, self.optimizers, self.schedulers = model, optimizers, schedulers
        self.table_paths = table_paths
        self.metadata = metadata if metadata is not None else {}
        self.slice_of = slice_of  # (rank, world size): a group rank's snapshots hold its slice only

    def capture(self, batch: int) -> dict:
        with dense_only():
            model = self.model.state_dict()  # with _metadata (module versions); the tables left out
        tree = {"batch": batch, "model": model,
                "optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers],
                "rng": codec.capture_rng(), "tables": dict(self.table_paths), "metadata": self.metadata,
                "threads": torch.get_num_threads()}
        return tree if self.slice_of is None else dense_slices.slice_of(tree, *self.slice_of)

    def check(self, tree: dict, where: str) -> None:
        """Raise RecoveryError unless the snapshot fits the live model, optimizers and schedulers."""
        if len(tree["optimizers"]) != len(self.optimizers) or len(tree["schedulers"]) != len(self.schedulers):
            raise RecoveryError(f"{where}: the snapshot has {len(tree['optimizers'])} optimizer(s) and "
                                f"{len(tree['schedulers'])} scheduler(s); this run has {len(self.optimizers)} "
                                f"and {len(self.schedulers)}")
        with dense_only():
            own = self.model.state_dict()
        theirs = tree["model"]
        if set(own) != set(theirs) or any(own[k].shape != theirs[k].shape or own[k].dtype != theirs[k].dtype
                                          for k in own):
            changed = sorted(set(own) ^ set(theirs)) or [k for k in own if own[k].shape != theirs[k].shape
                                                         or own[k].dtype != theirs[k].dtype]
            raise RecoveryError(f"{where}: the snapshot's dense parameters do not match this model "
                                f"(first difference: {changed[0]!r})")
        for optimizer, state in zip(self.optimizers, tree["optimizers"]):
            groups = state.get("param_groups", []) if isinstance(state, dict) else []
            if [len(g.get("params", ())) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
                raise RecoveryError(f"{where}: the snapshot's optimizer state does not fit {type(optimizer).__name__} "
                                    "(its parameter groups differ)")

    def restore(self, tree: dict, where: str) -> None:
        """Load a snapshot, already checked with check(), into the live model, optimizers, schedulers
        and RNGs."""
        with dense_only():
            self.model.load_state_dict(tree["model"])
        for optimizer, state in zip(self.optimizers, tree["optimizers"]):
            try:
                optimizer.load_state_dict(state)
            except (ValueError, KeyError, RuntimeError) as e:
                raise RecoveryError(f"{where}: the snapshot's optimizer state does not fit "
                                    f"{type(optimizer).__name__}: {e}") from None
        for scheduler, state in zip(self.schedulers, tree["schedulers"]):
            scheduler.load_state_dict(state)
        codec.restore_rng(tree["rng"])
        self.metadata = tree["metadata"]
        if tree["threads"] != torch.get_num_threads():
            warnings.warn(f"{where}: was written with {tree['threads']} torch threads, this run uses "
                          f"{torch.get_num_threads()}: CPU reductions may round differently, so the resumed run "
                          "need not end bit-identical to an uninterrupted one", stacklevel=2)


def free_slot(pool: Pool, agreed: int | None = None) -> int:
    """The dense slot a new snapshot may overwrite: in one process's pool, the one of two the durable
    root does not name; in a group rank's (three slots), one no recovery can still need, given the
    group's last agreed recovery point G (`agreed`; None before any)."""
    if layout.SLICE_REGION not in pool.regions:
        return 2 if pool.root.dense_slot == 1 else 1
    held = slots.held_batches(pool)
    root = pool.root
    # ORDERING U3d: a rank keeps its slices of every batch the group may still recover to, since no
    # other rank holds them: the one its root names, those above G, and the newest at or below G.
    # A slice above the root's batch is of a future a roll-back abandoned: never needed.
    live = {s: b for s, b in held.items() if b is not None and b <= root.batches_done}
    keep = {root.dense_slot}
    if agreed is not None:
        keep |= {s for s, b in live.items() if b > agreed}
        at_or_below = [(b, s) for s, b in live.items() if b <= agreed]
        if at_or_below:
            keep.add(max(at_or_below)[1])
    free = [s for s in held if s not in keep]
    if not free:
        raise CheckpointError(f"{pool.path}: every dense slot holds a slice the group may still recover to (batches "
                              f"{sorted(b for b in live.values())}, agreed batch {agreed}): the ranks' commits are "
                              "further apart than a group's pool keeps")
    return min(free, key=lambda s: -1 if s not in live else live[s])  # an empty or abandoned slot, else the oldest


def drop_abandoned_slices(pool: Pool) -> None:
    """After a roll-back's root is durable: invalidate the dense slots holding slices of batches past
    it (of the future the roll-back abandoned), so that only one slot ever holds a batch's slice."""
    for slot, batch in slots.held_batches(pool).items():
        if batch is not None and batch > pool.root.batches_done:
            pool.device.copy_persist(slot_region(pool, slot).offset, bytes(layout.DENSE_HEADER.size))


slot_region = slots.slot_region


def write_snapshot(pool: Pool, slot: int, batch: int, tree: dict) -> None:
    """Store the snapshot `tree` (DenseState.capture) in dense slot `slot` (1 or 2), durably."""
    seal_snapshot(pool, slot, batch, *write_payload(pool, slot, batch, codec.lay_out(tree)))


def write_payload(pool: Pool, slot: int, batch: int, encoded: codec.Layout) -> tuple[int, int]:
    """Copy an encoded snapshot straight from the live tensors into slot `slot`'s payload and make
    it durable; returns its length and checksum (for the header of `batch`), summed from the live
    bytes as they are copied. The slot stays invalid (its header untouched) until seal_snapshot.
    Must not overlap a write of the dense state it copies."""
    region = slot_region(pool, slot)
    if layout.DENSE_HEADER.size + encoded.nbytes > region.size:
        raise CheckpointError(f"the dense state ({encoded.nbytes:,} bytes encoded) does not fit the pool's dense "
                              f"slots ({max(0, region.size - layout.DENSE_HEADER.size):,} bytes); create the pool "
                              "with larger slots (Runtime(dense_slot_bytes=...))")
    device, start = pool.device, region.offset + layout.DENSE_HEADER.size
    crc = slots.payload_checksum_seed(pool.superblock.uuid, batch)
    write_back = streamed_write_back(device, start)
    if write_back is not None:
        return encoded.nbytes, _stream_payload(device, start, region.offset + region.size, write_back, crc, encoded)
    return encoded.nbytes, _copy_payload(device, start, crc, encoded)


def streamed_write_back(device, start: int) -> native.NativePersistence | None:
    """How a native kernel makes what it stores at `start` on `device` durable by itself
    (Device.native_persistence), where the build streams: write_payload then copies in one native
    pass. None: piece by piece through the device."""
    lib = native.lib()
    persistence = device.native_persistence()
    if lib is None or not lib.STREAMS or persistence is None:
        return None
    if persistence.kind not in (native.NativePersistence.LINES, native.NativePersistence.MEDIA):
        return None
    return persistence


def _stream_payload(device, start: int, end: int, write_back: native.NativePersistence, seed: int,
                    encoded: codec.Layout) -> int:
    """write_payload's copy in one native pass (kernels/rows.c stream_pieces, never past `end`): long
    pieces streamed around the caches, the rest stored and written back as `write_back` says, then
    one fence (and on the power-loss emulator the lines copied to the media); returns the checksum,
    summed from the sources as they are copied."""
    lib = native.lib()
    pieces = [raw for _, raw in encoded.pieces()]
    sources = np.array(lib.addresses(*pieces), dtype=np.int64)
    lengths = np.array([len(raw) for raw in pieces], dtype=np.int64)
    device.streamed_persisted(start, encoded.nbytes, 1)  # checked and counted (the crash tests' flush point)
    with write_back.lock:
        # the payload is durable (its fence, or its lines in the media) when this returns: what
        # seal_snapshot's ordering, payload before header, rests on
        return lib.stream_pieces(native.address(device.array) + start, end - start, write_back,
                                 *lib.addresses(sources, lengths), len(pieces), seed)


# Pieces at least this big are copied with the device's copy_persist (non-temporal stores where it
# has them); smaller ones (the manifest, padding, RNG states, scalars) are plain stores, flushed once.
_STREAM_BYTES = 16 << 10


def _copy_payload(device, start: int, crc: int, encoded: codec.Layout) -> int:
    """write_payload's copy piece by piece through the device; returns the checksum, summed while the
    bytes are in cache: a big piece from its source just before its copy, a run of small pieces from
    the slot just after they are stored."""
    stored = [0, 0]  # a run of small pieces stored and not yet flushed (they tile it): one flush, one sum

    def flush_stored(crc: int) -> int:
        if stored[1] > stored[0]:
            device.flush(start + stored[0], stored[1] - stored[0])
            crc = checksum_more(device.array[start + stored[0] : start + stored[1]], crc)
        stored[0] = stored[1]
        return crc

    for offset, raw in encoded.pieces():  # in offset order, each starting where the one before ends
        src = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, bytes) else raw
        if src.size >= _STREAM_BYTES:
            crc = checksum_more(src, flush_stored(crc))
            device.copy_persist(start + offset, src)
            stored[:] = [offset + src.size] * 2
        else:
            device.array[start + offset : start + offset + src.size] = src
            stored[1] = offset + src.size
    crc = flush_stored(crc)
    device.drain()
    return crc


def seal_snapshot(pool: Pool, slot: int, batch: int, nbytes: int, crc: int) -> None:
    """Make slot `slot` valid for `batch`: write the header of the `nbytes` payload write_payload made
    durable, with the checksum it returned."""
    region = slot_region(pool, slot)
    header = layout.pack_dense_header(batch, nbytes, crc, pool.superblock.uuid, slot)
    # ORDERING: the payload is durable (write_payload) before the header that makes the slot valid
    pool.device.copy_persist(region.offset, header)


def read_snapshot(pool: Pool, slot: int, batch: int) -> dict:
    """The snapshot in `slot`, checked: header, batch, payload checksum (slots.checked_payload), and
    the decoded tree's shape."""
    tree = codec.decode(slots.checked_payload(pool, slot, batch))
    _check_tree(tree, slots.where(pool, slot), batch)
    return tree


def _check_tree(tree, where: str, batch: int) -> None:
    """Shape of a decoded snapshot; a well-checksummed slot of another format is refused, not half-used."""
    kinds = {"batch": int, "model": dict, "optimizers": list, "schedulers": list, "rng": dict, "tables": dict,
             "metadata": dict, "threads": int}
    if not isinstance(tree, dict) or set(tree) != set(kinds) or any(
            not isinstance(tree[k], t) for k, t in kinds.items()):
        raise PoolCorruptError(f"{where}: not a dense snapshot this cxltrain can read")
    if tree["batch"] != batch or not all(isinstance(v, torch.Tensor) for v in tree["model"].values()):
        raise PoolCorruptError(f"{where}: snapshot contents are inconsistent")
