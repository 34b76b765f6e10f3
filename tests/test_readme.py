"""The README: every Python example runs on its own and prints the output shown under it, and `.ci/run` runs the
quick start's commands exactly as printed.

Outputs are compared with the digits of their decimal numbers masked: the examples draw random inputs with
torch's CPU sampler, which takes other code paths (other bits) on other CPUs. Everything else (words, shapes,
dtypes, the backend, the contract fingerprint) must match exactly."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```\n(?:\n```text\n(.*?)```)?", README, re.S)  # (code, output shown)
DECIMAL = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def test_the_readme_has_its_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_example_runs_on_its_own_and_prints_what_is_shown(index):
    code, shown = EXAMPLES[index]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md example {index + 1}", "exec"), {})  # a fresh namespace: nothing borrowed
    assert out.getvalue().strip(), "the example prints nothing"
    assert shown, "the README does not show the example's output (a ```text block right below it)"
    assert DECIMAL.sub("#", out.getvalue()) == DECIMAL.sub("#", shown)


def test_ci_runs_the_quick_start_commands_as_printed():
    quick = README.split("## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", quick, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["nox -s determinism", "nox -s tests"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-len(commands):] == commands


def test_layouts_are_named_as_the_gate_prints_and_accepts_them():
    """The gate prints and accepts `tp<T>xdp<D>` only (`--plant-drift tp2` is refused): every layout the README names
    is spelled so, and the gate's section lists exactly the layouts of a world of four."""
    from harness.cli import layout_name
    from harness.topology import layouts
    names = re.findall(r"\b(?:tp|dp)\d+(?:x(?:tp|dp)\d+)?\b", README)
    assert names and [n for n in names if layout_name(n) != n] == []  # layout_name raises on tp2, dp2, ...
    gate = README.split("## The determinism gate\n", 1)[1].split("\n## ", 1)[0]
    listed = re.split(r",\s*", re.search(r"named `tp<T>xdp<D>` \(([^)]*)\)", gate).group(1))
    assert listed == [lay.name for lay in layouts(4)]


def test_the_semantics_name_every_dtype_the_checks_accept():
    from grpo_core.checks import _LOGIT_DTYPES
    semantics = README.split("### Semantics worth knowing\n", 1)[1].split("\n## ", 1)[0]
    words = " ".join(semantics.split())
    assert all(str(d).removeprefix("torch.") in words for d in _LOGIT_DTYPES)
    assert "`completion_mask` may be bool or any dtype holding only 0 and 1" in words


def test_which_python_shows_the_interpreters_that_nox_makes():
    """The one line that `python -m harness` prints on an interpreter without the project points at this section,
    and the section's commands use the virtualenvs of the noxfile's sessions."""
    from harness.cli import missing_module
    section = README.split("### Which Python\n", 1)[1].split("\n## ", 1)[0]
    sessions = set(re.findall(r"^def (\w+)\(session", (ROOT / "noxfile.py").read_text(), re.M))
    used = re.findall(r"^\.nox/(\w+)/bin/python ", section, re.M)
    assert used and set(used) <= sessions
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        missing_module("python -m harness", ModuleNotFoundError("No module named 'torch'", name="torch"))
    assert "(README, Which Python)" in err.getvalue() and ".nox/determinism/bin/python" in err.getvalue()
