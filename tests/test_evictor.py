"""Early write-back (emulation/evictor.py): unpersisted lines reach the media before their flush,
some torn at 8-byte boundaries, and never over a newer persisted value."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from cxltrain.knobs import override
from cxltrain.pool.handle import Pool
from emulation.evictor import MAX_CREDIT_SECONDS

SIZE = 1 << 20


def _pool_device(path: str, rate: int, seed: int = 1):
    with override(power_loss=1, evict_rate=rate, evict_seed=seed):
        pool = Pool.create(path, SIZE, backend="emulated")
    return pool, pool.device


def _media(path: str, offset: int, length: int) -> np.ndarray:
    with open(path, "rb") as f:   # read() sees the file, i.e. the media
        f.seek(offset)
        return np.frombuffer(f.read(length), dtype=np.uint64)


def _wait_for(predicate, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_unpersisted_lines_reach_the_media_some_torn(shm_dir):
    path = str(shm_dir / "evict.pool")
    # slow enough that torn lines stay torn for a second or more after the wait ends: at 200,000
    # lines/s the evictor had rewritten every one whole 50 ms later, less than a loaded machine may
    # take to wake this thread (0 torn of 2,048 then; at 2,000 lines/s, 246 after 1.5 s)
    rate = 2_000
    pool, dev = _pool_device(path, rate=rate)
    with pool:
        offset = pool.superblock.data_offset
        lines = 2048
        words = dev.array[offset : offset + lines * 64].view(np.uint64)
        started = time.monotonic()
        words[:] = np.arange(1, words.size + 1, dtype=np.uint64)   # every word differs from the media (zeros)
        assert _wait_for(lambda: dev.evictor.torn_lines > 20 and dev.evictor.lines_written > 200)
        dev.evictor.stop()
        elapsed = time.monotonic() - started
        media = _media(path, offset, lines * 64).reshape(lines, 8)
        mine = words.reshape(lines, 8)
        landed = media == mine
        assert (landed | (media == 0)).all()             # a word is old or new, never anything else
        whole, none = landed.all(axis=1), ~landed.any(axis=1)
        torn = ~whole & ~none
        assert whole.sum() > 50 and torn.sum() > 5       # written back early, some lines only in part
        # Only lines the evictor counted changed, and it counted no more than its rate allows (a
        # loaded machine only slows it down, so this bound holds however long the wait took).
        assert (~none).sum() <= dev.evictor.lines_written
        assert dev.evictor.lines_written <= rate * elapsed + rate * MAX_CREDIT_SECONDS + 64


def test_without_eviction_nothing_unpersisted_reaches_the_media(shm_dir):
    path = str(shm_dir / "quiet.pool")
    pool, dev = _pool_device(path, rate=0)
    with pool:
        assert dev.evictor is None
        offset = pool.superblock.data_offset
        dev.array[offset : offset + 64 * 256] = 7
        time.sleep(0.1)
        assert (_media(path, offset, 64 * 256) == 0).all()


def test_eviction_never_reverts_a_persisted_line(shm_dir):
    """The evictor copies lines while this thread keeps storing and persisting new values into the
    same lines; after each persist the media must hold that value (the media lock at work). Seen
    failing with the lock removed and the evictor's read-to-write window widened (a sleep between
    them); without the sleep the GIL alone mostly hides the race, which the C flush kernel, running
    without the GIL, would not."""
    path = str(shm_dir / "race.pool")
    pool, dev = _pool_device(path, rate=1_000_000)
    with pool:
        offset = pool.superblock.data_offset
        media = np.frombuffer(dev._media, dtype=np.uint8)
        region = dev.array[offset : offset + 64 * 64].view(np.uint64)
        value, deadline = 0, time.monotonic() + 20
        while dev.evictor.lines_written < 20_000 and time.monotonic() < deadline:
            value += 1
            region[:] = value
            dev.persist(offset, 64 * 64)
            seen = media[offset : offset + 64 * 64].view(np.uint64)
            assert (seen == value).all(), f"persisted {value}, media holds {np.unique(seen)}"
            region[:] = value + (1 << 40)   # unpersisted: the evictor may or may not take it
            time.sleep(0)                   # let the evictor run between the store and the next persist
        assert dev.evictor.lines_written >= 20_000


def test_a_killed_process_keeps_early_written_lines(shm_dir):
    """What early write-back means at a power failure: stores that were never persisted survive."""
    path = str(shm_dir / "kill.pool")
    pool, _ = _pool_device(path, rate=0)
    offset = pool.superblock.data_offset
    pool.close()
    body = f"""
import os, signal, time
from cxltrain.pool.handle import Pool
from emulation.evictor import MAX_CREDIT_SECONDS
pool = Pool.open({path!r})
dev = pool.device
dev.array[{offset}:{offset} + 64 * 1024] = 9
while dev.evictor.lines_written < 100:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""
    out = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CXLTRAIN_POWER_LOSS": "1", "CXLTRAIN_EVICT_RATE": "100000"})
    assert out.returncode == -signal.SIGKILL, out.stderr
    data = np.frombuffer(open(path, "rb").read(), dtype=np.uint8)[offset : offset + 64 * 1024]
    assert (data == 9).sum() >= 100 * 8 and (data == 0).any()   # some lines (or words of them) survived


@pytest.mark.parametrize("rate", [-1])
def test_evictor_refuses_a_rate_that_is_not_positive(rate):
    import threading

    from cxltrain.emulation.evictor import Evictor

    with pytest.raises(ValueError, match="must be > 0"):
        Evictor(np.zeros(64, np.uint8), np.zeros(64, np.uint8), threading.Lock(), rate=rate, seed=0)
