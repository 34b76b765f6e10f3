"""The whole run of `GRPOCoreTrainer`, recorded and compared: the run's description and what `harness diff` says of
two runs' settings, verified replay (`replay_from=`), per-layer digests (`record_layers=`), the sampler's log-probs
against the trainer's (`record_sampler=`) and the reproducible switch (`reproducible=True`). The tiny models and the
run shape are `tests/test_trl.py`'s (4 steps, generations at steps 1 and 3)."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")
from test_trl import make_trainer, tiny_model  # noqa: E402, F401  (tiny_model: the module's fixture)
from test_trl_record import harness_diff, recorded  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402

from grpo_core.integrations.trl import GRPOCoreTrainer  # noqa: E402
from grpo_core.reproducible import determinism_settings  # noqa: E402
from grpo_core.rollouts import read_rollouts  # noqa: E402
from harness.training import read_training_run, sampler_mismatch, training_comparison  # noqa: E402
from reports.drift import drift_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def llama(folder: Path, tokenizer_from: str, layers: int = 3, hidden: int = 32) -> str:
    """A Llama of `layers` layers and `hidden` width (seeded weights) with the tokenizer of `tokenizer_from`."""
    PreTrainedTokenizerFast.from_pretrained(tokenizer_from).save_pretrained(folder)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=12, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def deep_model(tiny_model, tmp_path_factory) -> str:
    """A 3-layer Llama with `tiny_model`'s tokenizer."""
    return llama(tmp_path_factory.mktemp("deep"), tiny_model)


@pytest.fixture(scope="module")
def two_steps(tiny_model, tmp_path_factory) -> Path:
    """A recorded run of 2 steps (one generation) of `tiny_model`, shared: copy it before changing it."""
    return recorded(tiny_model, tmp_path_factory.mktemp("two_steps"), max_steps=2)[0]


@pytest.fixture
def restore_torch_settings():
    """`reproducible=True` sets process-wide flags: put them back for the tests after."""
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.cudnn_sdp_enabled())
    env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC")}
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn[:2]
    torch.backends.cuda.enable_cudnn_sdp(cudnn[2])
    for k, v in env.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_replaying_a_run_with_its_configuration_reproduces_it_bit_for_bit(tiny_model, tmp_path):
    """B trains on A's recorded completions and rewards (no sampling, no reward call): every value and digest of
    every step has A's bits (`harness diff` exit 0), and B's rollouts are A's. Without restoring the generators'
    state after a replayed generation, TRL's shuffle of the generation batch draws other numbers and step 1's
    micro-batches hold other sequences (tested: the diff then fails)."""
    a, _ = recorded(tiny_model, tmp_path / "a")
    b, _ = recorded(tiny_model, tmp_path / "b", functools.partial(GRPOCoreTrainer, replay_from=str(a)))
    proc = harness_diff(a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"B replayed the completions of {a}" in proc.stdout
    ra, rb = read_rollouts(a), read_rollouts(b)
    assert sorted(ra) == sorted(rb) == [1, 3]
    for step in ra:
        for x, y in zip(ra[step], rb[step]):
            assert (x["prompt_ids"], x["completion_ids"], x["sequence"]) == (y["prompt_ids"], y["completion_ids"],
                                                                              y["sequence"])
            assert np.array_equal(x["rewards"].view(np.int32), y["rewards"].view(np.int32))


def test_truncated_completions_masked_out_are_recorded_and_replayed_as_generated(tiny_model, tmp_path):
    """`mask_truncated_completions=True`: a completion cut at the length limit is masked out of the loss (its key in
    the step files has no completion token), yet its rollout holds the ids generated and the sampler's and trainer's
    log-prob of each, and a replay serves them again: identical at every step."""
    a, _ = recorded(tiny_model, tmp_path / "a", functools.partial(GRPOCoreTrainer, record_sampler=True), max_steps=2,
                    mask_truncated_completions=True)
    rows = read_rollouts(a)[1]
    cut = [r for r in rows if len(r["completion_ids"]) == 8 and r["completion_ids"][-1] != 1]
    assert cut and all(len(r["trainer_logps"]) == len(r["sampler_logps"]) == 8 for r in cut)
    df, _ = read_training_run(a)
    tokens = df[(df["field"] == "per_sequence_active_tokens") & (df["step"] == 1)]
    assert (tokens["value"] == 0).sum() == len(cut)  # masked out of the loss, keyed as the loss saw them
    assert set(tokens["sequence"]) == {r["sequence"] for r in rows}
    b, _ = recorded(tiny_model, tmp_path / "b", functools.partial(GRPOCoreTrainer, replay_from=str(a)), max_steps=2,
                    mask_truncated_completions=True)
    assert harness_diff(a, b).returncode == 0


def test_replay_with_another_accumulation_isolates_the_training_numerics(tiny_model, tmp_path):
    """A: 2 micro-batches of 4 a step; B: 1 of 8, replaying A. Every sequence is in both runs at every step (the same
    completions, whatever B's sampler would have drawn), step 1 is identical, and from step 2 on what moved is the
    training: upstream of the loss (the weights after step 1 differ)."""
    a, _ = recorded(tiny_model, tmp_path / "a")
    b, _ = recorded(tiny_model, tmp_path / "b", functools.partial(GRPOCoreTrainer, replay_from=str(a)),
                    per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=1)
    c = training_comparison(str(a), str(b))
    steps = c["steps"].set_index("step")
    assert steps["sequences"].eq(8).all() and steps[["only_in_A", "only_in_B"]].eq(0).all().all()
    assert steps.loc[1, "moved"] == 0 and c["first"] == 2 and set(c["verdicts"]["cause"]) == {"upstream"}
    assert any("per_device_train_batch_size: A 4 vs B 8" in s for s in c["settings"])


@pytest.mark.parametrize("change", ["model", "prompts", "batch", "steps", "tokenizer", "rewards", "empty"])
def test_a_replay_folder_that_does_not_fit_is_refused_before_training(tiny_model, two_steps, tmp_path, change):
    a = two_steps
    model, options = tiny_model, {}
    if change == "model":
        model = llama(tmp_path / "wide", tiny_model, layers=1, hidden=64)
    elif change == "tokenizer":
        tok = PreTrainedTokenizerFast.from_pretrained(tiny_model)
        tok.add_tokens(["zz"])
        tok.save_pretrained(tmp_path / "tok")
        options["processing_class"] = tok
    elif change == "batch":
        options = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=2)
    elif change == "steps":
        options = dict(max_steps=4)
    elif change == "rewards":
        options["reward_funcs"] = [lambda completions, **kw: [1.0] * len(completions)]
    elif change == "empty":
        a = tmp_path / "nothing"
        a.mkdir()
    want = {"model": "hidden_size: 32 recorded, 64 here", "prompts": "prompt set (digest",
            "batch": "generation batch (all processes) (8 recorded, 16 here)", "steps": "without step 3",
            "tokenizer": "tokenizer (digest", "rewards": "reward functions (['toy_reward'] recorded",
            "empty": "which has none"}[change]

    def build(**kw):
        if change == "prompts":
            from datasets import Dataset
            kw["train_dataset"] = Dataset.from_dict({"prompt": ["abc", "hag", "bead", "cafe", "dh", "g f"]})
        if "processing_class" in options:
            kw["processing_class"] = options["processing_class"]
        if "reward_funcs" in options:
            kw["reward_funcs"] = options["reward_funcs"]
        return GRPOCoreTrainer(replay_from=str(a), **kw)

    extra = {k: v for k, v in options.items() if k not in ("processing_class", "reward_funcs")}
    with pytest.raises(ValueError) as err:
        make_trainer(model, tmp_path / "b", build, loss_type="grpo", beta=0.04, max_steps=extra.pop("max_steps", 2),
                     **extra)
    text = str(err.value)
    assert text.startswith("replay_from: expected") and "\n" not in text and want in text, text


def test_a_prompt_that_differs_at_its_place_is_refused(tiny_model, two_steps, tmp_path):
    a = shutil.copytree(two_steps, tmp_path / "a")
    rollout = next(Path(a).glob("rank-*/rollout-0000001.parquet"))
    import pyarrow as pa
    import pyarrow.parquet as pq
    t = pq.read_table(rollout)
    prompts = t["prompt_ids"].to_pylist()
    prompts[0], prompts[4] = prompts[4], prompts[0]  # two places swapped (another order of the same prompts)
    t = t.set_column(t.schema.get_field_index("prompt_ids"), "prompt_ids", pa.array(prompts, pa.list_(pa.int64())))
    rollout.unlink()
    pq.write_table(t, rollout)
    trainer = make_trainer(tiny_model, tmp_path / "b", functools.partial(GRPOCoreTrainer, replay_from=str(a)),
                           loss_type="grpo", beta=0.04, max_steps=2)
    with pytest.raises(ValueError, match=r"^replay_from: expected step 1's prompt at position 0 to be the recorded"):
        trainer.train()


class PlantInLayer(TrainerCallback):
    """Before step `step`, one weight of `layer`'s MLP moves by 2**-10 of itself (one ULP can round away in the
    layer's sums: then nothing moved, and nothing is reported)."""

    def __init__(self, layer: int, step: int):
        self.layer, self.step = layer, step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                w = model.model.layers[self.layer].mlp.down_proj.weight
                w[0, 0] *= 1 + 2**-10


def test_a_change_planted_in_one_layer_is_named_with_its_step(deep_model, tmp_path, layer=1):
    """One weight of decoder layer k moved before step 2 (a step without a generation: both runs train on the
    same completions): steps before it are identical, and every sequence that moved at step 2 names
    `model.layers.k` as the first module whose output moved (the embedding and the layers before k kept their
    bits). Two identical runs with layer digests are identical."""
    class Planted(GRPOCoreTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(PlantInLayer(layer, 2))

    a, _ = recorded(deep_model, tmp_path / "a", functools.partial(GRPOCoreTrainer, record_layers=True), max_steps=2)
    b, _ = recorded(deep_model, tmp_path / "b", functools.partial(Planted, record_layers=True), max_steps=2)
    df, _ = read_training_run(a)
    fields = sorted(f for f in df["field"].unique() if f.startswith("layer/"))
    assert fields == ["layer/000/model.embed_tokens", "layer/001/model.layers.0", "layer/002/model.layers.1",
                      "layer/003/model.layers.2", "layer/004/model.norm"]
    c = training_comparison(str(a), str(b))
    assert c["first"] == 2
    moved = c["verdicts"]
    assert len(moved) == 8 and set(moved["step"]) == {2} and set(moved["cause"]) == {"upstream"}
    assert set(moved["first_module"]) == {f"model.layers.{layer}"}
    proc = harness_diff(a, b)
    assert f"first module whose output moved at step 2: model.layers.{layer} (in 8 sequences of 8)" in proc.stdout
    drift_report(str(a), str(b), tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Where the drift starts" in report and f"| 2 | model.layers.{layer} | 8 |" in report
    c2 = recorded(deep_model, tmp_path / "c", functools.partial(GRPOCoreTrainer, record_layers=True), max_steps=2)[0]
    assert harness_diff(a, c2).returncode == 0


def test_the_sampler_against_the_trainer(tiny_model, tmp_path):
    """`record_sampler=True`: each completion token's log-prob as `generate` sampled it (the temperature-scaled
    distribution) beside the trainer's under the same weights. On the CPU in fp32 they agree to rounding (a log-prob
    of another token, or of the token before, would be off by far more), and the run logs TRL's
    `sampling/sampling_logp_difference/{mean,max}`."""
    a, logs = recorded(tiny_model, tmp_path / "a", functools.partial(GRPOCoreTrainer, record_sampler=True))
    rollouts = read_rollouts(a)
    for rows in rollouts.values():
        for r in rows:
            assert len(r["sampler_logps"]) == len(r["trainer_logps"]) == len(r["completion_ids"])
            assert (r["sampler_logps"] <= 0).all()
    m = sampler_mismatch(rollouts)
    assert m["steps"]["sequences"].tolist() == [8, 8]
    assert 0 < m["steps"]["max_abs_delta"].max() < 1e-5  # rounding: other kernels, not other tokens
    assert 0 < m["steps"]["other_bits"].sum() <= m["steps"]["tokens"].sum()
    assert abs(m["steps"]["k3_kl"]).max() < 1e-9
    assert "sampling/sampling_logp_difference/max" in logs[0]
    proc = harness_diff(a, a.parent.parent / "a" / "record")  # the same folder: refused
    assert proc.returncode == 2
    b, _ = recorded(tiny_model, tmp_path / "b")
    text = harness_diff(a, b).stdout
    assert "sampler vs trainer, A:" in text and "sampler vs trainer, B:" not in text
    drift_report(str(a), str(b), tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Sampler against trainer, run A" in report and "## Worst tokens, run A" in report
    assert "run B" not in report


def test_settings_that_differ_name_the_configuration_not_the_paths(tiny_model, tmp_path, restore_torch_settings):
    """The run's description holds the GRPOConfig fields that change numbers, the model, the versions and (in the
    provenance) torch's determinism settings: another learning rate and the reproducible switch are named; the
    output folders, which differ between any two runs, are not."""
    a, _ = recorded(tiny_model, tmp_path / "a", max_steps=2)
    b, _ = recorded(tiny_model, tmp_path / "b", functools.partial(GRPOCoreTrainer, reproducible=True), max_steps=2,
                    learning_rate=0.1)
    assert determinism_settings()["sdp_cudnn"] is False and torch.are_deterministic_algorithms_enabled()
    c = training_comparison(str(a), str(b))
    settings = "; ".join(c["settings"])
    assert "config.learning_rate: A 0.3 vs B 0.1" in settings
    assert "provenance.sdp_cudnn: A True vs B False" in settings
    assert "provenance.deterministic_algorithms: A False vs B True" in settings
    assert "reproducible: A False vs B True" in settings
    assert "output_dir" not in settings and "trainer" not in settings.replace("trainer:", "")
    _, meta = read_training_run(a)
    m = meta["metadata"]
    assert m["model_config"]["hidden_size"] == 32 and len(m["weights_digest"]) == 32
    assert m["versions"]["trl"] == trl.__version__ and "_name_or_path" not in m["model_config"]


def test_runs_of_two_models_and_a_missing_step_file_are_said_first(tiny_model, two_steps, tmp_path):
    a = two_steps
    wide = llama(tmp_path / "wide", tiny_model, layers=1, hidden=64)
    b, _ = recorded(wide, tmp_path / "b", max_steps=2)
    text = harness_diff(a, b).stdout
    line = next(line for line in text.splitlines() if line.startswith("the runs train different models ("))
    assert "model_config.hidden_size: A 32 vs B 64" in line and "weights_digest: A" in line
    c, _ = recorded(tiny_model, tmp_path / "c", max_steps=2)
    (Path(c) / "rank-00000" / "step-0000002.parquet").rename(Path(c) / "rank-00000" / "step-0000002.parquet.9.tmp")
    proc = harness_diff(a, c)
    assert proc.returncode == 1
    assert "B has no file for step 2 of rank 0 (A has one)" in proc.stdout
    assert "B: step 2 of rank 0 was being written when the run stopped" in proc.stdout
