"""The checkpointing methods `cxltrain bench` compares, and what a crash costs under each.

Each method is one training run in its own process: either ours (`cxltrain.jobs.train.train` with
TrainConfig overrides) or plain PyTorch (`plain.py`: nn.EmbeddingBag(sparse=True) tables, the same
MLPs and data) with a checkpoint policy. Torch-free, so the command line starts fast.
"""

from __future__ import annotations

import dataclasses

from ..modes import OFF, RELAXED, UNDO


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    family: str                  # "ours" (trainer.train) or "plain" (plain.py)
    label: str                   # how the tables and the plot name it
    baseline: str                # the method its step-time ratio is taken against
    overrides: dict = dataclasses.field(default_factory=dict)  # ours: TrainConfig fields
    save: str = "none"           # plain: "none", "torch" (torch.save) or "dcp" (dcp.async_save)
    every: int = 1               # plain: a checkpoint every k batches

    def batches_lost(self, overlap_steps: int = 0) -> int | None:
        """The most batches a crash can undo (None: all of them, the run starts over).

        overlap_steps: for an asynchronous save, the most steps one save ran behind training; a
        crash before it completes falls back to the previous checkpoint.
        """
        if self.family == "ours":
            if self.overrides.get("checkpoint") == OFF:
                return None
            # strict: the batch in flight; relaxed: the dense state may be dense_every batches old
            return self.overrides.get("dense_every", 1) if self.overrides.get("mode") == RELAXED else 1
        if self.save == "none":
            return None
        return self.every + (overlap_steps if self.save == "dcp" else 0)


def step_methods(periods: tuple[int, int] = (1, 100)) -> list[Method]:
    """Every method, the plain-PyTorch checkpoints at both periods k (k = 1 and 100)."""
    ours = [Method("ours-off", "ours", "ours, no checkpoint", "ours-off", {"checkpoint": OFF}),
            Method("ours-strict", "ours", "ours, strict per-batch", "ours-off", {"checkpoint": UNDO}),
            Method("ours-relaxed", "ours", "ours, relaxed (dense every 100)", "ours-off",
                   {"checkpoint": UNDO, "mode": RELAXED, "dense_every": 100}),
            Method("ours-sync-undo", "ours", "ours, undo logging on the critical path", "ours-off",
                   {"checkpoint": UNDO, "pipeline": False}),
            Method("ours-strict-bgcap", "ours", "ours, strict, capture+flush on the worker", "ours-off",
                   {"checkpoint": UNDO, "background_capture": True})]
    plain = [Method("plain", "plain", "PyTorch, no checkpoint", "plain")]
    for save, label in (("torch", "torch.save"), ("dcp", "dcp.async_save")):
        plain += [Method(f"plain-{save}-{k}", "plain", f"PyTorch, {label} every {k}", "plain", save=save, every=k)
                  for k in periods]
    return ours + plain
