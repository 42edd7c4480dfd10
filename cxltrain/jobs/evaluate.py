"""`cxltrain eval POOL --data PATH`: AUC and log loss of a pool's committed model; never writes it.

The pool is opened read-only (a read-only mapping: a store into it would fault, not land), the
tables are viewed in place, the dense state comes from the committed snapshot, and the data is
read with the settings the pool's run stored (batch size, tables, rows, seed). A pool whose last
batch must be rolled back first is refused: recovery writes, and evaluation does not.
"""

from __future__ import annotations

import warnings

from ..checkpoint import pending, pending_words, verify
from ..checkpoint.seam import dense_only
from ..data.files import open_criteo
from ..errors import ConfigError
from ..kernels.cpu_threads import resolve_vml_dispatch
from ..pool.handle import Pool
from ..tables import cache as hot_cache
from .config import TrainConfig
from .train import build_model, evaluate


def evaluate_pool(pool_path: str, data_path: str, batches: int | None = None) -> dict:
    """{"batch", "auc", "logloss", "batches", "samples", "which"} of the pool's model on the data's
    last `batches` batches, or with None on the batches its run never trained on (held_out)."""
    resolve_vml_dispatch()  # the figures the same every time: the forward's first VML call never splits badly
    with Pool.open(pool_path, writable=False) as pool:
        live, snapshot = verify(pool)
        if pending(live, pool.root.batches_done):
            raise ConfigError(f"{pool_path}: {pending_words(live, pool.root.batches_done)} first; run `cxltrain recover "
                              f"{pool_path}` (eval opens a pool read-only and never writes it)")
        config = _config_of(pool_path, snapshot.get("metadata"))
        model = build_model(config)
        with dense_only():   # the snapshot holds the dense state; the tables are the pool's, viewed below
            model.load_state_dict(snapshot["model"])
        with warnings.catch_warnings():   # torch warns that the read-only mapping is not writable: intended
            warnings.simplefilter("ignore", UserWarning)
            for module_path in snapshot["tables"]:
                table = model.get_submodule(module_path)
                table.attach(pool)   # existing regions: viewed, nothing written
                if hot_cache.cached_slots(pool, table.name):  # its cached rows are read from the cache
                    table.cache = hot_cache.HotRowCache(table, pool)
        source = open_criteo(data_path, batch_size=config.batch_size, rows=config.rows_per_table(),
                             num_tables=config.num_tables, seed=config.seed)
        n = source.num_batches
        if batches is not None:
            indices, which = range(n - min(batches, n), n), f"the last {min(batches, n)}"
        else:
            indices, which = held_out(source, snapshot["metadata"], pool.root.batches_done)
            if not indices:
                raise ConfigError(f"{pool_path}: its run trained on every batch of {data_path}, so none is held out; "
                                  "give --batches N to evaluate on the last N anyway (training batches)")
        auc, loss = evaluate(model, source, indices)
        return {"pool": pool_path, "batch": pool.root.batches_done, "auc": auc, "logloss": loss,
                "batches": len(indices), "samples": len(indices) * config.batch_size, "which": which}


def held_out(source, metadata: dict, done: int) -> tuple[range, str]:
    """(the batches of `source` the pool's run never trained on, which they are, in words): all of
    them for data it did not train on (another fingerprint); the last `eval_batches` where it held
    those out (--epochs, --eval-every: jobs/data_source.py); else those after its `done` batches."""
    n = source.num_batches
    if metadata.get("data") is None or metadata["data"] != getattr(source, "fingerprint", None):
        return range(n), "all (not the run's training data)"
    if "eval_batches" in metadata:
        k = min(int(metadata["eval_batches"]), n)
        return range(n - k, n), f"the {k} the run held out"
    return range(min(done, n), n), f"those after the {done} the run trained on"


def _config_of(pool_path: str, metadata: dict | None) -> TrainConfig:
    """The model and data settings the pool's run stored with its snapshot."""
    if not metadata or any(name not in metadata for name in ("batch_size", "num_tables", "rows", "dim", "seed")):
        raise ConfigError(f"{pool_path}: holds no `cxltrain train` settings (made by another program?), so eval "
                          "cannot tell which model and data settings to use")
    fields = {name: metadata[name] for name in TrainConfig.TRAJECTORY if name in metadata and name != "data"}
    for name in ("bottom_mlp", "top_mlp"):
        if name in fields:
            fields[name] = tuple(fields[name])
    if "table_rows" in metadata:
        fields["table_rows"] = tuple(metadata["table_rows"])
    return TrainConfig(**fields)
