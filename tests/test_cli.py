"""The command line, run as a real process: summaries, and one clear line for every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cxltrain.pool.handle import Pool
from helpers import cxltrain, write_criteo  # test_bench imports cxltrain from here
from test_pool import REFUSALS, small_pool

SMALL = ["--steps", "30", "--rows", "2000", "--num-tables", "3", "--dim", "16", "--batch-size", "256",
         "--no-progress"]


def assert_one_line_error(result, code=1, match=""):
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert match in lines[0], lines[0]


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_pool_create_info_check(shm_dir):
    path = shm_dir / "c.pool"
    created = cxltrain("pool", "create", path, "--size", "2M", "--json")
    assert created.returncode == 0, created.stderr
    assert last_json(created.stdout)["size"] == 2 << 20
    info = last_json(cxltrain("pool", "info", path, "--json").stdout)
    assert info["ok"] and info["superblock"]["pool_size"] == 2 << 20 and info["regions"] == []
    check = cxltrain("pool", "check", path)
    assert check.returncode == 0 and check.stdout.startswith("ok:")


def test_train_json_summary_and_pool_contents(shm_dir):
    path = shm_dir / "t.pool"
    result = cxltrain("train", "--pool", path, *SMALL, "--json")
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["batch"] == 30 and summary["steps"] == 30
    assert summary["seconds"] > 0 and summary["steps_per_s"] > 0
    assert "final AUC" in result.stdout
    info = last_json(cxltrain("pool", "info", path, "--json").stdout)
    assert info["batch"] == 30
    names = {r["name"]: r for r in info["regions"]}
    tables = {f"t{i}.{kind}" for i in range(3) for kind in ("weight", "optim")}
    assert set(names) == tables | {"cxltrain.undo", "cxltrain.dense.A", "cxltrain.dense.B"}
    assert summary["checkpoint"] == "undo" and summary["recovered_batch"] is None
    stats = summary["checkpoint_stats"]
    assert stats["commits"] == 30 and summary["pipeline"] and summary["mode"] == "strict"
    assert stats["commit_lag_max"] <= 1 and stats["wait_ms_per_batch"] >= 0
    assert stats["bytes_persisted_per_batch"] * 30 == stats["row_bytes"] + stats["undo_bytes"] + stats["dense_bytes"]
    assert "checkpoint: training thread waited" in result.stdout and "commit lag" in result.stdout
    current = max((r for r in info["roots"] if r["state"] == "valid"), key=lambda r: r["seq"])
    assert current["dense_batch"] == 30 and current["dense_slot"] in ("A", "B") and current["ring_generation"] == 1
    assert current["relaxed"] is False and summary["background_capture"] is False
    assert names["t0.weight"]["shape"] == [2000, 16] and names["t0.optim"]["shape"] == [2000, 1]


def test_pool_info_says_when_a_root_is_relaxed(shm_dir):
    path = shm_dir / "r.pool"
    assert cxltrain("train", "--pool", path, *SMALL, "--mode", "relaxed", "--dense-every", "4").returncode == 0
    info = cxltrain("pool", "info", path, "--json").stdout
    current = max((r for r in last_json(info)["roots"] if r["state"] == "valid"), key=lambda r: r["seq"])
    assert current["relaxed"] is True
    assert "relaxed (the dense state may trail the embeddings)" in cxltrain("pool", "info", path).stdout


def test_train_is_deterministic_and_resumes_an_existing_pool(shm_dir):
    a, b = shm_dir / "a.pool", shm_dir / "b.pool"
    assert cxltrain("train", "--pool", a, *SMALL).returncode == 0
    assert cxltrain("train", "--pool", b, *SMALL).returncode == 0
    with Pool.open(str(a), writable=False) as pa, Pool.open(str(b), writable=False) as pb:
        for name in pa.regions:
            if not name.startswith("cxltrain."):  # the dense slots hold RNG states and the like
                assert (pa.array(name) == pb.array(name)).all(), name
    again = cxltrain("train", "--pool", a, *SMALL, "--json")
    assert again.returncode == 0 and "nothing to train: the pool is at batch 30" in again.stdout
    more = cxltrain("train", "--pool", a, *[x if x != "30" else "35" for x in SMALL], "--json")
    assert more.returncode == 0, more.stderr
    assert "recovered" in more.stdout and "resuming at batch 30" in more.stdout
    summary = last_json(more.stdout)
    assert (summary["recovered_batch"], summary["start_batch"], summary["steps"], summary["batch"]) == (30, 30, 5, 35)
    assert summary["recovery_seconds"] >= 0


def test_resuming_with_other_settings_is_refused(shm_dir):
    path = shm_dir / "s.pool"
    assert cxltrain("train", "--pool", path, *SMALL).returncode == 0
    other_seed = cxltrain("train", "--pool", path, *SMALL, "--seed", "9")
    assert_one_line_error(other_seed, match="other settings: --seed 9 (the pool's: 0)")


def test_train_learns(shm_dir):
    result = cxltrain("train", "--pool", shm_dir / "l.pool", "--steps", "80", "--rows", "5000", "--num-tables", "4",
                      "--dim", "16", "--batch-size", "512", "--no-progress", "--json")
    summary = last_json(result.stdout)
    assert summary["final_loss"] < summary["first_loss"] - 0.05
    assert summary["eval_auc"] > 0.65


@pytest.mark.parametrize("args,match", [
    (["train", "--steps", "-1"], "--steps: -1 must be at least 0"),
    (["train", "--rows", "many"], "'many' is not an integer"),
    (["train", "--zipf", "-1"], "positive finite"),
    (["train", "--bogus"], "unrecognized arguments"),
    (["pool", "create", "/tmp/x.pool", "--size", "lots"], "is not a size"),
    (["pool"], "required"),
    (["devices", "--bogus"], "unrecognized arguments"),
    ([], "required"),
])
def test_usage_errors(args, match):
    assert_one_line_error(cxltrain(*args), code=2, match=match)


def test_pool_errors_are_one_line(shm_dir):
    foreign = shm_dir / "foreign.pool"
    foreign.write_bytes(b"hello, not a pool" * 1000)
    before = foreign.read_bytes()
    for command in ("info", "check"):
        assert_one_line_error(cxltrain("pool", command, foreign), match="not a cxltrain pool")
    assert_one_line_error(cxltrain("train", "--pool", foreign, *SMALL), match="not a cxltrain pool")
    assert foreign.read_bytes() == before
    assert_one_line_error(cxltrain("pool", "info", shm_dir / "missing.pool"), match="no such pool")
    assert_one_line_error(cxltrain("pool", "create", foreign, "--size", "1M"), match="already exists")
    assert foreign.read_bytes() == before
    assert_one_line_error(cxltrain("pool", "create", shm_dir / "tiny.pool", "--size", "4K"), match="too small")
    assert not (shm_dir / "tiny.pool").exists()


def test_train_on_a_pool_of_another_model_is_refused_untouched(shm_dir):
    path = shm_dir / "m.pool"
    assert cxltrain("train", "--pool", path, *SMALL).returncode == 0
    before = path.read_bytes()
    other = [a if a != "16" else "8" for a in SMALL]  # --dim 8
    result = cxltrain("train", "--pool", path, *other)
    assert_one_line_error(result, match="other settings: --dim 8 (the pool's: 16)")
    assert "or use another pool" in result.stderr
    assert path.read_bytes() == before


def test_a_pool_with_part_of_the_model_is_refused_untouched(shm_dir):
    path = shm_dir / "part.pool"
    one_table = [a if a != "3" else "1" for a in SMALL]  # --num-tables 1
    assert cxltrain("train", "--pool", path, *one_table).returncode == 0
    before = path.read_bytes()
    assert_one_line_error(cxltrain("train", "--pool", path, *SMALL), match="--num-tables 3 (the pool's: 1)")
    assert path.read_bytes() == before


@pytest.mark.parametrize("env,match", [
    ({"CXLTRAIN_THREADS": "abc"}, "CXLTRAIN_THREADS='abc' is not an integer"),
    ({"CXLTRAIN_THREADS": "0"}, "threads 0 must be at least 1"),
    ({"CXLTRAIN_RANK_THREADS": "0"}, "rank_threads 0 must be at least 1"),
    ({"CXLTRAIN_ROW_ALIGN": "0"}, "row_align 0"),
    ({"CXLTRAIN_DEVICE": "floppy"}, "device 'floppy'"),
])
def test_bad_settings_are_one_line(shm_dir, env, match):
    result = cxltrain("train", "--pool", shm_dir / "s.pool", *SMALL, env=env)
    assert_one_line_error(result, match=match)
    assert not (shm_dir / "s.pool").exists()


def test_absurd_pool_size_is_refused_cleanly(shm_dir):
    path = shm_dir / "huge.pool"
    assert_one_line_error(cxltrain("pool", "create", path, "--size", "99999999999T"), match="out of range")
    assert not path.exists()


def test_second_opener_gets_a_clear_error(shm_dir):
    path = shm_dir / "busy.pool"
    assert cxltrain("pool", "create", path, "--size", "1M").returncode == 0
    with Pool.open(str(path)):
        assert_one_line_error(cxltrain("train", "--pool", path, *SMALL), match="in use by another process")


def test_failed_train_leaves_no_half_built_pool(shm_dir):
    path = shm_dir / "nospace.pool"
    # 1e9 rows x 64 dims does not fit: creation must fail cleanly and leave no file behind
    result = cxltrain("train", "--pool", path, "--rows", "1000000000", "--num-tables", "64", "--no-progress")
    assert_one_line_error(result, match="space")
    assert not path.exists()


def test_help_for_every_command():
    for args in (["--help"], ["train", "--help"], ["pool", "--help"], ["pool", "create", "--help"],
                 ["pool", "info", "--help"], ["pool", "check", "--help"], ["devices", "--help"]):
        result = cxltrain(*args)
        assert result.returncode == 0 and "usage:" in result.stdout


def test_train_on_a_raw_criteo_file(shm_dir):
    data = write_criteo(shm_dir / "day_0", 160)  # the raw layout users have (TSV, integers, no header)
    common = ["--data", data, "--batch-size", "32", "--num-tables", "26", "--rows", "1000", "--dim", "16",
              "--no-progress"]
    result = cxltrain("train", "--pool", shm_dir / "c.pool", "--steps", "3", *common, "--json")
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    assert summary["batch"] == 3 and summary["eval_auc"] is not None  # batches 3 and 4 held out
    too_many = cxltrain("train", "--pool", shm_dir / "d.pool", "--steps", "30", *common)
    assert_one_line_error(too_many, match="holds 5 batches of 32, fewer than --steps 30")
    assert not (shm_dir / "d.pool").exists()
    assert_one_line_error(cxltrain("train", "--data", shm_dir / "nope", "--pool", shm_dir / "e.pool"),
                          match="nope")


def test_train_fills_an_empty_pool_made_by_pool_create(shm_dir):
    path = shm_dir / "empty.pool"
    assert cxltrain("pool", "create", path, "--size", "8M").returncode == 0
    too_small = cxltrain("train", "--pool", path, *SMALL)
    assert_one_line_error(too_small, match="need 20,058,384 bytes, 8,343,552 are free")
    path.unlink()
    assert cxltrain("pool", "create", path, "--size", "32M").returncode == 0
    result = cxltrain("train", "--pool", path, *SMALL, "--json")
    assert result.returncode == 0, result.stderr
    assert not last_json(result.stdout)["restarted"] and "restarted" not in result.stderr
    assert last_json(cxltrain("pool", "info", path, "--json").stdout)["batch"] == 30


@pytest.mark.parametrize("label,damage,error,message", REFUSALS, ids=[r[0] for r in REFUSALS])
@pytest.mark.parametrize("command", ["info", "check"])
def test_every_refusal_is_one_line_on_the_command_line(shm_dir, command, label, damage, error, message):
    path = shm_dir / "bad.pool"
    small_pool(path)
    damage(str(path))
    before = path.read_bytes()
    assert_one_line_error(cxltrain("pool", command, path), match=message)
    assert path.read_bytes() == before


def test_recover_and_export_errors_are_one_line_and_touch_nothing(shm_dir):
    path = shm_dir / "e.pool"
    assert cxltrain("train", "--pool", path, *SMALL).returncode == 0
    before = path.read_bytes()
    assert_one_line_error(cxltrain("export", path, shm_dir / "missing" / "x.pt"), match="cannot write into")
    assert path.read_bytes() == before
    (shm_dir / "there.pt").write_bytes(b"x")
    assert_one_line_error(cxltrain("export", path, shm_dir / "there.pt"), match="already exists")
    empty = shm_dir / "empty.pool"
    assert cxltrain("pool", "create", empty, "--size", "1M").returncode == 0
    assert_one_line_error(cxltrain("recover", empty), match="holds no committed checkpoint")
    assert_one_line_error(cxltrain("export", empty, shm_dir / "y.pt"), match="holds no committed checkpoint")
    assert not (shm_dir / "y.pt").exists() and not (shm_dir / "y.pt.partial").exists()


# ---------------------------------------------------------------------------------------------
# the small things a careless user walks into
# ---------------------------------------------------------------------------------------------
def test_json_output_is_json_alone(shm_dir):
    path = shm_dir / "j.pool"
    assert cxltrain("pool", "create", path, "--size", "2M").returncode == 0
    for command in ("info", "check"):
        result = cxltrain("pool", command, path, "--json")
        assert result.returncode == 0, result.stderr
        json.loads(result.stdout)  # the whole of stdout, not its last line


def test_a_closed_stdout_ends_quietly(shm_dir):
    path = shm_dir / "p.pool"
    assert cxltrain("pool", "create", path, "--size", "2M").returncode == 0
    script = Path(sys.executable).with_name("cxltrain")
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` that has read enough, gone before the command writes (not after: a race)
    reader_gone = subprocess.Popen([str(script), "pool", "info", str(path)], stdout=write_end,
                                   stderr=subprocess.PIPE)
    os.close(write_end)
    _, err = reader_gone.communicate(timeout=60)
    assert reader_gone.returncode == 141 and b"Traceback" not in err and not err, err


def test_sigterm_stops_at_a_batch_boundary_and_says_where(shm_dir):
    import signal
    import time

    path = shm_dir / "term.pool"
    script = Path(sys.executable).with_name("cxltrain")
    args = [str(script), "train", "--pool", str(path), *[a if a != "30" else "100000" for a in SMALL]]
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "pool" in run.stdout.readline()
    assert "training from batch 0" in run.stdout.readline()
    time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 143, err
    assert_one_line_error(subprocess.CompletedProcess(args, 1, "", err), code=1, match="stopped by SIGTERM")
    batch = int(err.split("committed at batch ")[1].split()[0])
    check = cxltrain("pool", "check", path)
    assert check.returncode == 0 and f"checkpoint at batch {batch}, 0 undo record(s) to roll back" in check.stdout


def test_a_live_pool_can_be_inspected(shm_dir):
    path = shm_dir / "live.pool"
    assert cxltrain("train", "--pool", path, *SMALL).returncode == 0
    with Pool.open(str(path)):  # a writer holds it
        for command in ("info", "check"):
            result = cxltrain("pool", command, path, "--json")
            assert result.returncode == 0, result.stderr
            report = json.loads(result.stdout)
            assert report["in_use"] and report["batch"] == 30
            assert "in use by a writer; showing its last committed root" in result.stderr


@pytest.mark.parametrize("args,match", [
    (["train", "--persist-bandwidth", "-1G"], "--persist-bandwidth: -1G must be a finite rate of at least 1 byte per second"),
    (["train", "--zipf", "-inf"], "--zipf: -inf must be a positive finite number"),
    (["pool", "create", "/tmp/x.pool", "--size", "-1M"], "is not a size"),
])
def test_negative_looking_values_reach_our_validation(args, match):
    assert_one_line_error(cxltrain(*args), code=2, match=match)


def test_version():
    result = cxltrain("--version")
    assert result.returncode == 0 and result.stdout.startswith("cxltrain ")


def test_num_tables_of_a_criteo_file_names_the_inclusive_range(shm_dir):
    from cxltrain.data import CriteoFile
    from cxltrain.errors import ConfigError

    with pytest.raises(ConfigError, match="num_tables must be between 1 and 26, got 27"):
        CriteoFile(str(shm_dir / "any"), batch_size=4, rows=10, num_tables=27)


def test_a_pool_on_an_ordinary_file_is_not_called_pmem(tmp_path):
    result = cxltrain("pool", "create", tmp_path / "disk.pool", "--size", "2M")
    assert result.returncode == 0, result.stderr
    assert "on pmem" not in result.stdout and "on msync" not in result.stdout


def test_the_default_pool_belongs_to_the_working_directory(tmp_path):
    """Two checkouts on one machine never share (resume, or refuse) one pool."""
    here, there = tmp_path / "checkout-a", tmp_path / "checkout-b"
    here.mkdir(), there.mkdir()
    paths = [last_json(cxltrain("devices", "--json", cwd=folder).stdout)["train"]["pool_path"]
             for folder in (here, there, here)]
    assert paths[0] != paths[1] and paths[0] == paths[2]


# the side name a new pool is built under
def _interrupt_pool_creation(monkeypatch, how):
    """posix_fallocate (seconds for a big pool) is where Ctrl-C or SIGTERM lands while creating."""
    import signal

    real = os.posix_fallocate

    def interrupted(fd, offset, size):
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs once this returns
            return real(fd, offset, size)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "posix_fallocate", interrupted)


@pytest.mark.parametrize("how,code,line", [("ctrl-c", 130, "cxltrain: interrupted"),
                                           ("sigterm", 143, "cxltrain: terminated (SIGTERM)")])
def test_an_interrupted_pool_creation_leaves_nothing(shm_dir, monkeypatch, capsys, how, code, line):
    from cxltrain.cli import main

    _interrupt_pool_creation(monkeypatch, how)
    assert main(["train", "--pool", str(shm_dir / "i.pool"), *SMALL]) == code
    assert capsys.readouterr().err.strip() == line
    assert list(shm_dir.iterdir()) == []


def test_a_rank_sigterm_is_left_to_its_launcher_to_say(shm_dir, monkeypatch, capsys):
    """torchrun's agent SIGTERMs every rank when a peer fails: a rank's own "terminated" line came
    before the launcher's one line saying why (seen in CI). A rank whose launcher reports says nothing."""
    from cxltrain.cli import main
    from cxltrain.jobs.lifeline import RANK_ERROR_ENV, TORCHRUN_ENV

    monkeypatch.setenv(TORCHRUN_ENV, "a-run")
    monkeypatch.setenv(RANK_ERROR_ENV, str(shm_dir / "rank-errors"))
    _interrupt_pool_creation(monkeypatch, "sigterm")
    assert main(["pool", "create", str(shm_dir / "r.pool"), "--size", "8M"]) == 143
    assert capsys.readouterr().err == ""
    assert list(shm_dir.iterdir()) == []


def test_pool_creation_errors_name_the_users_path(shm_dir, capsys):
    from cxltrain.cli import main

    path = shm_dir / "big.pool"
    assert main(["train", "--pool", str(path), "--rows", "1000000000", "--num-tables", "64", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"cxltrain: error: {path}: ") and ".creating" not in err, err
    assert list(shm_dir.iterdir()) == []


def test_checkpoint_off_on_a_committed_pool_is_one_line_and_changes_nothing(shm_dir):
    """Checkpoint off on committed batches, through the command line."""
    path = shm_dir / "off.pool"
    assert cxltrain("train", "--pool", path, *SMALL).returncode == 0
    before = path.read_bytes()
    more = [a if a != "30" else "40" for a in SMALL]
    refused = cxltrain("train", "--pool", path, *more, "--checkpoint", "off")
    assert_one_line_error(refused, match="holds 30 committed batches that --checkpoint off would put at risk")
    assert path.read_bytes() == before
    accepted = cxltrain("train", "--pool", path, *more, "--checkpoint", "off", "--discard-checkpoint")
    assert accepted.returncode == 0 and "resuming at batch 30" in accepted.stdout, accepted.stderr


# export's failure paths
def _small_trained_pool(folder: Path) -> Path:
    path = folder / "e.pool"
    assert cxltrain("train", "--pool", path, *[a if a != "30" else "3" for a in SMALL]).returncode == 0
    return path


def test_an_export_that_runs_out_of_disk_is_one_line_and_leaves_nothing(shm_dir):
    import resource

    pool = _small_trained_pool(shm_dir)
    out = shm_dir / "out.pt"
    # the child may write no file over 64 KiB: the export's write fails part-way, as on a full disk
    full = cxltrain("export", pool, out,
                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16)))
    # the streamed export writes the tables itself, so the failed write's own reason reaches the line
    assert_one_line_error(full, match=f"{out}: cannot write: File too large")
    assert sorted(p.name for p in shm_dir.iterdir()) == ["e.pool"]
    again = cxltrain("export", pool, out)
    assert again.returncode == 0 and sorted(p.name for p in shm_dir.iterdir()) == ["e.pool", "out.pt"], again.stderr


def test_an_interrupted_export_leaves_nothing(shm_dir, monkeypatch, capsys):
    from cxltrain.cli import main
    from cxltrain.runtime import streamed_save

    pool = _small_trained_pool(shm_dir)

    def interrupted(obj, f, *args, **kwargs):
        f.write(b"half an export")
        raise KeyboardInterrupt

    monkeypatch.setattr(streamed_save, "save", interrupted)  # export's writer (torch.save's format, streamed)
    assert main(["export", str(pool), str(shm_dir / "out.pt")]) == 130
    assert capsys.readouterr().err == "cxltrain: interrupted\n"
    assert sorted(p.name for p in shm_dir.iterdir()) == ["e.pool"]


def test_exporting_a_committed_pool_writes_nothing_to_it(shm_dir):
    pool = _small_trained_pool(shm_dir)
    before = pool.read_bytes()
    assert cxltrain("export", pool, shm_dir / "out.pt").returncode == 0
    assert pool.read_bytes() == before


# resources checked, with the figures, before any work
@pytest.mark.parametrize("args,match", [
    (["--batch-size", "100000000"], "of memory for its model and one batch (--batch-size 100000000"),
    (["--num-tables", "100000"], "of memory for its model and one batch (--batch-size 2048, --num-tables 100000"),
    (["--rows", "1000000000", "--num-tables", "64"], "not enough space for the pool: it needs 16,640,116,854,784 bytes"),
])
def test_a_run_that_cannot_fit_is_refused_before_any_work(shm_dir, capsys, args, match):
    from cxltrain.cli import main

    assert main(["train", "--pool", str(shm_dir / "r.pool"), "--no-progress", *args]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and match in err, err  # no summary line for a refused run
    assert list(shm_dir.iterdir()) == []


def test_the_data_file_is_known_by_its_content_not_its_path(shm_dir):
    """A moved data file resumes; other bytes under the same path are refused."""
    import shutil

    data = write_criteo(shm_dir / "day_0", 160)
    common = ["--pool", shm_dir / "c.pool", "--batch-size", "32", "--num-tables", "4", "--rows", "1000", "--dim", "8",
              "--no-progress"]
    assert cxltrain("train", "--data", data, "--steps", "2", *common).returncode == 0
    moved = shutil.copy(data, shm_dir / "moved")
    resumed = cxltrain("train", "--data", moved, "--steps", "3", *common)
    assert resumed.returncode == 0 and "resuming at batch 2" in resumed.stdout, resumed.stderr
    lines = data.read_text().splitlines()
    lines[0] = ("1" if lines[0][0] == "0" else "0") + lines[0][1:]  # one label flipped, same size
    data.write_text("\n".join(lines) + "\n")
    changed = cxltrain("train", "--data", data, "--steps", "4", *common)
    assert_one_line_error(changed, match="was written by a run with other settings (data '")


@pytest.mark.parametrize("given,expected", [
    ({}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}),
    ({"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}),
])
def test_openmp_spins_briefly_then_waits_passively_unless_the_user_says_otherwise(monkeypatch, given, expected):
    """libgomp's own spin made runs 5-12x slower on shared cores; no spin slows an idle machine."""
    from cxltrain.cli import main

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    main(["pool", "info", "/nonexistent/p.pool"])
    assert {name: os.environ.get(name) for name in expected} == expected


def test_the_zygote_sets_openmp_as_the_command_line_does():
    """The tests' preloaded interpreter mirrors set_openmp_wait (it imports nothing of cxltrain)."""
    from cxltrain.knobs import OPENMP_SPIN_COUNT

    zygote = (Path(__file__).parent / "zygote.py").read_text()
    assert f'os.environ["GOMP_SPINCOUNT"] = "{OPENMP_SPIN_COUNT}"' in zygote


def test_the_command_line_imports_no_torch_before_it_runs():
    """So the OMP_WAIT_POLICY default reaches libgomp: torch starts OpenMP when it is imported."""
    probe = "import sys, cxltrain.cli.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
