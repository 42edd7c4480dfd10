"""Batches made ahead on a background thread: `Prefetcher(source, start, stop, depth)`.

`get(b)` returns exactly `source.batch(b)`: the thread makes batches start, start+1, ... in order
into a queue of at most `depth` (bounded memory: depth batches plus the one being made), and a
request for any other batch than the next in line (a jump, a resume elsewhere) is answered by
the source directly and the thread restarts after it. Deterministic because every source's
`batch(b)` depends only on its configuration and b; the thread only moves the work off the
training thread (the C parser, numpy and the file reads release the GIL).

An exception raised while making a batch is raised by `get` for that batch, on the caller's
thread, so a malformed line stops the run at the batch that holds it, as without prefetching.
"""

from __future__ import annotations

import queue
import threading

from .batch import Batch, BatchSource

_DONE = object()


class Prefetcher:
    """`get(b)`: batch b of `source`, made ahead by one background thread (`depth` >= 1 batches)."""

    def __init__(self, source: BatchSource, start: int, stop: int | None, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.source, self.stop, self.depth = source, stop, depth
        self._thread: threading.Thread | None = None
        self._start_thread(start)

    def get(self, b: int) -> Batch:
        if self._thread is None or b != self._next:
            self.close()
            batch = self.source.batch(b)
            self._start_thread(b + 1)
            return batch
        item = self._queue.get()
        self._next = b + 1
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop the thread and drop what it made."""
        if self._thread is None:
            return
        self._halt.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)   # unblocks a put on a full queue
            except queue.Empty:
                pass
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_thread(self, first: int) -> None:
        stop = self.stop if self.stop is not None else self.source.num_batches
        if stop is not None and first >= stop:
            self._thread = None
            return
        self._next = first
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(first, stop, self._queue, self._halt),
                                        name="cxltrain-prefetch", daemon=True)
        self._thread.start()

    def _work(self, first: int, stop: int | None, out: queue.Queue, halt: threading.Event) -> None:
        b = first
        while not halt.is_set() and (stop is None or b < stop):
            try:
                item = self.source.batch(b)
            except BaseException as e:   # handed to the caller of get(b), on its own thread
                item = e
            while not halt.is_set():
                try:
                    out.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            b += 1
