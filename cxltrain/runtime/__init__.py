"""The runtime: open or create a pool (set), attach tables and dense modules, recover, drive the
checkpointer at batch boundaries; one process or a group of ranks.

    runtime.py          `Runtime`
    recovery_point.py   where a Runtime resumes: its own durable batch, or a group's agreed G
    tiers.py            a Runtime's pool set: capacity pools beside the primary (docs/tiers.md)
    interop.py          exports to and from TorchRec's key names
    state_import.py     a pool built from an exported state dict
    group.py            joining a torch.distributed group; TorchrunRuntime, a rank's Runtime for your own loop
    group_recovery.py   rolling every rank back to G
    manifest.py         a run folder's manifest (plan, world size, run id)
"""
