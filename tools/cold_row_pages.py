"""How many capacity pages the cold rows of a table fall on, scattered as the synthetic data places
them (a random permutation stands in for its bijection of ranks to rows) and as they would lie if
rows were placed by how often they are looked up (Zipf rank order): per batch
(the pages an update write-faults) and per write-back interval (the pages a write-back syncs).
Drawn from the generator the bench trains on (cxltrain.data.synthetic.ZipfRanks), the cache taking
the most looked-up rows, as the planner's hot list does.

    python tools/cold_row_pages.py [--rows 250000] [--batch-size 2048] [--dim 64] [--zipf 1.05]
                                   [--cached 0.10] [--window 16] [--samples 10] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np

from cxltrain.data.synthetic import ZipfRanks

PAGE = 4096


def pages(ranks: np.ndarray, placed: np.ndarray, rows_per_page: int) -> tuple[int, int, int]:
    """(cold rows, their pages as placed, their pages in rank order) of one draw of ranks (shape
    [n]); placed: rank -> row, shape [rows], the data's own placement of the ranks."""
    cold = np.unique(ranks)
    return cold.size, np.unique(placed[cold] // rows_per_page).size, np.unique(cold // rows_per_page).size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--dim", type=int, default=64, help="float32 weights: 4 * dim bytes a row")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--cached", type=float, default=0.10, help="fraction of the rows cached (the most looked up)")
    p.add_argument("--window", type=int, default=16, help="batches between write-backs")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    zipf = ZipfRanks.build(a.rows, a.zipf)
    placed = rng.permutation(a.rows)  # the synthetic data scatters the ranks over the table (a bijection)
    rows_per_page = max(1, PAGE // (4 * a.dim))
    first_cold = int(a.rows * a.cached)
    print(f"{a.rows:,} rows, {rows_per_page} a page, Zipf {a.zipf}, the top {a.cached:.0%} cached; "
          f"means of {a.samples} samples")
    for batches in (1, a.window):
        drawn = [zipf.sample(rng.random(a.batch_size * batches)) for _ in range(a.samples)]
        counts = np.mean([pages(d[d >= first_cold], placed, rows_per_page) for d in drawn], axis=0)
        print(f"{batches:>3} batch(es): {counts[0]:,.1f} cold rows on {counts[1]:,.1f} pages as placed, "
              f"{counts[2]:,.1f} in rank order ({counts[2] / counts[1]:.3f} of them)")


if __name__ == "__main__":
    main()
