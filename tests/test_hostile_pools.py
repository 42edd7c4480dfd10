"""Hostile pool images: `pool check` and `recover` on damaged copies of real checkpointed pools.

Two seed images, both from real training runs of CONFIG (2 tables of 500 rows, tiny MLPs, a
64 KiB undo ring: one image is ~2.3 MB):

    trained   `train` ran 3 batches and ended: root at batch 3, no live undo records (the ring still
              holds the records of earlier batches, which the older root slot needs);
    killed    a child `train` SIGKILLed just before the root of batch 3 (commit:before-root:3): root
              at batch 2, batch 2's undo records live, its rows already updated in place, and the
              batch-3 snapshot in the dense slot the root does not name.

Hypothesis damages a seed image (bit flips and byte patches aimed at every structure, random bytes
over a whole structure or region, a valid superblock, roots and directory over a garbage data area,
truncation, extension) and runs what the command line runs, in this process: `pool check`
(pool_inspect.inspect, then runtime.check_checkpoint) and `recover` (runtime.recover_pool). Each image
must end one of two ways:

  * refused: a CxlTrainError with a one-line message (any other exception fails the test), and a
    refused `recover` leaves the file byte for byte as it was;
  * recovered: the exported model (tables, dense parameters, optimizer and scheduler state) equals,
    tensor for tensor, an uninterrupted run of as many batches as recovery reports — the only
    legitimate states (the trained image may legitimately fall back to batch 2 when its newest
    root is damaged). And `pool check` agrees: it passed before recovery, and passes after.

What the format detects, and so what "silently wrong" is checked against: every structure read to
decide anything is checksummed (superblock, root slots, live directory entries, undo record headers
and payloads, the undo ring's tail mark, dense slot headers and payloads), and bounds are checked
after each checksum. Table rows (weights and optimizer state) are not: they are the live data,
rewritten in place every batch, and a checksum per row per batch would cost what the checkpointer
exists to save. A damaged table row is used as it is, unless recovery restores it from an undo
record; the state check excludes exactly the table rows a mutation overwrote, everything else must
be exact. Two independent faults that each hide the other (both tail mark copies and a record
header, say) are beyond the format too; the fuzzer's up-to-3 mutations have not produced one.

The default suite runs a derandomized sample (HOSTILE_EXAMPLES per seed image, reproducible);
`-m slow` runs HOSTILE_EXAMPLES_SLOW per seed image from a random seed the test prints (rerun with
CXLTRAIN_TEST_SEED).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import cxltrain.jobs.train as trainer
from cxltrain import cli
from cxltrain.checkpoint import layout, ring
from cxltrain.errors import CxlTrainError, NonFiniteError, PoolError
from cxltrain.faults import CRASH_ENV
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.train import build_model, train
from cxltrain.knobs import override
from cxltrain.pool import format as fmt
from cxltrain.pool.format import RegionKind
from cxltrain.pool.handle import Pool
from cxltrain.pool.info import inspect
from cxltrain.runtime.runtime import Runtime, check_checkpoint, export_state, recover_pool
from cxltrain.tables.bag import PersistentEmbeddingBag
from helpers import assert_same_export, cxltrain, reference_export, run_python, shm_tempdir
from test_checkpoint_crash import differences
from test_cli import assert_one_line_error
from test_pool import _newer_version
from test_runtime import make_batch, make_run, state_of, train_steps

CONFIG = TrainConfig(steps=3, batch_size=32, num_tables=2, rows=500, dim=8, bottom_mlp=(8,), top_mlp=(8,), seed=5)
RING_BYTES = 64 << 10
HOSTILE_EXAMPLES = int(os.environ.get("HOSTILE_N", 1000))
HOSTILE_EXAMPLES_SLOW = 5000
SEED = int(os.environ.get("CXLTRAIN_TEST_SEED", random.randrange(1 << 30)))


# ---------------------------------------------------------------------------------------------
# Seed images and where their structures are.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SeedImage:
    name: str
    image: bytes
    spans: tuple[tuple[str, int, int], ...]    # (structure, first byte, end), aimed at by mutations
    tables: tuple[tuple[str, int, int, int], ...]  # (export key, offset, row stride, rows): unchecksummed rows


def _run_killed(path: str) -> None:
    """`train` of CONFIG in a child process, SIGKILLed before the root of batch 3 is written."""
    code = ("from cxltrain.jobs.config import TrainConfig; from cxltrain.jobs.train import train; "
            f"train({CONFIG!r}, pool_path={path!r}, progress=False)")
    env = {CRASH_ENV: "commit:before-root:3", "CXLTRAIN_UNDO_RING_BYTES": str(RING_BYTES)}
    child = run_python(code, env=env, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr


def _export_keys() -> dict[str, str]:
    """{pool region name: export key} of CONFIG's tables (export names them by module path)."""
    keys = {}
    for path, module in build_model(CONFIG).named_modules():
        if isinstance(module, PersistentEmbeddingBag):
            keys[module.weight_region] = f"{path}.weight"
            keys[module.state_region] = f"{path}.optimizer_state"
    return keys


def _spans(path: str) -> tuple[tuple, tuple]:
    """Every structure of the pool at `path` (as the seed holds it), and its table regions."""
    with Pool.open(path, writable=False) as pool:
        root, regions = pool.root, pool.regions
        spans = [("superblock", 0, fmt.SUPERBLOCK.size),
                 ("root A", fmt.ROOT_OFFSETS[0], fmt.ROOT_OFFSETS[0] + fmt.ROOT.size),
                 ("root B", fmt.ROOT_OFFSETS[1], fmt.ROOT_OFFSETS[1] + fmt.ROOT.size),
                 ("directory", fmt.DIR_OFFSET, fmt.DIR_OFFSET + root.dir_count * fmt.DIR_ENTRY.size),
                 ("metadata", 0, pool.superblock.data_offset),
                 ("data area", pool.superblock.data_offset, pool.superblock.pool_size)]
        undo = pool.region(layout.RING_REGION)
        # every record of this generation, from the ring's start: the live ones and those the older
        # root slot would still need
        for record in ring.scan(pool, root.ring_generation, 0, 0):
            start = undo.offset + record.offset
            spans += [("undo header", start, start + layout.UNDO_HEADER.size),
                      ("undo payload", start + layout.UNDO_HEADER.size,
                       start + layout.UNDO_HEADER.size + record.header.payload_bytes)]
        spans += [("undo ring", undo.offset, undo.end), ("undo tail mark", undo.end - layout.TAIL_BYTES, undo.end)]
        for slot, name in enumerate(layout.DENSE_REGIONS, start=1):
            region = regions[name]
            header = pool.device.array[region.offset : region.offset + layout.DENSE_HEADER.size].tobytes()
            _, length, _ = layout.unpack_dense_header(header, pool.superblock.uuid, slot)
            payload = region.offset + layout.DENSE_HEADER.size
            spans += [("dense header", region.offset, payload), ("dense payload", payload, payload + length),
                      ("dense slot", region.offset, region.end)]
        keys = _export_keys()
        tables = []
        for region in regions.values():
            if region.kind in (RegionKind.TABLE_WEIGHTS, RegionKind.TABLE_OPTIM_STATE):
                spans.append(("table rows", region.offset, region.end))
                tables.append((keys[region.name], region.offset, region.row_stride, region.shape[0]))
    assert {s[0] for s in spans} >= {"undo header", "undo payload", "dense payload", "table rows"}
    return tuple(spans), tuple(tables)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    with shm_tempdir("cxltrain-hostile-") as path:
        yield path


@pytest.fixture(scope="module")
def seeds(folder) -> dict[str, SeedImage]:
    made = {}
    for name in ("trained", "killed"):
        path = os.path.join(folder, f"seed-{name}.pool")
        if name == "trained":
            with override(undo_ring_bytes=RING_BYTES):
                train(CONFIG, pool_path=path, progress=False)
        else:
            _run_killed(path)
        spans, tables = _spans(path)
        with open(path, "rb") as f:
            made[name] = SeedImage(name, f.read(), spans, tables)
        os.unlink(path)
    return made


# ---------------------------------------------------------------------------------------------
# Mutations. Each is a plain tuple, so a failure prints one that replays.
# ---------------------------------------------------------------------------------------------
def mutations(seed_image: SeedImage):
    size = len(seed_image.image)
    span = st.sampled_from(seed_image.spans)
    offset = span.flatmap(lambda s: st.integers(s[1], s[2] - 1))
    return st.lists(st.one_of(
        st.tuples(st.just("flip"), offset, st.integers(0, 7)),
        st.tuples(st.just("bytes"), offset, st.binary(min_size=1, max_size=64)),
        # random bytes over a whole structure or region ("data area": a valid superblock, roots and
        # directory over garbage regions)
        span.flatmap(lambda s: st.tuples(st.just("garbage"), st.just(s[1]), st.just(s[2]), st.integers(0, 2**32 - 1))),
        st.tuples(st.just("truncate"), st.integers(0, size - 1)),
        st.tuples(st.just("extend"), st.integers(1, 1 << 16)),
    ), min_size=1, max_size=3)


def mutate(image: bytes, steps) -> tuple[bytearray, list[tuple[int, int]]]:
    """The damaged image, and the byte ranges of the original that the damage overwrote."""
    data = bytearray(image)
    touched = []
    for m in steps:
        if m[0] == "flip":
            if m[1] < len(data):
                data[m[1]] ^= 1 << m[2]
                touched.append((m[1], m[1] + 1))
        elif m[0] == "bytes":
            end = min(len(data), m[1] + len(m[2]))
            data[m[1] : end] = m[2][: max(0, end - m[1])]
            touched.append((m[1], end))
        elif m[0] == "garbage":
            end = min(len(data), m[2])
            if m[1] < end:
                data[m[1] : end] = np.random.default_rng(m[3]).integers(0, 256, end - m[1], dtype=np.uint8).tobytes()
                touched.append((m[1], end))
        elif m[0] == "truncate":
            touched.append((m[1], len(data)))
            del data[m[1] :]
        else:
            data += bytes(m[1])
    return data, touched


def touched_rows(seed_image: SeedImage, touched) -> dict[str, list[int]]:
    """{export key: table rows a mutation overwrote}: the bytes no checksum covers."""
    rows = {}
    for key, offset, stride, count in seed_image.tables:
        hit = set()
        for start, end in touched:
            first, last = max(start, offset), min(end, offset + stride * count)
            if first < last:
                hit.update(range((first - offset) // stride, (last - 1 - offset) // stride + 1))
        if hit:
            rows[key] = sorted(hit)
    return rows


# ---------------------------------------------------------------------------------------------
# The check of one image.
# ---------------------------------------------------------------------------------------------
def one_line(error: CxlTrainError) -> str:
    message = str(error)
    assert message and "\n" not in message, repr(message)
    return message


def pool_check(path: str) -> list[str]:
    """What `cxltrain pool check` does, in this process: its problems (empty: ok)."""
    report = inspect(path)
    if report.ok:
        try:
            check_checkpoint(path)
        except PoolError as e:
            report.problems.append(one_line(e))
    for problem in report.problems:
        assert problem and "\n" not in problem, repr(problem)
    return report.problems


def check_image(seed_image: SeedImage, steps, folder: str) -> str:
    """Run `pool check` and `recover` on the damaged image; returns "refused" or "recovered"."""
    data, touched = mutate(seed_image.image, steps)
    path = os.path.join(folder, "hostile.pool")
    with open(path, "wb") as f:
        f.write(data)
    problems = pool_check(path)
    try:
        recover_pool(path)
    except CxlTrainError as e:
        one_line(e)
        with open(path, "rb") as f:
            assert f.read() == data, "a refused recover changed the pool"
        return "refused"
    assert problems == [], f"recover succeeded on a pool `pool check` refuses: {problems}"
    assert pool_check(path) == [], "the recovered pool fails `pool check`"
    got = export_state(path)  # recovers again: recovery is idempotent
    want = reference_export(CONFIG, got["batch"], folder)
    for key, rows in touched_rows(seed_image, touched).items():
        got["model"][key][rows] = want["model"][key][rows]  # no checksum covers table rows
    wrong = differences(got, want)
    assert wrong == [], f"recovered to batch {got['batch']} but differs from that batch's state at {wrong[:4]}"
    return "recovered"


# ---------------------------------------------------------------------------------------------
# The fuzzers.
# ---------------------------------------------------------------------------------------------
def fuzz(seeds, folder, name: str, examples: int, derandomize: bool) -> None:
    seed_image = seeds[name]
    outcomes = {"refused": 0, "recovered": 0}

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))
    @given(steps=mutations(seed_image))
    def run(steps):
        outcomes[check_image(seed_image, steps, folder)] += 1

    if not derandomize:
        run = seed(SEED)(run)
        print(f"hostile pools: hypothesis seed {SEED} (rerun with CXLTRAIN_TEST_SEED={SEED})")
    started = time.perf_counter()
    run()
    print(f"hostile pools, {name}: {sum(outcomes.values())} images in {time.perf_counter() - started:.1f} s: "
          f"{outcomes['refused']} refused, {outcomes['recovered']} recovered exactly")
    assert outcomes["refused"] and outcomes["recovered"]  # both branches were exercised


@pytest.mark.parametrize("name", ["trained", "killed"])
def test_hostile_images_are_refused_or_recovered_exactly(seeds, folder, name):
    fuzz(seeds, folder, name, HOSTILE_EXAMPLES, derandomize=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trained", "killed"])
def test_many_hostile_images(seeds, folder, name):
    fuzz(seeds, folder, name, HOSTILE_EXAMPLES_SLOW, derandomize=False)


# ---------------------------------------------------------------------------------------------
# Regressions the fuzzer found.
# ---------------------------------------------------------------------------------------------
def test_a_damaged_generation_fails_the_header_check_instead_of_overflowing():
    """A flipped high bit in an undo header's generation made the checksum seed overflow (an
    OverflowError, not a refusal): checksum indices are taken modulo 2**32."""
    uuid = bytes(range(16))
    header = layout.UndoHeader(0, 1, 0, 2, 1, 64, 4, 0, 1)
    raw = bytearray(header.pack(uuid))
    raw[12] ^= 1  # generation 1 -> 2**32 + 1
    assert layout.unpack_undo_header(bytes(raw), uuid) is None
    assert layout.unpack_undo_header(header.pack(uuid), uuid) == header


# ---------------------------------------------------------------------------------------------
# A few damaged images through the real command line.
# ---------------------------------------------------------------------------------------------
def _span(seed_image: SeedImage, name: str) -> tuple[int, int]:
    """The last structure called `name` (for undo records: the newest, live in the killed image)."""
    return [(start, end) for label, start, end in seed_image.spans if label == name][-1]


CLI_DAMAGE = [  # (seed image, damage, what both commands must say)
    ("killed", lambda s: [("flip", _span(s, "undo header")[0] + 20, 3)], "undo record 5 is damaged"),
    ("killed", lambda s: [("garbage", *_span(s, "undo ring"), 7)], "tail mark is damaged"),
    ("trained", lambda s: [("flip", _span(s, "dense payload")[0] + 100, 0),
                           ("flip", _span(s, "dense payload")[0] + 100, 0)], None),  # flipped back: intact
    ("trained", lambda s: [("garbage", *_span(s, "data area"), 11)], "damaged"),
]


@pytest.mark.parametrize("name,damage,message", CLI_DAMAGE, ids=["undo header", "undo ring", "intact", "data area"])
def test_damaged_images_on_the_command_line(seeds, folder, name, damage, message):
    data, _ = mutate(seeds[name].image, damage(seeds[name]))
    path = os.path.join(folder, "cli.pool")
    with open(path, "wb") as f:
        f.write(data)
    check, recover = cxltrain("pool", "check", path), None
    if message is None:
        assert check.returncode == 0 and "checkpoint at batch 3" in check.stdout, check.stderr
        assert cxltrain("recover", path).returncode == 0
        return
    assert_one_line_error(check, match=message)
    recover = cxltrain("recover", path)
    assert_one_line_error(recover, match=message)
    with open(path, "rb") as f:
        assert f.read() == data


# ---------------------------------------------------------------------------------------------
# Non-finite gradients: the run stops, the batch is not committed, resuming works.
# ---------------------------------------------------------------------------------------------
def _poisoned_batch(model, batch, table: str):
    """The TwoTower loss with a NaN put into `table`'s gradient alone (the loss stays finite)."""
    users, items, labels = batch
    out = {"user": model.towers["user"](users), "item": model.towers["item"](items)}
    out[table].register_hook(lambda grad: grad * float("nan"))
    logits = model.head(torch.cat([out["user"], out["item"]], dim=1)).squeeze(1)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


@pytest.mark.parametrize("table", ["user", "item"])
def test_a_non_finite_table_gradient_stops_the_run_before_the_batch_commits(shm_dir, table):
    path = shm_dir / "nan.pool"
    train_steps(path, 3)
    before = state_of(path)
    model, optimizer, scheduler = make_run()
    with pytest.raises(NonFiniteError, match=f"table '{table}': gradient in batch 3 is not finite"):
        with Runtime(path, model, optimizer, schedulers=[scheduler]) as rt:
            for batch in rt.batches(make_batch, stop=5):
                _poisoned_batch(model, batch, table).backward()
    assert_same_export(state_of(path), before)  # the other table's stores, if any, are rolled back
    assert torch.isfinite(state_of(path)["model"][f"towers.{table}.weight"]).all()
    train_steps(path, 5)  # resuming works, and ends where an uninterrupted run does
    train_steps(shm_dir / "ref.pool", 5)
    assert_same_export(state_of(path), state_of(shm_dir / "ref.pool"))


def test_a_non_finite_loss_stops_train_before_its_backward(folder, monkeypatch):
    """`train` checks the loss (the dense parameters' only guard): a NaN loss at batch 2 stops
    the run with one clear error, the pool keeps batch 2, and the next run resumes from it."""
    path = os.path.join(folder, "nan-loss.pool")
    real = torch.nn.functional.binary_cross_entropy_with_logits
    calls = []

    def poisoned(logits, labels):
        calls.append(1)
        loss = real(logits, labels)
        return loss * float("nan") if len(calls) == 3 else loss  # batch 2

    monkeypatch.setattr(trainer.torch.nn.functional, "binary_cross_entropy_with_logits", poisoned)
    with pytest.raises(NonFiniteError, match="batch 2: the loss is nan; stopped before its backward"):
        train(CONFIG, pool_path=path, progress=False)
    monkeypatch.undo()
    assert export_state(path)["batch"] == 2
    assert differences(export_state(path), reference_export(CONFIG, 2, folder)) == []
    assert train(CONFIG, pool_path=path, progress=False).progress.recovered_batch == 2
    assert differences(export_state(path), reference_export(CONFIG, 3, folder)) == []


# ---------------------------------------------------------------------------------------------
# Read-only pools, a full disk, a newer format.
# ---------------------------------------------------------------------------------------------
SMALL_CLI = ["--steps", "3", "--batch-size", "32", "--num-tables", "2", "--rows", "500", "--dim", "8", "--no-progress"]


@pytest.fixture
def mount_point(tmp_path):
    """A folder to mount on; skips the test where mounting needs privileges this process lacks."""
    target = tmp_path / "mnt"
    target.mkdir()
    yield target
    subprocess.run(["umount", str(target)], capture_output=True)


def _mount(args: list[str]) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here ({done.stderr.strip() or done.returncode}): needs root in a privileged box")


def _cli_as(uid: int, *args) -> subprocess.CompletedProcess:
    """cli.main(args) in a forked child running as `uid` (the interpreter itself may live where
    that user cannot read, so no new process is started), with its exit code and output."""
    pipes = [os.pipe(), os.pipe()]
    pid = os.fork()
    if pid == 0:  # child: report through the pipes, never return into pytest
        code = 99
        try:
            for fd, (_, write) in zip((1, 2), pipes):
                os.dup2(write, fd)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            os.setuid(uid)
            code = cli.main([str(a) for a in args])
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    outputs = []
    for read, write in pipes:
        os.close(write)
    for read, _ in pipes:
        with os.fdopen(read) as f:
            outputs.append(f.read())
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(status), *outputs)


def _read_only_commands(path: str, run) -> list[str]:
    """pool info and check work; recover and train refuse with one line (returned); nothing changes."""
    before = open(path, "rb").read()
    assert run("pool", "info", path).returncode == 0
    check = run("pool", "check", path)
    assert check.returncode == 0 and "checkpoint at batch 3" in check.stdout, check.stderr
    errors = []
    for command in (["recover", path], ["train", "--pool", path, *SMALL_CLI]):
        result = run(*command)
        assert_one_line_error(result, match=path)
        errors.append(result.stderr)
    assert open(path, "rb").read() == before
    return errors


def test_a_pool_on_a_read_only_mount(shm_dir, mount_point):
    with override(undo_ring_bytes=RING_BYTES):
        train(CONFIG, pool_path=str(shm_dir / "ro.pool"), progress=False)
    _mount(["--bind", "-o", "ro", str(shm_dir), str(mount_point)])
    errors = _read_only_commands(str(mount_point / "ro.pool"), cxltrain)
    assert all("Read-only file system" in e for e in errors), errors


def test_a_read_only_pool_file(shm_dir):
    """chmod 0444. Root ignores permission bits, so as root the commands run as user nobody."""
    path = shm_dir / "ro.pool"
    with override(undo_ring_bytes=RING_BYTES):
        train(CONFIG, pool_path=str(path), progress=False)
    os.chmod(path, 0o444)
    os.chmod(shm_dir, 0o755)
    run = functools.partial(_cli_as, 65534) if os.geteuid() == 0 else cxltrain
    errors = _read_only_commands(str(path), run)
    assert all("permission denied opening for read-write" in e for e in errors), errors


@pytest.mark.parametrize("how", ["tmpfs", "file size limit"])
def test_a_full_disk_when_creating_a_pool_leaves_no_file(tmp_path, mount_point, how):
    """posix_fallocate reserves every block up front: no room is one clear line, and no pool file
    (nor the `.creating` file train builds under) is left behind."""
    limit = {}
    if how == "tmpfs":
        _mount(["-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)])
        folder = mount_point
    else:  # the child may write no file larger than 1 MiB (EFBIG; Python ignores SIGXFSZ)
        folder = tmp_path / "out"
        folder.mkdir()
        limit = {"preexec_fn": lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))}
    assert_one_line_error(cxltrain("pool", "create", folder / "p.pool", "--size", "8M", **limit),
                          match="not enough space for a 8,388,608-byte pool")
    assert_one_line_error(cxltrain("train", "--pool", folder / "t.pool", *SMALL_CLI, **limit),
                          match="not enough space")
    assert os.listdir(folder) == []


def test_a_pool_of_a_newer_format_is_refused_by_every_command(shm_dir):
    path = shm_dir / "new.pool"
    assert cxltrain("train", "--pool", path, *SMALL_CLI).returncode == 0
    _newer_version(str(path))
    before = path.read_bytes()
    for command in (["pool", "check", path], ["recover", path], ["export", path, shm_dir / "x.pt"],
                    ["train", "--pool", path, *SMALL_CLI]):
        assert_one_line_error(cxltrain(*command), match="pool format v2 is newer than this cxltrain supports (v1)")
    assert path.read_bytes() == before and not (shm_dir / "x.pt").exists()


def test_the_tail_mark_layout_is_pinned():
    """The undo ring's tail mark is on-media format: two 64-byte copies closing the ring region."""
    uuid = bytes(range(16))
    raw = layout.pack_tail_mark(7, 12, uuid, 1)
    assert len(raw) == layout.TAIL_MARK.size == 64 and layout.TAIL_BYTES == 128
    assert raw[:4] == b"TAIL" and int.from_bytes(raw[8:16], "little") == 7 and int.from_bytes(raw[16:24], "little") == 12
    assert not any(raw[4:8]) and not any(raw[24:60])
    assert layout.unpack_tail_mark(raw, uuid, 1) == (7, 12)
    assert layout.unpack_tail_mark(raw, uuid, 0) is None  # each copy checksummed with its own index
    assert layout.ring_record_bytes(64 << 10) == (64 << 10) - 128
