"""The end-to-end GRPO example learns: reward rises well above its start, KL stays finite (both entry points)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from conftest import HAS_CUDA

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from grpo_toy import train  # noqa: E402

# Observed over seeds 0-5 at 40 steps (native, CPU): first-10 mean 0.22-0.26, last-10 mean 0.61-0.74, so a rise of
# at least 0.36; the margin below leaves room for platform noise while a non-learning loop (rise ~0) fails.
MARGIN = 0.2


@pytest.mark.parametrize("contract", [False, True], ids=["get_op", "get_loss_op"])
def test_reward_rises_and_kl_stays_finite(contract):
    hist = train(steps=40, seed=1, contract=contract, progress=False)
    first = sum(h["reward"] for h in hist[:10]) / 10
    last = sum(h["reward"] for h in hist[-10:]) / 10
    assert last > first + MARGIN, (first, last)
    assert all(math.isfinite(h["kl"]) for h in hist)
    assert any(h["clip_fraction"] > 0 for h in hist)  # several steps per rollout: clipping engages


def test_script_sets_one_thread_and_names_the_machine_beside_the_step_time():
    """The step time depends on torch's threads and the machine: the script pins one thread unless told otherwise
    and prints both next to the figure."""
    import subprocess
    script = Path(__file__).resolve().parents[1] / "examples" / "grpo_toy.py"
    proc = subprocess.run([sys.executable, str(script), "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert "median step" in line and "1 thread," in line and " cores, " in line and "torch " in line, line


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """The script's `main()` with these arguments, in this process: `(exit code, stdout, stderr)`."""
    from grpo_toy import main
    monkeypatch.setattr(sys, "argv", ["grpo_toy.py", *argv])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


HERE = str(Path(__file__).resolve())
MISTAKES = [(["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
            (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
            (["--bogus"], "unrecognized arguments: --bogus"),
            (["--device", "tpu"], "--device: expected cpu or cuda[:index], got tpu"),
            (["--plot", f"{HERE}/reward.png"], f"--plot: expected a file in a folder that exists or can be made, got "
                                               f"{HERE}/reward.png (cannot make {HERE}: "),
            (["--plot", str(Path(HERE).parent)],
             f"--plot: expected a file, got {Path(HERE).parent}, which is a folder")]
if not HAS_CUDA:
    MISTAKES += [(["--device", "cuda"], "--device: expected cpu (torch "),
                 (["--backend", "triton"], "--backend: expected native or nothing with --device cpu")]


@pytest.mark.parametrize("argv,words", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_script_mistakes_are_one_line_before_anything_runs(monkeypatch, capsys, argv, words):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a user's shell: the Triton kernels need CUDA
    code, out, err = run_main(monkeypatch, capsys, *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith(f"grpo_toy.py: error: {words}"), err


def test_script_help_names_the_interpreter_of_the_readme():
    import grpo_toy
    examples = [line.split()[0] for line in grpo_toy.__doc__.splitlines() if "examples/grpo_toy.py" in line]
    assert examples and set(examples) <= {".nox/determinism/bin/python", "python"}
    assert examples.count(".nox/determinism/bin/python") >= 2  # the CPU commands: the interpreter nox makes


def test_plot_makes_its_folder(monkeypatch, capsys, tmp_path):
    """`--plot runs/toy/reward.png` (the README's) works before anything made runs/."""
    code, out, err = run_main(monkeypatch, capsys, "--steps", "2", "--plot", str(tmp_path / "runs" / "toy" / "r.png"))
    assert code == 0 and (tmp_path / "runs" / "toy" / "r.png").stat().st_size > 0, err


@pytest.mark.parametrize("steps,window", [(1, "first step"), (5, "first 2 steps"), (30, "first 10 steps")])
def test_script_names_the_steps_it_averaged(monkeypatch, capsys, steps, window):
    code, out, _ = run_main(monkeypatch, capsys, "--steps", str(steps))
    assert code == 0 and out.startswith(f"mean reward: {window} ") and f", last {window[6:]} " in out, out


def test_trl_quickstart_trains_with_grpo_cores_loss_and_prints_each_step():
    """The README's TRL script as a user runs it: TRL's trainer with our loss on a tiny Llama, one line a step, the KL
    moving once the policy has; an interpreter without TRL gets one line and exit code 2."""
    pytest.importorskip("trl")
    import re
    import subprocess
    script = Path(__file__).resolve().parents[1] / "examples" / "trl_quickstart.py"
    proc = subprocess.run([sys.executable, str(script), "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    line = re.compile(r"step (\d): loss (-?\d+\.\d{4}), kl (\d+\.\d{4}), reward (\d\.\d{3})")
    steps = [line.fullmatch(text) for text in lines]
    assert all(steps) and [int(m.group(1)) for m in steps] == [1, 2], lines
    assert float(steps[0].group(3)) == 0.0 < float(steps[1].group(3))  # step 1: the reference is the policy
    proc = subprocess.run([sys.executable, str(script), "--steps", "0"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "trl_quickstart.py: error: --steps: expected an integer >= 1, got 0 (see --help)")


def test_trl_quickstart_uses_grpo_cores_loss(monkeypatch, tmp_path):
    """Its trainer computes the loss with `linear_grpo_loss` (a trainer that kept TRL's own loss would not call it)."""
    pytest.importorskip("trl")
    import grpo_core.integrations.trl as integration
    from trl_quickstart import train
    calls = []
    real = integration.linear_grpo_loss
    monkeypatch.setattr(integration, "linear_grpo_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert len(train(1, tmp_path)) == 1 and calls
