"""Training on file data: one converted folder trains bit-identical to its source at two --rows, a
folder in TorchRec's npy layout trains, a run killed on converted, gzipped or TorchRec data resumes
exactly (and a planted ordering bug makes the same check fail), epochs and held-out evaluation,
`cxltrain eval` never writes the pool, the options file data refuses.

The killed runs are child processes (`cxltrain train` with CXLTRAIN_CRASH_AT and the emulated
device's power-loss model); references, resumes and exports run in this process."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import signal
from pathlib import Path

import pytest

from cxltrain.cli import main
from cxltrain.data.converted import convert
from cxltrain.errors import ConfigError, PoolCorruptError, RecoveryError
from cxltrain.faults import CRASH_ENV, FAULT_ENV, CrashPoint, Planted
from cxltrain.jobs.config import TrainConfig
from cxltrain.jobs.evaluate import evaluate_pool
from cxltrain.jobs.train import train
from cxltrain.runtime.runtime import export_state
from helpers import assert_same_export, cxltrain, shared_sample_rows, shm_tempdir, write_criteo, write_torchrec_days

ROWS = 500
STEPS = 10
BASE = TrainConfig(batch_size=32, num_tables=26, rows=ROWS, dim=8, steps=STEPS, seed=2)
CLI = ["--batch-size", "32", "--rows", str(ROWS), "--dim", "8", "--seed", "2", "--no-progress"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The same 480 lines (15 batches) as a raw file, a gzipped one and a converted folder; and the
    shared sample's 200 real lines three times over (18 batches) in TorchRec's layout, as two days."""
    folder = tmp_path_factory.mktemp("train-files")
    raw = write_criteo(folder / "day_0", 480, seed=11)
    gz = folder / "day_0.gz"
    gz.write_bytes(gzip.compress(raw.read_bytes()))
    convert([gz], folder / "converted")
    torchrec = write_torchrec_days(folder / "torchrec", shared_sample_rows() * 3, [350, 250])
    return {"raw": raw, "gzip": gz, "converted": folder / "converted", "torchrec": torchrec}


def run(config: TrainConfig, pool: Path) -> dict:
    train(config, pool_path=str(pool), progress=False)
    return export_state(str(pool))


@pytest.fixture(scope="module")
def reference(files) -> dict:
    """An uninterrupted run on the raw file (its pool on the memory-backed file system)."""
    with shm_tempdir("cxltrain-test-") as folder:
        return run(dataclasses.replace(BASE, data=str(files["raw"])), Path(folder) / "r.pool")


def test_a_converted_folder_trains_bit_identical_to_its_source(files, reference, shm_dir):
    assert_same_export(run(dataclasses.replace(BASE, data=str(files["converted"]), prefetch=0), shm_dir / "c.pool"),
                       reference)


def _logged_run(config: TrainConfig, folder: Path, name: str) -> tuple[list[dict], dict]:
    """(the metrics file's lines, one per step with its loss and held-out AUC; the export).
    One held-out batch: evaluating after every step is what writes a line per step."""
    metrics = folder / f"{name}.jsonl"
    config = dataclasses.replace(config, eval_every=1, eval_batches=1, metrics=str(metrics))
    export = run(config, folder / f"{name}.pool")
    return [json.loads(line) for line in metrics.read_text().splitlines()], export


@pytest.mark.parametrize("rows", [{"rows": 300}, {"rows": 125, "table_rows": tuple(100 + t for t in range(26))}])
def test_one_conversion_trains_at_any_rows_bit_identical_to_the_raw_file(files, shm_dir, rows):
    """The folder converted once (no rows given) against the raw file at that --rows: the same
    loss and held-out AUC at every step, and the same export."""
    config = dataclasses.replace(BASE, **rows)
    raw_lines, raw_export = _logged_run(dataclasses.replace(config, data=str(files["raw"])), shm_dir, "raw")
    lines, export = _logged_run(dataclasses.replace(config, data=str(files["converted"])), shm_dir, "converted")
    assert len(lines) == STEPS
    assert [(p["loss"], p["eval_auc"]) for p in lines] == [(p["loss"], p["eval_auc"]) for p in raw_lines]
    assert_same_export(export, raw_export)
    table = export["model"]["embedding_bag_collection.embedding_bags.t25.weight"]
    assert table.shape[0] == (rows["table_rows"][25] if "table_rows" in rows else rows["rows"])


def test_the_resume_check_is_the_folders_fingerprint_and_the_runs_rows_and_seed(files, shm_dir):
    """The folder holds no rows or seed, so the pool's settings are what a resume must match; the
    folder's fingerprint is its source's, so the raw file resumes a run begun on the folder."""
    pool, config = shm_dir / "p.pool", dataclasses.replace(BASE, data=str(files["converted"]), rows=300, steps=2)
    train(config, pool_path=str(pool), progress=False)
    with pytest.raises(RecoveryError, match=r"other settings \(seed 2 vs 3\)"):
        train(dataclasses.replace(config, steps=4, seed=3), pool_path=str(pool), progress=False)
    with pytest.raises(RecoveryError, match=r"float32 \[300, 8\], table 't0' expects table_weights float32 \[400, 8\]"):
        train(dataclasses.replace(config, steps=4, rows=400), pool_path=str(pool), progress=False)
    resumed = train(dataclasses.replace(config, steps=4, data=str(files["raw"])), pool_path=str(pool), progress=False)
    assert resumed.to_json()["start_batch"] == 2 and resumed.to_json()["batch"] == 4


def test_a_torchrec_folder_trains_and_resumes_exactly(files, shm_dir):
    """TorchRec's day_N_*.npy read as they are: a run killed part-way resumes to the uninterrupted
    run's export, and the trained model scores the held-out batches."""
    config = dataclasses.replace(BASE, data=str(files["torchrec"]))
    uninterrupted = train(config, pool_path=str(shm_dir / "u.pool"), progress=False).to_json()
    assert uninterrupted["batch"] == STEPS and 0 < uninterrupted["eval_auc"] < 1
    assert_same_export(_crash_then_resume(files, "torchrec", shm_dir), export_state(str(shm_dir / "u.pool")))


def _crash_then_resume(files, kind: str, shm_dir: Path, fault: str = "") -> dict:
    pool = shm_dir / f"{kind}.pool"
    env = {CRASH_ENV: f"{CrashPoint.COMMIT_BEFORE_ROOT}:7", "CXLTRAIN_POWER_LOSS": "1", FAULT_ENV: fault}
    killed = cxltrain("train", "--pool", pool, "--data", files[kind], "--steps", STEPS, *CLI, env=env, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    if not fault:   # a pool with a batch to roll back: eval refuses it, and writes nothing
        before = _digest(pool)
        with pytest.raises(ConfigError, match="undo record.* to roll back first; run `cxltrain recover"):
            evaluate_pool(str(pool), str(files[kind]))
        assert _digest(pool) == before
    return run(dataclasses.replace(BASE, data=str(files[kind])), pool)   # recovers, resumes, ends


@pytest.mark.parametrize("kind", ["converted", "gzip"])
def test_kill_and_resume_on_file_data_is_exact(files, reference, shm_dir, kind):
    assert_same_export(_crash_then_resume(files, kind, shm_dir), reference)


def test_the_resume_check_catches_a_planted_ordering_bug(files, reference, shm_dir):
    """U1 broken (the undo record never persisted): under power loss the same check must fail, by a
    recovery that finds the ring damaged or by an export that differs."""
    with pytest.raises((AssertionError, PoolCorruptError)):
        assert_same_export(_crash_then_resume(files, "converted", shm_dir, fault=Planted.SKIP_UNDO_PERSIST),
                           reference)


def _digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def test_epochs_held_out_evaluation_metrics_and_a_read_only_eval(files, shm_dir):
    """15 batches, 10 held out: 2 epochs of 5; an evaluation every 3 steps into the metrics file;
    then `cxltrain eval` on the pool, whose bytes stay as they were."""
    pool, metrics = shm_dir / "e.pool", shm_dir / "m.jsonl"
    result = cxltrain("train", "--pool", pool, "--data", files["converted"], "--epochs", "2", "--eval-every", "3",
                      "--eval-batches", "10", "--metrics", metrics, *CLI, "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "26 tables" in result.stdout and "2 epoch(s)" in result.stdout
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["batch"] == 10 and summary["eval_auc"] is not None
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 6, 9]
    assert lines[1]["position"] == "epoch 1, batch 0" and all("eval_auc" in line for line in lines)
    before = _digest(pool)
    evaluated = cxltrain("eval", pool, "--data", files["gzip"], "--batches", "10", "--json", timeout=120)
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads(evaluated.stdout.splitlines()[-1])
    assert report["batch"] == 10 and report["batches"] == 10 and report["auc"] == pytest.approx(summary["eval_auc"])
    by_default = evaluate_pool(str(pool), str(files["gzip"]))  # the same file's content: its held-out batches
    assert by_default == report | {"which": "the 10 the run held out"}
    assert _digest(pool) == before


def test_eval_defaults_to_the_batches_the_run_never_trained_on(files, shm_dir, capsys):
    """Without --batches, eval reads only batches its run did not train on: after its steps, all of
    another file, and none (a one-line refusal) where it trained on every batch."""
    pool, synthetic = shm_dir / "d.pool", shm_dir / "s.pool"
    train(dataclasses.replace(BASE, data=str(files["raw"]), steps=10), pool_path=str(pool), progress=False)
    report = evaluate_pool(str(pool), str(files["converted"]))
    assert (report["batches"], report["which"]) == (5, "those after the 10 the run trained on")
    assert evaluate_pool(str(pool), str(files["raw"]), batches=5)["auc"] == report["auc"]
    train(dataclasses.replace(BASE, data=None, steps=2), pool_path=str(synthetic), progress=False)
    assert evaluate_pool(str(synthetic), str(files["raw"]))["batches"] == 15
    train(dataclasses.replace(BASE, data=str(files["raw"]), steps=15), pool_path=str(pool), progress=False)
    assert main(["eval", str(pool), "--data", str(files["raw"])]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "trained on every batch" in err and "--batches N" in err, err


@pytest.mark.parametrize("args,message", [
    (["--pooling", "2"], "--pooling shapes synthetic data only"),
    (["--zipf", "1.2"], "--zipf shapes synthetic data only"),
    (["--epochs", "1", "--steps", "3"], "give --steps or --epochs, not both"),
    (["--rows", "10,20"], "--rows lists 2 row counts but there are 26 tables"),
])
def test_options_that_mean_nothing_for_file_data_are_refused(files, shm_dir, capsys, args, message):
    assert main(["train", "--pool", str(shm_dir / "x.pool"), "--data", str(files["raw"]), *args, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert main(["train", "--pool", str(shm_dir / "x.pool"), "--epochs", "2"]) == 1
    assert "--epochs needs file data" in capsys.readouterr().err
    assert not (shm_dir / "x.pool").exists()


@pytest.mark.parametrize("flag", ["--rows", "--seed"])
def test_data_convert_takes_no_rows_or_seed(files, shm_dir, capsys, flag):
    assert main(["data", "convert", str(files["raw"]), str(shm_dir / "out"), flag, "7", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"data convert takes no {flag}: the folder keeps the categorical values and serves any {flag}" in err
    assert len(err.splitlines()) == 1 and not (shm_dir / "out").exists()


def test_per_table_rows_reach_the_model_and_the_data(files, shm_dir):
    rows = tuple(100 + t for t in range(26))
    config = dataclasses.replace(BASE, data=str(files["raw"]), table_rows=rows, rows=max(rows), steps=2)
    state = run(config, shm_dir / "rows.pool")
    assert [state["model"][f"embedding_bag_collection.embedding_bags.t{t}.weight"].shape[0] for t in range(26)] == list(rows)


def test_plot_without_matplotlib_is_one_line(shm_dir, capsys):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed: the refusal cannot be seen")
    except ImportError:
        pass
    (shm_dir / "m.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    assert main(["plot", str(shm_dir / "m.jsonl")]) == 1
    assert "plot needs matplotlib" in capsys.readouterr().err
