"""A resume that remembers: `cxltrain train --pool P` alone goes on with the settings P stores, the
options given that differ are refused together in one line, a learning rate may change (said, and
recorded in the pool); and `--metrics` lines of a run killed and resumed equal an uninterrupted
run's, line for line. The killed run is a real process, killed by a real SIGKILL at a crash point
(cxltrain.faults); the other runs go through the command line's main() in this process."""

from __future__ import annotations

import json
import signal

import pytest

from cxltrain.cli import main
from cxltrain.faults import CRASH_ENV, CrashPoint
from cxltrain.jobs.resume import stored_metadata
from cxltrain.pool.handle import Pool
from helpers import cxltrain

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


def test_steps_0_sets_the_pool_up_and_a_resume_trains_it_as_one_run(shm_dir, capsys):
    """`--steps 0`: the pool made at batch 0, nothing trained (what a kill before the first commit
    leaves; the tortures' reference of batch 0). Before: refused, "--steps: 0 must be at least 1"."""
    pool, uninterrupted = shm_dir / "p.pool", shm_dir / "u.pool"
    code, out, err = train(capsys, pool, *[a if a != "10" else "0" for a in FIRST])
    assert code == 0 and "nothing to train: the pool is at batch 0" in out, err
    assert "the pool is committed at batch 0" in out
    assert train(capsys, pool, "--steps", "10")[0] == 0
    assert train(capsys, uninterrupted, *FIRST)[0] == 0
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


def metrics_lines(path) -> list[dict]:
    """The lines of a metrics file, less what a clock decides (steps_per_s) and the pool's name (run)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in ("steps_per_s", "run")} for line in lines]


def test_metrics_of_a_killed_and_resumed_run_equal_an_uninterrupted_runs(shm_dir, capsys):
    """Killed as batch 9 commits (its root never written): the line of step 10 is in the file, the
    pool holds 9 batches; the resume cuts the line off and writes it again, from the running sum
    of batches 0-8 that the pool's snapshot kept."""
    steps = ["--steps", "25"]
    reference = shm_dir / "u.jsonl"
    assert train(capsys, shm_dir / "u.pool", *FIRST, *steps, "--metrics", reference)[0] == 0
    pool, metrics = shm_dir / "k.pool", shm_dir / "k.jsonl"
    killed = cxltrain("train", "--pool", pool, *FIRST, *steps, "--metrics", metrics,
                      env={CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:10"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [line["step"] for line in metrics_lines(metrics)] == [10]
    code, out, err = train(capsys, pool, "--json")   # --metrics remembered too
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["start_batch"] == 9
    assert [line["step"] for line in metrics_lines(reference)] == [10, 20]
    assert metrics_lines(metrics) == metrics_lines(reference)


def test_a_metrics_file_of_another_run_is_refused(shm_dir, capsys):
    metrics = shm_dir / "m.jsonl"
    assert train(capsys, shm_dir / "a.pool", *FIRST, "--metrics", metrics)[0] == 0
    before = metrics.read_text()
    code, _, err = train(capsys, shm_dir / "b.pool", *FIRST, "--metrics", metrics)
    assert code == 1 and "m.jsonl: holds the metrics of another run (this run starts a new pool)" in one_line_error(err)
    assert not (shm_dir / "b.pool").exists()
    assert train(capsys, shm_dir / "c.pool", *FIRST)[0] == 0
    pool_before = (shm_dir / "c.pool").read_bytes()
    code, _, err = train(capsys, shm_dir / "c.pool", "--steps", "12", "--metrics", metrics)
    assert code == 1 and "m.jsonl: holds the metrics of another run (line 1 is of run " in one_line_error(err)
    assert metrics.read_text() == before and (shm_dir / "c.pool").read_bytes() == pool_before


def test_plot_draws_one_line_per_run(shm_dir, capsys):
    """Two runs appended to one file, as files written before lines named their run were: the plot
    splits them where the step goes back, and where the run named changes."""
    from cxltrain.jobs.metrics_log import split_runs

    lines = [{"step": s, "loss": 0.5} for s in (10, 20, 10, 20, 30)]
    assert [[p["step"] for p in run] for run in split_runs(lines)] == [[10, 20], [10, 20, 30]]
    named = [{"step": s, "loss": 0.5, "run": r} for s, r in ((10, "a"), (20, "a"), (30, "b"))]
    assert [len(run) for run in split_runs(named)] == [2, 1]
    pytest.importorskip("matplotlib")
    metrics = shm_dir / "two.jsonl"
    metrics.write_text("".join(json.dumps({**line, "eval_auc": 0.7, "eval_logloss": 0.5}) + "\n" for line in lines))
    assert main(["plot", str(metrics)]) == 0
    assert "(2 run(s), 5 points, 5 evaluations)" in capsys.readouterr().out
    assert (shm_dir / "two.png").read_bytes()[:4] == b"\x89PNG"
