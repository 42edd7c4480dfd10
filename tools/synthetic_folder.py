"""A converted folder holding exactly the synthetic source's first batches (ids, dense, labels), so
`cxltrain train --data FOLDER` does the same work as synthetic training (26 tables x 100,000 rows,
batch 2048, seed 0) and only the data path differs: the side-by-side in docs/criteo.md. The ids are
the synthetic rows themselves, so it is a format version 1 folder (ids fixed for those rows).

    python tools/synthetic_folder.py OUT BATCHES
"""

import json
import sys
from pathlib import Path

import numpy as np

from cxltrain.data import SyntheticCriteo
from cxltrain.data import converted as conv


def main() -> None:
    out, batches = Path(sys.argv[1]), int(sys.argv[2])
    rows, B = 100_000, 2048
    src = SyntheticCriteo(num_tables=26, rows=rows, batch_size=B, seed=0)
    out.mkdir()
    writers = {name: conv._ColumnWriter(out / f, d, s) for name, (f, d, s) in conv.FILES.items()}
    for b in range(batches):
        x = src.batch(b)
        writers["dense"].append(x.dense.numpy())
        writers["sparse"].append(np.stack([v.numpy() for v in x.values], axis=1))
        writers["labels"].append(x.labels.numpy())
    for w in writers.values():
        w.close()
    (out / conv.MANIFEST).write_text(json.dumps({"format": conv.FORMAT, "version": conv.BAKED_VERSION, "lines": batches * B,
        "rows": [rows] * 26, "seed": 0, "sources": [], "fingerprint": "synthetic seed 0"}))


if __name__ == "__main__":
    main()
