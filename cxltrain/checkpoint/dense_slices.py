"""A group's dense state made durable in slices: rank r of W keeps only its part of it
(docs/distributed.md, "Dense slices").

The dense state (parameters, buffers, the dense optimizers' per-parameter state) is the same on
every rank of a group. Its units, in the tree's own order: each entry of "model", then each item
of each optimizer's per-parameter state (a parameter's exp_avg, say). slice_of cuts that sequence into W contiguous runs of
about equal bytes (a unit goes to the run its middle byte falls in), from the tree alone, so every
rank, holding the same tree, cuts it alike. Everything else (the optimizers' param_groups,
schedulers, RNG states, metadata) is small and stays whole in every slice. merge concatenates the
slices' units in rank order: the tree again, in its own order, bit for bit.

    whole == merge([slice_of(whole, r, W) for r in range(W)], own=0, where="...")  # own: whose rest
"""

from __future__ import annotations

import torch

from ..errors import RecoveryError


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 8  # a scalar (an optimizer's step count, say)


def _optimizer_states(tree: dict) -> list[dict | None]:
    """Each optimizer's per-parameter state ({index: state}), None where its state_dict has none."""
    return [o["state"] if isinstance(o, dict) and isinstance(o.get("state"), dict) else None
            for o in tree["optimizers"]]


def _owners(sizes: list[int], world_size: int) -> list[int]:
    """The rank of each unit: W contiguous runs of about equal bytes."""
    total, before, owners = sum(sizes), 0, []
    for n in sizes:
        owners.append(min(world_size - 1, (2 * before + n) * world_size // (2 * total)) if total else 0)
        before += n
    return owners


def slice_of(tree: dict, rank: int, world_size: int) -> dict:
    """Rank `rank`'s slice of the DenseState.capture tree `tree` (shared tensors, no copy)."""
    states = _optimizer_states(tree)
    units = [(None, k, None, _nbytes(v)) for k, v in tree["model"].items()]
    units += [(j, i, key, _nbytes(v)) for j, state in enumerate(states) if state is not None
              for i, entry in state.items() for key, v in _items(entry)]
    owned = {u[:3] for u, r in zip(units, _owners([u[3] for u in units], world_size)) if r == rank}
    model = type(tree["model"])((k, v) for k, v in tree["model"].items() if (None, k, None) in owned)
    if hasattr(tree["model"], "_metadata"):
        model._metadata = tree["model"]._metadata  # module versions, which load_state_dict reads
    optimizers = []
    for j, (o, state) in enumerate(zip(tree["optimizers"], states)):
        if state is not None:
            parts = {i: _part(entry, [key for key, _ in _items(entry) if (j, i, key) in owned])
                     for i, entry in state.items()}
            o = {**o, "state": {i: part for i, part in parts.items() if part is not None}}
        optimizers.append(o)
    return {**tree, "model": model, "optimizers": optimizers}


def _items(entry) -> list:
    """The units of one parameter's optimizer state: its items, or the whole entry if not a dict."""
    return list(entry.items()) if isinstance(entry, dict) else [(None, entry)]


def _part(entry, keys: list):
    """The items `keys` of a parameter's optimizer state (in its order); None for none of them."""
    if not keys:
        return None
    return entry if not isinstance(entry, dict) else type(entry)((k, entry[k]) for k in keys)


def merge(slices: list[dict], own: int, where: str) -> dict:
    """The whole tree from every rank's slice (rank order), all of one batch; the rest (RNG states,
    schedulers, metadata, table paths) from slice `own`. RecoveryError (one line) for slices of
    different batches, runs or ranks, or that overlap."""
    world_size, base = len(slices), slices[own]
    for r, s in enumerate(slices):
        meta = s["metadata"]
        if s["batch"] != base["batch"]:
            raise RecoveryError(f"{where}: rank {r}'s dense slice is of batch {s['batch']}, rank {own}'s of batch "
                                f"{base['batch']}: the dense state is rebuilt only from slices of one batch")
        if meta.get("run") != base["metadata"].get("run") or meta.get("rank") != r or meta.get("slices") != world_size:
            raise RecoveryError(f"{where}: rank {r}'s dense slice is not slice {r} of {world_size} of this run (it says "
                                f"run {meta.get('run')}, rank {meta.get('rank')}, {meta.get('slices')} slices)")
        if len(s["optimizers"]) != len(base["optimizers"]):
            raise RecoveryError(f"{where}: rank {r}'s dense slice has {len(s['optimizers'])} optimizer(s), rank "
                                f"{own}'s {len(base['optimizers'])}")
    overlap = RecoveryError(f"{where}: the ranks' dense slices overlap: they were not cut from one dense state")
    model = type(base["model"])()
    for s in slices:
        if model.keys() & s["model"].keys():
            raise overlap
        model.update(s["model"])
    if hasattr(base["model"], "_metadata"):
        model._metadata = base["model"]._metadata
    optimizers = []
    for j, (o, state) in enumerate(zip(base["optimizers"], _optimizer_states(base))):
        if state is not None:
            whole: dict = {}
            for s in slices:  # in rank order: each parameter's items in their own order again
                for i, part in s["optimizers"][j]["state"].items():
                    if i not in whole:
                        whole[i] = part
                    elif isinstance(part, dict) and isinstance(whole[i], dict) and not whole[i].keys() & part.keys():
                        whole[i] = type(part)({**whole[i], **part})
                    else:
                        raise overlap
            o = {**o, "state": whole}
        optimizers.append(o)
    return {**base, "model": model, "optimizers": optimizers}

