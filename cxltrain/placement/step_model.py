"""The capacity tier's step model (docs/planner.md): what a pool set's configuration costs a step,
predicted from measured tier speeds and the profile's held-out batches, and the choice among them.

A configuration is the hot-row caches' size (`--cache-rows`, rows of each capacity table; or none
given: the planner's own use of what `--fast-bytes` leaves, planner.make_plan) and the write-back
interval N (`--write-back-every`), within the fast tier's room (`--fast-bytes`, which also decides
the whole tables in the fast tier).

    step = fast-tier step                                   (all tables in the fast tier, measured or given)
         + miss lookups x (capacity row cost - fast row cost)
         + (fdatasync's fixed cost + pages the misses dirty in N batches x a page's write-back) / N
         + redo record bytes / the fast tier's copy bandwidth           (N > 1: a set that steals)

Not in it: reads from the disk (the prefetcher overlaps them; a set larger than the page cache pays
them), the cached tables' own overhead (their gather and the slots' capture), and the commit
worker's competition for the cores. The ring bounds N: a set writes back early when the ring is
half full (commit.CommitPipeline), so each N is priced at the interval it would get.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..checkpoint.layout import record_bytes

PAGE_BYTES = 4096
INTERVALS = (1, 2, 4, 8, 16, 32, 64)
# the cache sizes priced, as shares of the smallest table's rows (`--cache-rows` is at most that)
CACHE_SHARES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
# A configuration within this share of the best predicted step counts as good as the best: the
# smallest cache, then the shortest interval (less redo to replay after a crash) among them wins,
# so a flat curve never buys memory for a step the model cannot tell apart.
SLACK = 0.05


@dataclasses.dataclass(frozen=True)
class TierSpeeds:
    """The tiers as a short probe measured them (jobs/tier_probe.py)."""

    fast_row_us: float            # a random 256-byte row read and written in a mapping of the fast tier
    capacity_row_us: float        # the same in the capacity tier's file, its pages cached and dirty
    page_write_back_us: float     # a clean capacity page dirtied by one row and written back (fdatasync), each
    sync_ms: float                # fdatasync's fixed cost
    copy_mb_s: float              # the fast tier's copy bandwidth: what a redo record's bytes cost

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TableShape:
    """What the model needs of a table: its rows and their bytes in each of its regions."""

    name: str
    rows: int
    strides: tuple[int, ...]      # bytes a row takes in each region: weights (aligned), optimizer state
    state_bytes: int              # optimizer state bytes a row (a record's state column)

    def record(self, count: int) -> int:
        """Ring bytes of one undo or redo record of `count` rows (0 rows: none)."""
        return record_bytes(count, self.strides[0], self.state_bytes) if count else 0


@dataclasses.dataclass
class Traffic:
    """What one configuration's misses do, per held-out batch."""

    lookups: float                # lookups of the capacity tables that have a cache
    hits: float                   # of those, served by the cache
    miss_lookups: float           # lookups of every capacity table not served by a cache
    redo_bytes: float             # redo records of the missed rows (a set that steals)
    ring_bytes: float             # undo and redo records together: the ring a batch takes
    pages: list[list[np.ndarray]]  # per batch: each cold region's distinct pages the misses dirty

    def pages_dirtied(self, n: int) -> float:
        """Mean distinct capacity pages the misses of n consecutive batches dirty (write-back's work)."""
        windows = len(self.pages) // n
        if not windows:
            raise ValueError(f"{len(self.pages)} held-out batches cannot price a write-back every {n}")
        total = 0
        for region in range(len(self.pages[0])):
            seen = np.zeros(int(max((int(b[region].max()) + 1 for b in self.pages if b[region].size), default=0)),
                            bool)
            for w in range(windows):
                for batch in self.pages[w * n:(w + 1) * n]:
                    fresh = batch[region][~seen[batch[region]]]
                    total += fresh.size
                    seen[fresh] = True
                seen[:] = False
        return total / windows


def traffic(shapes: list[TableShape], cold: set[str], batches: list[dict[str, np.ndarray]],
            hot: dict[str, np.ndarray]) -> Traffic:
    """The misses of `batches` ({table: ids [N]} each, held out from the ranking that chose `hot`)
    when the tables named in `cold` live in the capacity tier and cache `hot` ({table: row ids})."""
    lookups = hits = misses = redo = ring = 0
    pages: list[list[np.ndarray]] = []
    for batch in batches:
        dirtied = []
        for shape in shapes:
            ids = np.asarray(batch[shape.name], dtype=np.int64)
            if shape.name not in cold:
                ring += shape.record(np.unique(ids).size)
                continue
            cached = np.isin(ids, hot[shape.name]) if shape.name in hot else np.zeros(ids.size, bool)
            if shape.name in hot:
                lookups += ids.size
                hits += int(cached.sum())
            missed = np.unique(ids[~cached])
            misses += int((~cached).sum())
            redo += shape.record(missed.size)
            ring += shape.record(np.unique(ids[cached]).size) + 2 * shape.record(missed.size)
            dirtied += [np.unique(missed * stride // PAGE_BYTES) for stride in shape.strides]
        pages.append(dirtied)
    n = max(len(batches), 1)
    return Traffic(lookups / n, hits / n, misses / n, redo / n, ring / n, pages)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A priced configuration. The keys shared with `train --profile --json`'s "measured" are
    COMPARABLE; the rest say how the step was put together."""

    cache_rows_option: int | None  # `--cache-rows` (None: the planner's use of --fast-bytes)
    cache_bytes: int              # the fast tier's bytes the caches take
    write_back_every: int         # the option
    batches_per_write_back: int   # what the ring lets it be
    cache_rows: dict[str, int]    # tables with a cache: its rows
    cache_hit_rate: float | None  # the caches' share of their tables' lookups (None: no cache)
    miss_lookups_per_batch: float
    disk_bytes_written_per_batch: float
    redo_bytes_per_batch: float
    fast_step_ms: float
    misses_ms: float
    write_back_ms: float
    redo_ms: float

    @property
    def step_ms(self) -> float:
        return self.fast_step_ms + self.misses_ms + self.write_back_ms + self.redo_ms

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "step_ms": self.step_ms}


# the keys a plan's prediction and a run's measurement both have (docs/planner.md)
COMPARABLE = ("step_ms", "cache_rows", "cache_hit_rate", "miss_lookups_per_batch", "disk_bytes_written_per_batch",
              "redo_bytes_per_batch", "write_back_every", "batches_per_write_back")


def predict(speeds: TierSpeeds, fast_step_ms: float, option: int | None, cache_rows: dict[str, int],
            cache_bytes: int, seen: Traffic, interval: int, ring_bytes: int) -> Prediction:
    """The step of one configuration: `option` its --cache-rows, which cache `cache_rows` ({table:
    rows}) in `cache_bytes`; `seen` its traffic; `ring_bytes` its undo ring's size."""
    # a stealing set writes back once the ring is half full (commit.CommitPipeline)
    fits = int(ring_bytes // (2 * seen.ring_bytes)) + 1 if seen.ring_bytes else interval
    every = max(1, min(interval, fits, len(seen.pages)))
    pages = seen.pages_dirtied(every)
    redo = seen.redo_bytes if every > 1 else 0.0
    return Prediction(
        cache_rows_option=option, cache_bytes=cache_bytes, write_back_every=interval, batches_per_write_back=every,
        cache_rows={name: rows for name, rows in cache_rows.items() if rows},
        cache_hit_rate=seen.hits / seen.lookups if seen.lookups else None,
        miss_lookups_per_batch=seen.miss_lookups, disk_bytes_written_per_batch=pages * PAGE_BYTES / every,
        redo_bytes_per_batch=redo, fast_step_ms=fast_step_ms,
        misses_ms=seen.miss_lookups * max(0.0, speeds.capacity_row_us - speeds.fast_row_us) / 1e3,
        write_back_ms=(speeds.sync_ms + pages * speeds.page_write_back_us / 1e3) / every if pages else 0.0,
        redo_ms=redo / (speeds.copy_mb_s * 1e3))


def cache_candidates(min_rows: int, cold_row_bytes: int, room: int) -> list[int | None]:
    """The `--cache-rows` priced: None (the planner's own caches), and shares of the smallest
    table's rows (CACHE_SHARES) whose caches fit in `room` bytes (`cold_row_bytes`: a row of every
    capacity table together), and the most that fits."""
    most = min(min_rows, room // cold_row_bytes) if cold_row_bytes else 0
    sizes = {max(1, int(min_rows * share)) for share in CACHE_SHARES} | ({most} if most else set())
    return [None, *sorted(n for n in sizes if n <= most)]


def choose(priced: list[Prediction]) -> Prediction:
    """The configuration to use: the smallest room, then the shortest interval, whose predicted step
    is within SLACK of the best one's."""
    if not priced:
        raise ValueError("no configuration to choose from")
    best = min(p.step_ms for p in priced)
    return min((p for p in priced if p.step_ms <= best * (1 + SLACK)), key=_smaller)


def _smaller(p: Prediction) -> tuple:
    return p.cache_bytes, p.write_back_every, p.cache_rows_option is not None


def shown(priced: list[Prediction], chosen: Prediction) -> list[Prediction]:
    """The alternatives a printout shows: each cache size at its best interval, and the chosen one
    at each interval."""
    best: dict[int | None, Prediction] = {}
    for p in priced:
        if p.cache_rows_option not in best or p.step_ms < best[p.cache_rows_option].step_ms:
            best[p.cache_rows_option] = p
    rows = {id(p): p for p in [*best.values(), *(p for p in priced if p.cache_rows_option == chosen.cache_rows_option)]}
    return sorted(rows.values(), key=_smaller)


def train_options(p: Prediction) -> str:
    """The options that make `train` run the configuration `p` (beside --fast-bytes as given)."""
    cache = "" if p.cache_rows_option is None else f"--cache-rows {p.cache_rows_option} "
    return f"{cache}--write-back-every {p.write_back_every}"


def format_choice(priced: list[Prediction], chosen: Prediction, fast_step_how: str) -> str:
    """The priced alternatives (a short table), the choice, and why."""
    head = (f"{'--cache-rows':>12} {'cached bytes':>13} {'hit rate':>8} {'misses':>8} {'every':>5} "
            f"{'written MB':>10} {'redo MB':>8} {'step ms':>8}")
    lines = [f"priced configurations (docs/planner.md), per batch; fast-tier step {chosen.fast_step_ms:.1f} ms "
             f"({fast_step_how}):", head, "-" * len(head)]
    for p in shown(priced, chosen):
        rate = "-" if p.cache_hit_rate is None else f"{p.cache_hit_rate:.1%}"
        every = (f"{p.write_back_every}" if p.batches_per_write_back == p.write_back_every
                 else f"{p.write_back_every}>{p.batches_per_write_back}")
        mark = "  <- chosen" if p is chosen else ""
        option = "planner" if p.cache_rows_option is None else f"{p.cache_rows_option:,}"
        lines.append(f"{option:>12} {p.cache_bytes:>13,} {rate:>8} "
                     f"{p.miss_lookups_per_batch:>8,.0f} {every:>5} {p.disk_bytes_written_per_batch / 1e6:>10.2f} "
                     f"{p.redo_bytes_per_batch / 1e6:>8.2f} {p.step_ms:>8.1f}{mark}")
    best = min(priced, key=lambda p: p.step_ms)
    lines.append(f"chosen: {train_options(chosen)}: predicted "
                 f"step {chosen.step_ms:.1f} ms = fast-tier step {chosen.fast_step_ms:.1f} + misses "
                 f"{chosen.misses_ms:.1f} + write-back {chosen.write_back_ms:.1f} + redo {chosen.redo_ms:.1f}")
    lines.append(f"why: the best predicted step is {best.step_ms:.1f} ms ({train_options(best)}); the smallest "
                 f"cache, then the shortest interval, within {SLACK:.0%} of it is chosen ('planner': the "
                 "planner's own caches in what --fast-bytes leaves)")
    return "\n".join(lines)
