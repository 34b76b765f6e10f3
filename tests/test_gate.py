"""A gate a user can trust (issue 13): `harness diff` is symmetric and compares layout with layout, a planted drift
that cannot be planted is refused, goldens are verified before they are believed, and a user mistake gets one line
and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import shutil
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from harness.record import read_table, write_table
from harness.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "canonical"
SCN = "csr_straddle_odd_v1031"
pytestmark = pytest.mark.distributed


def python_m(module: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, **kw)


def cli(capsys, module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m <module> args` in this process (no interpreter start, no torch import): same code, same output."""
    main = importlib.import_module(f"{module}.__main__").main
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess([module, *args], code, out.out, out.err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A clean run and a run with a drift planted at tp2xdp1 (max world 2, two scenarios)."""
    out = {}
    for name, extra in (("clean", []), ("planted", ["--plant-drift", "tp2xdp1"])):
        folder = tmp_path_factory.mktemp(name)
        proc = python_m("harness", "run", "--max-world", "2", "--scenarios", f"{SCN},identity", "--out", str(folder),
                        *extra)
        assert proc.returncode == (1 if extra else 0), proc.stdout[-3000:] + proc.stderr[-3000:]
        out[name], out[f"{name} output"] = folder, proc.stdout + proc.stderr
    return out


def _diff_lines(stdout: str) -> set[str]:
    return {line.split(":")[0].strip() for line in stdout.splitlines() if "ULP" in line}


# --- harness diff ----------------------------------------------------------------------------------------------------

def test_diff_is_symmetric_and_compares_layout_with_layout(runs):
    ab = python_m("harness", "diff", str(runs["clean"] / "run.parquet"), str(runs["planted"] / "run.parquet"))
    ba = python_m("harness", "diff", str(runs["planted"] / "run.parquet"), str(runs["clean"] / "run.parquet"))
    assert ab.returncode == ba.returncode == 1, ab.stdout + ba.stdout
    assert "Traceback" not in ab.stderr + ba.stderr
    moved = _diff_lines(ab.stdout)
    assert moved and moved == _diff_lines(ba.stdout)  # the same cells, whichever run comes first
    assert all(" tp2xdp1 " in line for line in moved), moved
    assert f"{SCN} tp2xdp1 per_sequence_policy[" in ab.stdout


def test_diff_lines_name_the_side_of_each_value(runs):
    proc = python_m("harness", "diff", str(runs["clean"]), str(runs["planted"]))
    moved = [line for line in proc.stdout.splitlines() if "ULP" in line]
    assert moved and all(re.search(r": A -?[\d.e+-]+ \(0x[0-9a-f]{8}\) vs B -?[\d.e+-]+ \(0x[0-9a-f]{8}\), \d+ ULP$",
                                   line) for line in moved), moved


def test_a_planted_drift_is_not_blamed_on_the_golden(runs):
    out = runs["planted output"]
    assert "planted: a regrouped token sum at tp2xdp1 (the gate must fail)" in out
    assert "Every one of them is at tp2xdp1, where the drift was planted: the gate caught it" in out
    assert "the golden is not at fault (do not re-record it)" in out
    assert "Once the change is intended" not in out and "nox -s goldens" not in out


def test_diff_fails_on_cells_whose_contracts_differ(runs, tmp_path, capsys):
    """Same bits, another contract fingerprint: not the same experiment (issue 23 item 14)."""
    df, meta = read_table(runs["clean"] / "run.parquet")
    cell = (df["scenario"] == "identity") & (df["topology"] == "tp2xdp1")
    df.loc[cell, "fingerprint"] = "0" * 32
    write_table(df.to_dict("records"), tmp_path / "other" / "run.parquet", meta)
    proc = cli(capsys, "harness", "diff", str(runs["clean"]), str(tmp_path / "other"))
    assert proc.returncode == 1, proc.stdout
    fp = read_table(runs["clean"] / "run.parquet")[0].loc[cell, "fingerprint"].iloc[0]
    assert f"  identity tp2xdp1: contract fingerprint A {fp} vs B {'0' * 32}" in proc.stdout
    assert proc.stdout.splitlines()[-1] == ("FAILED: 0 values moved and 0 rows missing on one side, in 1 cell; the "
                                            "contracts differ in 1 cell (different contracts are not the same "
                                            "experiment)")
    assert re.search(r"identity\s+tp2xdp1\s+contract differs\s", proc.stdout)
    from reports.drift import drift_report
    drift_report(str(runs["clean"]), str(tmp_path / "other"), tmp_path / "report")
    assert ("the contracts differ in 1 cell (identity tp2xdp1): not the same experiment; identical"
            in (tmp_path / "report" / "report.md").read_text())


def _without(df: pd.DataFrame, what: str) -> pd.DataFrame:
    if what == "everything":
        return df.iloc[:0]
    if what == "a scenario":
        return df[df["scenario"] != "identity"]
    if what == "a layout":
        return df[df["topology"] != "tp1xdp2"]
    return df.drop(index=df.index[(df["field"] == "per_sequence_kl") & (df["index"] == 3)][:1])  # a row


@pytest.mark.parametrize("what", ["everything", "a scenario", "a row"])
def test_diff_counts_rows_on_one_side_only_as_missing(runs, tmp_path, capsys, what):
    df, meta = read_table(runs["clean"] / "run.parquet")
    write_table(_without(df, what).to_dict("records"), tmp_path / "run.parquet", meta)
    mine, clean = tmp_path / "run.parquet", runs["clean"] / "run.parquet"
    for a, b in ((mine, clean), (clean, mine)):
        proc = cli(capsys, "harness", "diff", str(a), str(b))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "missing" in proc.stdout and "identical" not in proc.stdout.splitlines()[-1]
        assert not re.search(r"\bnan\b", proc.stdout, re.I)


def test_diff_accepts_run_folders_and_ends_identical_runs_with_a_count(runs, tmp_path, capsys):
    copy = shutil.copytree(runs["clean"], tmp_path / "copy")  # a folder against itself is refused
    proc = cli(capsys, "harness", "diff", str(runs["clean"]), str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = len(read_table(runs["clean"] / "run.parquet")[0])
    assert proc.stdout.splitlines()[-1] == f"identical: 6 cells (2 scenarios x 3 layouts), {rows} rows compared bitwise"


def test_diff_of_runs_of_different_worlds_compares_the_layouts_both_hold(runs, tmp_path, capsys):
    """A world-1 run against a world-2 run: said in one line, then the shared layout is compared (its rows are not
    `missing`); a moved value there still fails."""
    df, meta = read_table(runs["clean"] / "run.parquet")
    single = df[df["topology"] == "tp1xdp1"]
    write_table(single.to_dict("records"), tmp_path / "w1" / "run.parquet", meta)
    for a, b, only in ((runs["clean"], tmp_path / "w1", "only A: tp2xdp1, tp1xdp2; only B: none"),
                       (tmp_path / "w1", runs["clean"], "only A: none; only B: tp2xdp1, tp1xdp2")):
        proc = cli(capsys, "harness", "diff", str(a), str(b))
        assert proc.returncode == 0, proc.stdout
        assert (f"The runs hold different layouts ({only}): comparing the 1 layout both hold, tp1xdp1"
                in proc.stdout.splitlines())
        assert proc.stdout.splitlines()[-1] == (f"identical: 2 cells (2 scenarios x 1 layout both runs hold), "
                                                f"{len(single)} rows compared bitwise")
        assert "missing in the" not in proc.stdout and "missing on one side" not in proc.stdout
    moved = single.copy()
    row = (moved["scenario"] == "identity") & (moved["field"] == "per_sequence_kl") & (moved["index"] == 0)
    moved.loc[row, "bits"] += 1
    moved.loc[row, "value"] = float(torch.tensor(int(moved.loc[row, "bits"].iloc[0]), dtype=torch.int32).view(
        torch.float32))
    write_table(moved.to_dict("records"), tmp_path / "moved" / "run.parquet", meta)
    proc = cli(capsys, "harness", "diff", str(runs["clean"]), str(tmp_path / "moved"))
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == (
        "FAILED: 1 value moved and 0 rows missing on one side, in 1 cell of the layouts both runs hold")


# --- one line and exit code 2 for a user mistake ---------------------------------------------------------------------

def _not_a_run(tmp_path: Path) -> Path:
    folder = tmp_path / "not_a_run"
    folder.mkdir()
    (folder / "summary.csv").write_text("scenario,topology\n")
    return folder


USAGE = [  # (module, arguments, what the line must name); {tmp} is a scratch folder, {not_a_run} a folder without run
    ("harness", ["run", "--max-world", "0"], "--max-world: expected an integer from 1 to 64"),
    ("harness", ["run", "--max-world", "2", "--scenarios", "identity", "--plant-drift", "tp9xdp9"],
     "--plant-drift: expected one of this run's layouts (tp1xdp1, tp2xdp1, tp1xdp2), got tp9xdp9"),
    ("harness", ["run", "--max-world", "2", "--scenarios", "identity", "--plant-drift", "tp4xdp1"],
     "--plant-drift: expected one of this run's layouts (tp1xdp1, tp2xdp1, tp1xdp2), got tp4xdp1"),
    ("harness", ["run", "--scenarios", "identity", "--plant-drift", "tp2"], "--plant-drift: expected a layout"),
    ("harness", ["run", "--scenarios", "identity,nope"], "--scenarios: expected names from"),
    ("harness", ["run", "--scenarios", "identity", "--timeout", "0"], "--timeout: expected a number of seconds >= 10"),
    ("harness", ["run", "--scenarios", "identity", "--timeout", "1e-9", "--out", "{tmp}/run"],
     "--timeout: expected a number of seconds >= 10 (a world takes seconds to start), got 1e-9"),
    ("harness", ["run", "--scenarios", "identity", "--timeout", "inf"], "--timeout: expected a number of seconds"),
    ("harness", ["run", "--max-world", "1000", "--scenarios", "identity", "--out", "{tmp}/run"],
     "--max-world: expected an integer from 1 to 64 (the harness spawns one process per rank on this host), got 1000"),
    ("harness", ["run", "--scenarios", "identity,identity", "--out", "{tmp}/run"],
     "--scenarios: expected each name once, got identity more than once"),
    ("harness", ["goldens", "--scenarios", "identity,identity", "--allow-dirty", "--golden-dir", "{tmp}/g"],
     "--scenarios: expected each name once, got identity more than once"),
    ("harness", ["run", "--scenarios", "identity", "--golden-dir", "{golden}/sm_90", "--out", "{tmp}/run"],
     "--golden-dir: expected a golden set whose bits are portable for this run, got {golden}/sm_90, whose "
     "MANIFEST.json says per GPU architecture (sm_90); pass --golden-dir {golden}/canonical"),
    ("harness", ["run", "--scenarios", "identity", "--golden-dir", "{golden}", "--out", "{tmp}/run"],
     "--golden-dir: expected a folder holding a golden set (MANIFEST.json and its .parquet files), got {golden}, "
     "which holds the sets {golden}/canonical, {golden}/sm_90 in folders of its own: pass one, e.g. --golden-dir "
     "{golden}/canonical"),
    ("harness", [], "python -m harness: error: COMMAND: expected one of run, goldens, diff, got nothing"),
    ("harness", ["goldens", "--out", "{tmp}/g"], "python -m harness goldens: error: unrecognized arguments: --out"),
    ("harness", ["diff", "{tmp}/absent"], "python -m harness diff: error: the following arguments are required: "
                                          "RUN_B"),
    ("harness", ["diff", "{tmp}/absent", "{tmp}/absent"], "RUN_A: expected a run folder or a run.parquet file, got"),
    ("harness", ["diff", "{not_a_run}", "{not_a_run}"], "RUN_A: expected a run folder or a run.parquet file, got"),
    ("harness", ["diff", "{not_a_run}/summary.csv", "{not_a_run}"], "not a Parquet file"),
    ("reports", ["study", "--seeds", "0", "--out", "{tmp}/study"], "--seeds: expected an integer >= 1, got 0"),
    ("reports", ["drift", "{tmp}/absent", "{not_a_run}", "--out", "{tmp}/r"],
     "RUN_A: expected a run folder or a run.parquet file, got"),
    ("reports", [], "python -m reports: error: COMMAND: expected one of drift, study, got nothing"),
    ("reports", ["drift", "{tmp}/absent"], "the following arguments are required: RUN_B, --out"),
    ("reports", ["study", "--out", "{tmp}/s", "--bogus"], "python -m reports study: error: unrecognized arguments: "
                                                          "--bogus"),
]
if not torch.cuda.is_available():
    USAGE += [("harness", ["run", "--device", "cuda", "--scenarios", "identity"], "--device: expected cpu"),
              ("harness", ["goldens", "--device", "cuda", "--allow-dirty", "--golden-dir", "{tmp}/g"],
               "--device: expected cpu")]


@pytest.mark.parametrize("module,args,names", USAGE, ids=[" ".join([u[0], *u[1]]) for u in USAGE])
def test_user_mistakes_get_one_line_and_exit_2(tmp_path, capsys, module, args, names):
    fill = {"tmp": str(tmp_path), "not_a_run": str(_not_a_run(tmp_path)), "golden": str(GOLDEN.parent)}
    argv = [a.format(**fill) for a in args]
    # Two through a real interpreter (what a user sees), the others in this process (the same code, faster).
    real = args == ["run", "--max-world", "0"] or args[:3] == ["diff", "{tmp}/absent", "{tmp}/absent"]
    proc = python_m(module, *argv) if real else cli(capsys, module, *argv)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names.format(**fill) in lines[0], proc.stderr
    assert not (tmp_path / "g").exists() and not (tmp_path / "run").exists()  # nothing recorded, before the world


def test_max_world_from_the_environment_has_the_same_bound(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_MAX_WORLD", "1000")
    proc = cli(capsys, "harness", "run", "--scenarios", "identity", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "python -m harness run: error: GRPO_MAX_WORLD: expected an integer from 1 to 64 (the harness spawns one "
        "process per rank on this host), got 1000")
    assert not (tmp_path / "run").exists()


def test_a_world_that_does_not_finish_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    import harness.__main__ as entry

    def hung(*args, **kwargs):
        raise TimeoutError("world of 1 ranks (gloo, cpu) did not finish within 10 s")
    monkeypatch.setattr(entry, "_record", hung)
    proc = cli(capsys, "harness", "run", "--max-world", "1", "--scenarios", "identity", "--timeout", "10", "--out",
               str(tmp_path / "run"))
    assert proc.returncode == 1 and proc.stderr.strip() == ("python -m harness run: FAILED: world of 1 ranks (gloo, "
                                                           "cpu) did not finish within 10 s (--timeout 10)")


def test_runs_land_in_the_checkouts_runs_folder_wherever_the_command_starts(tmp_path, monkeypatch):
    """Started from tests/ or anywhere else, the default run folder is the checkout's runs/, which git ignores."""
    from harness.__main__ import _run_dir
    from harness.cli import harness_parser
    monkeypatch.chdir(tmp_path)
    assert _run_dir(harness_parser().parse_args(["run"]), GOLDEN).parent == ROOT / "runs"
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "runs/20261206-010203/run.parquet"])
    assert ignored.returncode == 0, "runs/ is not ignored by git"


def test_out_never_replaces_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.parquet").write_bytes(b"an earlier run")
    proc = cli(capsys, "harness", "run", "--max-world", "1", "--scenarios", "identity", "--out", str(run))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"python -m harness run: error: --out: expected a new or empty folder (an existing run is never replaced), "
        f"got {run}, which is a run (run.parquet)")
    assert (run / "run.parquet").read_bytes() == b"an earlier run" and sorted(run.iterdir()) == [run / "run.parquet"]
    proc = cli(capsys, "harness", "run", "--max-world", "1", "--scenarios", "identity", "--out", str(GOLDEN / "run"))
    assert proc.returncode == 2 and "--out: expected a folder outside the golden set" in proc.stderr
    assert not (GOLDEN / "run").exists()


def test_help_describes_every_command_and_lists_the_scenarios(capsys):
    from harness.scenarios import SCENARIOS
    top = cli(capsys, "harness", "--help").stdout
    for name in ("run", "goldens", "diff"):
        assert len(re.findall(rf"^ +{name} +\S", top, re.M)) == 1, top  # each command once, with its line of help
    words = " ".join(cli(capsys, "harness", "run", "--help").stdout.split())
    assert "comma-separated names (default: all): " + ", ".join(SCENARIOS) in words
    from harness.cli import harness_parser
    from reports.__main__ import parser
    for top in (harness_parser(), parser()):  # every option of every command says what it does and its default
        (commands,) = [a.choices for a in top._actions if isinstance(a, argparse._SubParsersAction)]
        for name, command in commands.items():
            for a in command._actions:
                if isinstance(a, argparse._HelpAction):
                    continue
                assert a.help, (name, a.dest)
                assert a.default in (None, False) or "default" in a.help, (name, a.dest, a.help)


def test_an_interpreter_without_the_project_gets_one_line(tmp_path):
    """The system python3 has neither torch nor pandas: each entry point says so in one line (exit code 2), with
    the interpreter to use, never a ModuleNotFoundError traceback."""
    for name in ("torch", "pandas"):  # stand-ins that fail to import, ahead of the real ones
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ModuleNotFoundError({'No module named ' + name!r}, "
                                                     f"name={name!r})\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    for argv in (["-m", "harness", "run"], ["-m", "reports", "study", "--out", str(tmp_path / "s")],
                 [str(ROOT / "examples" / "grpo_toy.py")]):
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert ": expected an interpreter with grpo-core" in line and sys.executable in line, line


def test_torchrun_is_detected_from_its_environment(tmp_path):
    """Without `--torchrun`: one world across the torchrun processes, not one world per process."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "harness",
                           "run", "--scenarios", "identity", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("on cpu (gloo, world") == 1 and "(gloo, world 2)" in proc.stdout
    assert "vs golden: identical=3" in proc.stdout


# --- golden verification ---------------------------------------------------------------------------------------------

def _copy_golden(tmp_path: Path) -> Path:
    gold = tmp_path / "golden"
    shutil.copytree(GOLDEN, gold)
    return gold


def _manifest(gold: Path) -> dict:
    return json.loads((gold / "MANIFEST.json").read_text())


def _set_manifest(gold: Path, manifest: dict) -> None:
    (gold / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _rehash(gold: Path) -> None:
    """Brings the manifest's hashes up to date, so that a tampered file meets the check under test, not sha256."""
    m = _manifest(gold)
    for name, entry in m["files"].items():
        if (gold / name).is_file():
            entry["sha256"] = hashlib.sha256((gold / name).read_bytes()).hexdigest()
    _set_manifest(gold, m)


def _edit_file(gold: Path, name: str, edit, meta_edit=None) -> None:
    """Rewrites one golden file through `edit(DataFrame)` (raw pyarrow: no validation on the way), then rehashes."""
    table = pq.read_table(gold / name)
    meta = json.loads(table.schema.metadata[b"grpo_core"])
    if meta_edit:
        meta_edit(meta)
    df = edit(table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get))
    out = pa.Table.from_pandas(df, preserve_index=False)
    pq.write_table(out.replace_schema_metadata({b"grpo_core": json.dumps(meta).encode()}), gold / name)
    _rehash(gold)


def _manifest_edit(fn):
    def tamper(gold: Path) -> None:
        m = _manifest(gold)
        fn(m)
        _set_manifest(gold, m)
    return tamper


def _row(df: pd.DataFrame, field: str, index: int):
    return (df["field"] == field) & (df["index"] == index)


def _edited(df: pd.DataFrame, mask, column: str, value) -> pd.DataFrame:
    df = df.copy()
    df.loc[mask, column] = value
    return df


def _another_math(gold: Path) -> None:
    """Every file and the manifest agree on a math version that is not this code's."""
    def older(meta: dict) -> None:
        meta["provenance"]["math_version"] = "grpo-core-math-0"
    for f in gold.glob("*.parquet"):
        _edit_file(gold, f.name, lambda d: d, older)
    _manifest_edit(lambda m: older(m))(gold)


F = f"{SCN}.parquet"
TAMPERS = {  # name: (tamper, the check that must name it)
    "manifest hash edited": (_manifest_edit(lambda m: m["files"][F].update(sha256="0" * 64)), "sha256"),
    "file bytes changed": (lambda g: (g / F).write_bytes((g / F).read_bytes()[:-9] + b"x" * 9), "sha256"),
    "manifest platform edited": (_manifest_edit(lambda m: m.update(platform="cuda-nvidia-h200")), "platform"),
    "manifest deleted": (lambda g: (g / "MANIFEST.json").unlink(), "manifest"),
    "manifest not JSON": (lambda g: (g / "MANIFEST.json").write_text("{\n"), "manifest"),
    "manifest without files": (_manifest_edit(lambda m: m.pop("files")), "manifest"),
    "manifest lists 1 of 10 files": (_manifest_edit(lambda m: m.update(files={F: m["files"][F]})), "file list"),
    "listed file deleted": (lambda g: (g / F).unlink(), "file list"),
    "unlisted file added": (lambda g: shutil.copy(g / F, g / "extra.parquet"), "file list"),
    "manifest math_version edited": (_manifest_edit(lambda m: m["provenance"].update(math_version="x")),
                                     "math_version"),
    "manifest fingerprint edited": (_manifest_edit(lambda m: m["files"][F].update(fingerprint="0" * 32)),
                                    "fingerprint"),
    "file truncated": (lambda g: ((g / F).write_bytes((g / F).read_bytes()[:500]), _rehash(g)), "readable"),
    "zero-byte file": (lambda g: ((g / F).write_bytes(b""), _rehash(g)), "readable"),
    "bits renamed": (lambda g: _edit_file(g, F, lambda d: d.rename(columns={"bits": "bit"})), "schema"),
    "bits as strings": (lambda g: _edit_file(g, F, lambda d: d.assign(bits=d["bits"].astype(str))), "schema"),
    "index as floats": (lambda g: _edit_file(g, F, lambda d: d.assign(index=d["index"] + 0.5)), "schema"),
    "value edited, bits intact": (lambda g: _edit_file(
        g, F, lambda d: _edited(d, _row(d, "per_sequence_kl", 3), "value", 0.125)), "value vs bits"),
    "bits edited, value intact": (lambda g: _edit_file(
        g, F, lambda d: _edited(d, _row(d, "loss", -1), "bits", 0x3E000000)), "value vs bits"),
    "count value edited": (lambda g: _edit_file(
        g, F, lambda d: _edited(d, _row(d, "per_sequence_active_tokens", 0), "value", 99.0)), "value vs bits"),
    "exact duplicate row": (lambda g: _edit_file(g, F, lambda d: pd.concat([d, d.iloc[[5]]])), "unique keys"),
    "row of another scenario": (lambda g: _edit_file(
        g, F, lambda d: _edited(d, _row(d, "loss", -1), "scenario", "identity")), "scenario"),
    "another topology": (lambda g: _edit_file(g, F, lambda d: d.assign(topology="tp2xdp1")), "topology"),
    "unknown field": (lambda g: _edit_file(g, F, lambda d: _edited(d, _row(d, "kl", -1), "field", "kl2")), "fields"),
    "bad digest": (lambda g: _edit_file(
        g, F, lambda d: _edited(d, _row(d, "grad_digest", 1), "digest", "not-a-digest")), "digest"),
    "file platform edited": (lambda g: _edit_file(g, F, lambda d: d, lambda m: m.update(platform="cuda-x")),
                             "platform"),
    "file math_version edited": (lambda g: _edit_file(
        g, F, lambda d: d, lambda m: m["provenance"].update(math_version="x")), "math_version"),
    "another math, consistently": (lambda g: _another_math(g), "math_version"),
}


def test_checked_in_golden_verifies():
    """The canonical set holds every scenario; the H200's set (sm_90) the fused linear ones, each saying where its
    bits hold."""
    from harness.golden import PORTABLE, read_manifest, verify_golden
    rows, provenance = verify_golden(GOLDEN)
    assert set(rows["scenario"]) == set(SCENARIOS) and set(provenance) == set(rows["scenario"])
    assert read_manifest(GOLDEN)["bits"] == PORTABLE
    rows, _ = verify_golden(GOLDEN.parent / "sm_90")
    assert set(rows["scenario"]) == {n for n, s in SCENARIOS.items() if s.linear}
    assert read_manifest(GOLDEN.parent / "sm_90")["bits"].startswith("per GPU architecture (sm_90)")


@pytest.mark.parametrize("name", list(TAMPERS))
def test_tampered_golden_is_caught_by_the_named_check(tmp_path, name):
    from harness.golden import verify_golden
    from harness.record import TableError
    tamper, check = TAMPERS[name]
    gold = _copy_golden(tmp_path)
    tamper(gold)
    with pytest.raises(TableError) as err:
        verify_golden(gold)
    assert err.value.check == check, str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["manifest deleted", "zero-byte file", "value edited, bits intact",
                                  "bits as strings", "manifest lists 1 of 10 files"])
def test_the_gate_fails_on_a_tampered_golden_in_one_sentence(tmp_path, capsys, name):
    tamper, check = TAMPERS[name]
    gold = _copy_golden(tmp_path)
    tamper(gold)
    proc = cli(capsys, "harness", "run", "--max-world", "1", "--scenarios", SCN, "--golden-dir", str(gold), "--out",
                    str(tmp_path / "run"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"golden {check}:" in proc.stderr and "python -m harness goldens" in proc.stderr
    assert "git checkout" not in proc.stderr
    assert f"copy it again from where it came: {gold} is not under git" in proc.stderr


def test_a_damaged_golden_set_in_the_checkout_is_restored_from_git():
    from harness.__main__ import _restore_hint
    assert _restore_hint(GOLDEN) == f"git checkout -- {GOLDEN}"


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    """The default run folder is claimed when the run is written, with a suffix when another run (here, or beside
    this one) took its name: three gates run at once on a GPU machine had written one folder."""
    from harness.__main__ import _claim
    stamp = tmp_path / "runs" / "20261202-051541"
    got = [_claim(stamp) for _ in range(3)]
    assert [p.name for p in got] == ["20261202-051541", "20261202-051541-2", "20261202-051541-3"]
    assert all(p.is_dir() for p in got)
    (tmp_path / "link").symlink_to(tmp_path / "missing")  # a parent that cannot be a folder raises, once (it had
    with pytest.raises(FileExistsError):                  # been taken for a taken name, suffix after suffix)
        _claim(tmp_path / "link" / "20261202-051541")


def test_a_row_missing_from_the_golden_is_reported_as_missing(tmp_path):
    gold = _copy_golden(tmp_path)
    _edit_file(gold, F, lambda d: d[~_row(d, "per_sequence_kl", 3)])
    proc = python_m("harness", "run", "--max-world", "1", "--scenarios", SCN, "--golden-dir", str(gold), "--out",
                    str(tmp_path / "run"))
    assert proc.returncode == 1
    assert f"{SCN} tp1xdp1 per_sequence_kl[3]: missing in the reference" in proc.stderr
    assert not re.search(r"\bnan\b", proc.stderr, re.I) and "determinism: FAILED (1 problem)\n" in proc.stdout


def test_recording_some_goldens_keeps_the_others(tmp_path):
    gold = _copy_golden(tmp_path)
    proc = python_m("harness", "goldens", "--scenarios", "identity", "--allow-dirty", "--golden-dir", str(gold))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = _manifest(gold)["files"]
    assert sorted(files) == sorted(p.name for p in gold.glob("*.parquet")) and len(files) == len(SCENARIOS)
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((gold / name).read_bytes()).hexdigest(), name
    old, _ = read_table(GOLDEN / "identity.parquet")
    new, _ = read_table(gold / "identity.parquet")
    assert np.array_equal(old["bits"].fillna(0).to_numpy(), new["bits"].fillna(0).to_numpy())


# --- reports ---------------------------------------------------------------------------------------------------------

def _md_table(md: str, heading: str) -> list[list[str]]:
    """The rows of the Markdown table under `## heading`."""
    section = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]


def test_drift_report_puts_drift_first_shows_the_plant_and_embeds_its_figures(runs, tmp_path):
    from reports.drift import drift_report
    diffs = drift_report(str(runs["planted"]), str(runs["clean"] / "run.parquet"), tmp_path)
    assert set(diffs["topology"]) == {"tp2xdp1"} and (diffs["missing"] == "").all()
    assert "per_sequence_policy" in set(diffs["field"])
    md = (tmp_path / "report.md").read_text()
    rows = _md_table(md, "Scalar versus vector")
    assert [r[2] for r in rows] == ["drift", "drift", "identical", "identical", "identical", "identical"]
    assert {r[1] for r in rows[:2]} == {"tp2xdp1"}
    assert "A = " in md and "(planted: a regrouped token sum at tp2xdp1)" in md and "(planted: nothing)" in md
    html = (tmp_path / "report.html").read_text()
    images = re.findall(r'<img src="([^"]*)"', html)
    assert len(images) == 2 and all(src.startswith("data:image/png;base64,") for src in images)
    import base64
    assert all(base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n" for src in images)


def test_drift_report_counts_absent_cells_as_missing_not_drift(runs, tmp_path):
    from reports.drift import drift_report
    df, meta = read_table(runs["clean"] / "run.parquet")
    write_table(df[df["scenario"] != "identity"].to_dict("records"), tmp_path / "fewer" / "run.parquet", meta)
    drift_report(str(runs["planted"]), str(tmp_path / "fewer"), tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    status = {(r[0], r[1]): r[2] for r in _md_table(md, "Scalar versus vector")}
    assert status[("identity", "tp1xdp1")] == "missing" and status[(SCN, "tp2xdp1")] == "drift"
    assert list(status.values()).count("drift") == 1 and not re.search(r"\bnan\b", md, re.I)
    assert "in 1 cell of 6" in md and "3 cells with rows on one side only" in md


def test_a_single_moved_value_reads_in_the_singular(runs, tmp_path, capsys):
    from reports.drift import drift_report
    df, meta = read_table(runs["clean"] / "run.parquet")
    row = (df["topology"] == "tp1xdp2") & (df["field"] == "per_sequence_kl") & (df["index"] == 3) & (
        df["scenario"] == SCN)
    df.loc[row, "bits"] += 1
    df.loc[row, "value"] = float(np.array([df.loc[row, "bits"].iloc[0]], np.int32).view(np.float32)[0])
    write_table(df.to_dict("records"), tmp_path / "one" / "run.parquet", meta)
    drift_report(str(tmp_path / "one"), str(runs["clean"]), tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "1 value moved in 1 cell of 6" in md
    proc = cli(capsys, "harness", "diff", str(tmp_path / "one"), str(runs["clean"]))
    assert proc.returncode == 1 and "FAILED: 1 value moved and 0 rows missing on one side, in 1 cell" in proc.stdout


def _integer_ticks(axis) -> bool:
    lo, hi = axis.get_view_interval()
    ticks = [t for t in axis.get_ticklocs() if lo <= t <= hi]
    return bool(ticks) and all(float(t).is_integer() for t in ticks)


def test_report_figures_have_titles_and_integer_counts():
    from reports.drift import moved_by_scenario, study_figure, ulp_histogram
    moved = pd.DataFrame({"ulp": [1.0, 3.0]})  # two values: a count axis of 0..1 would get ticks 0.2, 0.4, ...
    cells = pd.DataFrame({"scenario": ["a", "b"], "sequences_moved": [1, 0]})
    study = pd.DataFrame({"seed": [0, 1, 2], "sequence_values_moved": [3, 0, 1], "loss_moved": [False, False, True]})
    for fig, counts in ((ulp_histogram(moved), "y"), (moved_by_scenario(cells), "x"), (study_figure(study, 8), "y")):
        ax = fig.axes[0]
        fig.canvas.draw()
        assert ax.get_title(), fig
        assert _integer_ticks(ax.yaxis if counts == "y" else ax.xaxis), (ax.get_title(), counts)
    fig = study_figure(study, 8)
    bars = fig.axes[0].containers
    assert len(bars) == 2 and [len(b) for b in bars] == [3, 3]  # per seed: vector moved next to scalar moved
    assert [b.get_height() for b in bars[0]] == [3, 0, 1] and [b.get_height() for b in bars[1]] == [0, 0, 1]
    # The legend says a sequence counts twice, and covers no bar (it had hidden the last seeds' bars: 12 seeds, each
    # with every value moved).
    full = pd.DataFrame({"seed": range(12), "sequence_values_moved": [16] * 12, "loss_moved": [True] * 12})
    fig = study_figure(full, 8)
    legend = fig.axes[0].get_legend()
    assert "policy and KL of 8 sequences: at most 16" in legend.get_texts()[0].get_text()
    fig.tight_layout()
    fig.canvas.draw()
    box = legend.get_window_extent()
    assert not any(box.overlaps(bar.get_window_extent()) for c in fig.axes[0].containers for bar in c)


def test_regroup_study_draws_vector_versus_scalar_per_seed(tmp_path):
    from reports.drift import regroup_study
    summary = regroup_study(2, tmp_path, seq_len=64)
    assert summary["seeds"] == 2 and 0 <= summary["loss_moved"] <= summary["vector_moved"] <= 2
    html = (tmp_path / "report.html").read_text()
    assert (tmp_path / "study.png").stat().st_size > 0 and html.count('<img src="data:image/png;base64,') == 1
    md = (tmp_path / "report.md").read_text()
    assert "over 2 seeds" in md
    # On these inputs the scalar moved whenever the vector did: the report says so, and claims nothing else.
    assert summary["loss_moved"] == summary["vector_moved"] == 2
    assert "the scalar alone would have caught the drift" in md and "hidden" not in md and "hides" not in md


def test_study_verdict_says_what_the_counts_show():
    from reports.drift import study_verdict
    assert study_verdict(12, 8) == ("In 4 seeds the per-sequence vector moved and the scalar loss did not: there, "
                                    "comparing only the scalar would have hidden the drift.")
    assert study_verdict(12, 12).startswith("The scalar loss moved in every seed in which the vector moved")
    assert study_verdict(0, 0) == "Nothing moved: on these inputs regrouping changed no bit."


def test_report_html_rules_its_tables_for_a_browser(runs, tmp_path):
    """A person reads the HTML in a browser: its tables have borders and padded cells (they had neither)."""
    from reports.drift import drift_report
    drift_report(str(runs["planted"]), str(runs["clean"]), tmp_path)
    html = (tmp_path / "report.html").read_text()
    style = re.search(r"<style>(.*?)</style>", html, re.S).group(1)
    rules = {sel.strip(): body for sel, body in re.findall(r"([^{}]+)\{([^}]*)\}", style)}
    assert "border-collapse: collapse" in rules["table"]
    assert "border: 1px solid" in rules["th, td"] and "padding:" in rules["th, td"]
    assert html.count("<table") == 3  # runs, scalar versus vector, the moved sequences (nothing is missing)


def test_goldens_refuse_a_working_tree_with_uncommitted_changes(tmp_path):
    """The manifest names the commit that recorded the goldens, so a dirty tree is refused unless asked."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, capture_output=True, timeout=120)
    with open(clone / "harness" / "scenarios.py", "a") as f:
        f.write("\n# an uncommitted change\n")
    gold = tmp_path / "golden"
    shutil.copytree(GOLDEN, gold)
    before = {p.name: p.read_bytes() for p in gold.iterdir()}
    env = {**os.environ, "PYTHONPATH": str(clone)}  # the clone's harness, whatever the environment exports
    proc = subprocess.run([sys.executable, "-m", "harness", "goldens", "--golden-dir", str(gold)], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "--allow-dirty: expected a clean working tree or the flag, got uncommitted changes" in line
    assert "-dirty" in line and {p.name: p.read_bytes() for p in gold.iterdir()} == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the Triton kernels run on CUDA tensors")
def test_triton_kernels_on_the_cpu_need_the_interpreter():
    """Without TRITON_INTERPRET (Triton reads it when a kernel is defined: a process of its own for each check)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--kernels", "triton", "--scenarios", "identity"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--kernels: expected auto or torch with --device cpu" in proc.stderr
    code = ("from grpo_core import LossContractError\n"
            "from grpo_core.distributed import DistributedGRPOLossOp\n"
            "from harness.scenarios import SCENARIOS\n"
            "scn = SCENARIOS['identity']\n"
            "inp = scn.inputs()\n"
            "try:\n"
            "    DistributedGRPOLossOp(kernels='triton').apply(inp['policy_logits'], inp['action_ids'],\n"
            "        inp['old_logps'], inp['rewards'], contract=scn.contract(),\n"
            "        completion_mask=inp['completion_mask'], ref_local_logits=inp['ref_logits'])\n"
            "except LossContractError as exc:\n"
            "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert "kernels: 'triton' needs CUDA tensors" in proc.stdout, proc.stdout + proc.stderr


# --- the nox sessions' arguments --------------------------------------------------------------------------------------

NOX_MISTAKES = [(["-s", "determinism", "--", "--bogus"],
                 "python -m harness run: error: unrecognized arguments: --bogus (see --help)"),
                (["-s", "report", "--", "drift", "onlyone"],
                 "python -m reports drift: error: the following arguments are required: RUN_B, --out (see --help)"),
                (["-s", "goldens", "--", "--out", "x"],
                 "python -m harness goldens: error: unrecognized arguments: --out x (see --help)"),
                (["--", "--max-world", "0"],  # the default sessions: determinism takes the arguments too
                 "python -m harness run: error: argument --max-world: expected an integer from 1 to 64 (the harness "
                 "spawns one process per rank on this host), got 0 (see --help)")]


@pytest.mark.skipif(importlib.util.find_spec("nox") is None, reason="nox is not installed")
@pytest.mark.parametrize("argv,line", NOX_MISTAKES, ids=[" ".join(m[0]) for m in NOX_MISTAKES])
def test_nox_refuses_bad_arguments_in_one_line_with_exit_2_before_any_virtualenv(tmp_path, argv, line):
    proc = subprocess.run([sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "--envdir",
                           str(tmp_path / "env"), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == line and proc.stdout == ""
    assert not (tmp_path / "env").exists()  # nox made no virtualenv
