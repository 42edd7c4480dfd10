"""Recovery (docs/architecture.md §4): roll a pool back to its last committed batch, bit for bit.

    report, snapshot = recover(pool)    # needs only the pool, not the model
    report.batch                        # batches the recovered embeddings have seen
    report.dense_lag                    # batches the dense snapshot is older by (0 unless relaxed mode)
    verify(pool)                        # recovery's checks alone, writing nothing (`pool check`)
    roll_back(pool, g, live)            # the step every recovery shares (a group's rank: to G)

Order: validate everything (root, every live undo record and the dense snapshot the root names)
before the first write; redo the live redo records whose batch is < the target (a pool set's cold
rows committed since the last write-back, docs/tiers.md), oldest first; restore the undo records
whose batch is >= the target, newest first; persist;
then write a fresh root that starts a new ring generation, so records from before the crash can
never be taken as live again. Restoring writes absolute old values, so a crash anywhere in here is
repaired by recovering again.
"""

from __future__ import annotations

import dataclasses
import time

from ..errors import RecoveryError
from ..faults import CrashPoint, Planted, crash_point, planted
from ..pool.format import ROOT_RELAXED
from ..pool.handle import Pool
from . import layout, ring, slots


@dataclasses.dataclass(frozen=True)
class RecoveryReport:
    batch: int                 # the recovery target: batches the recovered embeddings have seen (the data position)
    dense_batch: int           # batches the restored dense snapshot has seen: == batch in strict mode,
                               # up to dense_every older in relaxed mode
    records_restored: int      # undo records rolled back
    batches_rolled_back: int   # distinct batches among them (the batch in flight, at most, in strict mode)
    rows_restored: int
    generation: int            # the ring generation the fresh root starts
    seconds: float
    records_redone: int = 0    # redo records applied (a stealing pool set's cold rows since its last write-back)

    @property
    def dense_lag(self) -> int:
        return self.batch - self.dense_batch

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "dense_lag": self.dense_lag}

    def describe(self, path: str, seconds: float) -> str:
        """One line: what recovering `path` rolled back, in `seconds` (as its caller timed it)."""
        return (f"recovered {path} to batch {self.batch} in {seconds * 1000:.1f} ms (rolled back "
                f"{self.records_restored} undo records, {self.rows_restored:,} rows, of "
                f"{self.batches_rolled_back} uncommitted batch(es))"
                + (f"; dense state from batch {self.dense_batch}, {self.dense_lag} batch(es) behind the embeddings "
                   "(relaxed mode)" if self.dense_lag else ""))


def has_checkpoint(pool: Pool) -> bool:
    """True when the pool holds a committed checkpoint: a consistent root naming a dense snapshot."""
    return (pool.root.batches_done >= 0 and pool.root.dense_slot != 0 and layout.RING_REGION in pool.regions
            and all(name in pool.regions for name in layout.DENSE_REGIONS))


def verify(pool: Pool, snapshot: dict | None = None, *,
           decode: bool = True) -> tuple[list[ring.ScannedRecord], dict | None]:
    """Everything recovery checks before its first write, and nothing else: the root's commit
    fields, every live undo record (header, payload checksum, regions, row indices) and the dense
    snapshot the root names. Writes nothing, so it runs on a pool opened read-only (`pool check`).
    Returns (the live records oldest first, the decoded snapshot); raises a PoolError subclass.
    decode=False checks the snapshot's slot (header, batch, checksum) without decoding it, and
    returns None for it: no torch is imported (`cxltrain recover`, `pool check`)."""
    if not has_checkpoint(pool):
        raise RecoveryError(f"{pool.path}: holds no committed checkpoint to recover (it was never committed "
                            "with the checkpointer on, or a run with --checkpoint off was interrupted)")
    root = pool.root
    relaxed = bool(root.flags & ROOT_RELAXED)
    if root.dense_batch > root.batches_done or (root.dense_batch != root.batches_done and not relaxed):
        raise RecoveryError(f"{pool.path}: the root's target is batch {root.batches_done} but its dense snapshot is "
                            f"of batch {root.dense_batch}, and the root is {'relaxed' if relaxed else 'strict'}: "
                            "a committed root never says so (corrupt pool)")
    live = ring.scan(pool, root.ring_generation, root.ring_start, root.ring_start_seq)
    if snapshot is None and decode:
        from . import dense  # torch: decoding makes tensors

        snapshot = dense.read_snapshot(pool, root.dense_slot, root.dense_batch)
    elif snapshot is None:
        slots.checked_payload(pool, root.dense_slot, root.dense_batch)
    return live, snapshot


def recover(pool: Pool, snapshot: dict | None = None, *, decode: bool = True) -> tuple[RecoveryReport, dict | None]:
    """Roll `pool` back to its root's target. Returns the report and the decoded dense snapshot.

    snapshot: the root's snapshot, when the caller has just read it (dense.read_snapshot, which
    checks it) from this pool: it is not read and decoded a second time.
    decode: False to check the snapshot's slot without decoding it (no torch); None is returned for it.
    """
    started = time.perf_counter()
    live, snapshot = verify(pool, snapshot, decode=decode)  # every check before the first write
    root = pool.root
    rollback, generation = roll_back(pool, root.batches_done, live)
    redone = len(to_redo(live, root.batches_done))
    report = RecoveryReport(root.batches_done, root.dense_batch, len(rollback), len({r.header.batch for r in rollback}),
                            sum(r.header.count for r in rollback), generation, time.perf_counter() - started,
                            redone)
    return report, snapshot


def to_redo(live: list[ring.ScannedRecord], target: int) -> list[ring.ScannedRecord]:
    """The live redo records recovery to `target` applies: those of committed batches (< target), oldest first."""
    return [record for record in live if record.header.redo and record.header.batch < target]


def to_undo(live: list[ring.ScannedRecord], target: int) -> list[ring.ScannedRecord]:
    """The live undo records recovery to `target` restores: those of batches >= target, oldest first."""
    return [record for record in live if not record.header.redo and record.header.batch >= target]


def pending(live: list[ring.ScannedRecord], target: int) -> int:
    """How many live records recovery to `target` writes back (0: the pool is as its root says)."""
    return len(to_redo(live, target)) + len(to_undo(live, target))


def pending_words(live: list[ring.ScannedRecord], target: int) -> str:
    """What recovery to `target` writes back, in words: "U undo record(s) to roll back", then
    " and R redo record(s) to apply" where a pool set's ring holds committed cold rows' records."""
    redo = len(to_redo(live, target))
    return f"{len(to_undo(live, target))} undo record(s) to roll back" + (
        f" and {redo} redo record(s) to apply" if redo else "")


def roll_back(pool: Pool, target: int, live: list[ring.ScannedRecord], *, dense_slot: int | None = None,
              before_root: CrashPoint = CrashPoint.RECOVER_BEFORE_ROOT) -> tuple[list[ring.ScannedRecord], int]:
    """The one roll-back of every recovery (one process, a group's rank, `cxltrain recover`): restore
    the `live` records (verify's, already checked) of batches >= `target`, newest first, make them
    durable in the primary and its capacity pools, then write a fresh root naming `target` and a
    new ring generation. dense_slot: a slot the caller has just made durable with the snapshot at
    `target` (a rank rolled back past its own snapshot), named by that root; None keeps the root's.
    A pool set's live redo records of batches < `target` are applied first, oldest first.
    Returns (the undo records restored, oldest first; the new ring generation)."""
    rollback = to_undo(live, target)
    ring_region = pool.region(layout.RING_REGION)
    # Redo before undo: the undo records of batches >= target hold the values the redo records
    # of batches < target end with, so the restore below lands on the target either way; oldest
    # first, so a row's newest committed value wins.
    for done, record in enumerate(to_redo(live, target)):
        ring.restore(pool, ring_region, record)
        if done == 0:
            crash_point(CrashPoint.RECOVER_MID_REDO)  # one redo record applied, maybe more to go
    for done, record in enumerate(reversed(rollback)):  # newest first: the oldest record's values win
        ring.restore(pool, ring_region, record)
        if done == 0 and len(rollback) > 1:
            crash_point(CrashPoint.RECOVER_MID)  # one record restored, more to go
    pool.device.drain()
    late_sync = planted(Planted.RECOVERY_ROOT_BEFORE_CAPACITY_SYNC)  # a crash test's planted bug
    if not late_sync:
        pool.drain_members()  # a pool set's capacity pools: restored cold rows synced
    crash_point(before_root)
    generation = pool.root.ring_generation + 1
    dense = {} if dense_slot is None else {"dense_slot": dense_slot, "dense_batch": target}
    # ORDERING: the restored rows (and the snapshot at the target) are durable, in the primary and
    # in every capacity pool, before the root that retires the records they came from (a new
    # generation: they can never be live again).
    pool.commit(batches_done=target, ring_generation=generation, ring_start=0, ring_start_seq=0, **dense)
    crash_point(CrashPoint.RECOVER_AFTER_ROOT)
    if late_sync:  # the planted bug's sync, after the root (a kill above loses the restored cold rows)
        pool.drain_members()
    return rollback, generation
