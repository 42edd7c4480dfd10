"""A group whose ranks keep their tables in pool sets, for tests/test_dist_sets.py:

    torchrun --standalone --nproc-per-node 2 tests/dist_set_train.py DIR DISK STEPS

docs/distributed.md's own-loop example, with each rank's tables (its own, table-wise, and a small
one copied on every rank) in a capacity pool DISK/rank-<r>.cap beside its primary DIR/rank-<r>.pool.
The set steals by default (the write_back_every knob: CXLTRAIN_WRITE_BACK_EVERY).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from cxltrain import PersistentEmbeddingBag
from cxltrain.runtime.group import TorchrunRuntime, join_group

ROWS, DIM, BATCH, BAG = 1000, 8, 64, 3


class Model(nn.Module):
    def __init__(self, rank: int, world_size: int):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.own = PersistentEmbeddingBag(ROWS, DIM, name=f"t{rank}", seed=rank)
        self.small = PersistentEmbeddingBag(16, DIM, name="small", seed=99)
        self.head = nn.Linear((world_size + 1) * DIM, 1)

    def loss(self, batch):
        ids, small_ids, labels = batch
        own = self.own(ids[self.rank])                     # [BATCH, DIM]
        pooled = [torch.empty_like(own) for _ in range(self.world_size)]
        dist.all_gather(pooled, own.detach())
        pooled[self.rank] = own
        logits = self.head(torch.cat([*pooled, self.small(small_ids)], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def batch(b: int):
    """Batch b, the same on every rank and after every restart."""
    g = torch.Generator().manual_seed(b)
    ids = torch.randint(ROWS, (dist.get_world_size(), BATCH, BAG), generator=g)
    return ids, torch.randint(16, (BATCH, BAG), generator=g), torch.randint(2, (BATCH,), generator=g).float()


if __name__ == "__main__":
    directory, disk, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank, world_size = join_group(timeout_s=30)
    torch.manual_seed(0)
    model = Model(rank, world_size)
    opt = torch.optim.Adam(model.head.parameters(), lr=0.01)
    with TorchrunRuntime(directory, model, opt, settings={"rows": ROWS}, rows_per_batch=BATCH * BAG,
                         capacity_pool=os.path.join(disk, f"rank-{rank}.cap")) as rt:
        recovered = rt.recovery_point.recovered
        print(f"rank {rank}: from batch {rt.start_batch}, write-back every {rt.checkpoint_options.write_back_every}"
              + (f" (its pool was at batch {recovered.target})" if recovered else ""), flush=True)
        for b in rt.batches(batch, stop=steps):
            model.loss(b).backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()
