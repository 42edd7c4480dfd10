"""Named crash points and planted faults, for crash tests. Inert unless their variables are set.

    CXLTRAIN_CRASH_AT=NAME[:N]   the process SIGKILLs itself the N-th time (default 1st) it reaches
                                 crash_point(NAME): a crash at an exact place in a protocol.
    CXLTRAIN_FAULT=NAME[,NAME]   planted bugs (an ordering rule broken on purpose), so a crash test
                                 can show it catches them. Never set outside tests.

Both are read once, at import (or set by `arm`, for a child forked from a process that imported
this module already); a process that sets neither pays one `is None` check per point.

Every name is registered here (CrashPoint, Planted), and only registered names are accepted:
arming an unknown point or fault raises, and so does reaching a point whose name is not
registered while a crash is armed — a misspelt name can never switch a crash test off silently.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "CXLTRAIN_CRASH_AT"
FAULT_ENV = "CXLTRAIN_FAULT"


class CrashPoint:
    """Every named crash point, where it is reached, and (for `cxltrain crashtest`) how often a
    training run reaches it: once per table per batch ("tables"), once per commit ("commits"),
    or elsewhere (None)."""

    CREATE_BEFORE_SUPERBLOCK = "create:before-superblock"  # pool.py: Pool.create, root written
    ADD_REGIONS_BETWEEN = "add-regions:between"            # pool.py: between directory entries and root
    COMMIT_TORN_ROOT = "commit:torn-root"                  # pool.py: half a root slot written
    UNDO_BETWEEN_PAYLOAD_AND_HEADER = "undo:between-payload-and-header"  # checkpoint/ring.py, or a chunk of kernels/ops.py's fused update
    UNDO_BETWEEN_HEADER_AND_UPDATE = "undo:between-header-and-update"    # record durable, no row stored yet (ditto)
    UPDATE_MID = "update:mid"                              # kernels/ops.py: a table half-updated in place
    UPDATE_ROWS_FLUSHED = "update:rows-flushed"            # checkpoint/checkpointer.py: rows flushed at update
    COMMIT_MID_ROWS = "commit:mid-rows"                    # checkpoint/commit.py: one table's rows flushed
    COMMIT_BETWEEN_ROWS_AND_SNAPSHOT = "commit:between-rows-and-snapshot"  # checkpoint/commit.py
    COMMIT_BEFORE_ROOT = "commit:before-root"              # checkpoint/commit.py: snapshot sealed, no root
    COMMIT_AFTER_ROOT = "commit:after-root"                # checkpoint/commit.py: root durable, no reclaim
    RECOVER_MID = "recover:mid"                            # checkpoint/recovery.py: one record restored
    RECOVER_BEFORE_ROOT = "recover:before-root"            # checkpoint/recovery.py: rows restored, no root
    RECOVER_AFTER_ROOT = "recover:after-root"              # checkpoint/recovery.py: the root written, recovery done
    DEVICE_FLUSH = "device:flush"                          # emulation/cxl.py: every flush of the device
    # pool sets (docs/tiers.md)
    CAPACITY_PAGE_WRITE = "capacity:page-write"            # devices/capacity.py: every page write / sync
    COMMIT_BEFORE_CAPACITY_SYNC = "commit:before-capacity-sync"  # checkpoint/commit.py: cold pages written, unsynced
    COMMIT_BETWEEN_ROOTS = "commit:between-roots"          # pool.py: members' roots durable, not the primary's
    CACHE_MID_ADMISSION = "cache:mid-admission"            # cache.py: half a table's slots filled (admission, re-placement)
    CACHE_AFTER_WRITE_BACK = "cache:after-write-back"      # cache.py: re-placement's evicted rows written back, slots not refilled
    REPOINT_TORN_RECORD = "repoint:torn-record"            # pool/repoint.py: half the set's new record written
    REPOINT_AFTER_RECORD = "repoint:after-record"          # pool/repoint.py: the new record durable, nothing said yet
    # a stealing pool set's write-back (docs/tiers.md "Steal, no force"), and its recovery's redo
    CAPACITY_MID_WRITE_BACK = "capacity:mid-write-back"    # devices/capacity.py (crash model): half the queued pages written
    CAPACITY_BEFORE_SYNC = "capacity:before-sync"          # devices/capacity.py (crash model): every queued page written, unsynced
    COMMIT_AFTER_WRITE_BACK = "commit:after-write-back"    # checkpoint/commit.py: capacity pools synced, the root not yet moved past the redo records
    # checkpoint/commit.py: a commit's root written while a write-back is still in flight (armed, it holds the write-back)
    COMMIT_WHILE_WRITING_BACK = "commit:while-writing-back"
    RECOVER_MID_REDO = "recover:mid-redo"                  # checkpoint/recovery.py: one redo record applied
    # distributed runs, reached on every rank; CXLTRAIN_CRASH_RANK picks the one that dies
    DIST_AFTER_LOCAL_COMMIT = "dist:after-local-commit"    # runtime/recovery_point.py: committed here, not at peers
    DIST_BEFORE_AGREEMENT = "dist:before-agreement"        # runtime/recovery_point.py: step done, G not agreed
    DIST_RECOVER_BEFORE_ROOT = "dist:recover-before-root"  # runtime/group_recovery.py: rolled back to G, no root yet
    DIST_REPLICAS_REDUCED = "dist:replicas-reduced"        # models/replicated.py: hot rows' gradient summed, none updated

    REACHED_PER = {
        UNDO_BETWEEN_PAYLOAD_AND_HEADER: "tables",
        UNDO_BETWEEN_HEADER_AND_UPDATE: "tables",
        UPDATE_MID: "tables",
        UPDATE_ROWS_FLUSHED: "tables",    # rows flushed at their update (the default on emulated devices)
        COMMIT_MID_ROWS: "commits",       # ... or by the commit (capture and flushes on the worker)
        COMMIT_BETWEEN_ROWS_AND_SNAPSHOT: "commits",
        COMMIT_BEFORE_ROOT: "commits",
        COMMIT_TORN_ROOT: "commits",
        COMMIT_AFTER_ROOT: "commits",
    }
    # reached only by a pool set (a capacity pool beside the primary), as REACHED_PER says
    SET_REACHED_PER = {
        COMMIT_BEFORE_CAPACITY_SYNC: "commits",
        COMMIT_BETWEEN_ROOTS: "commits",
        CAPACITY_PAGE_WRITE: "commits",   # at least once per commit (the sync), more with the crash model
    }
    RECOVERY = (RECOVER_MID, RECOVER_BEFORE_ROOT, RECOVER_AFTER_ROOT)
    # reached by a write-back (on its own thread, checkpoint/write_back.py) or by the pages it writes
    WRITE_BACK = (COMMIT_BEFORE_CAPACITY_SYNC, CAPACITY_MID_WRITE_BACK, CAPACITY_BEFORE_SYNC, COMMIT_AFTER_WRITE_BACK,
                  CAPACITY_PAGE_WRITE)


class Planted:
    """The planted bugs, each breaking one ordering rule where the code enforces it."""

    SKIP_UNDO_PERSIST = "skip-undo-persist"          # U1: the undo record is never persisted
    COMMIT_BEFORE_ROWS = "commit-before-rows"        # U2: the root is written before the batch's rows are durable
    CAPTURE_BEFORE_UPDATE = "capture-before-update"  # U4: the record holds rows from before the previous update
    ROOT_BEFORE_ENTRIES = "root-before-entries"      # pool: a root naming directory entries not yet durable
    WINDOW_NEVER_CLEARED = "window-never-cleared"    # U1: a row recorded in one commit window gets no record in later ones
    SKIP_CAPACITY_SYNC = "skip-capacity-sync"        # U2 across pools: the root names cold pages never synced
    HEADER_BEFORE_PAYLOAD = "header-before-payload"  # U1 (fused update): a chunk's header durable before its payload
    UPDATE_BEFORE_HEADER = "update-before-header"    # U1 (fused update): a chunk's rows stored before its header
    KERNEL_SKIPS_ROW_FLUSH = "kernel-skips-row-flush"  # U2 (fused update): its rows' flush counted, never done
    UNLOGGED_ADMISSION = "unlogged-admission"        # U1: cache slots filled with no undo record of them first
    CACHED_UPDATE_UNLOGGED = "cached-update-unlogged"  # U1: cached rows updated before their slots' record is taken
    RENORM_UNLOGGED = "renorm-unlogged"              # U1: max_norm's renorm stores rows before their record is taken
    # U2 across pools, in recovery: its root retires the records before the cold rows they restored are synced
    RECOVERY_ROOT_BEFORE_CAPACITY_SYNC = "recovery-root-before-capacity-sync"
    # U3c (steal): a write-back counted when it starts, so a root lets the ring reuse the redo records before it has synced
    RECLAIM_BEFORE_WRITE_BACK = "reclaim-before-write-back"
    # U2f (steal): a batch's redo records are written only after the commit naming it is durable
    REDO_AFTER_COMMIT = "redo-after-commit"


class PlantedDist:
    """The planted bugs of distributed runs; a single process never reaches them."""

    # U3b, checkpoint/ordering.py: a rank reclaims records above the agreed target G
    RECLAIM_ABOVE_AGREED = "reclaim-above-agreed"
    # runtime/recovery_point.py agree_on_g: a rank commits as if its batch were agreed
    COMMIT_WITHOUT_AGREEMENT = "commit-without-agreement"
    # jobs/sharded_train.py: the last rank's step raises a RuntimeError (a bug, not a lost peer)
    ERROR_IN_STEP = "error-in-step"


class PlantedDevice:
    """The planted bugs of the GPU path (tables/bag.py, tables/device_rows.py); a CPU run never reaches them."""

    DEVICE_UPDATE_BEFORE_CAPTURE = "device-update-before-capture"  # U1: the update kernel runs before the record is durable


def _names(namespace: type) -> tuple[str, ...]:
    return tuple(value for key, value in vars(namespace).items() if key.isupper() and isinstance(value, str))


CRASH_POINTS = frozenset(_names(CrashPoint))
PLANTED = _names(Planted)
DIST_PLANTED = _names(PlantedDist)
DEVICE_PLANTED = _names(PlantedDevice)


def _parse_crash(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    name, _, count = value.rpartition(":")  # names contain ':' themselves; the count is last
    parsed = (name, int(count)) if count.isdigit() and int(count) > 0 and name else (value, 1)
    if parsed[0] not in CRASH_POINTS:
        raise ValueError(f"{CRASH_ENV}={value!r}: unknown crash point {parsed[0]!r}; "
                         f"registered: {', '.join(sorted(CRASH_POINTS))}")
    return parsed


def _parse_faults(value: str) -> frozenset[str]:
    faults = frozenset(f for f in value.split(",") if f)
    unknown = sorted(faults - set(PLANTED) - set(DIST_PLANTED) - set(DEVICE_PLANTED))
    if unknown:
        raise ValueError(f"{FAULT_ENV}={value!r}: unknown planted fault(s) {', '.join(unknown)}; "
                         f"registered: {', '.join(PLANTED + DIST_PLANTED + DEVICE_PLANTED)}")
    return faults


CRASH_RANK_ENV = "CXLTRAIN_CRASH_RANK"  # distributed runs: only this rank (RANK) arms CXLTRAIN_CRASH_AT


def _crash_setting() -> str | None:
    """CXLTRAIN_CRASH_AT, unless CXLTRAIN_CRASH_RANK names another rank than this process's RANK,
    or torchrun is restarting the group (a crash test kills the first incarnation only)."""
    rank = os.environ.get(CRASH_RANK_ENV)
    if rank is not None and (rank != os.environ.get("RANK", "0")
                             or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        return None
    return os.environ.get(CRASH_ENV)


_CRASH = _parse_crash(_crash_setting())
_FAULTS = _parse_faults(os.environ.get(FAULT_ENV, ""))
_reached = 0


def arm(crash_at: str | None, faults: str = "") -> None:
    """Set the crash point and planted faults as the variables would: for a process forked after
    import (cxltrain crashtest's children), where the variables were read before they were set."""
    global _CRASH, _FAULTS, _reached
    _CRASH, _FAULTS, _reached = _parse_crash(crash_at), _parse_faults(faults), 0


def crash_point(name: str) -> None:
    """Die here, as a power cut or kill -9 would, if CXLTRAIN_CRASH_AT names this point."""
    global _reached
    if _CRASH is None:
        return
    if name not in CRASH_POINTS:
        raise ValueError(f"crash point {name!r} is not registered in cxltrain.faults.CrashPoint")
    if _CRASH[0] != name:
        return
    _reached += 1
    if _reached == _CRASH[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def reached() -> int:
    """How many times the armed crash point has been reached so far (it dies at the count asked)."""
    return _reached


def crash_armed(name: str) -> bool:
    """True when CXLTRAIN_CRASH_AT names this point: for a write that must be split to crash inside it."""
    return _CRASH is not None and _CRASH[0] == name


def crash_due(name: str) -> bool:
    """True when the next crash_point(name) is the one that kills: for a kernel that must stop
    half-way through that one call, and only that one."""
    return _CRASH is not None and _CRASH[0] == name and _reached + 1 == _CRASH[1]


def planted(name: str) -> bool:
    """True when the test-only fault `name` is planted (CXLTRAIN_FAULT). Read once, where a strategy
    is chosen (checkpoint/ordering.py), never in a hot path."""
    return name in _FAULTS


def planted_faults() -> frozenset[str]:
    """Every planted fault (CXLTRAIN_FAULT)."""
    return _FAULTS
