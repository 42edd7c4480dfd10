"""Which attempt of a torchrun group this is, agreed by its ranks through torchrun's store.

torchrun's store outlives a restart, and gloo finds its peers' addresses in it, so each attempt
needs keys of its own or a rank reads a dead rank's address (`Gloo connectFullMesh ... Connection
refused`). TORCHELASTIC_RESTART_COUNT cannot name the attempt under several agents (several
hosts): an agent whose own workers did not fail restarts them for the others' sake (a membership
change) without counting it, so the agents' counts part after the first kill. Instead rank 0 draws
a number no attempt had (a counter in the store) and hands it to every other rank, which takes
only an answer to a nonce of its own: keys left by an earlier attempt are never read as this one's.
"""

from __future__ import annotations

import time
import uuid

import torch.distributed as dist

COUNTER = "cxltrain/attempts"
POLL_S = 0.02


def agree_on_attempt(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> int:
    """This attempt's number (1, 2, ...), the same on every rank of the attempt and unlike any
    earlier attempt's. Collective: every rank calls it once per attempt, before joining the group.
    Raises dist.DistStoreError after timeout_s without the other ranks."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        return _hand_out(store, world_size, deadline)
    return _ask(store, rank, deadline)


def _ask(store: dist.Store, rank: int, deadline: float) -> int:
    nonce = uuid.uuid4().hex  # fresh: no earlier attempt's answer can carry it
    store.set(_key("ask", rank), nonce)
    while True:
        answer = _get(store, _key("answer", rank))
        if answer is not None and answer.partition(":")[0] == nonce:
            store.set(_key("took", rank), answer)  # rank 0 waits for this before it stops answering
            return int(answer.partition(":")[2])
        _wait(deadline, "rank 0 to hand out the attempt's number")


def _hand_out(store: dist.Store, world_size: int, deadline: float) -> int:
    attempt = store.add(COUNTER, 1)  # never handed out before, whatever earlier attempts left behind
    answered: dict[int, str] = {}
    waiting = set(range(1, world_size))
    while True:
        for rank in sorted(waiting):
            asked = _get(store, _key("ask", rank))
            if asked is None:
                continue
            # an `ask` may be an earlier attempt's, not yet overwritten: answer again when it changes
            reply = f"{asked}:{attempt}"
            if answered.get(rank) != reply:
                store.set(_key("answer", rank), reply)
                answered[rank] = reply
            if _get(store, _key("took", rank)) == reply:  # this attempt's number: no earlier `took` holds it
                waiting.discard(rank)
        if not waiting:
            return attempt
        _wait(deadline, f"rank(s) {', '.join(map(str, sorted(waiting)))} to join")


def _key(kind: str, rank: int) -> str:
    return f"cxltrain/attempt-{kind}/{rank}"


def _get(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _wait(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise dist.DistStoreError(f"timed out waiting for {what} (agreeing on the attempt's number)")
    time.sleep(POLL_S)
