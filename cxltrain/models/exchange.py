"""The step's exchanges (docs/distributed.md, The step): ids to the ranks that hold their rows, pooled embeddings back,
gradients to the owners in backward. Every one is an `all_to_all_single` over gloo (NCCL where
there are GPUs), in table order, summed in rank order: deterministic for a given world size.

Per step, with B samples in the global batch, B_r of them on rank r (its slice), D dims:

    1  counts    [W, 2] int64: the length of the id message for each rank, and this rank's durable
                 recovery target, piggy-backed: every rank's comes back, from which the step's
                 recovery point makes the agreed target G (runtime/recovery_point.py agree_on_g)
    2  ids       per owner, for each table it holds: the slice's bag lengths [B_r] and ids (row-wise:
                 only those in the owner's rows, made local to them)
    3  pooled    each owner looks its tables up for the whole batch ([B, D], one fused lookup), then
                 sends rank r its rows [B_r, D]; a row-wise table's partial sums are added up by the
                 receiver in rank order (the reduce-scatter, done as an all-to-all plus a fixed-order
                 sum: deterministic, and gloo has no reduce-scatter); a data-parallel table is looked
                 up on every rank, which keeps its own rows
    back         the gradients [B_r, D] go to every rank holding the table (1/W each: the loss is a
                 mean over the slice, DDP averages the dense gradients over the ranks) and each owner
                 applies its fused update to its rows, for the whole batch at once

`bytes_sent` counts what left this rank for another (never what it sent itself).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..data.batch import Batch
from ..placement.sharding import DATA_PARALLEL, ROW_WISE, ShardingPlan
from .sharded import RankModel


class Comm:
    """The process group of a run, and the bytes this rank sent to others."""

    def __init__(self, rank: int, world_size: int, group=None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.bytes_sent = 0

    def all_to_all(self, pieces: list[torch.Tensor], receive: list[int]) -> list[torch.Tensor]:
        """Send pieces[r] (flat) to rank r; returns what each rank sent here (receive[r] elements)."""
        send = torch.cat(pieces) if pieces else torch.empty(0)
        out = torch.empty(sum(receive), dtype=send.dtype)
        dist.all_to_all_single(out, send, receive, [p.numel() for p in pieces], group=self.group)
        self.bytes_sent += sum(p.numel() for r, p in enumerate(pieces) if r != self.rank) * send.element_size()
        return list(out.split(receive))

    def ordered_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x [H, D] (float), the same bits on every rank and every run:
        rank c sums the c-th chunk of rows (chunk_bounds) from every rank in rank order (a
        reduce-scatter as an all-to-all: sum_in_rank_order), then sends its sum to every rank
        (gather_chunks). A ring all-reduce would add each element in an order that depends on its
        position. The replicated step (replicated.py) sums its rows the same way, by owner, and
        sends the sums with its next step's rows; the link probe (jobs/replication.py) times this."""
        if self.world_size == 1:
            return x.clone()
        bounds = chunk_bounds(x.shape[0], self.world_size)
        mine = (bounds[self.rank + 1] - bounds[self.rank]) * x.shape[1]
        parts = self.all_to_all([x[bounds[c] : bounds[c + 1]].reshape(-1) for c in range(self.world_size)],
                                [mine] * self.world_size)
        return self.gather_chunks(sum_in_rank_order(parts), x.shape[0], x.shape[1])

    def gather_chunks(self, chunk: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        """Every rank's chunk (rank c: rows chunk_bounds[c:c+2] of [rows, dim]) on every rank."""
        bounds = chunk_bounds(rows, self.world_size)
        sizes = [(bounds[c + 1] - bounds[c]) * dim for c in range(self.world_size)]
        return torch.cat(self.all_to_all([chunk.reshape(-1)] * self.world_size, sizes)).view(rows, dim)


def chunk_bounds(rows: int, world_size: int) -> list[int]:
    """Row c of the result starts rank c's chunk of a [rows, D] reduction; the last entry is rows."""
    return [rows * c // world_size for c in range(world_size + 1)]


def sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def slice_of(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Samples [lo, hi) of a global batch that `rank` trains on (equal slices)."""
    per = batch_size // world_size
    return rank * per, (rank + 1) * per


def local_slice(batch: Batch, world_size: int, rank: int) -> Batch:
    """This rank's samples of the global batch (a real loader would read only these)."""
    lo, hi = slice_of(batch.size, world_size, rank)
    values, offsets = [], []
    for v, o in zip(batch.values, batch.offsets):
        ends = torch.cat([o, torch.tensor([v.numel()])])
        values.append(v[ends[lo] : ends[hi]])
        offsets.append(o[lo:hi] - ends[lo])
    return Batch(batch.index, batch.dense[lo:hi], tuple(values), tuple(offsets), batch.labels[lo:hi])


class SparseExchange:
    """The sparse half of a step for one rank: `forward(batch_slice, target)` returns the
    embeddings of every table for this rank's samples (F x [B_r, D]) and every rank's `target`, in
    rank order, carried in the id exchange's header (what G is made of: runtime/recovery_point.py;
    the exchange only carries them)."""

    def __init__(self, plan: ShardingPlan, model: RankModel, comm: Comm, batch_size: int) -> None:
        self.plan, self.model, self.comm = plan, model, comm
        self.slices = [slice_of(batch_size, comm.world_size, r) for r in range(comm.world_size)]
        self.dim = model.dense.embedding_dim
        self.lengths_seen: dict[int, list[torch.Tensor]] = {}
        self._served: dict[tuple[int, int], torch.Tensor] = {}  # served's answers for this batch's lookup
        # per table: its holders get distinct ids, a bag of one each (replicated.py), or bags (here always)
        self.unique: tuple[bool, ...] = tuple(False for _ in plan.tables)

    def forward(self, local: Batch, target: int) -> tuple[list[torch.Tensor], list[int]]:
        comm, plan = self.comm, self.plan
        messages = []
        for owner in range(comm.world_size):
            parts = []
            for t in range(len(plan.tables)):
                if owner in plan.owners(t):
                    lengths, ids = _bags_for(plan, t, owner, local.values[t], local.offsets[t])
                    parts += [lengths, ids]
            messages.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64))
        header = torch.tensor([[m.numel(), target] for m in messages], dtype=torch.int64)
        received_header = torch.cat(comm.all_to_all(list(header), [2] * comm.world_size)).view(-1, 2)
        targets = received_header[:, 1].tolist()
        received = comm.all_to_all(messages, received_header[:, 0].tolist())
        pooled = self._look_up(received)
        return list(_Exchange.apply(self, *pooled)), targets

    def _look_up(self, received: list[torch.Tensor], own: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Each held table looked up for the whole batch, in table order: [B, D] per table of bags
        (every source's B_r bag lengths, then the ids), [U, D] per table of unique rows (every
        source's count U_r, then its U_r distinct ids, each a bag of its own: served says which
        rows answer which source); then own[t] (local ids [O]), a bag of one each, the last O rows:
        rows whose gradient the exchange's backward brings, taken by the table's one update."""
        cursors = [0] * len(received)
        pooled = []
        self._served = {}
        for t in self.model.table_index:
            ids, lengths = [], []
            for source, message in enumerate(received):
                at = cursors[source]
                if self.unique[t]:
                    count = int(message[at])
                    bag_lengths, at = torch.ones(count, dtype=torch.int64), at + 1
                else:
                    lo, hi = self.slices[source]
                    bag_lengths = message[at : at + hi - lo]
                    count, at = int(bag_lengths.sum()), at + hi - lo
                ids.append(message[at : at + count])
                lengths.append(bag_lengths)
                cursors[source] = at + count
            self.lengths_seen[t] = lengths  # per source: which bags held ids of t (replicated.py)
            if own and t in own:
                ids.append(own[t])
                lengths = [*lengths, torch.ones(own[t].numel(), dtype=torch.int64)]
            # no id at all: one empty bag, as a lookup needs an offset
            all_lengths = torch.cat(lengths) if any(x.numel() for x in lengths) else torch.zeros(1, dtype=torch.int64)
            offsets = torch.cumsum(all_lengths, 0) - all_lengths
            pooled.append(self.model.shard(t)(torch.cat(ids), offsets))
        return pooled

    def served(self, t: int, source: int) -> torch.Tensor:
        """The rows of held table t's lookup (_look_up) that answer `source`: the bags of its slice
        that sent ids of t, or one row per distinct id it asked for."""
        if (t, source) not in self._served:  # asked for in forward and twice in backward
            lengths = self.lengths_seen[t]
            start = sum(x.numel() for x in lengths[:source])
            self._served[t, source] = start + torch.nonzero(lengths[source]).view(-1)
        return self._served[t, source]


def _bags_for(plan: ShardingPlan, t: int, owner: int, values: torch.Tensor,
              offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bag lengths [B_r], ids) of table t's lookups that `owner` serves, ids local to its rows."""
    ends = torch.cat([offsets, torch.tensor([values.numel()])])
    if plan.tables[t].kind != ROW_WISE:
        return ends[1:] - ends[:-1], values
    lo, hi = plan.rows_of(t, owner)
    mine = (values >= lo) & (values < hi)
    counted = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(mine.to(torch.int64), 0)])
    return counted[ends[1:]] - counted[ends[:-1]], values[mine] - lo


class _Exchange(torch.autograd.Function):
    """pooled (held tables, [B, D] each) -> embeddings of every table for this rank's slice
    ([B_r, D] each); backward sends the slice's gradients to the holders (module docstring)."""

    @staticmethod
    def forward(ctx, exchange: SparseExchange, *pooled: torch.Tensor):
        ctx.exchange = exchange
        plan, comm, rank = exchange.plan, exchange.comm, exchange.comm.rank
        held = dict(zip(exchange.model.table_index, pooled))
        lo, hi = exchange.slices[rank]
        pieces = []
        for r in range(comm.world_size):
            a, b = exchange.slices[r]
            parts = [held[t][a:b].reshape(-1) for t in exchange.model.table_index
                     if plan.tables[t].kind != DATA_PARALLEL]
            pieces.append(torch.cat(parts) if parts else torch.empty(0))
        dim = exchange.dim
        receive = [(hi - lo) * dim * sum(1 for t in plan.held_by(o) if plan.tables[t].kind != DATA_PARALLEL)
                   for o in range(comm.world_size)]
        received = [m.view(-1, hi - lo, dim) if m.numel() else m for m in comm.all_to_all(pieces, receive)]
        cursor = [0] * comm.world_size

        def from_holders(t: int, table) -> torch.Tensor:
            total = None
            for o in table.ranks:  # rank order: the row-wise sum is the same on every run
                part = received[o][cursor[o]]
                cursor[o] += 1
                total = part.clone() if total is None else total + part
            return total
        return slice_embeddings(plan, held, lo, hi, from_holders)

    @staticmethod
    def backward(ctx, *grads):
        exchange = ctx.exchange
        plan, comm = exchange.plan, exchange.comm
        lo, hi = exchange.slices[comm.rank]
        dim, scale = exchange.dim, 1.0 / comm.world_size
        grads = [torch.zeros(hi - lo, dim) if g is None else g * scale for g in grads]
        pieces = []
        for o in range(comm.world_size):
            parts = [grads[t].reshape(-1) for t in plan.held_by(o)]
            pieces.append(torch.cat(parts) if parts else torch.empty(0))
        held = exchange.model.table_index
        receive = [(b - a) * dim * len(held) for a, b in exchange.slices]
        received = comm.all_to_all(pieces, receive)
        out = []
        for i in range(len(held)):
            out.append(torch.cat([m.view(len(held), -1, dim)[i] for m in received]))
        return (None, *out)


def slice_embeddings(plan: ShardingPlan, held: dict, lo: int, hi: int, from_holders) -> tuple[torch.Tensor, ...]:
    """Every table's embeddings of the slice [lo, hi), in table order: a data-parallel table's own
    lookup (held[t] [B, D]), the others' from_holders(t, table) [B_r, D]."""
    return tuple(held[t][lo:hi].clone() if table.kind == DATA_PARALLEL else from_holders(t, table)
                 for t, table in enumerate(plan.tables))


def timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
