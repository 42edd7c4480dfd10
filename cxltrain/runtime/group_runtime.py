"""DistRuntime: the `Runtime` of one rank of a distributed run (DESIGN §8).

    recover_group(directory, rank, world_size, run_id)      # every rank: agree on G, roll back to it
    with DistRuntime(pool_path(directory, rank), model, dense_opt, run_metadata={...}) as rt:
        for batch in rt.batches(source, stop=steps):
            embedded, agreed = exchange.forward(local_slice(batch), rt.durable_target)
            rt.agree(agreed)                                 # the step's all-reduce MIN: G
            ...

It is a Runtime whose commits keep the undo records of every batch at or above the last agreed
target G (U3b), and whose dense snapshots carry that G in their metadata (as "agreed"), so that
recovery can tell whether a rank's ring still reaches a G a restart agrees on. Its metadata also
names the run and the rank; recover_group checks them (the Runtime's own metadata check is off,
since "agreed" moves).
"""

from __future__ import annotations

from .runtime import Runtime


class DistRuntime(Runtime):
    """Runtime(pool, model, optimizers, **kwargs) for one rank; run_metadata: {"run": id, "rank": r,
    ...}, stored with every snapshot beside the agreed target."""

    def __init__(self, pool, model, optimizers=None, *, run_metadata: dict, **kwargs) -> None:
        super().__init__(pool, model, optimizers, metadata=None, **kwargs)
        self._state.metadata = {**run_metadata, "agreed": 0}

    def __enter__(self) -> "DistRuntime":
        super().__enter__()
        self.agree(self.start_batch)  # recover_group left every rank here
        return self

    @property
    def durable_target(self) -> int:
        """The batch this rank's durable root names (what it offers to the agreement)."""
        return self._guard.durable

    def agree(self, target: int) -> None:
        """G agreed by every rank: commits handed over from now on keep records of batches >= G."""
        self._state.metadata["agreed"] = target
        self._guard.agree(target)
