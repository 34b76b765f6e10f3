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
