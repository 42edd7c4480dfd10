"""The runtime: open or create a pool (set), attach tables and dense modules, recover, drive the
checkpointer at batch boundaries; one process or a group of ranks.

    runtime.py          `Runtime`
    tiers.py            a Runtime's pool set: capacity pools beside the primary (docs/tiers.md)
    interop.py          exports to and from TorchRec's key names
    state_import.py     a pool built from an exported state dict
    group.py            joining a torch.distributed group; agreeing on the recovery target G
    group_runtime.py    the Runtime of one rank in a group
    group_recovery.py   rolling every rank back to G
    manifest.py         a run folder's manifest (plan, world size, run id)
"""
