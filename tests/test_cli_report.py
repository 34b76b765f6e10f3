"""What a new user meets on a fresh clone: `harness diff` and `reports drift` given one run twice, what `reports drift`
prints and writes for training runs, their help, and `harness run` on worlds larger than a scenario's vocabulary or
batch can be sharded on."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from grpo_core import LossContractError
from harness.record import read_table, write_table
from harness.training import CAUSES, training_comparison, verdict_text
import test_recorder
from test_gate import cli
from test_recorder import record_run

ROOT = Path(__file__).resolve().parents[1]


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    return line


def gate_run(folder: Path, moved: bool = False) -> Path:
    """A gate run of one cell (the golden of `identity`); `moved`: one per-sequence value 1 ULP away, one row gone."""
    df, meta = read_table(ROOT / "golden" / "canonical" / "identity.parquet")
    if moved:
        row = df.index[df["field"] == "per_sequence_policy"][0]
        df.loc[row, "bits"] += 1
        df.loc[row, "value"] = float(np.array(df.loc[row, "bits"], dtype=np.int32).view(np.float32))
        df = df.drop(df.index[df["field"] == "per_sequence_kl"][0])
    write_table(df.to_dict("records"), folder / "run.parquet", meta)
    return folder


def test_one_run_given_twice_is_refused_in_one_line(tmp_path, capsys):
    """A mistyped path (A and B one folder) compared a run with itself: "identical", exit code 0."""
    record_run(tmp_path / "train", steps=1)
    gate_run(tmp_path / "gate")
    (tmp_path / "link").symlink_to(tmp_path / "train")
    for run, again in ((tmp_path / "train", tmp_path / "train"), (tmp_path / "train", tmp_path / "link"),
                       (tmp_path / "gate", tmp_path / "gate"), (tmp_path / "gate", tmp_path / "gate" / "run.parquet")):
        want = f"RUN_B: expected another run than RUN_A, got {again}, which is the same folder as RUN_A ({run})"
        line = one_line(cli(capsys, "harness", "diff", str(run), str(again)))
        assert line == f"python -m harness diff: error: {want}"
        line = one_line(cli(capsys, "reports", "drift", str(run), str(again), "--out", str(tmp_path / "rep")))
        assert line == f"python -m reports drift: error: {want}"
        assert not (tmp_path / "rep").exists()
    assert cli(capsys, "harness", "diff", str(tmp_path / "gate"), str(gate_run(tmp_path / "copy"))).returncode == 0


def test_drift_prints_the_verdict_of_harness_diff_for_training_runs(tmp_path, capsys):
    record_run(tmp_path / "a")
    record_run(tmp_path / "b", op_at={2})
    diff = cli(capsys, "harness", "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    drift = cli(capsys, "reports", "drift", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep"))
    verdict = verdict_text(training_comparison(str(tmp_path / "a"), str(tmp_path / "b")))
    assert diff.returncode == 1 and verdict in diff.stdout
    assert drift.returncode == 0 and drift.stdout == f"{verdict}\nreport: {tmp_path / 'rep' / 'report.html'}\n"


def test_drift_says_what_it_counts_for_gate_runs(tmp_path, capsys):
    a, b = gate_run(tmp_path / "a"), gate_run(tmp_path / "b", moved=True)
    drift = cli(capsys, "reports", "drift", str(a), str(b), "--out", str(tmp_path / "rep"))
    assert drift.returncode == 0 and drift.stdout.splitlines() == [
        "2 differing rows (value or digest, per field): 1 moved, 1 on one side only, in 1 cell (scenario x layout)",
        f"report: {tmp_path / 'rep' / 'report.html'}"]


def _section(text: str, heading: str) -> str:
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_training_report_lists_the_moved_scalars_and_one_row_per_sequence_in_one_run(tmp_path, capsys, monkeypatch):
    record_run(tmp_path / "a")
    batch = test_recorder._batch

    def moved(seed: int) -> dict:  # step 2's hidden states scaled: every value of the step moves, the loss too
        b = batch(seed)
        return {**b, "hidden": b["hidden"] * 1.5} if seed == 2 else b

    monkeypatch.setattr(test_recorder, "_batch", moved)
    record_run(tmp_path / "planted", steps=2)  # step 2 moved, step 3 in A only
    assert cli(capsys, "reports", "drift", str(tmp_path / "a"), str(tmp_path / "planted"), "--out",
               str(tmp_path / "rep")).returncode == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    c = training_comparison(str(tmp_path / "a"), str(tmp_path / "planted"))
    moved = c["diffs"][c["diffs"]["field"].isin(["loss", "policy_loss", "kl"]) & (c["diffs"]["missing"] == "")]
    scalars = _section(md, "Per-call scalars that moved")
    assert "| step | call | field | A | B | ULP |" in scalars and "3 per-call values in one run only" in scalars
    assert len(moved) and (moved["step"] == 2).all()
    for r in moved.itertuples():  # each as `harness diff` prints it: every digit of both values
        assert f"| 2 | {r.sequence} | {r.field} | {r.value_a!r} | {r.value_b!r} | {r.ulp:.0f} |" in scalars
    alone = _section(md, "In one run only")
    assert "| step | sequence | occurrence | missing in |\n" in alone and "rows |" not in alone
    assert alone.count("| 3 | ") == 8 and "`missing in` names the run that lacks it" in alone
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "<h2>Per-call scalars that moved</h2>" in html and "<th>rows</th>" not in html
    per_step = _section(md, "Per step")
    for cause, why in CAUSES.items():  # one cause a line: a Markdown list, line breaks in the HTML
        assert f"\n- {cause}: {why}\n" in per_step and f"<br>- {cause}: " in html


def test_training_report_says_when_no_scalar_moved_or_none_was_compared(tmp_path, capsys):
    record_run(tmp_path / "a")
    record_run(tmp_path / "b")
    record_run(tmp_path / "two", micro=2)
    for other, want in (("b", "_none_"), ("two", "Not compared: the layouts differ (A: world_size 1, "
                                                 "gradient_accumulation_steps 1, per_device_train_batch_size 8; B: "
                                                 "world_size 1, gradient_accumulation_steps 2")):
        out = tmp_path / f"rep-{other}"
        assert cli(capsys, "reports", "drift", str(tmp_path / "a"), str(tmp_path / other), "--out",
                   str(out)).returncode == 0
        assert want in _section((out / "report.md").read_text(), "Per-call scalars that moved")


def test_per_step_figure_shows_every_bar_that_is_not_zero():
    """The log axis of the largest ULP distance autoscaled to 5.6e6 here, where the 6e6 bar is all but gone."""
    from reports.drift import per_step_figure
    steps = pd.DataFrame({"step": [1, 2, 3], "sequences": 8, "moved": [0, 1, 1], "upstream": 0, "loss": [0, 1, 1],
                          "scale": 0, "gradient": 0, "max_ulp": [0, 6_000_000, 20_000_000], "only_in_A": 0,
                          "only_in_B": 0, "scalar_moved": False})
    fig = per_step_figure(steps)
    fig.canvas.draw()
    assert fig.axes[1].get_yscale() == "log" and 0 < fig.axes[1].get_ylim()[0] <= 1


def test_help_of_diff_and_drift_names_both_kinds_of_run_and_the_exit_codes(capsys):
    for module, command in (("harness", "diff"), ("reports", "drift")):
        proc = cli(capsys, module, command, "--help")
        words = " ".join(proc.stdout.split())
        assert proc.returncode == 0
        for part in ("gate run", "run.parquet", "rank-*/step-*.parquet", "TrainingRecorder",
                     "GRPOCoreTrainer(record_dir=...)", "Exit code: 0"):
            assert part in words, (module, part, words)
    assert "Exit code: 0 identical, 1 anything moved or missing on one side, 2 a mistake" in " ".join(
        cli(capsys, "harness", "diff", "--help").stdout.split())


def test_layouts_a_scenario_cannot_be_sharded_on_are_skipped_with_a_line():
    """World 64: TP up to the vocabulary's tiles, DP up to the sequences; every layout kept builds its contract, every
    one left out is one the contract refuses."""
    from harness.__main__ import held_layouts
    from harness.scenarios import SCENARIOS
    from harness.topology import Layout, layouts
    names = ["luspo_empty", "wide_exponent"]
    held, skipped = held_layouts(names, 64)
    assert skipped == [
        "luspo_empty: layouts with TP > 5 (vocab 520 holds 5 tiles of 128) or DP > 8 (8 sequences) skipped",
        "wide_exponent: layouts with TP > 33 (vocab 4099 holds 33 tiles of 128) or DP > 8 (8 sequences) skipped"]
    assert max(Layout.parse(n).tp for n in held["luspo_empty"]) == 5 and "tp5xdp8" in held["luspo_empty"]
    for name in names:
        for lay in layouts(64):
            if lay.name in held[name]:
                SCENARIOS[name].contract(lay.tp, lay.dp)
            else:
                with pytest.raises(LossContractError, match="(tp|dp)_world_size: expected <= "):
                    SCENARIOS[name].contract(lay.tp, lay.dp)
    assert held_layouts(names, 4) == ({n: [lay.name for lay in layouts(4)] for n in names}, [])


def test_plant_drift_at_a_layout_no_scenario_holds_is_refused(tmp_path, capsys):
    line = one_line(cli(capsys, "harness", "run", "--max-world", "6", "--scenarios", "luspo_empty", "--plant-drift",
                        "tp6xdp1", "--out", str(tmp_path / "run")))
    assert "--plant-drift: expected a layout that one of the scenarios can be sharded on" in line
    assert not (tmp_path / "run").exists()


def test_a_layout_that_no_scenario_holds_is_a_column_of_skipped(tmp_path, capsys, monkeypatch):
    """World 9 (tp9xdp1, tp1xdp9: more tiles and sequences than `identity` has), recorded without a world: every layout
    the scenario holds gives its golden rows."""
    import harness.__main__ as entry
    golden, _ = read_table(ROOT / "golden" / "canonical" / "identity.parquet")

    def recorded(args, held, world):
        rows = pd.concat([golden.assign(topology=lay) for lay in held["identity"]])
        return {"rows": rows.to_dict("records"), "guards": {"identity": None}, "provenance": {"process_group": "gloo"}}

    monkeypatch.setattr(entry, "_record", recorded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pandas: a column of floats (NaN) filled with a string
        proc = cli(capsys, "harness", "run", "--max-world", "9", "--scenarios", "identity", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skip = "identity: layouts with TP > 8 (vocab 1000 holds 8 tiles of 128) or DP > 8 (8 sequences) skipped"
    assert f"\n{skip}\n" in proc.stdout and f"- {skip}\n" in (tmp_path / "summary.md").read_text()
    assert re.search(r"^identity +(identical +){20}skipped +identical +skipped$", proc.stdout, re.M), proc.stdout
    assert "vs golden: identical=21" in proc.stdout and "determinism: all identical" in proc.stdout


@pytest.mark.distributed
def test_a_world_larger_than_a_vocabulary_skips_its_layouts_and_passes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--max-world", "6", "--scenarios",
                           "luspo_empty,identity", "--timeout", "120", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "\nluspo_empty: layouts with TP > 5 (vocab 520 holds 5 tiles of 128) skipped\n" in proc.stdout
    assert re.search(r"^luspo_empty +(identical +){10}skipped +(identical +){2}identical$", proc.stdout, re.M)
    assert "determinism: all identical" in proc.stdout and "vs golden: identical=27" in proc.stdout
    df, _ = read_table(tmp_path / "run.parquet")
    cells = set(zip(df["scenario"], df["topology"]))
    assert ("identity", "tp6xdp1") in cells and ("luspo_empty", "tp6xdp1") not in cells and len(cells) == 27
