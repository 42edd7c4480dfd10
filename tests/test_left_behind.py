"""Nothing outlives a killed trainer (issue 35, item 4): its DataLoader workers do not keep the
pool locked, so a restart right after a SIGKILL opens it; the ranks of `train --nproc-per-node 2`
end with their launcher, and a run of theirs leaves nothing in $TMPDIR; and a creation killed half-way
is named, and removed, by the next command that meets it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cxltrain.faults import CRASH_ENV
from cxltrain.jobs.processes import alive, children, rank_of
from cxltrain.pool.handle import Pool
from helpers import cxltrain, cxltrain_command

TRAINER_WITH_WORKERS = """
import sys, time
from torch.utils.data import DataLoader, Dataset
from cxltrain.pool.handle import Pool

class Slow(Dataset):
    def __len__(self):
        return 1 << 20
    def __getitem__(self, i):
        time.sleep(0.01)
        return i

pool = Pool.create(sys.argv[1], 1 << 20)
batches = iter(DataLoader(Slow(), batch_size=1, num_workers=2))
next(batches)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_restart_right_after_a_sigkill_opens_the_pool_its_workers_held(shm_dir):
    path = str(shm_dir / "workers.pool")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_WITH_WORKERS, path], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        Pool.open(path).close()  # at once, as torchrun or a supervisor restarts it
    finally:
        trainer.kill()


def test_the_ranks_end_with_their_launcher(shm_dir):
    run = shm_dir / "run"
    command = cxltrain_command() + ["train", "--nproc-per-node", "2", "--pool", str(run), "--steps", "100000",
                                    "--batch-size", "96", "--num-tables", "3", "--rows", "2000", "--dim", "16",
                                    "--no-progress", "--dist-timeout", "30"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = []
    try:
        for line in launcher.stdout:
            if "training from batch" in line:
                break
        ranks = children(launcher.pid)
        assert len(ranks) == 2, ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(alive, ranks)), "the ranks outlived their launcher"
        done = cxltrain("pool", "check", run)
        assert done.returncode == 0, done.stderr
    finally:
        launcher.kill()
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_run_on_two_ranks_leaves_nothing_in_the_temporary_folder(shm_dir, tmp_path):
    """The launcher's folder (the ranks' error lines, torchrun's log folder) goes with it; before,
    torchrun left a torchelastic_* folder in $TMPDIR at every run."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    done = cxltrain("train", "--nproc-per-node", "2", "--pool", shm_dir / "run", "--steps", "3", "--batch-size", "32",
                    "--num-tables", "2", "--rows", "500", "--dim", "8", "--no-progress", env={"TMPDIR": str(temporary)})
    assert done.returncode == 0, done.stderr
    # torchinductor_<user>: torch's cache of compiled code, one per user, meant to outlive runs
    assert [name for name in os.listdir(temporary) if not name.startswith("torchinductor_")] == []


@pytest.mark.parametrize("command", [("pool", "info"), ("pool", "check"), ("recover",)])
def test_a_creation_killed_half_way_is_named_and_removed(shm_dir, command):
    path = shm_dir / "killed.pool"
    killed = cxltrain("train", "--pool", path, "--steps", "2", "--num-tables", "2", "--rows", "1000",
                      "--no-progress", env={CRASH_ENV: "create:before-superblock"})
    assert killed.returncode != 0 and os.path.exists(f"{path}.creating"), killed
    done = cxltrain(*command, path)
    assert done.returncode == 1 and f"removed {path}.creating" in done.stderr, done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not os.path.exists(f"{path}.creating")


def test_a_creation_still_running_is_left_alone(shm_dir):
    path = str(shm_dir / "running.pool")
    with Pool.create(path + ".creating", 1 << 20):  # this process is its creator, alive
        done = cxltrain("pool", "info", path)
        assert done.returncode == 1 and "being created by a running process" in done.stderr, done
        assert os.path.exists(path + ".creating")


@pytest.mark.parametrize("sent", ["SIGTERM", "SIGINT"])
def test_a_sigterm_ends_a_rank_blocked_in_a_collective_within_seconds(shm_dir, sent):
    """Rank 1 stopped (SIGSTOP: a peer that is gone), rank 0 blocks in the next collective; torchrun's
    agent would SIGTERM it (or pass on the launcher's Ctrl-C), and it must end within seconds, not
    wait out the collective's timeout (120 s here; before, its Python handler never ran while
    blocked, and the agent waited 30 s before a SIGKILL; for SIGINT, until this test had it)."""
    run = shm_dir / "blocked"
    command = cxltrain_command() + ["train", "--nproc-per-node", "2", "--pool", str(run), "--steps", "100000",
                                    "--batch-size", "96", "--num-tables", "3", "--rows", "2000", "--dim", "16",
                                    "--no-progress", "--dist-timeout", "120", "--max-restarts", "0"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = {}
    try:
        for line in launcher.stdout:
            if "training from batch" in line:
                break
        ranks = {rank_of(pid): pid for pid in children(launcher.pid)}
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(1.0)  # rank 0 reaches the next collective and waits there for rank 1
        os.kill(ranks[0], getattr(signal, sent))
        deadline = time.monotonic() + 20
        while alive(ranks[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(ranks[0]), f"rank 0 ignored the {sent} while blocked"
    finally:
        launcher.kill()
        for pid in ranks.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)


RANK_ENDING = """
import os, signal, sys, time
os.environ.update(TORCHELASTIC_RUN_ID="test", CXLTRAIN_RANK_ERRORS=sys.argv[1])
from cxltrain.cli import stop
signal.signal(signal.SIGTERM, stop.install())  # as main() does, before the rank's own handler
stop.end_rank_on_signal()
try:
    raise RuntimeError("a collective failed")
except RuntimeError:
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))  # the agent's, while the rank handles its error
    time.sleep(10)
    print("the rank went on")
"""


@pytest.mark.parametrize("sent", ["SIGTERM", "SIGINT"])
def test_a_signal_ends_a_rank_at_once_even_while_it_handles_its_error(tmp_path, sent):
    """The agent SIGTERMs a rank that has lost its peer as the rank writes its line: it ends there,
    with 128 + the signal and nothing on its streams (before: an exception raised in its error path,
    a traceback beside the launcher's line, or an abort at the interpreter's exit that the launcher
    named as the run's cause)."""
    done = subprocess.run([sys.executable, "-c", RANK_ENDING, str(tmp_path / "errors"), sent], capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (128 + getattr(signal, sent), "", ""), done
