"""The step's exchange with hot rows replicated on every rank (docs/distributed.md, "Replicated hot
rows"; the rows: placement/replication.py).

Every rank holds a copy of the chosen rows of each sharded table (`Replicas`: weights and optimizer
state, volatile). A lookup of one of them is served from the copy on the rank that makes it; only the
other ids go to their holders, in one of two forms per table (the cost model's choice,
placement/replication.py): bags (exchange.py's messages: every bag's length, then the ids; only the
bags holding one of them get a pooled row back and send a gradient), or unique rows (`AskedRows`:
each distinct id once, its row back, the bags pooled here from those rows and the copies, one
gradient per row back, summed over its lookups in lookup order; the holder applies the rows'
gradients as a lookup of each row, so its update, undo log and commit are its table's as ever). In backward each rank
sends the copies' gradients to the rows' owners inside the exchange's gradient all-to-all, and
each owner sums them in rank order; its table's lookup of the batch looked each of its replicated
rows up as a bag of its own, which takes the sum as its gradient, so the table's one fused update
applies it, undo-logged and committed with the batch: a row is logged once, by its owner. The
owner's sums reach every rank in the next step's rows all-to-all, and every rank applies the same
fused update to its copies before their lookups: no collective of their own. The copies are never
durable: they are rebuilt from the owners' rows at every start (after the group's recovery) and
whenever the chosen rows change, and the sums in flight are then dropped (the owners' rows hold
them).

Shape letters: B samples of the global batch, B_r of this rank's slice, D dims, H_t replicated rows
of table t (H of every table, H_o of them owned by rank o), U distinct rows asked of a table's
holders.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.batch import Batch
from ..faults import CrashPoint, crash_point
from ..kernels.lookups import add_bags_to_rows, asked_rows
from ..placement.sharding import DATA_PARALLEL, ShardingPlan
from .exchange import Comm, SparseExchange, _bags_for, slice_embeddings, sum_in_rank_order
from .sharded import RankModel


class Replicas:
    """This rank's copies of the replicated rows: per table, ids [H_t] (sorted, global), rows
    [H_t, D] and optimizer state [H_t, K] (None for SGD), runs of one block [H, D] and [H, K]."""

    def __init__(self, plan: ShardingPlan, model: RankModel, comm: Comm) -> None:
        self.plan, self.model, self.comm = plan, model, comm
        self.dim = model.dense.embedding_dim
        self.optimizer = next(iter(model.shards)).optimizer
        empty = torch.empty(0, dtype=torch.int64)
        self.ids = [empty] * len(plan.tables)
        self.rows: list[torch.Tensor] = [torch.empty(0, self.dim)] * len(plan.tables)
        self.state: list[torch.Tensor | None] = [None] * len(plan.tables)
        self.block, self.block_state = torch.empty(0, self.dim), None  # every table's rows and state (rebuild)
        # per rank o: (table, positions in ids[t]) of the rows o owns, in table order (rebuild)
        self.owned_rows: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(comm.world_size)]
        # per rank o: the same rows' positions in [H], every table's rows in table order
        self.owned: list[torch.Tensor] = [empty] * comm.world_size
        # this step's lookups of the copies, per table: (copy row [M], bag of the slice [M], offsets
        # of the slice's bags over them [B_r]), None: none
        self.lookups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(plan.tables)
        self.summed: torch.Tensor | None = None  # this rank's rows' gradient summed over the ranks [H_self, D]
        self.due = False  # `summed` is still to reach the copies (the next step's rows all-to-all)

    @property
    def count(self) -> int:
        return sum(ids.numel() for ids in self.ids)

    def rebuild(self, hot) -> None:
        """Collective: copies of rows `hot[t]` (np or torch ids, any order) of every table, each
        taken from its owner's rows as they are now (one broadcast per owner and table). The sums
        in flight are dropped: the owners' rows hold them."""
        k = self.optimizer.state_columns
        self.owned_rows = [[] for _ in range(self.comm.world_size)]
        every = [torch.as_tensor(np.sort(np.asarray(hot[t], dtype=np.int64))) for t in range(len(self.plan.tables))]
        bases = np.cumsum([0] + [ids.numel() for ids in every]).tolist()
        # every table's copies in one block [H, D] (and [H, K]), table t's rows a run of it: take_sums
        # updates them all in one call
        self.block = torch.empty(bases[-1], self.dim)
        self.block_state = torch.empty(bases[-1], k) if k else None
        for t, table in enumerate(self.plan.tables):
            ids = every[t]
            rows = self.block[bases[t] : bases[t + 1]]
            state = self.block_state[bases[t] : bases[t + 1]] if k else None
            for owner in table.ranks if table.kind != DATA_PARALLEL else ():
                lo, hi = table.rows_of(owner)
                at = torch.nonzero((ids >= lo) & (ids < hi)).view(-1)
                if not at.numel():
                    continue
                self.owned_rows[owner].append((t, at))
                values = torch.empty(at.numel(), self.dim + k)
                if owner == self.comm.rank:
                    weights, table_state = self.model.shard(t).storage()
                    local = ids[at] - lo
                    values[:, : self.dim] = weights[local, : self.dim]
                    if k:
                        values[:, self.dim :] = table_state[local]
                dist.broadcast(values, src=owner, group=self.comm.group)
                rows[at] = values[:, : self.dim]
                if k:
                    state[at] = values[:, self.dim :]
            self.ids[t], self.rows[t], self.state[t] = ids, rows, state
        self.owned = [torch.cat([bases[t] + at for t, at in rows]) if rows else torch.empty(0, dtype=torch.int64)
                      for rows in self.owned_rows]
        self.summed, self.due = None, False

    def look_up(self, t: int, values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Table t's bags (values [N], offsets [B_r]) split: (the ids not replicated, their offsets
        [B_r]); the lookups of the copies are kept for `pooled` and `gradient`."""
        ids = self.ids[t]
        if not ids.numel():
            return values, offsets
        # one binary search in the sorted ids says both whether a lookup's row is replicated and
        # where its copy is (rather than a torch.isin pass, then a second search of the hot ones)
        at = torch.searchsorted(ids, values).clamp_(max=ids.numel() - 1)
        hot = ids[at] == values
        ends = torch.cat([offsets, torch.tensor([values.numel()])])
        counted = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(hot.to(torch.int64), 0)])
        hot_lengths = counted[ends[1:]] - counted[ends[:-1]]
        cold_lengths = ends[1:] - ends[:-1] - hot_lengths
        self.lookups[t] = (at[hot], torch.repeat_interleave(torch.arange(offsets.numel()), hot_lengths),
                           torch.cumsum(hot_lengths, 0) - hot_lengths)
        return values[~hot], torch.cumsum(cold_lengths, 0) - cold_lengths

    def pooled(self, t: int) -> torch.Tensor | None:
        """Table t's bags [B_r, D] pooled from the copies (look_up's replicated lookups), None when
        t has none. Called once the last step's sums are taken (take_sums)."""
        if self.lookups[t] is None:
            return None
        positions, _, offsets = self.lookups[t]
        # no autograd here: the exchange's backward takes the gradient of these bags (gradient)
        return F.embedding_bag(positions, self.rows[t], offsets, mode="sum")

    def gradient(self, grads: list[torch.Tensor], given: dict[int, torch.Tensor]) -> torch.Tensor:
        """The copies' gradient [H, D] (every replicated table's rows, in table order) from this
        slice's bag gradients grads[t] [B_r, D]: each lookup's bag gradient added to its row, in
        lookup order; given[t] [H_t, D]: table t's, made so by its AskedRows."""
        parts = []
        for t, ids in enumerate(self.ids):
            if t in given:
                parts.append(given[t])
            elif ids.numel():
                grad = torch.zeros(ids.numel(), self.dim)
                if self.lookups[t] is not None:
                    positions, bags, _ = self.lookups[t]
                    grad.index_add_(0, positions, grads[t][bags])
                parts.append(grad)
        self.lookups = [None] * len(self.plan.tables)
        return torch.cat(parts) if parts else torch.empty(0, self.dim)

    def own_rows(self) -> dict[int, torch.Tensor]:
        """This rank's replicated rows, per table it owns some of: local ids [O_t], in the order
        of its part of `summed` (the exchange looks each up for the table's update to take)."""
        return {t: self.ids[t][index] - self.plan.rows_of(t, self.comm.rank)[0]
                for t, index in self.owned_rows[self.comm.rank]}

    def outgoing(self) -> torch.Tensor:
        """What the rows all-to-all carries from this rank to every rank: its rows' sums of the last
        step [H_self * D], or nothing when none is due."""
        return self.summed.reshape(-1) if self.due else torch.empty(0)

    def incoming(self, owner: int) -> int:
        """How many floats of `owner`'s sums that all-to-all brings here."""
        return self.owned[owner].numel() * self.dim if self.due else 0

    def take_sums(self, parts: list[torch.Tensor]) -> None:
        """The last step's sums from every owner (parts[o] [H_o * D]) applied to every copy: the
        owner's fused rule on the same inputs, so a copy keeps its row's bits."""
        if not self.due:
            return
        total = torch.zeros(self.count, self.dim)
        for owner, part in enumerate(parts):
            total[self.owned[owner]] = part.view(-1, self.dim)
        if self.count:
            # every copy, a bag of its own: a row no lookup reached has a zero sum, and the rule
            # leaves its weights and state bit for bit as they were, as on its owner
            every = torch.arange(self.count)
            self.optimizer.update(self.block, self.block_state, every, total, every)
        self.summed, self.due = None, False


class AskedRows:
    """Table t's lookups of this rank's slice (values [N], offsets [B_r]) for the unique-row
    exchange: the ids not replicated asked of their holders as distinct rows, ids[o] [U_o] sorted,
    local to holder o's rows (U of them in all, answered in rank order); the others served by the
    H_t copies. positions [N]: each lookup's row in the answers and then the copies, [U + H_t, D].
    So a bag is pooled from both at once, and one pass lays out the gradients of both."""

    def __init__(self, table, values: torch.Tensor, offsets: torch.Tensor, copies: torch.Tensor) -> None:
        # the slice's distinct ids once, in one native pass: each is a copy (copies [H_t], sorted)
        # or asked of its holder; each holder's ids a run of them, answered in rank order
        spans = [table.rows_of(o) for o in table.ranks]
        cold, starts, counts, self.positions = asked_rows(values, table.rows, copies, spans)
        self.ids: dict[int, torch.Tensor] = {o: cold[start : start + count] - lo
                                             for o, (lo, _), start, count in zip(table.ranks, spans, starts, counts)}
        self.rows, self.copies = cold.numel(), copies.numel()
        self.offsets = offsets

    def pooled(self, rows: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
        """The slice's bags [B_r, D] summed from the answered rows [U, D] and the copies [H_t, D]."""
        weight = torch.cat([rows, copies]) if self.copies else rows
        if not weight.shape[0]:
            return torch.zeros(self.offsets.numel(), rows.shape[1])
        return F.embedding_bag(self.positions, weight, self.offsets, mode="sum")

    def gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """Each answered row's gradient, then each copy's [U + H_t, D], from the bags' grad [B_r,
        D]: every lookup's bag gradient added to its row in lookup order (the same bits every run)."""
        return add_bags_to_rows(grad.contiguous(), self.offsets, self.positions, self.rows + self.copies)

    def span(self, owner: int) -> slice:
        """The rows of [U, D] that `owner` answers."""
        start = 0
        for o, ids in self.ids.items():
            if o == owner:
                return slice(start, start + ids.numel())
            start += ids.numel()
        raise KeyError(owner)


class ReplicatedExchange(SparseExchange):
    """SparseExchange with `replicas` looked up where the lookups are, and each table's other ids
    sent as bags or, where `unique[t]`, as distinct rows pooled here (module docstring)."""

    def __init__(self, plan: ShardingPlan, model: RankModel, comm: Comm, batch_size: int,
                 replicas: Replicas) -> None:
        super().__init__(plan, model, comm, batch_size)
        self.replicas = replicas
        self.sent: dict[tuple[int, int], torch.Tensor] = {}  # (table of bags, holder): the slice's bags it serves
        self.asked: dict[int, AskedRows] = {}                # table of unique rows: what its holders answer

    def forward(self, local: Batch, target: int) -> tuple[list[torch.Tensor], list[int]]:
        comm, plan = self.comm, self.plan
        replicas = self.replicas
        sharded = [t for t, table in enumerate(plan.tables) if table.kind != DATA_PARALLEL]
        self.asked = {t: AskedRows(plan.tables[t], local.values[t], local.offsets[t], replicas.ids[t])
                      for t in sharded if self.unique[t]}
        split = {t: replicas.look_up(t, v, o) if t in sharded else (v, o)  # a data-parallel table: none replicated
                 for t, (v, o) in enumerate(zip(local.values, local.offsets)) if t not in self.asked}
        messages = []
        for owner in range(comm.world_size):
            parts = []
            for t in range(len(plan.tables)):
                if owner not in plan.owners(t):
                    continue
                if t in self.asked:
                    ids = self.asked[t].ids[owner]
                    parts += [torch.tensor([ids.numel()]), ids]
                else:
                    lengths, ids = _bags_for(plan, t, owner, split[t][0], split[t][1])
                    self.sent[t, owner] = torch.nonzero(lengths).view(-1)
                    parts += [lengths, ids]
            messages.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64))
        header = torch.tensor([[m.numel(), target] for m in messages], dtype=torch.int64)
        received_header = torch.cat(comm.all_to_all(list(header), [2] * comm.world_size)).view(-1, 2)
        targets = received_header[:, 1].tolist()
        pooled = self._look_up(comm.all_to_all(messages, received_header[:, 0].tolist()), self.replicas.own_rows())
        embedded = _ColdExchange.apply(self, *pooled)  # the copies have taken the last step's sums in it
        hot = {t: replicas.pooled(t) for t in split if t in sharded}  # bag tables' (AskedRows pooled their own)
        return [e if hot.get(t) is None else e + hot[t] for t, e in enumerate(embedded)], targets

    def answers(self, t: int, owner: int) -> int:
        """How many rows `owner` sends this rank for sharded table t (and gets gradients for)."""
        return self.asked[t].ids[owner].numel() if t in self.asked else self.sent[t, owner].numel()


class _ColdExchange(torch.autograd.Function):
    """pooled (held tables, [B, D] or [U, D] each: SparseExchange._look_up) -> every table's
    embeddings for this rank's slice ([B_r, D] each), but for a bag table's copies (added after
    it): a holder sends back the rows that answer each rank (served: the bags that sent it ids, or
    the distinct rows asked; a data-parallel table: none, every rank looked it up), the asking rank
    adds up a row-wise table's bags in rank order or pools its bags from the rows and its copies
    (AskedRows); backward sends the gradients of those rows (a unique row's summed over its
    lookups; all of a data-parallel table's bags) to the holders, and this rank's replicated rows'
    gradient, each row's to its owner, which sums them in rank order (a reduce-scatter by owner)
    and returns the sums as the gradient of its own lookups of those rows (Replicas.own_rows): its
    tables' one update takes them. The forward's rows carry the owners' sums of the last step to
    every rank, for its copies (Replicas.take_sums)."""

    @staticmethod
    def forward(ctx, exchange: ReplicatedExchange, *pooled: torch.Tensor):
        ctx.exchange, ctx.sizes = exchange, [p.shape[0] for p in pooled]
        plan, comm, dim = exchange.plan, exchange.comm, exchange.dim
        held = dict(zip(exchange.model.table_index, pooled))
        lo, hi = exchange.slices[comm.rank]
        sharded = [t for t in exchange.model.table_index if plan.tables[t].kind != DATA_PARALLEL]
        replicas = exchange.replicas
        sums = replicas.outgoing()
        pieces = [torch.cat([*(held[t][exchange.served(t, r)].reshape(-1) for t in sharded), sums])
                  for r in range(comm.world_size)]
        receive = [dim * sum(exchange.answers(t, o) for t in plan.held_by(o) if plan.tables[t].kind != DATA_PARALLEL)
                   for o in range(comm.world_size)]
        received = comm.all_to_all(pieces, [n + replicas.incoming(o) for o, n in enumerate(receive)])
        replicas.take_sums([message[n:] for message, n in zip(received, receive)])
        cursor = [0] * comm.world_size

        def answer(o: int, t: int) -> torch.Tensor:
            n = exchange.answers(t, o) * dim
            cursor[o] += n
            return received[o][cursor[o] - n : cursor[o]].view(-1, dim)

        def from_holders(t: int, table) -> torch.Tensor:
            if t in exchange.asked:  # the distinct rows, put together in rank order, pooled here
                return exchange.asked[t].pooled(torch.cat([answer(o, t) for o in table.ranks]), replicas.rows[t])
            total = torch.zeros(hi - lo, dim)
            for o in table.ranks:  # rank order: a row-wise table's partial sums add up the same on every run
                total.index_add_(0, exchange.sent[t, o], answer(o, t))
            return total
        return slice_embeddings(plan, held, lo, hi, from_holders)

    @staticmethod
    def backward(ctx, *grads):
        exchange = ctx.exchange
        plan, comm, dim = exchange.plan, exchange.comm, exchange.dim
        lo, hi = exchange.slices[comm.rank]
        scale = 1.0 / comm.world_size
        grads = [torch.zeros(hi - lo, dim) if g is None else g * scale for g in grads]
        replicas = exchange.replicas
        both = {t: asked.gradient(grads[t]) for t, asked in exchange.asked.items()}  # [U + H_t, D]
        rows_grad = {t: g[: exchange.asked[t].rows] for t, g in both.items()}
        hot = replicas.gradient(grads, {t: g[exchange.asked[t].rows :] for t, g in both.items()
                                        if exchange.asked[t].copies})  # [H, D], already times 1/W
        pieces = []
        for o in range(comm.world_size):
            parts = [(grads[t] if plan.tables[t].kind == DATA_PARALLEL else rows_grad[t][exchange.asked[t].span(o)]
                      if t in exchange.asked else grads[t][exchange.sent[t, o]]).reshape(-1)
                     for t in plan.held_by(o)]
            pieces.append(torch.cat([*parts, hot[replicas.owned[o]].reshape(-1)]))
        held = exchange.model.table_index
        rows = {(t, s): (exchange.slices[s][1] - exchange.slices[s][0] if plan.tables[t].kind == DATA_PARALLEL
                         else exchange.served(t, s).numel()) for t in held for s in range(comm.world_size)}
        mine = replicas.owned[comm.rank].numel() * dim
        received = comm.all_to_all(pieces, [dim * sum(rows[t, s] for t in held) + mine
                                            for s in range(comm.world_size)])
        # each of this rank's rows summed over the ranks in rank order: the same bits every run
        replicas.summed = sum_in_rank_order([message[message.numel() - mine :] for message in received]).view(-1, dim)
        out = [torch.zeros(size, dim) for size in ctx.sizes]
        for s, message in enumerate(received):
            a, b = exchange.slices[s]
            at = 0
            for i, t in enumerate(held):
                part = message[at : at + rows[t, s] * dim].view(-1, dim)
                at += rows[t, s] * dim
                if plan.tables[t].kind == DATA_PARALLEL:
                    out[i][a:b] = part
                else:
                    out[i][exchange.served(t, s)] = part
        if replicas.count:
            crash_point(CrashPoint.DIST_REPLICAS_REDUCED)
            at = 0
            for t, index in replicas.owned_rows[comm.rank]:  # the last rows of its lookup (own_rows)
                out[held.index(t)][-index.numel() :] = replicas.summed[at : at + index.numel()]
                at += index.numel()
            replicas.due = True
        return (None, *out)
