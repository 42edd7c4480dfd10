"""Damaged images through every command that reads them, counted (docs/testing.md):

    python tools/fuzz_images.py N [--seed S] [--json]
    python tools/fuzz_images.py N --seed S --image K      # replay image K of that run

A lab instrument, not a `cxltrain` command: it measures how the commands meet damage (users never
need it for their own pools), and it drives the command line in this process as any caller of
`cxltrain.cli.main` would, from above the package's layers.

Four seed images are made once, by real runs: a trained pool, a pool killed before a commit's root
(live undo records), a pool set (primary on /dev/shm, capacity pool on the disk, a hot-row cache),
and a 2-rank run folder. Image i damages one seed (chosen by (seed, i)) in one to three ways:
bit flips, short byte runs, garbage over a whole structure (superblock, a root slot, the directory,
any region: the set's list of members, the placement plan, the cache's slots and row map, the undo
ring, a dense slot, table rows), truncation, extension; a cache map slot set to another row (one
no slot holds, one another slot holds, one past the table, a negative one); a set's capacity pool
emptied or removed; a run folder's manifest edited (a table's sharding, its ranks or bounds, the
world size, the run id, a byte) or its rank pools swapped or one removed. Then, in this process,
as the command line runs them: `pool info`, `pool check`, `recover`, `export`, and (pools and sets;
a run folder's `train` is a 2-rank launch, seconds each) `train` one batch further.

Counted per image:
  traceback  an exception other than the commands' own one-line refusal (must be 0)
  silent     damage accepted that changes what is read (must be 0): `export` succeeds and its
             state is not, bit for bit, an uninterrupted run's of the batch it names; or `train`
             succeeds where `export` refused; or a refused command changed the files or left output
  rows       `export` succeeds and differs only where the damage hit table rows (weights, optimizer
             state, a cache's slots and its row map; a truncation, those past the cut, which read
             as zeros once the file is extended again): no checksum covers rows by design
             (docs/testing.md), so these are counted apart, not as silent
  several    a refusal of `pool info`, `recover`, `export` or `train` longer than one line

A cache map slot moved to a row no other slot holds is such row damage: the map is the last column
of the slots' optimizer-state rows, rewritten in place at every admission and re-placement like
any row, and a checksum over it would have to be rewritten, under the undo log, at each of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np

from cxltrain import faults
from cxltrain.cli.main import main as cli_main
from cxltrain.emulation.cxl import memory_dir
from cxltrain.errors import CxlTrainError
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.crashtest import References, differences
from cxltrain.jobs.crashtest_ranks import RankReferences, stop_launched, train_args
from cxltrain.jobs.train import train
from cxltrain.knobs import override
from cxltrain.pool import format as fmt
from cxltrain.pool.cache_format import map_of
from cxltrain.pool.format import RegionKind
from cxltrain.pool.info import inspect

POOL_CONFIG = TrainConfig(steps=3, batch_size=32, num_tables=2, rows=500, dim=8, bottom_mlp=(8,), top_mlp=(8,), seed=5)
SET_CONFIG = dataclasses.replace(POOL_CONFIG, cache_rows=50)
RUN_CONFIG = dataclasses.replace(POOL_CONFIG, num_tables=3)
RING_BYTES = 64 << 10
ROW_KINDS = (RegionKind.TABLE_WEIGHTS, RegionKind.TABLE_OPTIM_STATE)
SEEDS = ("pool", "killed", "set", "run")


@dataclasses.dataclass
class Tally:
    images: int = 0
    tracebacks: int = 0
    silent: int = 0
    rows: int = 0         # accepted, differing only in unchecksummed table rows
    refused: int = 0      # `export` refused
    exact: int = 0        # `export` accepted, bit for bit an uninterrupted run's state
    several: int = 0      # refusals longer than one line
    by_seed: dict = dataclasses.field(default_factory=lambda: {s: 0 for s in SEEDS})
    findings: list = dataclasses.field(default_factory=list)  # (image, seed, damage, what)

    def to_json(self) -> dict:
        return {**{k: v for k, v in dataclasses.asdict(self).items() if k != "findings"},
                "findings": [{"image": i, "seed": s, "damage": d, "what": w} for i, s, d, w in self.findings[:20]]}


@dataclasses.dataclass(frozen=True)
class Seed:
    name: str
    files: dict          # {relative path: bytes}
    spans: dict          # {relative path: [(structure, start, end, rows?)]}
    options: list        # `train` options that resume it (None: no in-process train)
    batch: int           # the batch its export names


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------
def _spans(path: str) -> list[tuple]:
    """(structure, first byte, end, whether it is table rows, its Region or None) of every structure
    of one pool file."""
    report = inspect(path)
    spans = [("superblock", 0, fmt.SUPERBLOCK.size, False, None),
             ("root A", fmt.ROOT_OFFSETS[0], fmt.ROOT_OFFSETS[0] + fmt.ROOT.size, False, None),
             ("root B", fmt.ROOT_OFFSETS[1], fmt.ROOT_OFFSETS[1] + fmt.ROOT.size, False, None),
             ("directory", fmt.DIR_OFFSET, fmt.DIR_OFFSET + len(report.regions) * fmt.DIR_ENTRY.size, False, None)]
    spans += [(r.name, r.offset, r.offset + r.size, r.kind in ROW_KINDS, r) for r in report.regions]
    return spans


def _read_files(folder: str, names: list[str]) -> dict:
    return {name: open(os.path.join(folder, name), "rb").read() for name in names}


def _cli(*args: str) -> tuple[int, str, str]:
    """The command line in this process: (exit status, stdout, stderr). An exception that escapes
    it (a traceback, for a user) propagates."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def _train_options(config: TrainConfig) -> list[str]:
    return ["--batch-size", str(config.batch_size), "--num-tables", str(config.num_tables), "--rows",
            str(config.rows), "--dim", str(config.dim), "--bottom-mlp", ",".join(map(str, config.bottom_mlp)),
            "--top-mlp", ",".join(map(str, config.top_mlp)), "--seed", str(config.seed), "--no-progress"]


def make_seeds(folder: str, disk: str) -> dict[str, Seed]:
    """The four seed images, made by real runs in `folder` (and the capacity pool in `disk`)."""
    import subprocess

    seeds = {}
    pool = os.path.join(folder, "pool.pool")
    with override(undo_ring_bytes=RING_BYTES):
        train(POOL_CONFIG, pool_path=pool, progress=False)
    seeds["pool"] = Seed("pool", _read_files(folder, ["pool.pool"]), {"pool.pool": _spans(pool)},
                         _train_options(POOL_CONFIG), POOL_CONFIG.steps)
    killed = os.path.join(folder, "killed.pool")
    done = subprocess.run([sys.executable, "-m", "cxltrain", "train", "--pool", killed, "--steps", "3",
                           *_train_options(POOL_CONFIG)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, faults.CRASH_ENV: "commit:before-root:3",
                               "CXLTRAIN_UNDO_RING_BYTES": str(RING_BYTES)})
    if done.returncode != -9:
        raise CxlTrainError(f"crashtest --fuzz: the killed seed run was not killed: {done.stderr[-300:]}")
    seeds["killed"] = Seed("killed", _read_files(folder, ["killed.pool"]), {"killed.pool": _spans(killed)},
                           _train_options(POOL_CONFIG), 2)
    primary, capacity = os.path.join(folder, "set.pool"), os.path.join(disk, "set.cap")
    train(dataclasses.replace(SET_CONFIG, capacity_pool=capacity), pool_path=primary, progress=False)
    seeds["set"] = Seed("set", {"set.pool": open(primary, "rb").read(), "@set.cap": open(capacity, "rb").read()},
                        {"set.pool": _spans(primary), "@set.cap": _spans(capacity)},
                        [*_train_options(SET_CONFIG), "--capacity-pool", "@set.cap", "--cache-rows",
                         str(SET_CONFIG.cache_rows)], SET_CONFIG.steps)
    run = os.path.join(folder, "run")
    done = subprocess.run([sys.executable, "-m", "cxltrain", *train_args(run, RUN_CONFIG)[:-1]], capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise CxlTrainError(f"crashtest --fuzz: the 2-rank seed run failed: {done.stderr[-300:]}")
    names = sorted(os.listdir(run))
    seeds["run"] = Seed("run", _read_files(run, names),
                        {f"run/{n}": _spans(os.path.join(run, n)) for n in names if n.endswith(".pool")},
                        None, RUN_CONFIG.steps)
    seeds["run"] = dataclasses.replace(seeds["run"], files={f"run/{n}": b for n, b in seeds["run"].files.items()})
    for made in (pool, killed, primary, capacity):
        os.unlink(made)
    shutil.rmtree(run)
    return seeds


# ---------------------------------------------------------------------------------------------
# Damage
# ---------------------------------------------------------------------------------------------
def damage(seed: Seed, rng: random.Random) -> tuple[dict, list[str], set[str]]:
    """(damaged files {relative path: bytes, or None for removed}, what was done, the tables whose
    rows (weights, optimizer state, cache slots and map) the damage hit)."""
    files = {name: bytearray(data) for name, data in seed.files.items()}
    done, tables = [], set()
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        what, hit = _one_damage(seed, files, rng)
        done.append(what)
        tables |= hit if isinstance(hit, set) else {hit} - {None}
    return {k: (None if v is None else bytes(v)) for k, v in files.items()}, done, tables


def _one_damage(seed: Seed, files: dict, rng: random.Random) -> tuple[str, str | set[str] | None]:
    """One damage: (what was done, the table (or tables) whose rows it hit, or None)."""
    pools = [n for n in seed.spans if files.get(n) is not None]
    roll = rng.random()
    if seed.name == "run" and roll < 0.35:
        return _damage_run(files, rng), None
    if seed.name == "set" and roll < 0.1:
        member = "@set.cap"
        if rng.random() < 0.5:
            files[member] = None
            return "capacity pool removed", None
        files[member] = bytearray()
        return "capacity pool emptied", None
    if seed.name in ("set", "run") and roll < 0.3 and _cache_map(seed, pools):
        return _damage_map(seed, files, rng)
    name = rng.choice(pools)
    data = files[name]
    structure, start, end, is_rows, _ = rng.choice(seed.spans[name])
    kind = rng.choice(("flip", "flip", "bytes", "garbage", "truncate", "extend"))
    if kind == "truncate":
        cut = rng.randrange(0, len(data)) if data else 0
        del data[cut:]
        # the rows past the cut read as zeros if the file is extended again (a later damage): row
        # damage, as garbage over them is (docs/testing.md); what else it cut is checksummed
        lost = {s[0].split(".")[0] for s in seed.spans[name] if s[3] and s[2] > cut}
        return f"{name} truncated to {cut} bytes", lost
    if kind == "extend":
        data += bytes(rng.randint(1, 1 << 16))
        return f"{name} extended", None  # nothing read changes: any refusal is the commands' own choice
    end = min(end, len(data))
    if start >= end:
        return f"{name}: {structure} already cut off", None
    table = structure.split(".")[0] if is_rows else None
    if kind == "flip":
        at = rng.randrange(start, end)
        data[at] ^= 1 << rng.randrange(8)
        return f"{name}: bit flipped in {structure} at {at}", table
    if kind == "bytes":
        at = rng.randrange(start, end)
        patch = rng.randbytes(rng.randint(1, 64))[: end - at]
        data[at : at + len(patch)] = patch
        return f"{name}: {len(patch)} random bytes in {structure} at {at}", table
    data[start:end] = np.random.default_rng(rng.randrange(1 << 32)).integers(0, 256, end - start,
                                                                              dtype=np.uint8).tobytes()
    return f"{name}: garbage over {structure}", table


def _cache_map(seed: Seed, pools: list[str]) -> list[tuple[str, tuple]]:
    """[(file, span)] of the cache slot state regions (their last column is the row map)."""
    return [(name, span) for name in pools for span in seed.spans[name] if span[0].endswith(".cache.optim")]


def _damage_map(seed: Seed, files: dict, rng: random.Random) -> tuple[str, str | None]:
    name, span = rng.choice(_cache_map(seed, [n for n in seed.spans if files.get(n) is not None]))
    state = span[4]
    raw = bytes(files[name][span[1] : span[2]])
    if len(raw) < state.size:
        return f"{name}: {span[0]} already cut off", None
    held = map_of(state, raw)
    table_rows = POOL_CONFIG.rows if seed.name == "set" else _rank_rows(seed, name, span[0])
    slot = rng.randrange(held.size)
    choice = rng.choice(("unused row", "another slot's row", "past the table", "negative"))
    free = sorted(set(range(table_rows)) - set(held.tolist()))
    value = {"unused row": rng.choice(free), "another slot's row": int(held[(slot + 1) % held.size]),
             "past the table": table_rows + rng.randrange(1 << 20), "negative": -rng.randint(2, 1 << 20)}[choice]
    at = span[1] + slot * state.row_stride + (state.shape[1] - 1) * 4
    files[name][at : at + 4] = np.int32(value).tobytes()
    # a slot moved to a row no slot holds is row damage (module docstring); the others must be refused
    return (f"{name}: cache map slot {slot} of {span[0]} set to {choice} {value}",
            span[0].split(".")[0] if choice == "unused row" else None)


def _rank_rows(seed: Seed, name: str, state_name: str) -> int:
    """The rows of the table whose cache `state_name` is, in pool `name`."""
    table = state_name[: -len(".cache.optim")]
    return next(span[4].shape[0] for span in seed.spans[name] if span[0] == f"{table}.weight")


MANIFEST_EDITS = ("a table's sharding", "a table's ranks", "a table's bounds", "the world size", "the run id",
                  "a key removed", "a byte", "truncated", "rank pools swapped", "a rank pool removed")


def _damage_run(files: dict, rng: random.Random) -> str:
    """One damage to a run folder's manifest or to which rank pool is where."""
    name = "run/manifest.json"
    edit = rng.choice(MANIFEST_EDITS)
    if edit == "rank pools swapped":
        files["run/rank-0.pool"], files["run/rank-1.pool"] = files["run/rank-1.pool"], files["run/rank-0.pool"]
        return edit
    if edit == "a rank pool removed":
        files[f"run/rank-{rng.randrange(2)}.pool"] = None
        return edit
    if files.get(name) is None:
        return "manifest already removed"
    raw = bytes(files[name])
    if edit in ("a byte", "truncated") or not _parses(raw):
        data = bytearray(raw)
        if edit == "truncated" or not data:
            del data[rng.randrange(len(data) + 1):]
        else:
            data[rng.randrange(len(data))] = rng.randrange(256)
        files[name] = data
        return f"manifest: {edit}"
    m = json.loads(raw)
    tables = m.get("plan", {}).get("tables") or [{}]
    table = rng.choice(tables)
    if edit == "a table's sharding":
        table["kind"] = rng.choice([k for k in ("table-wise", "row-wise", "data-parallel") if k != table.get("kind")])
    elif edit == "a table's ranks":
        table["ranks"] = rng.choice(([0], [1], [1, 0], [0, 1, 2], []))
    elif edit == "a table's bounds":
        table["bounds"] = rng.choice(([], [0, 1000, 2000], [0, 999, 2000], [0, 1000, 500]))
    elif edit == "the world size":
        m["world_size"] = rng.choice((1, 3, 0, -1))
    elif edit == "the run id":
        m["run"] = "%032x" % rng.randrange(1 << 128)
    else:
        m.pop(rng.choice(sorted(m)), None)
    files[name] = bytearray(json.dumps(m).encode())
    return f"manifest: {edit}"


def _parses(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# One image through the commands
# ---------------------------------------------------------------------------------------------
class Fuzzer:
    """Makes the seeds once, then checks images: `Fuzzer(seed).run(n, on_image)`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.work = tempfile.mkdtemp(prefix="cxltrain-fuzz-", dir=memory_dir())
        self.disk = tempfile.mkdtemp(prefix="cxltrain-fuzz-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
        self.images = os.path.join(self.work, "image")
        self.seeds: dict[str, Seed] = {}
        self.references = {"pool": References(POOL_CONFIG, self.work),
                           "set": References(dataclasses.replace(SET_CONFIG, capacity_pool="set"), self.work,
                                             self.disk)}
        self.references["killed"] = self.references["pool"]
        self.tally = Tally()

    def make_seeds(self) -> None:
        with override(threads=1):
            self.seeds = make_seeds(self.work, self.disk)
        self.references["run"] = RankReferences(RUN_CONFIG, self.work)

    def _place(self, files: dict) -> dict[str, str]:
        """Write the image's files; {relative name: path}. '@' names go to the disk folder."""
        shutil.rmtree(self.images, ignore_errors=True)
        os.makedirs(os.path.join(self.images, "run"))
        for leftover in os.listdir(self.disk):
            os.unlink(os.path.join(self.disk, leftover))
        paths = {}
        for name, data in files.items():
            path = os.path.join(self.disk, name[1:]) if name.startswith("@") else os.path.join(self.images, name)
            paths[name] = path
            if data is not None:
                with open(path, "wb") as f:
                    f.write(data)
        return paths

    def check(self, number: int) -> None:
        rng = random.Random(f"{self.seed}:{number}")
        seed = self.seeds[SEEDS[number % len(SEEDS)]]
        files, done, hit_tables = damage(seed, rng)
        paths = self._place(files)
        target = paths["run/manifest.json"].rsplit("/", 1)[0] if seed.name == "run" else paths[next(iter(files))]
        self.tally.images += 1
        self.tally.by_seed[seed.name] += 1
        what = "; ".join(done)
        try:
            with override(threads=1, undo_ring_bytes=RING_BYTES):
                verdict = self._commands(seed, target, paths, hit_tables)
        except Exception as e:  # anything but a one-line refusal reaches the user as a traceback
            self.tally.tracebacks += 1
            self.tally.findings.append((number, seed.name, what, f"traceback: {type(e).__name__}: {e}"))
            return
        if verdict:
            kind, said = verdict
            setattr(self.tally, kind, getattr(self.tally, kind) + 1)
            if kind in ("silent", "several"):
                self.tally.findings.append((number, seed.name, what, said))

    def _digest(self, paths: dict) -> list:
        return [hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.exists(p) else None
                for p in paths.values()]

    def _commands(self, seed: Seed, target: str, paths: dict, hit_tables: set[str]) -> tuple[str, str] | None:
        import torch

        for command in (("pool", "info"), ("pool", "check")):
            code, _, err = _cli(*command, target)
            if "Traceback" in err:
                raise RuntimeError(f"{' '.join(command)} printed a traceback")
            if command == ("pool", "info") and code and len(err.strip().splitlines()) > 1:
                return "several", f"pool info refused in {len(err.strip().splitlines())} lines"
        before = self._digest(paths)
        code, out, err = _cli("recover", target)
        if code:
            if self._digest(paths) != before:
                return "silent", "recover refused, and changed the files"
            if len(err.strip().splitlines()) != 1:
                return "several", f"recover refused in {len(err.strip().splitlines())} lines"
        exported = os.path.join(self.work, "export.pt")
        if os.path.exists(exported):
            os.unlink(exported)
        code, out, err = _cli("export", target, exported)
        state = None
        if code:
            self.tally.refused += 1
            if os.path.exists(exported):
                return "silent", "export refused, and wrote its file"
            if len(err.strip().splitlines()) != 1:
                return "several", f"export refused in {len(err.strip().splitlines())} lines"
        else:
            state = torch.load(exported, weights_only=True)
        trained = self._train(seed, target, paths, None if state is None else state["batch"])
        if state is None:
            return ("silent", f"train accepted what export refused ({err.strip()})") if trained == "ok" else trained
        if trained not in ("ok", None):
            return trained
        wrong = differences(state, self.references[seed.name](state["batch"]))
        if not wrong:
            self.tally.exact += 1
            return None
        if all(any(f".embedding_bags.{t}." in key for t in hit_tables) for key in wrong):
            return "rows", ""  # only the tables whose rows were hit differ
        return "silent", f"export accepted at batch {state['batch']}, differing at {wrong[:3]}"

    def _train(self, seed: Seed, target: str, paths: dict, batch: int | None):
        """`train` one batch further: "ok", None (refused in one line, nothing written), or a verdict."""
        if seed.options is None:
            return None  # a run folder: a 2-rank launch per image costs seconds (module docstring)
        options = [paths.get(o, o) for o in seed.options]
        before = self._digest(paths)
        code, _, err = _cli("train", "--pool", target, "--steps", str((batch or 0) + 1), *options)
        if code == 0:
            return "ok"
        if len(err.strip().splitlines()) != 1:
            return "several", f"train refused in {len(err.strip().splitlines())} lines"
        if batch is None and self._digest(paths) != before:
            return "silent", f"train refused ({err.strip()}) and changed the files"
        return None

    def run(self, images: int | list[int], on_image=lambda: None) -> Tally:
        """Check images 0..images-1 (or those numbered in a list: a replay); Ctrl-C (SIGINT) stops after the image in hand (the commands
        would take it for their own interruption, a refusal)."""
        import signal

        stopped = []
        previous = signal.signal(signal.SIGINT, lambda *_: stopped.append(True))
        try:
            started = time.perf_counter()
            self.make_seeds()
            self.seed_seconds = time.perf_counter() - started
            for number in range(images) if isinstance(images, int) else images:
                if stopped:
                    break
                self.check(number)
                on_image()
        finally:
            signal.signal(signal.SIGINT, previous)
        return self.tally

    def close(self) -> None:
        stop_launched()
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tqdm import tqdm

    p = argparse.ArgumentParser(description="Damage N images (pools, a killed pool, pool sets, 2-rank run "
                                            "folders) and run pool info, pool check, recover, export and train on "
                                            "each; count tracebacks and damage accepted silently.")
    p.add_argument("images", type=int, metavar="N")
    p.add_argument("--seed", type=int, default=None, help="the images' plan (default: random, printed)")
    p.add_argument("--json", action="store_true", help="a JSON summary as the last line")
    p.add_argument("--image", type=int, action="append", metavar="K",
                   help="replay only image K of the plan (N and --seed as in the run that found it); repeatable")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    asked = args.image or args.images
    print(f"fuzz_images: seed {seed}, " + (f"images {', '.join(map(str, args.image))} replayed" if args.image
                                          else f"{args.images} damaged images"), flush=True)
    fuzzer = Fuzzer(seed)
    total = len(args.image) if args.image else args.images
    bar = tqdm(total=total, desc="fuzz", unit="image", file=sys.stderr, dynamic_ncols=True, mininterval=30)
    started = time.perf_counter()
    try:
        tally = fuzzer.run(asked, lambda: bar.update(1))
    finally:
        bar.close()
        fuzzer.close()
    seconds = time.perf_counter() - started
    checked = seconds - fuzzer.seed_seconds
    print(f"{tally.images}/{total} images in {seconds:.0f} s ({tally.images / max(checked, 1e-9):.1f} images/s "
          f"after {fuzzer.seed_seconds:.0f} s making the seeds): {tally.tracebacks} tracebacks, {tally.silent} "
          f"silent acceptances; export refused {tally.refused}, exact {tally.exact}, differing only in "
          f"unchecksummed table rows {tally.rows}; refusals longer than one line {tally.several}")
    for image, seed_name, damage_done, what in tally.findings[:10]:
        print(f"  image {image} ({seed_name}: {damage_done}): {what}")
    if args.json:
        print(json.dumps({"seed": seed, "asked": total, "seconds": round(seconds, 1), **tally.to_json()}))
    return 0 if not (tally.tracebacks or tally.silent or tally.several) and tally.images == total else 1


if __name__ == "__main__":
    sys.exit(main())
