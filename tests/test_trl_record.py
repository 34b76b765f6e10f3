"""`GRPOCoreTrainer` runs recorded (`record_dir=`) and compared (`python -m harness diff`, `python -m reports drift`):
the old and reference log-probs are the loss's own bits, the same run twice is identical at every step, other
accumulations and process counts move only what the backbone or the optimizer moved, and a change planted in the loss
at one step is named with its step and its side. The tiny Llama and the run shape are `tests/test_trl.py`'s."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
from test_readme import README, section  # noqa: E402
from test_recorder import planted  # noqa: E402
from test_trl import make_trainer, tiny_model  # noqa: E402, F401  (tiny_model: the module's fixture)

from grpo_core.integrations.trl import GRPOCoreTrainer  # noqa: E402
from grpo_core.linear import linear_logprobs  # noqa: E402
from harness.training import read_training_run, training_comparison  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def recorded(model_path: str, out: Path, cls=GRPOCoreTrainer, **options) -> tuple[Path, list[dict]]:
    """Trains the tests' run shape (4 steps, grpo, beta 0.04 unless `options` say otherwise) recording into
    `out / "record"`; returns the record folder and the logged step records."""
    options = {"loss_type": "grpo", "beta": 0.04, **options}
    trainer = make_trainer(model_path, out / "trainer", lambda **kw: cls(record_dir=str(out / "record"), **kw),
                           **options)
    trainer.train()
    return out / "record", [r for r in trainer.state.log_history if "loss" in r]


def harness_diff(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "diff", str(a), str(b)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_old_and_reference_logprobs_are_the_losss_own_bits(tiny_model, tmp_path):
    """Policy and reference identical at step 1, old log-probs computed (two passes over a generation): the logged
    KL is exactly 0, every sequence's KL term is +0.0, and the old log-probs are, bit for bit, the log-probs the loss
    computes for the policy in the first accumulation window (so each ratio is exactly 1.0). TRL's own head gives
    other bits for the same tokens: without the trainer's own log-probs this test fails."""
    seen = []

    class Watch(GRPOCoreTrainer):
        def _grpo_core_loss(self, unwrapped, inputs, num_items, entropy_coef):
            if self.state.global_step == 0:  # the first window: the policy is still the one that made old_logps
                ids = inputs["completion_ids"]
                hidden, weight, bias = self._hidden_and_head(
                    unwrapped, torch.cat([inputs["prompt_ids"], ids], 1),
                    torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), ids.size(1))
                mask = inputs["completion_mask"].bool()
                own = linear_logprobs(hidden.detach(), weight.detach(), ids, mask, temperature=self.temperature)
                theirs, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
                    self, unwrapped, torch.cat([inputs["prompt_ids"], ids], 1),
                    torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), ids.size(1))
                seen.append((own[mask], inputs["old_per_token_logps"][mask], theirs[mask]))
            return super()._grpo_core_loss(unwrapped, inputs, num_items, entropy_coef)

    record, logs = recorded(tiny_model, tmp_path, Watch)
    assert logs[0]["kl"] == 0.0 and logs[-1]["kl"] > 1e-3
    df, _ = read_training_run(record)
    kl = df[(df["field"] == "per_sequence_kl") & (df["step"] == 1)]
    assert len(kl) == 8 and (kl["bits"] == 0).all()
    assert len(seen) == 2
    for own, old, theirs in seen:
        assert torch.equal(own.view(torch.int32), old.view(torch.int32))
        assert (own.view(torch.int32) != theirs.view(torch.int32)).any()  # TRL's fused head: other bits


def test_the_same_run_twice_is_identical_at_every_step(tiny_model, tmp_path):
    a, _ = recorded(tiny_model, tmp_path / "a")
    b, _ = recorded(tiny_model, tmp_path / "b")
    proc = harness_diff(a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical: every recorded value and digest has the same bits at every step" in proc.stdout
    df, meta = read_training_run(a)
    assert meta["steps"] == 4 and df[df["field"] == "per_sequence_policy"].groupby("step").size().eq(8).all()
    assert df[df["field"] == "grad_digest"]["step"].nunique() == 4  # every step's backward was digested
    out = subprocess.run([sys.executable, "-m", "reports", "drift", str(a), str(b), "--out", str(tmp_path / "rep")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "identical" in (tmp_path / "rep" / "report.md").read_text()


def test_accumulation_moves_what_the_optimizer_moved(tiny_model, tmp_path):
    """2 micro-batches of 4 against 1 of 8 per optimizer step, the same generations: step 1 is identical (each
    sequence's hidden states and every value, the gradients too: the grpo normalizer's 1/4 * 1/2 and 1/8 are the same
    powers of two); from step 2 on the hidden states differ (the weights after step 1 differ: the parameter gradients
    were summed over other micro-batches), and the report says upstream. Wherever a sequence's inputs kept their bits,
    its per-sequence values kept theirs."""
    a, _ = recorded(tiny_model, tmp_path / "a")
    b, _ = recorded(tiny_model, tmp_path / "b", per_device_train_batch_size=8, gradient_accumulation_steps=1,
                    steps_per_generation=1)
    c = training_comparison(str(a), str(b))
    steps = c["steps"].set_index("step")
    assert steps.loc[1, "sequences"] == 8 and steps.loc[1, "moved"] == 0
    assert c["first"] == 2 and not c["scalars"]
    assert set(c["verdicts"]["cause"]) == {"upstream"}
    proc = harness_diff(a, b)
    assert proc.returncode == 1 and "first step where anything moved: 2" in proc.stdout
    assert "per-call scalars (loss, policy_loss, kl) not compared: the layouts differ" in proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(model_path: str, out: Path, processes: int, per_device: int) -> Path:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # the caller's packages too
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                           "--master-port", str(_free_port()), str(ROOT / "tests" / "trl_world.py"), model_path,
                           str(out / "trainer"), str(out / "record"), str(per_device)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "record"


@pytest.mark.distributed
def test_one_process_against_two(tiny_model, tmp_path):
    """The same 16 completions per step (`tests/trl_world.py`), on one process (micro-batches of 8) and on two
    (gloo, micro-batches of 4 each). Seen on the CPU: at step 1 every sequence's hidden states and per-sequence values
    have the same bits on both layouts, and only the gradients' scale moved, by a power of two (each process's loss is
    its micro-batch's mean, and DDP averages the two processes; the mantissas kept their bits); from step 2 on the hidden states differ
    (DDP's all-reduce summed the parameter gradients in another order). No sequence moved in the loss."""
    one = _torchrun(tiny_model, tmp_path / "one", 1, 8)
    two = _torchrun(tiny_model, tmp_path / "two", 2, 4)
    c = training_comparison(str(one), str(two))
    assert c["meta_b"]["ranks"] == [0, 1] and c["meta_b"]["metadata"]["world_size"] == 2
    steps = c["steps"].set_index("step")
    assert steps["sequences"].eq(16).all() and steps[["only_in_A", "only_in_B"]].eq(0).all().all()
    assert steps.loc[1, "scale"] == 16 and steps.loc[1, ["upstream", "loss", "gradient"]].eq(0).all()
    assert set(c["verdicts"]["cause"]) <= {"upstream", "scale"}
    assert c["first"] == 1 and not [n for n in c["notes"] if "no file" in n]  # rank 1 is not a missing file
    # the README shows this comparison: its per-step counts are this run's (the ULP distances are the machine's)
    counts = ["step", "sequences", "moved", "upstream", "loss", "scale", "gradient"]
    shown = section(README, "## Verify your training run").split("```\n step")[1].split("\n")[1:5]
    assert [[int(v) for v in line.split()[:7]] for line in shown] == c["steps"][counts].values.tolist()


def test_a_change_planted_in_the_loss_at_one_step_is_named(tiny_model, tmp_path):
    """The regrouped token sum (the gate's planted drift) in the loss during step 3 alone: the report names step 3,
    every moved sequence with its inputs unchanged (the loss moved), and nothing before it."""
    from transformers import TrainerCallback

    class PlantAtStep3(TrainerCallback):
        def __init__(self):
            self.plant = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2 and self.plant is None:
                self.plant = planted()
                self.plant.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.plant is not None and state.global_step == 3:
                self.plant.__exit__(None, None, None)

    class Planted(GRPOCoreTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(PlantAtStep3())

    a, _ = recorded(tiny_model, tmp_path / "a")
    b, _ = recorded(tiny_model, tmp_path / "b", Planted)
    c = training_comparison(str(a), str(b))
    assert c["first"] == 3
    at3 = c["verdicts"][c["verdicts"]["step"] == 3]
    assert len(at3) > 0 and set(at3["cause"]) == {"loss"}
    proc = harness_diff(a, b)
    assert proc.returncode == 1
    assert "first step where anything moved: 3" in proc.stdout and "0 upstream of the loss" in proc.stdout
    out = subprocess.run([sys.executable, "-m", "reports", "drift", str(a), str(b), "--out", str(tmp_path / "rep")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "first step where anything moved: 3" in text
    assert "report.html" in out.stdout and (tmp_path / "rep" / "per_step.png").is_file()
