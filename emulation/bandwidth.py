"""The emulated device's write-bandwidth cap: persistence traffic at most `bytes_per_s` on average.

A token bucket. The bucket fills at `bytes_per_s` up to `burst_bytes`; `charge(n)` takes n bytes of
tokens and, when that leaves the bucket in debt, sleeps until the refill has paid the debt back.
So over any run of charges totalling N bytes that starts with a full bucket at time t0, the last
charge returns no earlier than

    t0 + (N - burst_bytes) / bytes_per_s

on the cap's clock, and back-to-back charges return no later than that either (plus the sleep
function's own overshoot): the cap slows traffic to the rate, never below it.

Example: an Optane-like 2.3 GB/s cap on persistence, 10 ms of burst:

    cap = BandwidthCap(2.3e9)
    cap.charge(4 << 20)      # returns at once (within the burst) ...
    cap.charge(64 << 20)     # ... this one sleeps ~29 ms
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

from cxltrain.errors import ConfigError


class BandwidthCap:
    """Token bucket over `clock` (seconds, monotonic); `sleep` waits. Thread-safe."""

    def __init__(self, bytes_per_s: float, *, burst_bytes: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not (isinstance(bytes_per_s, (int, float)) and math.isfinite(bytes_per_s) and bytes_per_s > 0):
            raise ConfigError(f"bandwidth cap {bytes_per_s!r} bytes/s must be a positive finite number")
        if burst_bytes is None:
            burst_bytes = bytes_per_s / 100  # 10 ms of traffic: a flush batch passes without a sleep
        if not (math.isfinite(burst_bytes) and burst_bytes >= 0):
            raise ConfigError(f"burst {burst_bytes!r} bytes must be a finite number >= 0")
        self.bytes_per_s = float(bytes_per_s)
        self.burst_bytes = float(burst_bytes)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = self.burst_bytes  # may go negative: a debt the next refills pay back
        self._last = clock()

    def charge(self, nbytes: int) -> float:
        """Account for `nbytes` of traffic; sleep as long as the cap requires. Returns the sleep asked for."""
        if nbytes < 0:
            raise ValueError(f"cannot charge {nbytes} bytes")
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._last) * self.bytes_per_s)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.bytes_per_s if self._tokens < 0 else 0.0
        # Sleep outside the lock: a concurrent charger sees the debt this one left and waits
        # behind it, so together they still average the rate.
        if wait > 0:
            self._sleep(wait)
        return wait
