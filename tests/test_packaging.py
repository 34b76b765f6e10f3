"""Packaging and the nox sessions (issue 13): the wheel ships `grpo_core`, `harness` and `reports` with the
extras the README names; `nox -l` prints whole sentences; a session checks its arguments before installing and
installs only when its virtualenv is new or the pins changed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".nox", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".hypothesis")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=SKIP)  # a copy: the build leaves nothing in the checkout
    # The environment's own setuptools when there is one: a machine without an index (the GPU image) cannot fetch one.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w",
                           str(tmp / "dist"), str(tmp / "src")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (found,) = (tmp / "dist").glob("grpo_core-*.whl")
    return found


def test_wheel_ships_the_library_the_harness_and_the_reports(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("grpo_core/contract.py", "grpo_core/checks.py", "grpo_core/distributed/grpo_loss.py",
                   "grpo_core/triton/grpo_loss.py", "harness/__main__.py", "harness/cli.py", "harness/golden.py",
                   "harness/scenarios.py", "reports/__main__.py", "reports/drift.py"):
        assert module in names, module
    assert not [n for n in names if n.split("/")[0] in ("tests", "benchmarks", "examples", "golden")]


def test_wheel_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
    requires = meta.get_all("Requires-Dist")
    base = sorted(r for r in requires if "extra ==" not in r)
    assert base == ["numpy", "torch>=2.4"]  # the library alone: torch (numpy for torch's .numpy())

    def extra(name: str) -> set[str]:
        return {r.split(";")[0].split(">")[0].split("[")[0].strip() for r in requires if f'extra == "{name}"' in r}

    assert set(meta.get_all("Provides-Extra")) >= {"triton", "harness", "trl", "dev"}
    assert extra("triton") == {"triton"}
    assert extra("harness") == {"pandas", "pyarrow", "matplotlib", "numpy"}
    assert extra("trl") == {"trl==1.16.0", "transformers==5.24.0", "accelerate==1.15.0", "datasets==5.2.0",
                            "tokenizers==0.23.3"}  # pinned: the trainer hook overrides a private method of TRL's
    assert {"pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "nox", "grpo-core"} <= extra("dev")
    assert any('grpo-core[harness,triton,trl]; extra == "dev"' in r for r in requires)


def test_installed_wheel_runs_python_m_harness_and_reports_outside_the_checkout(wheel, tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    for module in ("harness", "reports"):
        proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0 and f"python -m {module}" in proc.stdout, proc.stderr
    where = subprocess.run([sys.executable, "-c", "import harness, reports; print(harness.__file__, reports.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120).stdout
    assert where.count(str(tmp_path / "site")) == 2, where


def test_installed_gate_needs_a_golden_set_and_records_none_by_accident(wheel, tmp_path):
    """Outside the checkout (issue 23) the installed harness has no golden set of its own: `run` refuses to start
    without --golden-dir, a missing, empty or file --golden-dir is refused before the world starts, recording needs
    --golden-dir and, outside a git checkout, --allow-no-git; with the checkout's golden set the gate passes."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}

    def harness(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "harness", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    def one_line(proc: subprocess.CompletedProcess) -> str:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
        (line,) = proc.stderr.strip().splitlines()
        return line

    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    refused = {(): "--golden-dir: expected the folder of a golden set, e.g. a checkout's golden/canonical (this "
                   f"harness is installed, in {site}, and ships no golden set), got nothing",
               ("--golden-dir", "absent"): "--golden-dir: expected a folder holding a golden set, got absent (no such "
                                           "folder)",
               ("--golden-dir", "a_file"): "got a_file (a file)",
               ("--golden-dir", "empty"): "got empty, which holds none; record it in a checkout, where goldens are "
                                          "committed (nox -s goldens)"}
    for extra, words in refused.items():
        proc = harness("run", "--scenarios", "identity", "--max-world", "1", "--out", "run", *extra)
        assert words in one_line(proc)
        assert "(gloo, world" not in proc.stdout and not (tmp_path / "run").exists()  # the world never started
    assert "--golden-dir: expected the folder" in one_line(harness("goldens", "--scenarios", "identity"))
    assert one_line(harness("goldens", "--scenarios", "identity", "--golden-dir", "new")).endswith(
        "--allow-no-git: expected a harness run from a git checkout or the flag, got " + str(site) + ", which is "
        "installed; the manifest names the commit that recorded the goldens, and goldens belong in a checkout, "
        "committed")
    assert not (tmp_path / "new").exists() and not (site / "golden").exists()
    proc = harness("goldens", "--scenarios", "identity", "--golden-dir", "new", "--allow-no-git")
    assert proc.returncode == 0 and sorted(p.name for p in (tmp_path / "new").iterdir()) == [
        "MANIFEST.json", "identity.parquet"], proc.stderr[-2000:]
    proc = harness("run", "--scenarios", "identity", "--max-world", "1", "--golden-dir", str(ROOT / "golden" /
                                                                                                "canonical"))
    assert proc.returncode == 0 and proc.stdout.endswith("determinism: all identical\n"), proc.stderr[-2000:]


# The nox tests need nox, a `[dev]` dependency that `nox -s tests` installs; an image without it (the GPU machine's)
# skips them instead of failing on the import.
needs_nox = pytest.mark.skipif(importlib.util.find_spec("nox") is None, reason="nox is not installed")


def nox_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), *args]


@needs_nox
def test_nox_list_prints_one_whole_sentence_per_session():
    proc = subprocess.run(nox_cmd("-l"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sessions = [line for line in proc.stdout.splitlines() if line.startswith(("* ", "- "))]
    assert {s.split()[1] for s in sessions} == {"tests", "determinism", "goldens", "report"}
    for line in sessions:
        assert line.endswith(".") and len(line) <= 100, line


@needs_nox
def test_nox_refuses_bad_arguments_before_installing(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(nox_cmd("-s", "determinism", "--envdir", str(tmp_path), "--", "--bogus"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "unrecognized arguments: --bogus" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("*/lib/*/site-packages/torch")), "torch was installed before argparse spoke"
    assert time.monotonic() - started < 60


class _Venv:
    def __init__(self, location: Path) -> None:
        self.location = str(location)


class _Session:
    """What `_install` uses of a nox session; `install` is recorded, `run_install` runs (it writes the stamp)."""

    def __init__(self, location: Path) -> None:
        self.virtualenv, self.installs = _Venv(location), []

    def log(self, *args) -> None:
        pass

    def install(self, *args, **kwargs) -> None:
        assert kwargs.get("silent") is False, "pip's progress must show while installing"
        self.installs.append(args)

    def run_install(self, python: str, *args: str, **kwargs) -> None:
        subprocess.run([sys.executable, *args], check=True)

    def run(self, *args, **kwargs) -> None:
        pass


@needs_nox
def test_sessions_install_only_into_a_new_virtualenv_or_when_the_pins_change(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    src = tmp_path / "src"
    src.mkdir()
    for pin in noxfile.PINS:
        shutil.copy(ROOT / pin, src / pin)
    monkeypatch.setattr(noxfile, "ROOT", src)
    session = _Session(tmp_path / "venv")
    (tmp_path / "venv").mkdir()
    noxfile._install(session, "harness")
    assert [a[-1] for a in session.installs] == [".[harness]"]
    noxfile._install(session, "harness")  # a second call: nothing to do
    assert len(session.installs) == 1
    with open(src / "constraints-cpu.txt", "a") as f:
        f.write("# a changed pin\n")
    noxfile._install(session, "harness")
    assert len(session.installs) == 2
    noxfile._install(session, "dev")  # other extras: install
    assert [a[-1] for a in session.installs] == [".[harness]", ".[harness]", ".[dev]"]
