"""Scale-out on torch.distributed (docs/distributed.md, DESIGN §8): tables sharded over ranks, each
rank's shards in its own pool under one directory, one recovery point G for every rank.

    plan.py       which rank holds which table or rows (table-wise, row-wise, data-parallel)
    manifest.py   the directory: one pool per rank and the manifest naming plan, world size and run
    shards.py     the local model of one rank: its table shards and the (replicated) dense part
    exchange.py   the step's all-to-alls: ids to their owners, pooled embeddings back, gradients back
    recovery.py   agreeing on G and rolling every rank back to it (online, and offline for `recover DIR`)
    runtime.py    DistRuntime: the Runtime of one rank, keeping undo records back to the agreed G
    group.py      TorchrunRuntime: a user's own model under torchrun (joins the group, agrees per batch)
    train.py      the job of one rank under torchrun, and the `--nproc-per-node` launcher
    reshard.py    export of a directory to one state dict, import of one onto any world size
    bench.py      step time, strict vs off, bytes exchanged, group recovery time
"""
