"""The write-bandwidth cap: its accounting on an injected clock, and its lower bound on the real one."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest

from cxltrain.emulation.bandwidth import BandwidthCap
from cxltrain.errors import ConfigError


class FakeClock:
    """A clock that only moves when the cap sleeps or the test lets time pass."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_back_to_back_charges_take_exactly_bytes_over_rate():
    clock = FakeClock()
    cap = BandwidthCap(1e6, burst_bytes=10_000, clock=clock, sleep=clock.sleep)
    start, total = clock.now, 0
    for n in (4_000, 4_000, 4_000, 50_000, 0, 1):
        cap.charge(n)
        total += n
        assert math.isclose(clock.now - start, max(0, total - 10_000) / 1e6, rel_tol=1e-12, abs_tol=1e-12)
    assert clock.sleeps[0] == pytest.approx(2_000 / 1e6)  # the first charge beyond the burst waits only for its excess


def test_idle_time_refills_the_bucket_up_to_the_burst_only():
    clock = FakeClock()
    cap = BandwidthCap(1e6, burst_bytes=10_000, clock=clock, sleep=clock.sleep)
    cap.charge(10_000)
    clock.now += 5.0                  # idle far longer than a burst takes to refill
    assert cap.charge(10_000) == 0.0  # a full burst again, no sleep ...
    assert cap.charge(1_000) == pytest.approx(1e-3)  # ... and no more credit than that


def test_random_charges_never_beat_the_rate(request):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")  # replay a failure with this seed
    request.node.user_properties.append(("seed", seed))
    rng = random.Random(seed)
    clock = FakeClock()
    rate, burst = 2.3e9, rng.choice([0, 4096, 23e6])
    cap = BandwidthCap(rate, burst_bytes=burst, clock=clock, sleep=clock.sleep)
    start, total, idle = clock.now, 0, 0.0  # idle: time the test let pass between charges
    for _ in range(500):
        n = rng.randrange(0, 1 << 22)
        cap.charge(n)
        total += n
        # the cap's promise: never faster than the rate, idle time or not, beyond one burst
        assert clock.now - start >= (total - burst) / rate - 1e-12 * clock.now, f"seed {seed}"
        gap = rng.choice([0.0, 0.0, rng.uniform(0, 1e-3)])
        clock.now += gap
        idle += gap
    busy = clock.now - start - idle
    assert busy <= total / rate + 1e-9, f"seed {seed}"  # and it never sleeps more than the bytes need


def test_real_clock_lower_bound_with_threads():
    resolution = time.get_clock_info("monotonic").resolution
    cap = BandwidthCap(20e6, burst_bytes=0)  # 20 MB/s: 3 MB must take at least 0.15 s
    start = time.monotonic()
    workers = [threading.Thread(target=lambda: [cap.charge(250_000) for _ in range(4)]) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert time.monotonic() - start >= 3_000_000 / 20e6 - 2 * resolution


@pytest.mark.parametrize("rate,burst,match", [(0, None, "positive finite"), (float("inf"), None, "positive finite"),
                                              (float("nan"), None, "positive finite"), (1e6, -1, "burst -1")])
def test_bad_settings_are_refused(rate, burst, match):
    with pytest.raises(ConfigError, match=match):
        BandwidthCap(rate, burst_bytes=burst)
    with pytest.raises(ValueError, match="cannot charge -5 bytes"):
        BandwidthCap(1e6).charge(-5)
