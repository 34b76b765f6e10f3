"""The README: every Python example runs on its own and prints the output shown under it, `.ci/run` runs the
quick start's commands exactly as printed, the counts it states are the code's, and its links lead somewhere.

Outputs are compared with the digits of their decimal numbers masked: the examples draw random inputs with
torch's CPU sampler, which takes other code paths (other bits) on other CPUs. Everything else (words, shapes,
dtypes, the backend, the contract fingerprint) must match exactly."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
EXAMPLES = re.findall(r"```python\n(.*?)```\n(?:\n```text\n(.*?)```)?", README, re.S)  # (code, output shown)
DECIMAL = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def test_the_readme_has_its_examples():
    assert len(EXAMPLES) == README.count("```python\n") >= 3  # the logits op, the contract path, the linear loss


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


def section(text: str, heading: str) -> str:
    """The body of the section `heading` (e.g. `## Quick start`), up to the next heading of its level or above."""
    level = heading.split()[0]
    body = text.split(f"{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", body, maxsplit=1)[0]


def test_layouts_are_named_as_the_gate_prints_and_accepts_them():
    """The gate prints and accepts `tp<T>xdp<D>` only (`--plant-drift tp2` is refused): every layout the README and
    its docs name is spelled so, and the gate's section lists exactly the layouts of a world of four."""
    from harness.cli import layout_name
    from harness.topology import layouts
    names = re.findall(r"\b(?:tp|dp)\d+(?:x(?:tp|dp)\d+)?\b", README + "".join(DOCS.values()))
    assert names and [n for n in names if layout_name(n) != n] == []  # layout_name raises on tp2, dp2, ...
    gate = README.split("## The determinism gate\n", 1)[1].split("\n## ", 1)[0]
    listed = re.split(r",\s*", re.search(r"named `tp<T>xdp<D>` \(([^)]*)\)", gate).group(1))
    assert listed == [lay.name for lay in layouts(4)]


def test_the_semantics_name_every_dtype_the_checks_accept():
    from grpo_core.checks import _LOGIT_DTYPES
    semantics = section(DOCS["options.md"], "## Semantics worth knowing")
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


def test_the_quick_starts_counts_are_the_codes():
    """The quick start states the scenarios x layouts the gate runs and the number of tests `nox -s tests` runs; both
    must be what the code has. When this fails after tests were added or removed, put the count it names in the
    README (and measure the suite's time again: the table beside it)."""
    from harness.scenarios import SCENARIOS
    from harness.topology import layouts
    quick = section(README, "## Quick start")
    scenarios, lays = map(int, re.search(r"runs (\d+) scenarios x (\d+) layouts", quick).groups())
    assert (scenarios, lays) == (len(SCENARIOS), len(layouts(4)))
    stated = int(re.search(r"runs\s+the suite's (\d+) tests", quick).group(1))
    passed, skipped = map(int, re.search(r"\((\d+) passed, (\d+) skipped;", quick).groups())  # the timed run's
    assert passed + skipped == stated, "the timed run's counts are not of the stated suite: measure it again"
    missing = [m for m in ("trl", "triton", "hypothesis", "xdist") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the README counts the suite of `nox -s tests` (the [dev] extras); this interpreter lacks "
                    f"{missing}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU suite's count, on any machine
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    found = re.search(r"^(\d+) tests? collected", proc.stdout, re.M)
    assert proc.returncode == 0 and found, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert stated == int(found.group(1)), (f"README.md, Quick start: the suite's {stated} tests; pytest collects "
                                           f"{found.group(1)}: put {found.group(1)} in the README")


def test_the_trl_section_shows_the_scripts_trainer_and_its_interpreter():
    """The TRL snippet is lines of `examples/trl_quickstart.py` (tests/test_example.py runs it), in their order, and
    the command runs it with the interpreter of the nox session that installs TRL."""
    trl = section(README, "### With TRL's trainer")
    script = [line.split("  # ")[0].strip()  # a line's comment aside
              for line in (ROOT / "examples" / "trl_quickstart.py").read_text().splitlines()]
    (block,) = re.findall(r"```py\n(.*?)```", trl, re.S)
    at = 0
    for line in filter(None, (line.strip() for line in block.splitlines())):
        assert line in script[at:], f"not in examples/trl_quickstart.py (after its line {at}): {line}"
        at = script.index(line, at) + 1
    assert ".nox/tests/bin/python examples/trl_quickstart.py" in trl
    noxfile = (ROOT / "noxfile.py").read_text()
    tests_session = re.search(r"^def tests\(.*?(?=^@nox|\Z)", noxfile, re.S | re.M).group(0)
    assert '_install(session, "dev")' in tests_session
    assert re.search(r'^dev = \["grpo-core\[[^]]*\btrl\b', (ROOT / "pyproject.toml").read_text(), re.M)


def test_links_lead_to_files_and_headings_that_exist():
    headings = {}
    for name, text in (("README.md", README), *((f"docs/{n}", t) for n, t in DOCS.items())):
        headings[name] = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                          for h in re.findall(r"^#+ (.*)$", text, re.M)}
    for name, text in (("README.md", README), *((f"docs/{n}", t) for n, t in DOCS.items())):
        base = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("http"):
                continue
            path, _, anchor = target.partition("#")
            file = (base / path).resolve() if path else ROOT / name
            assert file.exists(), f"{name}: link to {target}"
            if anchor:
                key = str(file.relative_to(ROOT))
                assert anchor in headings.get(key, set()), f"{name}: no heading #{anchor} in {key}"


def test_the_readme_describes_the_software_not_its_history():
    for name, text in (("README.md", README), *DOCS.items()):
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bissue \d+", text), name  # dates of work, issue numbers
