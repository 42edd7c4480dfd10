"""Jobs: the training loop, evaluation, the crash torture, and the run's configuration.

    config.py            `TrainConfig`, the `train` job's settings
    train.py             the training job on one process
    sharded_train.py     the training job of one rank of a group
    sharded_settings.py  a group's settings and plan from a TrainConfig
    reshard.py           a run folder exported to one state dict, and imported onto any world size
    data_source.py       the job's batches from a TrainConfig (synthetic or Criteo files)
    planning.py          profiling the job's data and planning its tiers
    evaluate.py          `cxltrain eval`
    metrics_log.py       the `--metrics` file
    crashtest.py         `cxltrain crashtest`: kill-and-recover torture
"""
