"""Sessions: `nox -s determinism` (the CI gate), `nox -s tests` (CPU suite). `nox -l` lists them all.

Each session keeps its virtualenv under `.nox/` between calls and installs into it only when it is new or when
`pyproject.toml` or `constraints-cpu.txt` changed since (a stamp in the virtualenv records what was installed), so
after the first call a session starts in seconds. `-R` still works; `nox --no-venv` (a machine that already has
torch, e.g. the GPU image) installs nothing. The harness and report arguments are checked before nox makes a
virtualenv: a mistake is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import nox
from nox.virtualenv import PassthroughEnv

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from harness.cli import harness_parser  # noqa: E402  (standard library only)
from reports.__main__ import parser as reports_parser  # noqa: E402  (standard library only)

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["determinism", "tests"]
nox.options.reuse_venv = "yes"
PINS = ("pyproject.toml", "constraints-cpu.txt")


def _check_args(session: nox.Session, parser, argv: list[str]) -> None:
    """Parses a session's arguments before anything is installed: a typo costs a second, not an install. A mistake
    is argparse's one line and exit code 2, like the harness's own (nox would make it 1)."""
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            raise  # through nox: its exit code is 2
        session.skip("help printed")


# The commands each session hands its arguments to (`-- ARGS`), checked before nox makes any virtualenv.
COMMAND_ARGS = {"determinism": (harness_parser, ["run"]), "goldens": (harness_parser, ["goldens"]),
                "report": (reports_parser, [])}


def _check_command_line(argv: list[str]) -> None:
    """Checks the arguments after `--` of the sessions that nox's command line names (`-s`; none: the defaults) as
    soon as nox loads this file, before it makes a virtualenv (the sessions check them again, for `-k` / `-t`)."""
    if "--" not in argv:
        return
    at = argv.index("--")
    named = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    named.add_argument("-s", "-e", "--session", "--sessions", dest="sessions", nargs="*", action="extend")
    sessions = named.parse_known_args(argv[:at])[0].sessions or nox.options.sessions
    for name in sessions:
        if name in COMMAND_ARGS:
            make, head = COMMAND_ARGS[name]
            posargs = argv[at + 1:] or (["study", "--out", "runs/report"] if name == "report" else [])
            make().parse_args([*head, *posargs])  # a mistake: one line and SystemExit(2), through nox


def _install(session: nox.Session, extras: str) -> None:
    """Installs the project with `extras` and the CPU torch pinned in constraints-cpu.txt, unless this virtualenv
    already holds exactly that install."""
    if isinstance(session.virtualenv, PassthroughEnv):
        session.log("--no-venv: using the interpreter's own torch and packages")
    else:
        stamp = Path(session.virtualenv.location) / "grpo-core-install.txt"
        want = f".[{extras}] " + " ".join(f"{p}:{hashlib.sha256((ROOT / p).read_bytes()).hexdigest()[:16]}"
                                           for p in PINS)
        if stamp.is_file() and stamp.read_text() == want:
            session.log(f"reusing {stamp.parent} (.[{extras}]; {' and '.join(PINS)} unchanged)")
        else:
            session.log(f"installing .[{extras}] into {stamp.parent}: the first time takes a few minutes (torch "
                        f"is large); later calls reuse it")
            session.install("-c", "constraints-cpu.txt", "-e", f".[{extras}]", silent=False)
            # run_install: skipped, like the install itself, under `nox -R` / `--no-install`
            session.run_install("python", "-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])",
                                str(stamp), want, silent=True)
    session.run("python", "-c", "import sys, torch; print('python', sys.version.split()[0], '| torch',"
                " torch.__version__, '| cuda', torch.cuda.is_available())", silent=False)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite on the CPU (pytest-xdist); extra arguments go to pytest."""
    _install(session, "dev")
    # Without CUDA, tests/conftest.py runs the Triton kernels under TRITON_INTERPRET=1. `--dist loadscope`: a test
    # module stays on one worker, so a module's world of processes (a fixture) starts once, not once per worker.
    session.run("python", "-m", "pytest", "-n", "auto", "--dist", "loadscope", *session.posargs)


@nox.session
def determinism(session: nox.Session) -> None:
    """Run the gate: every scenario on every TP x DP layout, diffed bitwise.

    Default world 4 on the CPU; exits non-zero on any drift. Extra arguments go to `python -m harness run` (e.g.
    `-- --device cuda`, `-- --max-world 8`)."""
    _check_args(session, harness_parser(), ["run", *session.posargs])
    _install(session, "harness")
    session.run("python", "-m", "harness", "run", *session.posargs)


@nox.session(default=False)
def goldens(session: nox.Session) -> None:
    """Record the golden set again (explicit; review the diff before committing).

    Extra arguments go to `python -m harness goldens` (e.g. `-- --device cuda`, `-- --scenarios identity`)."""
    _check_args(session, harness_parser(), ["goldens", *session.posargs])
    _install(session, "harness")
    session.run("python", "-m", "harness", "goldens", *session.posargs)


@nox.session(default=False)
def report(session: nox.Session) -> None:
    """Write a drift report between two runs, or the regroup study (the default).

    `nox -s report -- drift RUN_A RUN_B --out DIR`, or `nox -s report -- study --out DIR`."""
    argv = session.posargs or ["study", "--out", "runs/report"]
    _check_args(session, reports_parser(), argv)
    _install(session, "harness")
    session.run("python", "-m", "reports", *argv)


if os.path.basename(sys.argv[0]) == "nox" or sys.argv[0].endswith(os.path.join("nox", "__main__.py")):
    _check_command_line(sys.argv[1:])
