"""`benchmarks/benchmark_trl_step.py --tiny` end to end on the CPU: both trainers train 4 steps of a 2-layer Qwen2 on
the same completions, and every step's row holds its timings, its logged values and the provenance. And
`benchmarks/benchmark_recorder.py --tiny` on the CPU: every region timed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pd = pytest.importorskip("pandas")

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, cwd: Path, *args: str) -> str:
    """Runs `benchmarks/<script>` with `args` in `cwd` on one thread; its stdout (asserts exit code 0)."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # the caller's packages too
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_tiny_run(tmp_path):
    out = tmp_path / "trl_step.parquet"
    stdout = run_benchmark("benchmark_trl_step.py", tmp_path, "--tiny", "--out", str(out), "--profile-dir",
                           str(tmp_path / "profiles"), "--profile-step", "2")
    assert "| tiny | trl vs ours | loss |" in stdout and "| NO |" not in stdout
    for trainer in ("trl", "ours"):  # step 2 profiled, its 2 micro-batches' loss stages marked
        assert (tmp_path / "profiles" / f"tiny_{trainer}.json").stat().st_size > 0
        assert f"profiles/tiny_{trainer}.json: the loss stage's forward, 2 ranges: host " in stdout
    rows = pd.read_parquet(out)
    assert len(rows) == 8 and list(rows["trainer"]) == ["trl"] * 4 + ["ours"] * 4
    assert {"device", "torch", "trl", "transformers", "git_commit", "deterministic", "tf32_matmul"} <= set(rows)
    for _, r in rows.iterrows():
        assert r["step"] in (1, 2, 3, 4) and r["micro_batches"] == 2  # one loss stage per micro-batch
        assert r["generation"] == (r["step"] in (1, 3))  # 2 steps per generation of 16 completions
        assert (r["sample_ms"] > 0 and r["score_ms"] > 0) == r["generation"]
        assert r["step_ms"] > r["loss_fwd_ms"] >= r["loss_op_ms"] > 0 and r["loss_bwd_ms"] > 0
    trl, ours = (rows[rows["trainer"] == t].reset_index(drop=True) for t in ("trl", "ours"))
    assert trl["reward"].equals(ours["reward"])  # the same completions (NaN where no generation, in both)
    assert ((trl["loss"] - ours["loss"]).abs() < 1e-3).all() and (trl["loss"].abs() > 1e-2).any()


@pytest.mark.parametrize("args, message", [
    (["--profile-step", "2"], "--profile-step: expected with --profile-dir only, got 2 without it"),
    (["--profile-dir", "p", "--profile-step", "5"], "--profile-step: expected a step from 1 to --steps (4), got 5"),
    (["--profile-dir", "p", "--profile-step", "0"], "--profile-step: expected a step from 1 to --steps (4), got 0"),
])
def test_profile_options_are_checked_first(tmp_path, args, message):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "benchmark_trl_step.py"), "--tiny", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "p").exists()


def test_recorder_benchmark_tiny(tmp_path):
    line = run_benchmark("benchmark_recorder.py", tmp_path, "--device", "cpu", "--tiny", "--steps", "4"
                         ).strip().splitlines()[-1]
    values = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].removesuffix(" ms (medians)").split(", "))
    assert set(values) == {"op", "bwd", "record_host", "record", "bwd_recorded", "flush", "write"}
    assert all(float(v) > 0 for v in values.values())


def test_layer_digests_benchmark_tiny(tmp_path):
    line = run_benchmark("benchmark_recorder.py", tmp_path, "--device", "cpu", "--tiny", "--steps", "2", "--layers",
                         "tiny").strip().splitlines()[-1]
    assert line.startswith("tiny backbone, 2 x 16 tokens, 4 modules digested")
    values = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(" ms (medians")[0].split(", "))
    assert set(values) == {"plain", "digests", "digest_only"} and all(float(v) > 0 for v in values.values())
