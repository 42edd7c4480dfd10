"""Exports in TorchRec's vocabulary, and back.

Our export (`cxltrain export`, runtime.export_state) keys a table by its module path in the model
(`<path>.weight` [R, D], `<path>.optimizer_state` [R, K]) and says which paths are tables under
"tables" ({path: table name}). TorchRec's EmbeddingBagCollection keys its tables
`embedding_bags.<table name>.weight`. The torchrec format is one flat state dict:

    {"embedding_bags.<name>.weight": [R, D] for each table,
     "<dense parameter path>": tensor for each dense parameter and buffer}

so `ebc.load_state_dict({k: v for k, v in sd.items() if k.startswith("embedding_bags.")})` loads
the tables into an EmbeddingBagCollection of the same configs, and the rest are the dense weights.
Optimizer state has no place in it (TorchRec keeps it in its fused optimizer): export the native
format to keep it.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

TORCHREC_PREFIX = "embedding_bags."
# where our DLRM keeps its collection: a torchrec-format table lands here on import
DLRM_COLLECTION = "embedding_bag_collection"


def to_torchrec(export: dict) -> dict[str, torch.Tensor]:
    """Our export (runtime.export_state) as a TorchRec-style flat state dict (module docstring)."""
    tables = export.get("tables")
    if not isinstance(tables, dict):
        raise ConfigError("the export names no tables (written by an older cxltrain): export the pool again")
    table_keys = {}
    for path, name in tables.items():
        prefix = f"{path}." if path else ""
        table_keys[f"{prefix}weight"] = f"{TORCHREC_PREFIX}{name}.weight"
        table_keys[f"{prefix}optimizer_state"] = None  # TorchRec's EBC state holds no optimizer state
    out = {}
    for key, tensor in export["model"].items():
        if key in table_keys:
            if table_keys[key] is not None:
                out[table_keys[key]] = tensor
        elif key.startswith(TORCHREC_PREFIX):
            raise ConfigError(f"dense key {key!r} collides with TorchRec's table keys")
        else:
            out[key] = tensor
    return out


def from_torchrec(state: dict, collection_path: str = DLRM_COLLECTION) -> dict:
    """A TorchRec-style flat state dict (EBC tables plus dense weights) as our export's layout, its
    tables placed at `<collection_path>.embedding_bags.<name>` (our DLRM's paths), batch 0, no
    optimizer state."""
    model, tables = {}, {}
    for key, tensor in state.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"not a state dict: entry {key!r} is a {type(tensor).__name__}")
        if key.startswith(TORCHREC_PREFIX):
            name, _, leaf = key[len(TORCHREC_PREFIX):].partition(".")
            if leaf != "weight" or not name:
                raise ConfigError(f"unexpected TorchRec table key {key!r} (want embedding_bags.<table>.weight)")
            path = f"{collection_path}.{TORCHREC_PREFIX}{name}" if collection_path else f"{TORCHREC_PREFIX}{name}"
            tables[path] = name
            model[f"{path}.weight"] = tensor
        else:
            model[key] = tensor
    if not tables:
        raise ConfigError("no embedding_bags.<table>.weight keys: not a TorchRec EmbeddingBagCollection state dict")
    return {"batch": 0, "model": model, "optimizers": [], "schedulers": [], "tables": tables, "metadata": {}}


def torchrec_interaction_order(num_features: int) -> torch.Tensor:
    """order [(F+1)F/2]: TorchRec DLRM's interaction column k is our DLRM's column order[k].

    Ours keeps the lower triangle of the [F+1, F+1] dot products row-major (tril, offset -1),
    TorchRec's the upper triangle row-major (triu, offset 1); (i, j) and (j, i) hold the same dot."""
    vectors = num_features + 1
    ours = torch.tril_indices(vectors, vectors, offset=-1)
    position = {(int(i), int(j)): k for k, (i, j) in enumerate(ours.t())}
    theirs = torch.triu_indices(vectors, vectors, offset=1)
    return torch.tensor([position[(int(j), int(i))] for i, j in theirs.t()], dtype=torch.int64)
