"""Sessions: `nox -s tests` (CPU suite), `nox -s determinism` (the CI gate). `nox -l` lists them all.

In a fresh virtualenv each session installs the project with the CPU torch pinned by `constraints-cpu.txt`;
with `nox --no-venv` (a machine that already has torch, e.g. the GPU image) nothing is installed.
"""

from __future__ import annotations

import nox
from nox.virtualenv import PassthroughEnv

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "determinism"]


def _install(session: nox.Session) -> None:
    if isinstance(session.virtualenv, PassthroughEnv):
        session.log("--no-venv: using the interpreter's own torch and packages")
    else:
        session.install("-c", "constraints-cpu.txt", "-e", ".[test]")
    session.run("python", "-c", "import sys, torch; print('python', sys.version.split()[0], '| torch',"
                " torch.__version__, '| cuda', torch.cuda.is_available())")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite on the CPU (pytest-xdist); extra arguments go to pytest."""
    _install(session)
    # Without CUDA, tests/conftest.py runs the Triton kernels under TRITON_INTERPRET=1.
    session.run("python", "-m", "pytest", "-n", "auto", *session.posargs)


@nox.session
def determinism(session: nox.Session) -> None:
    """The gate: every scenario on every TP x DP layout, diffed bitwise against the single-rank run and the golden.

    Default world 4 on the CPU; exits non-zero on any drift. Extra arguments go to `python -m harness run` (e.g.
    `-- --device cuda`, `-- --max-world 8`)."""
    _install(session)
    session.run("python", "-m", "harness", "run", *session.posargs)


@nox.session(default=False)
def goldens(session: nox.Session) -> None:
    """Re-record the goldens, one set for every platform (explicit; review the diff before committing)."""
    _install(session)
    session.run("python", "-m", "harness", "goldens", *session.posargs)


@nox.session(default=False)
def report(session: nox.Session) -> None:
    """Drift report between two recorded runs: `nox -s report -- drift RUN_A RUN_B --out DIR`, or the
    regroup study: `nox -s report -- study --out DIR`."""
    _install(session)
    session.run("python", "-m", "reports", *(session.posargs or ["study", "--out", "runs/report"]))
