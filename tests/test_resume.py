"""A resume that remembers: `cxltrain train --pool P` alone goes on with the settings P stores, the
options given that differ are refused together in one line, a learning rate may change (said, and
recorded in the pool). The runs go through the command line's main() in this process."""

from __future__ import annotations

import json

from cxltrain.cli import main
from cxltrain.jobs.resume import stored_metadata
from cxltrain.pool.handle import Pool

# the first run's options; a resume gives none of them back
FIRST = ["--steps", "10", "--rows", "2000", "--num-tables", "3", "--dim", "16", "--batch-size", "256", "--seed", "4",
         "--bottom-mlp", "32,16", "--top-mlp", "32", "--no-progress"]


def train(capsys, pool, *args) -> tuple[int, str, str]:
    """`cxltrain train --pool POOL ARGS` through main(): (exit code, stdout, stderr)."""
    code = main(["train", "--pool", str(pool), *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cxltrain: error: "), err
    return lines[0]


def same_tables(a, b) -> bool:
    with Pool.open(str(a), writable=False) as pa, Pool.open(str(b), writable=False) as pb:
        return all((pa.array(name) == pb.array(name)).all() for name in pa.regions if not name.startswith("cxltrain."))


def test_train_with_only_the_pool_resumes_with_its_settings(shm_dir, capsys):
    pool, uninterrupted = shm_dir / "p.pool", shm_dir / "u.pool"
    assert train(capsys, pool, *FIRST)[0] == 0
    before = pool.read_bytes()
    code, _, err = train(capsys, pool, "--seed", "9", "--dim", "8", "--rows", "3000", "--steps", "20")
    assert code == 1 and ("was written by a run with other settings: --rows 3000 (the pool's: 2000), --dim 8 (the "
                          "pool's: 16), --seed 9 (the pool's: 4); leave them out") in one_line_error(err)
    assert "--steps" not in err and pool.read_bytes() == before   # a resume may train longer; nothing written
    code, out, err = train(capsys, pool, "--steps", "15", "--json")
    assert code == 0, err
    said = [line for line in out.splitlines() if line.startswith("resuming with the pool's settings:")]
    assert len(said) == 1 and all(option in said[0] for option in
                                  ("--rows 2000", "--num-tables 3", "--dim 16", "--batch-size 256", "--seed 4",
                                   "--bottom-mlp 32,16", "--top-mlp 32"))
    summary = json.loads(out.splitlines()[-1])
    assert (summary["start_batch"], summary["batch"]) == (10, 15)
    assert train(capsys, uninterrupted, *[a if a != "10" else "15" for a in FIRST])[0] == 0
    assert same_tables(pool, uninterrupted)


def test_a_learning_rate_changed_on_resume_is_said_and_remembered(shm_dir, capsys):
    pool = shm_dir / "p.pool"
    assert train(capsys, pool, *FIRST)[0] == 0
    code, out, err = train(capsys, pool, "--steps", "12", "--lr", "0.01")
    assert code == 0, err
    assert "learning rate changed on resume: --lr 0.001 -> 0.01, from batch 10" in out
    stored = stored_metadata(str(pool))
    assert stored["dense_lr"] == 0.01 and stored["lr_changes"] == [
        {"batch": 10, "from": {"sparse_lr": 0.05, "dense_lr": 0.001}, "to": {"sparse_lr": 0.05, "dense_lr": 0.01}}]
    code, out, err = train(capsys, pool)   # alone: its 12 steps and its new rate are remembered
    assert code == 0, err
    assert "nothing to train: the pool is at batch 12" in out and "--steps 12" in out and "--lr 0.01" in out
    assert "learning rate changed" not in out
