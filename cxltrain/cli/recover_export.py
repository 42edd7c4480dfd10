"""`cxltrain recover`, `export` and `import`: a pool's committed state, out and in."""

from __future__ import annotations

import dataclasses
import json
import os

from ..errors import CxlTrainError
from ..runtime import manifest as run_dir
from . import dist as dist_cli


def add_recover_export(sub) -> None:
    r = sub.add_parser("recover", help="roll a pool back to its last committed batch",
                       description="Roll a pool back to its last committed batch (what `train` does on start), "
                                   "and report it.")
    r.add_argument("path")
    r.add_argument("--capacity-pool", metavar="NEW", default=None,
                   help="a pool set whose capacity pool was moved: its new place, checked by UUID and recorded "
                        "in the primary first (docs/tiers.md, Moving a capacity pool)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(run=_run_recover)
    e = sub.add_parser("export", help="write the recovered model as a plain torch state dict",
                       description="Recover a pool and write its model as a plain state dict: every table's "
                                   "weights and optimizer state, the dense parameters and optimizer state, and "
                                   "the committed batch under \"batch\". Read it with torch.load(OUT, "
                                   "weights_only=True).")
    e.add_argument("path")
    e.add_argument("out", help="output file (.pt), or with --format dcp a folder; must not exist")
    e.add_argument("--format", choices=("cxltrain", "torchrec", "dcp"), default="cxltrain",
                   help="torchrec: one flat state dict, tables keyed embedding_bags.<table>.weight as in TorchRec's "
                        "EmbeddingBagCollection, plus the dense weights; no optimizer state. dcp: a "
                        "torch.distributed.checkpoint folder under TorchRec's keys, optimizer state included, "
                        "that dcp.load reads on any world size (docs/torchrec.md)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=_run_export)


def add_import(sub) -> None:
    i = sub.add_parser("import", help="build a new pool from an export (ours, or a TorchRec EBC state dict)",
                       description="Build the pool PATH (which must not exist) from OUT.pt: an export of cxltrain (any "
                                   "format), a TorchRec EmbeddingBagCollection state dict plus dense weights, or a "
                                   "DCP checkpoint folder of either. "
                                   "The pool is committed at the export's batch; a Runtime or `cxltrain train` "
                                   "with the same options resumes it there (docs/torchrec.md). With --nproc-per-node N, "
                                   "PATH is a distributed run's directory instead, the tables re-sharded onto N "
                                   "ranks (docs/distributed.md).")
    i.add_argument("source", metavar="OUT.pt", help="an export file, or a DCP checkpoint folder (TorchRec's keys)")
    i.add_argument("path", metavar="PATH", help="the new pool, or with --nproc-per-node the new run's directory "
                                                "(must not exist)")
    i.add_argument("--sparse-optimizer", choices=("adagrad", "sgd"), default="adagrad",
                   help="the tables' optimizer when the export holds no optimizer state (TorchRec's): its state "
                        "columns start at their initial value (default adagrad)")
    i.add_argument("--json", action="store_true")
    dist_cli.add_import_options(i)
    i.set_defaults(run=_run_import)


def _run_import(args) -> int:
    if args.nproc_per_node is not None:
        return dist_cli.run_import(args)
    from ..runtime.state_import import import_file

    report = import_file(args.source, args.path, state_columns=1 if args.sparse_optimizer == "adagrad" else 0)
    print(f"imported {args.source} ({report.source} format) into {report.path}: {len(report.tables)} tables, "
          f"committed at batch {report.batch}")
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    return 0


def _run_recover(args) -> int:
    from ..checkpoint.offline import process_seconds, recover_pool  # no torch: recovery copies bytes

    if run_dir.is_run_dir(args.path):
        if args.capacity_pool is not None:
            raise CxlTrainError(f"{args.path}: is a run directory; --capacity-pool re-points a pool set "
                                "(a distributed run's pools have no capacity pool)")
        return dist_cli.run_recover(args.path, args.json)
    if args.capacity_pool is not None:
        from ..pool.repoint import repoint

        said = repoint(args.path, args.capacity_pool)
        if said is not None:
            print(said, flush=True)
    _refuse_rank_pool(args.path)
    report = recover_pool(args.path)
    process = process_seconds()
    print(report.describe(args.path, report.seconds)
          + ("" if process is None else f"; {process:.2f} s since the process started"))
    if args.json:
        print(json.dumps({**report.to_json(), "process_seconds": process}))
    return 0


def _refuse_rank_pool(path: str) -> None:
    """A rank's pool of a distributed run is recovered with its run (`cxltrain recover DIR`): alone,
    to its own batch, its ring would start a new generation and hold nothing to roll it back to a
    lower batch the ranks agree on (docs/distributed.md)."""
    from ..pool.format import INCOMPAT_DENSE_SLICES
    from ..pool.handle import Pool

    directory = os.path.dirname(os.path.abspath(path))
    if not run_dir.is_run_dir(directory):
        return
    with Pool.open(path, writable=False) as pool:
        if pool.superblock.incompat & INCOMPAT_DENSE_SLICES:
            raise CxlTrainError(f"{path}: is one rank's pool of the distributed run in {directory}; recover the run "
                                f"(`cxltrain recover {directory}`): a rank recovered alone could no longer be "
                                "rolled back to the batch the ranks agree on")


def _run_export(args) -> int:
    from ..runtime.runtime import open_export

    if os.path.exists(args.out):
        raise CxlTrainError(f"{args.out}: already exists; not overwriting it")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.access(folder, os.W_OK | os.X_OK):  # before recovery writes to the pool
        raise CxlTrainError(f"{args.out}: cannot write into {folder}")
    save = {"dcp": _save_dcp, "torchrec": _save_torchrec}.get(args.format, _save_export)
    if run_dir.is_run_dir(args.path):
        return dist_cli.run_export(args.path, args.out, save, args.json)
    with open_export(args.path) as state:  # the tables are read from the pool as they are written
        save(state, args.out)
    tensors = len(state["model"])
    print(f"exported {args.path} at batch {state['batch']} to {args.out} ({tensors} model tensors)")
    if args.json:
        print(json.dumps({"path": args.path, "out": args.out, "batch": state["batch"]}))
    return 0


def _save_dcp(state: dict, out: str) -> None:
    """Our export (tables streamed) as the DCP checkpoint folder `out` (runtime/dcp.py)."""
    from ..runtime import dcp

    dcp.save(dcp.to_dcp(state), out)


def _save_torchrec(state: dict, out: str) -> None:
    """Our export as a TorchRec-style flat state dict (runtime/interop.py), saved as _save_export does."""
    from ..runtime.interop import to_torchrec

    _save_export(to_torchrec(state), out)


def _save_export(state: dict, out: str) -> None:
    """torch.save (streamed: tables a chunk at a time) into a file of this run's own beside OUT,
    linked to OUT once whole: OUT is never half-written, never overwritten, and the temporary file
    goes on every exit (a full disk, Ctrl-C)."""
    import tempfile

    from ..runtime import streamed_save

    folder = os.path.dirname(os.path.abspath(out))
    try:
        fd, partial = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".partial", dir=folder)
    except OSError as e:
        raise CxlTrainError(f"{out}: cannot write: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w+b") as f:
            streamed_save.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.link(partial, out)  # unlike a rename, never replaces an OUT that appeared meanwhile
    except FileExistsError:
        raise CxlTrainError(f"{out}: already exists; not overwriting it") from None
    except OSError as e:
        raise CxlTrainError(f"{out}: cannot write: {e.strerror}") from None
    except RuntimeError:  # torch's zip writer reports a short write as an "enforce fail", errno lost
        from ..emulation.cxl import free_bytes

        raise CxlTrainError(f"{out}: cannot write: the write failed part-way (is the disk full? "
                            f"{free_bytes(folder):,} bytes free in {folder})") from None
    finally:
        os.unlink(partial)
