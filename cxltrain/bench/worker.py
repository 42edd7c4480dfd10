"""One benchmark job in a fresh process: `python -m cxltrain.bench.worker '<job json>'`.

Every measurement runs in its own process, so no method inherits another's page cache, allocator
state or threads. The job's result is the last stdout line, a JSON object; a job that fails exits
non-zero with its error on stderr.

Jobs ("job" names one; "config" is a TrainConfig as a dict):
    ours-steps   {config, pool}                          cxltrain.jobs.train.train: step ms, checkpoint stats
    ours-crash   {config, pool}                          the same, run under CXLTRAIN_CRASH_AT (dies)
    ours-paired  {config, overrides, pools, warmup, blocks, block_steps}   paired.paired_steps: config
                 with checkpoints off against config with overrides, in alternating blocks
    plain-steps  {config, save, every, path, warmup, timed}   plain.train_steps
    plain-save   {config, torch_path, dcp_path, steps}   train a few steps, then torch.save and dcp.save
    torch-load   {config, path}  dcp-load {config, path}  read a full checkpoint back into a model
    nothing      {}                                      imports what a load imports, loads nothing
    embedding    {config, contender, optimizer, pool, warmup, timed}
    bandwidth    {config, nbytes}
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import warnings

import torch

from ..jobs.config import TrainConfig
from ..jobs.train import build_source
from ..kernels.cpu_threads import set_cpu_threads
from ..knobs import KNOBS
from ..modes import OFF
from . import plain
from .records import LoadTime, OursSteps, Record, SavedCheckpoint, Unmeasured


@dataclasses.dataclass
class NothingLoaded(Record):
    """The `nothing` job's result: only its process's wall time counts."""


def config_to_json(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_json(fields: dict) -> TrainConfig:
    """TrainConfig from config_to_json (tuples come back from JSON as lists)."""
    return TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _ours_steps(config: TrainConfig, pool: str) -> OursSteps:
    from ..jobs.train import build_model, train

    try:
        result = train(config, pool_path=pool, progress=False)
    finally:
        plain.remove(pool)
    # bytes a commit flushes per updated row: the padded weight row and its optimizer state
    table = build_model(dataclasses.replace(config, num_tables=1, rows=1)).tables[0]
    row_bytes = sum(spec.nbytes(KNOBS.row_align) for spec in table.region_specs())
    return OursSteps(mean_ms=result.timings.split_ms.total, split_ms=dataclasses.asdict(result.timings.split_ms),
                     checkpoint_stats=result.checkpoint.stats, row_bytes=row_bytes, timed_steps=result.progress.steps)


def _plain_save(config: TrainConfig, torch_path: str, dcp_path: str, steps: int) -> SavedCheckpoint:
    import torch.distributed.checkpoint as dcp

    model = plain.plain_model(config)
    opts = plain.optimizers(model, config)
    source = build_source(config)
    for b in range(steps):  # so the optimizers have state to save
        model.loss(source.batch(b)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    started = time.perf_counter()
    torch.save(plain.full_state(model, opts), torch_path)
    torch_seconds = time.perf_counter() - started
    started = time.perf_counter()
    dcp.save(plain.dcp_state(model, opts), checkpoint_id=dcp_path)
    return SavedCheckpoint(state_bytes=plain.state_bytes(plain.full_state(model, opts)),
                           torch_save_seconds=torch_seconds, dcp_save_seconds=time.perf_counter() - started)


def _load(config: TrainConfig, path: str, load) -> LoadTime:
    started = time.perf_counter()
    model = plain.plain_model(config, initialize=False)
    opts = plain.optimizers(model, config)
    load(model, opts, path)
    return LoadTime(seconds=time.perf_counter() - started)


def run_job(job: dict) -> Record:
    """Run one job; its record's to_json() is what reaches the suite."""
    set_cpu_threads(KNOBS.threads)
    kind = job["job"]
    config = config_from_json(job["config"]) if "config" in job else None
    if kind in ("ours-steps", "ours-crash"):
        return _ours_steps(config, job["pool"])
    if kind == "ours-paired":
        from .paired import paired_steps

        try:
            return paired_steps(dataclasses.replace(config, checkpoint=OFF),
                                dataclasses.replace(config, **job["overrides"]), tuple(job["pools"]),
                                warmup=job["warmup"], blocks=job["blocks"], block_steps=job["block_steps"])
        finally:
            for pool in job["pools"]:
                plain.remove(pool)
    if kind == "plain-steps":
        return plain.train_steps(config, save=job["save"], every=job["every"], path=job["path"],
                                 warmup=job["warmup"], timed=job["timed"])
    if kind == "plain-save":
        return _plain_save(config, job["torch_path"], job["dcp_path"], job["steps"])
    if kind == "torch-load":
        return _load(config, job["path"], plain.load_torch_state)
    if kind == "dcp-load":
        return _load(config, job["path"], plain.load_dcp_state)
    if kind == "nothing":
        return NothingLoaded()
    if kind == "embedding":
        from .embedding import measure, torchrec_missing

        missing = torchrec_missing() if job["contender"] == "torchrec" else None
        if missing:
            return Unmeasured(missing)
        return measure(job["contender"], job["optimizer"], config, pool_path=job["pool"],
                       warmup=job["warmup"], timed=job["timed"])
    if kind == "bandwidth":
        from .bandwidth import measure_bandwidth

        return measure_bandwidth(config, job["nbytes"], KNOBS.threads)
    raise ValueError(f"unknown bench job {kind!r}")


def quiet_library_warnings() -> None:
    """Keep the baselines' own chatter (DCP without a process group, torchrec's FX notice) out of
    the bench's output; errors still reach stderr."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.(distributed|optim|sparse)")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def warm_imports() -> None:
    """Import now what jobs would import lazily (DCP; torch._dynamo, which the first torch optimizer
    pulls in; torchrec where installed): the fork server runs this once, instead of every job
    paying seconds of imports inside its measurement."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed.checkpoint import state_dict  # noqa: F401

    from .embedding import torchrec_missing

    torchrec_missing()


quiet_library_warnings()


def main(argv: list[str]) -> int:
    result = run_job(json.loads(argv[0]))
    print(json.dumps(result.to_json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
