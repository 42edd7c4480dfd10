"""`cxltrain bench`: ours against the usual ways of checkpointing and of training embedding tables,
on the same model, data and machine.

Layer: above the trainer, beside the command line. Modules:
    methods.py    the checkpointing methods and what a crash loses under each (torch-free)
    plain.py      the plain-PyTorch DLRM baseline and its torch.save / DCP checkpoints
    embedding.py  lookup + update throughput: ours, nn.EmbeddingBag + torch optimizers, torchrec/FBGEMM
    bandwidth.py  memory copy bandwidth, the ceiling for row gathers
    paired.py     runs side by side in one process, in alternating blocks (the strict target's judge)
    interval.py   the bootstrap interval of a side-by-side ratio
    worker.py     one measurement in a fresh process; preload.py warms the fork server's imports
    records.py    typed records of what a job measured (and their JSON)
    results.py    the typed results of a whole run, as report.py and plot.py read them
    suite.py      runs every measurement, one after the other
    report.py     the text report and the targets;  plot.py  the plot
    dist.py       `cxltrain bench --dist` (dist_paired.py: one rank of its side-by-side runs)
    tiers.py      `cxltrain bench --tiers`: the fast tier, the capacity tier and the hot-row cache
    gpu.py        `cxltrain bench --gpu`: cxltrain's GPU placements against torch with its tables in GPU
                  memory (gpu_runs.py, the runs and their turns), and the gather bandwidth (gpu_gather.py)

The lab's instruments (the floors) are scripts in tools/ (tools/README.md);
nothing here imports them.
"""
