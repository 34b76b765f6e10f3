"""The determinism gate itself: identical runs pass, a planted drift fails with the right sequences and field,
a modified or missing golden fails."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from grpo_core.distributed import DistributedGRPOLossOp
from harness.diff import differences, topology_differences, ulp_distance
from harness.record import read_table, write_table
from harness.scenarios import SCENARIOS, RegroupedTokenSumOp

ROOT = Path(__file__).resolve().parents[1]
SCN = "csr_straddle_odd_v1031"
pytestmark = pytest.mark.distributed


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("clean")
    return harness("run", "--max-world", "2", "--scenarios", f"{SCN},identity", "--out", str(out)), out


def test_identical_path_reports_no_drift(clean_run):
    proc, out = clean_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "determinism: all identical" in proc.stdout and "vs golden: identical=6" in proc.stdout
    df, meta = read_table(out / "run.parquet")
    assert set(df["topology"]) == {"tp1xdp1", "tp2xdp1", "tp1xdp2"}
    assert meta["provenance"]["torch"] == torch.__version__ and meta["provenance"]["threads_per_rank"] == 1
    assert len(topology_differences(df)) == 0
    assert df[df["field"] == "grad_digest"]["digest"].str.len().eq(24).all()


def test_planted_drift_names_the_sequences_and_field(tmp_path):
    proc = harness("run", "--max-world", "2", "--scenarios", SCN, "--plant-drift", "tp1xdp2", "--out", str(tmp_path))
    assert proc.returncode == 1
    df, _ = read_table(tmp_path / "run.parquet")
    diffs = topology_differences(df)
    assert set(diffs["topology"]) == {"tp1xdp2"}
    # Independently: which sequences does the regrouped token sum move on these inputs?
    scn = SCENARIOS[SCN]
    inp = scn.inputs()
    c = scn.contract()

    def per_seq(op):
        return op.apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], inp["rewards"], contract=c,
                        completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"])

    a, b = per_seq(DistributedGRPOLossOp()), per_seq(RegroupedTokenSumOp())
    for field in ("per_sequence_policy", "per_sequence_kl"):
        expected = torch.nonzero(getattr(a, field).view(torch.int32) != getattr(b, field).view(torch.int32))
        got = sorted(diffs[diffs["field"] == field]["index"].tolist())
        assert got == expected.flatten().tolist(), field
    assert len(diffs[diffs["field"] == "per_sequence_policy"]) > 0
    assert re.search(r"sequences moved \([^)]*per_sequence_policy", proc.stderr)
    assert f"{SCN} tp1xdp2 per_sequence_policy[" in proc.stderr
    assert "ULP" in proc.stderr


def test_modified_golden_fails(clean_run, tmp_path):
    """A golden that verifies (hash, value vs bits) but holds other bits: the run names the value, shows both
    provenances and the command that records a golden."""
    gold = tmp_path / "golden"
    shutil.copytree(ROOT / "golden" / "canonical", gold)
    df, meta = read_table(gold / f"{SCN}.parquet")
    row = (df["field"] == "per_sequence_kl") & (df["index"] == 3)
    df.loc[row, "bits"] = df.loc[row, "bits"] + 1  # one ULP on one sequence, value to match
    df.loc[row, "value"] = float(torch.tensor(int(df.loc[row, "bits"].iloc[0]), dtype=torch.int32).view(torch.float32))
    write_table(df.to_dict("records"), gold / f"{SCN}.parquet", meta)
    manifest = json.loads((gold / "MANIFEST.json").read_text())
    manifest["files"][f"{SCN}.parquet"]["sha256"] = hashlib.sha256((gold / f"{SCN}.parquet").read_bytes()).hexdigest()
    (gold / "MANIFEST.json").write_text(json.dumps(manifest))
    proc = harness("run", "--max-world", "1", "--scenarios", SCN, "--golden-dir", str(gold), "--out",
                   str(tmp_path / "run"))
    assert proc.returncode == 1
    assert "1 row differs from the golden" in proc.stderr and f"{SCN} tp1xdp1 per_sequence_kl[3]" in proc.stderr
    assert f"{SCN} tp1xdp1: 1 sequence moved (per_sequence_kl); scalar moved: no; max 1 ULP" in proc.stderr
    assert proc.stdout.endswith("determinism: FAILED (1 problem)\n")
    # Both provenances side by side, and how to record a golden.
    assert "golden" in proc.stderr and "this run" in proc.stderr and "cpu_model" in proc.stderr
    assert "nox -s goldens -- --device cpu" in proc.stderr


def test_missing_golden_is_refused_before_the_world_with_the_command(tmp_path):
    """An empty --golden-dir is refused at once (issue 23: it used to fail after the whole run), with the command
    that records a golden set there."""
    proc = harness("run", "--max-world", "1", "--scenarios", "identity", "--golden-dir", str(tmp_path), "--out",
                   str(tmp_path / "run"))
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert (f"--golden-dir: expected a folder holding a golden set (MANIFEST.json and its .parquet files), got "
            f"{tmp_path}, which holds none; record it with: nox -s goldens -- --device cpu --golden-dir {tmp_path}"
            in proc.stderr)


def test_a_golden_set_that_lacks_a_scenario_names_it_and_the_command(tmp_path):
    gold = tmp_path / "golden"
    shutil.copytree(ROOT / "golden" / "canonical", gold)
    (gold / "identity.parquet").unlink()
    manifest = json.loads((gold / "MANIFEST.json").read_text())
    del manifest["files"]["identity.parquet"]
    (gold / "MANIFEST.json").write_text(json.dumps(manifest))
    proc = harness("run", "--max-world", "1", "--scenarios", "identity", "--golden-dir", str(gold), "--out",
                   str(tmp_path / "run"))
    assert proc.returncode == 1
    assert (f"no golden for scenarios ['identity'] in {gold}; record it with: nox -s goldens -- --device cpu "
            f"--golden-dir {gold}" in proc.stderr)


def test_diff_counts_signed_zero_and_nan_payloads():
    base = pd.DataFrame([dict(scenario="s", topology="tp1xdp1", field="per_sequence_kl", index=i, value=0.0,
                              bits=b, digest=None, fingerprint="f") for i, b in enumerate([0, 0x7FC00000])])
    other = base.copy()
    other["topology"] = "tp2xdp1"
    other["bits"] = [-(2**31), 0x7FC00001]  # -0.0 and another NaN payload
    diffs = differences(other, base)
    assert diffs["index"].tolist() == [0, 1]
    assert ulp_distance(pd.Series([0x3F800001]), pd.Series([0x3F800000]), pd.Series(["loss"])).item() == 1
    assert ulp_distance(pd.Series([-(2**31) + 1]), pd.Series([1]), pd.Series(["loss"])).item() == 2  # -tiny vs +tiny


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_cuda_memory_fraction_outside_zero_one_is_refused(value, capsys):
    from harness.__main__ import main
    with pytest.raises(SystemExit):
        main(["run", "--cuda-memory-fraction", value])
    assert f"--cuda-memory-fraction: expected a fraction in (0, 1], got {value}" in capsys.readouterr().err


def test_a_linear_scenario_holds_its_golden_and_a_planted_drift_fails_it(tmp_path):
    """The fused linear loss through the gate: identical at every layout and to the canonical golden (torch kernels
    on the CPU), and the regrouped token sum planted at tp2xdp1 moves only that layout's per-sequence values."""
    name = "linear_wide_ref_logps_dr_grpo"
    assert SCENARIOS[name].linear and SCENARIOS[name].wide
    clean = harness("run", "--max-world", "2", "--scenarios", name, "--out", str(tmp_path / "clean"))
    assert clean.returncode == 0 and "vs golden: identical=3" in clean.stdout, clean.stdout + clean.stderr
    planted = harness("run", "--max-world", "2", "--scenarios", name, "--plant-drift", "tp2xdp1", "--out",
                      str(tmp_path / "planted"))
    assert planted.returncode == 1
    df, _ = read_table(tmp_path / "planted" / "run.parquet")
    diffs = topology_differences(df)
    assert set(diffs["topology"]) == {"tp2xdp1"} and "per_sequence_policy" in set(diffs["field"])
    assert "grad_digest" not in set(diffs["field"])  # the token sum is not in the hidden states' gradient
