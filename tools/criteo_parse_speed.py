"""Lines per CPU-second of the Criteo line parsers, one core: `python tools/criteo_parse_speed.py [LINES]`.

Generates LINES raw-layout lines in memory (2,000 distinct generated lines repeated, like
tests/helpers.write_criteo: some counts negative or missing, 8-hex-digit hashes, some missing),
then parses them in batches of 2,048 as training does, 26 tables. CPU time of the parsing thread
(time.thread_time) is what it reports first, so load from other processes does not count; the
wall-clock rate follows.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from cxltrain.data.lines import LineParser, native_built

BATCH = 2048


def lines(n: int) -> bytes:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2000):
        counts = ["" if r < 0.2 else str(-int(v % 3) - 1) if r < 0.25 else str(int(v))
                  for r, v in zip(rng.random(13), rng.integers(0, 10_000, 13))]
        hashes = ["" if r < 0.1 else f"{int(v):08x}" for r, v in zip(rng.random(26), rng.integers(0, 1 << 32, 26))]
        out.append("\t".join([str(int(rng.random() < 0.25)), *counts, *hashes]))
    block = ("\n".join(out) + "\n").encode()
    return block * (n // 2000)


def rate(parser: LineParser, data: bytes, count: int) -> tuple[float, float]:
    pos, done = 0, 0
    wall, cpu = time.perf_counter(), time.thread_time()
    while done < count:
        columns, pos = parser.parse_bytes(data, 1, BATCH, start=pos)
        done += len(columns)
    return done / (time.thread_time() - cpu), done / (time.perf_counter() - wall)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    data = lines(n)
    rows = [40_000_000] * 26
    print(f"{n:,} lines, {len(data) / 1e6:.0f} MB; native parser built: {native_built()}")
    if native_built():
        for _ in range(3):
            cpu, wall = rate(LineParser("x", "\t", 26, rows, 0), data, n)
            print(f"native: {cpu / 1e6:.2f} M lines per CPU-second ({wall / 1e6:.2f} M/s wall)")
    cpu, wall = rate(LineParser("x", "\t", 26, rows, 0, native=False), data, min(n, 40_960))
    print(f"python: {cpu / 1e3:.0f} k lines per CPU-second ({wall / 1e3:.0f} k/s wall)")


if __name__ == "__main__":
    main()
