"""`cxltrain train --profile`: the phases of a batch from the step split and the checkpoint's
counters, the same figures `--json` reports (a tiny model: this checks the bookkeeping, never a timing)."""

from __future__ import annotations

import pytest

from helpers import cxltrain
from test_cli import assert_one_line_error, last_json

TINY = ["--steps", "12", "--rows", "2000", "--num-tables", "2", "--dim", "8", "--batch-size", "64", "--no-progress"]


def _profile(stdout: str) -> dict[str, float]:
    """{phase: figure} of the profile's lines, in the order printed."""
    lines = stdout[stdout.index("profile:"):].splitlines()
    return {line.split(None, 1)[1]: float(line.split()[0]) for line in lines if not line.startswith(("profile:", "{"))}


@pytest.mark.parametrize("checkpoint", ["undo", "off"])
def test_profile_prints_the_counters_the_run_kept(shm_dir, checkpoint):
    result = cxltrain("train", "--pool", shm_dir / "p.pool", "--checkpoint", checkpoint, "--profile", "--json", *TINY)
    assert result.returncode == 0, result.stderr
    out, phases = last_json(result.stdout), _profile(result.stdout)
    split = out["split_ms"]
    assert phases["step"] == pytest.approx(split["total"], abs=0.005)
    assert phases["checkpoint (the training thread's share)"] == pytest.approx(split["checkpoint"], abs=0.005)
    stats = out["checkpoint_stats"]
    if checkpoint == "off":
        assert stats is None and "profile: checkpoint off: no checkpoint phases" in result.stdout
        return
    per_batch = 1000 / stats["batches"]
    assert phases["training thread, backward: undo capture"] == pytest.approx(
        stats["training_capture_seconds"] * per_batch, abs=0.005)
    assert phases["any thread, commit: rows and snapshot persisted, root written"] == pytest.approx(
        stats["commit_seconds"] * per_batch, abs=0.005)
    assert phases["MB per batch made durable: undo records"] == pytest.approx(
        stats["undo_bytes"] / stats["batches"] / 1e6, abs=0.005) and stats["undo_bytes"] > 0


def test_profile_refuses_several_ranks(shm_dir):
    result = cxltrain("train", "--pool", shm_dir / "p.pool", "--nproc-per-node", "2", "--profile", *TINY)
    assert_one_line_error(result, match="--profile")
    assert list(shm_dir.iterdir()) == []
