"""Early write-back: cache lines that reach the media before anyone flushed them.

A CPU's write-back caches evict dirty lines whenever they need the room, so on real hardware a
store can be durable long before the program persists it, and a power failure can keep a store the
program never meant to be durable yet — in any order, and a line only 8 bytes at a time (the
hardware's failure atomicity). A protocol that is only correct because unpersisted stores are lost
(an in-place update that overtakes its undo record, say) survives a plain power-loss model and is
caught by this one.

The evictor is a thread beside the power-loss device (emulation/cxl.py). Every tick it compares one
window of the process's private view with the media, line by line, picks random lines that differ
(unpersisted stores) and copies them to the media; about half of them land torn, a random subset of
their eight 8-byte words. Over time the window sweeps the whole pool. It writes back at most `rate`
lines per second on average (credit that cannot be spent — no unpersisted lines in the window — is
capped, so an idle spell does not turn into a burst).

Every copy to the media, the evictor's and flush's, happens under the device's media lock: without
it, an evictor that read a line just before the program stored and persisted a new value could
write the old value back over the persisted one, which no hardware does.
"""

from __future__ import annotations

import threading
import time

import numpy as np

CACHE_LINE = 64
WORDS_PER_LINE = CACHE_LINE // 8

TICK_SECONDS = 0.002          # how often the evictor wakes
WINDOW_BYTES = 512 << 10      # media compared per tick (~250 MB/s: a few % of a core); 2 GB swept in ~8 s
MAX_CREDIT_SECONDS = 0.05     # unspent write-back credit kept, in seconds of rate


class Evictor:
    """Writes random unpersisted lines of `view` to `media` early, `rate` lines/s at most.

    view, media: uint8 [size] arrays of the same length (the private view and the media mapping);
    lock: held around every write to the media; seed: the random picks (thread timing is not
    reproducible, so a seed fixes which lines are picked from what is dirty, not when).
    """

    def __init__(self, view: np.ndarray, media: np.ndarray, lock: threading.Lock, *, rate: float,
                 seed: int) -> None:
        if rate <= 0:
            raise ValueError(f"eviction rate must be > 0 lines/s, got {rate}")
        lines = view.size // CACHE_LINE
        self._view = view[: lines * CACHE_LINE].view(np.uint64).reshape(lines, WORDS_PER_LINE)
        self._media = media[: lines * CACHE_LINE].view(np.uint64).reshape(lines, WORDS_PER_LINE)
        self._lock, self.rate = lock, float(rate)
        self._rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self.lines_written = 0     # lines written back early (whole or torn)
        self.torn_lines = 0        # of which only some words landed
        self._thread = threading.Thread(target=self._run, name="cxltrain-evictor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lines = self._view.shape[0]
        window = max(1, min(lines, WINDOW_BYTES // CACHE_LINE))
        cursor = int(self._rng.integers(lines)) if lines else 0
        credit, last = 0.0, time.monotonic()
        while lines and not self._stop.wait(TICK_SECONDS):
            now = time.monotonic()
            credit = min(credit + self.rate * (now - last), max(1.0, self.rate * MAX_CREDIT_SECONDS))
            last = now
            if credit < 1.0:
                continue
            start = cursor
            end = min(start + window, lines)
            cursor = end % lines  # the sweep goes on from here, back at line 0 after the pool's end
            dirty = start + np.flatnonzero((self._view[start:end] != self._media[start:end]).any(axis=1))
            if dirty.size:
                credit -= self._write_back(dirty, int(credit))

    def _write_back(self, dirty: np.ndarray, budget: int) -> int:
        """Copy up to `budget` random lines of `dirty` (line numbers) to the media; returns how many."""
        picked = self._rng.choice(dirty, size=min(budget, dirty.size), replace=False)
        # per line, the words that land: all of them, or (torn, half the lines) a random subset
        torn = self._rng.random(picked.size) < 0.5
        words = np.where(torn[:, None], self._rng.random((picked.size, WORDS_PER_LINE)) < 0.5, True)
        with self._lock:
            self._media[picked] = np.where(words, self._view[picked], self._media[picked])
        self.lines_written += picked.size
        self.torn_lines += int(torn.sum())
        return picked.size

    def stop(self) -> None:
        """Stop the thread and wait for it; writes nothing more after this returns."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
