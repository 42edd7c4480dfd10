"""`cxltrain crashtest --enumerate`: every crash state of one commit, as pmreorder and CrashMonkey do.

One batch's update and commit run on the crash-model devices (the emulated device's power-loss
model, and for a pool set the capacity tier's crash model), with an observer on each device
(Device.observer) called after every fence it completes and once at its close. Between two
observations a crash may leave, on each device:

    everything durable at that device's last fence (its media, or its file after the sync), and
    any subset of the atoms whose value in the process's view differs from it: 8-byte words on
    the emulated device (a store not yet written back, or written back and not yet fenced, may or
    may not have reached the media), whole pages on the capacity tier (a page write not yet
    synced may or may not have reached the disk).

Each such interval's states are enumerated (every subset where it has at most `exhaustive_atoms`
dirty atoms, else at most `samples` of them: nothing, everything, each run of adjacent dirty atoms
alone and all but it, then random subsets of random density), written to the pool files, recovered
and exported, and compared bit for bit with an uninterrupted run: of the batches committed before,
or of those after where the state holds the primary pool's new root whole (the commit point).

A native kernel's own persists (the fused capture's, the dense payload's) are observations too:
the power-loss device hands it a domain whose on_fence calls the observer (kernels/persist.h). The
commit runs on the training thread (no pipeline), so the observations are in program order. Two
values stored to one word between fences are seen as the last one alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import shutil
import tempfile

import numpy as np

from .. import faults, knobs
from ..emulation.cxl import memory_dir
from ..errors import ConfigError, CxlTrainError
from ..pool import format as fmt
from .config import TrainConfig
from .crashtest import TRIAL_CONFIG, References, differences

EXHAUSTIVE_ATOMS = 8   # intervals with at most this many dirty atoms: all 2^n states
SAMPLES = 24           # the bound on the states of any other interval


@dataclasses.dataclass
class Dirty:
    """One device's atoms a crash in an interval may keep or lose: atom numbers [n] int64 and their
    values in the process's view [n, atom bytes] uint8."""

    atoms: np.ndarray
    values: np.ndarray


@dataclasses.dataclass
class Interval:
    """The crash states between two observations: `dirty` per device; `advanced` per device that
    fenced at its end, the atoms its durable bytes gained there (Dirty), else None."""

    what: str
    dirty: list[Dirty]
    advanced: list[Dirty | None]


class Recorder:
    """Device.observer of every device of a pool (the primary's first): keeps, per observation, what
    a crash since the previous one may keep or lose. Needs crash-model devices (durable(),
    crash_atom_bytes). With `after_root` (the offset of a root slot of the primary) it starts once
    that slot's durable bytes change, right after the fence that made a root durable there: the
    recording then begins at a commit, inside a process that has trained since it started."""

    def __init__(self, devices: list, after_root: int | None = None) -> None:
        for device in devices:
            if not hasattr(device, "durable") or device.size % device.crash_atom_bytes:
                raise ConfigError(f"{device.path}: {type(device).__name__} has no crash model to enumerate "
                                  "(or its size is no whole number of atoms)")
        self.devices = devices
        self.atoms = [d.crash_atom_bytes for d in devices]
        self._slot = after_root
        self._old_root = None if after_root is None else self._root_bytes()
        self.start: list[np.ndarray] = []   # durable when the recording began
        self.intervals: list[Interval] = []
        self.errors: list[str] = []
        if after_root is None:
            self._begin()
        for device in devices:
            device.observer = self

    def _root_bytes(self) -> np.ndarray:
        return self.devices[0].durable()[self._slot : self._slot + fmt.ROOT.size]

    def _begin(self) -> None:
        self.start = [d.durable() for d in self.devices]
        self._durable = [a.copy() for a in self.start]
        self._open = [True] * len(self.devices)

    @property
    def started(self) -> bool:
        return bool(self.start)

    def __call__(self, device, fence: bool) -> None:
        try:
            self._observe(device, fence)
        except Exception as e:  # a native kernel's callback cannot raise: kept, and raised after the run
            self.errors.append(f"{type(e).__name__}: {e}")

    def _observe(self, device, fence: bool) -> None:
        if not self.started:
            if device is self.devices[0] and fence and not np.array_equal(self._root_bytes(), self._old_root):
                self._begin()
            return
        k = self.devices.index(device)
        dirty = [self._dirty(i) for i in range(len(self.devices))]
        advanced: list[Dirty | None] = [None] * len(self.devices)
        if fence:
            now = device.durable()
            advanced[k] = _differ(self._durable[k], now, self.atoms[k])
            self._durable[k] = now
        else:
            self._open[k] = False  # closed: its view is gone, its durable bytes stay
        self.intervals.append(Interval(f"{'fence' if fence else 'close'} of {os.path.basename(device.path)}",
                                       dirty, advanced))

    def _dirty(self, i: int) -> Dirty:
        if not self._open[i]:
            return Dirty(np.zeros(0, np.int64), np.zeros((0, self.atoms[i]), np.uint8))
        return _differ(self._durable[i], self.devices[i].array, self.atoms[i])


def _differ(old: np.ndarray, new: np.ndarray, atom: int) -> Dirty:
    """The atoms of `new` [size] uint8 that differ from `old`, with their values in `new`."""
    a, b = old.reshape(-1, atom), new.reshape(-1, atom)
    if atom == 8:
        differ = np.flatnonzero(a.view(np.uint64)[:, 0] != b.view(np.uint64)[:, 0])
    else:
        differ = np.flatnonzero((a != b).any(axis=1))
    return Dirty(differ.astype(np.int64), b[differ].copy())


def choose_states(atoms: list[np.ndarray], rng: random.Random, exhaustive_atoms: int,
                  samples: int) -> list[np.ndarray]:
    """The states of one interval, given each device's dirty atom numbers [n_i] int64: per state, a
    mask [sum n_i] bool of the dirty atoms it keeps (devices one after the other). Every subset
    when sum n_i <= exhaustive_atoms, else at most `samples` states: nothing; everything; runs of
    adjacent atoms (a store, a row, a record, a root), each alone and all but it, as many as half
    the bound allows, picked at random; random subsets of random density for the rest."""
    n = sum(a.size for a in atoms)
    if n <= exhaustive_atoms:
        bits = (np.arange(1 << n)[:, None] >> np.arange(n)[None, :]) & 1
        return list(bits.astype(bool))
    masks = [np.zeros(n, bool), np.ones(n, bool)]
    runs = adjacent_runs(atoms)
    for start, stop in rng.sample(runs, min(len(runs), max(0, samples // 4 - 1))):
        alone = np.zeros(n, bool)
        alone[start:stop] = True
        masks += [alone, ~alone]
    np_rng = np.random.default_rng(rng.randrange(1 << 63))
    while len(masks) < samples:
        masks.append(np_rng.random(n) < np_rng.random())
    return masks[:samples]


def adjacent_runs(atoms: list[np.ndarray]) -> list[tuple[int, int]]:
    """Runs of adjacent atom numbers on one device, as [start, stop) in the devices' concatenation."""
    out, at = [], 0
    for numbers in atoms:
        if numbers.size:
            breaks = np.flatnonzero(np.diff(numbers) != 1) + 1
            edges = np.concatenate(([0], breaks, [numbers.size])) + at
            out += list(zip(edges[:-1].tolist(), edges[1:].tolist()))
        at += numbers.size
    return out


@dataclasses.dataclass
class Outcome:
    """What the enumeration of one commit found."""

    name: str
    batches: tuple[int, int]   # batches committed before the recorded commit, and after it
    intervals: int             # observations: fences, and the devices' closes
    exhaustive: int            # intervals whose every state was tried
    states: int                # crash states chosen, over all intervals
    tried: int                 # distinct ones among them, each recovered and compared
    after: int                 # of those, holding the new root (expected: the batches after)
    inexact: list[str]         # one line per state that recovered to anything but its expected state

    def line(self) -> str:
        return (f"{self.name}: batch {self.batches[1]}'s update and commit, {self.intervals} fences and closes, "
                f"{self.tried} crash states tried ({self.after} holding the new root; {self.exhaustive} "
                f"intervals exhaustive), {len(self.inexact)} inexact")

    def to_json(self) -> dict:
        return {"name": self.name, "batches": list(self.batches), "intervals": self.intervals,
                "exhaustive_intervals": self.exhaustive, "states": self.states, "tried": self.tried,
                "after": self.after, "inexact": len(self.inexact), "problems": self.inexact[:5]}


# What the recorded run (and only it) is: every fence in program order, every persist through a device.
RECORDED = dict(pipeline=False)
# The devices' crash models, no early write-back (the enumeration chooses what reached the media).
MODELS = dict(power_loss=1, domain="adr", evict_rate=0, capacity_crash=1, threads=1)
PLAIN = dict(power_loss=0, capacity_crash=0, threads=1)


def enumerate_commit(*, pool_set: bool, before: int = 2, plant: str = "", seed: int = 0,
                     exhaustive_atoms: int = EXHAUSTIVE_ATOMS, samples: int = SAMPLES,
                     config: TrainConfig = TRIAL_CONFIG, folder: str | None = None) -> Outcome:
    """Train `before` batches, record the next batch's update and commit (with `plant` planted in
    both runs), then recover every chosen crash state of it and compare it bit for bit with an
    uninterrupted run. Returns what it found; the pools live in a folder of their own, removed after."""
    if plant and plant not in faults.PLANTED:
        raise ConfigError(f"unknown planted fault {plant!r}; choose one of {', '.join(faults.PLANTED)}")
    if before < 2 or samples < 2 or not 0 <= exhaustive_atoms <= 16:
        raise ConfigError(f"enumeration: needs 2 or more batches before (got {before}), 2 or more samples (got "
                          f"{samples}), and 0-16 atoms tried exhaustively (got {exhaustive_atoms})")
    work = tempfile.mkdtemp(prefix="cxltrain-enumerate-", dir=folder or memory_dir())
    try:
        return _enumerate(work, pool_set, before, plant, seed, exhaustive_atoms, samples,
                          dataclasses.replace(config, dense_every=1, **RECORDED))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _enumerate(work: str, pool_set: bool, before: int, plant: str, seed: int, exhaustive_atoms: int,
               samples: int, config: TrainConfig) -> Outcome:
    from .train import train

    primary = os.path.join(work, "enumerated.pool")
    capacity = os.path.join(work, "enumerated.cap") if pool_set else None
    # a set's enumerated commit syncs its capacity pool (forcing): a stealing set's run would end
    # with one more commit, its write-back, than the two recorded
    config = dataclasses.replace(config, capacity_pool=capacity, fast_bytes=0 if pool_set else None,
                                 write_back_every=1 if pool_set else config.write_back_every)
    seen: dict = {}

    def record(rt) -> None:
        seen["root_seq"] = rt.pool.root.seq
        # from the commit of batch `before` on, made by this very process (a bug may need one update before)
        seen["recorder"] = Recorder([rt.pool.device] + [m.device for m in rt.pool.members],
                                    after_root=fmt.ROOT_OFFSETS[(rt.pool.root.seq + 1) % 2])
        seen["pool"] = rt.pool

    with knobs.override(**MODELS):
        faults.arm(None, plant)
        try:
            train(dataclasses.replace(config, steps=before - 1), pool_path=primary, progress=False)
            train(dataclasses.replace(config, steps=before + 1), pool_path=primary, progress=False, on_ready=record)
        finally:
            faults.arm(None, "")
    recorder: Recorder = seen["recorder"]
    if recorder.errors:
        raise CxlTrainError(f"enumeration: the recorder failed: {recorder.errors[0]}")
    if seen["pool"].root.seq != seen["root_seq"] + 2 or not recorder.started:
        raise CxlTrainError(f"enumeration: the recorded run wrote {seen['pool'].root.seq - seen['root_seq']} "
                            "roots, not the two commits it is meant to hold")
    paths = [primary] + ([capacity] if capacity else [])
    final = [np.fromfile(p, np.uint8) for p in paths]
    slot = fmt.ROOT_OFFSETS[seen["root_seq"] % 2]  # the recorded commit's root: seq root_seq + 2
    new_root = final[0][slot : slot + fmt.ROOT.size]
    batches = (before, before + 1)
    with knobs.override(**PLAIN):
        references = References(dataclasses.replace(config, capacity_pool=None, fast_bytes=None),
                                 os.path.join(work))
        want = {b: references(b) for b in batches}
    outcome = Outcome("pool set" if pool_set else "one pool", batches, len(recorder.intervals), 0, 0, 0, 0, [])
    rng = random.Random(f"{seed}:{outcome.name}")
    images = [a.copy() for a in recorder.start]
    tried: set[bytes] = set()
    for number, interval in enumerate(recorder.intervals):
        atoms = [d.atoms for d in interval.dirty]
        masks = choose_states(atoms, rng, exhaustive_atoms, samples)
        outcome.exhaustive += sum(a.size for a in atoms) <= exhaustive_atoms
        outcome.states += len(masks)
        for mask in masks:
            state = _apply(images, interval.dirty, recorder.atoms, mask)
            key = hashlib.sha256(b"".join(hashlib.sha256(s).digest() for s in state)).digest()
            if key in tried:
                continue
            tried.add(key)
            committed = bool(np.array_equal(state[0][slot : slot + fmt.ROOT.size], new_root))
            outcome.after += committed
            problem = _recover_and_compare(paths, state, want[batches[committed]])
            if problem:
                outcome.inexact.append(f"interval {number} ({interval.what}), {int(mask.sum())} of {mask.size} "
                                       f"dirty atoms kept, expected batch {batches[committed]}: {problem}")
        for image, gained, atom in zip(images, interval.advanced, recorder.atoms):
            if gained is not None:
                image.reshape(-1, atom)[gained.atoms] = gained.values
    outcome.tried = len(tried)
    return outcome


def _apply(images: list[np.ndarray], dirty: list[Dirty], atoms: list[int], mask: np.ndarray) -> list[np.ndarray]:
    """The devices' durable bytes with the atoms `mask` keeps written over them (copies)."""
    out, at = [], 0
    for image, d, atom in zip(images, dirty, atoms):
        state = image.copy()
        keep = mask[at : at + d.atoms.size]
        state.reshape(-1, atom)[d.atoms[keep]] = d.values[keep]
        out.append(state)
        at += d.atoms.size
    return out


def _recover_and_compare(paths: list[str], state: list[np.ndarray], want: dict) -> str | None:
    """Write the state to the pool files, recover and export it; what differs from `want`, or None."""
    from ..runtime.runtime import export_state

    for path, image in zip(paths, state):
        image.tofile(path)
    try:
        with knobs.override(**PLAIN):
            got = export_state(paths[0])
    except CxlTrainError as e:
        return f"recovery refused: {e}"
    found = differences(got, want)
    return f"batch {got['batch']}, {len(found)} differ: {', '.join(found[:3])}" if found else None
