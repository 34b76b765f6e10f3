"""TRL's `GRPOTrainer` trained with TRL's own loss and with ours (`GRPOCoreTrainer`): the same logged numbers and
the same parameters after every step, for loss_type grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo and vespo,
with and without the KL term, and with TRL's `delta`, `use_bias_correction_kl`, SAPO temperatures, VESPO's
gamma parameters, GSPO's `importance_sampling_level="sequence"` and `off_policy_mask_threshold`. vLLM's importance
sampling ratio cannot come from a run here (no vLLM): both trainers' `_compute_loss` take it on one batch made by the
test.

Everything is local and on the CPU: a tiny randomly initialized Llama built from a config, a character-level
tokenizer built with `tokenizers`, a six-prompt in-memory dataset, a toy reward. No hub access (offline mode is
forced below). The `trl` extra (in `dev`) pins the versions; without TRL the file skips.

One run shape serves every case: 4 optimizer steps of 2 accumulated micro-batches of 4 completions each, 2 micro-
batches per generation and 2 iterations over each generation. So the old log-probs are given (the second pass over
a batch has ratios away from 1, so tokens get clipped), the loss is scaled for the accumulation, dapo's and cispo's
normalizer is the generation batch's token count (not the micro-batch's: `GRPOLinearLoss`'s `num_items_in_batch`
path) and two generations are made. A small vocabulary makes EOS likely, so completion lengths differ and the four token
normalizers really differ. A temperature and an asymmetric clip range (DAPO's 0.2 / 0.28) check that those reach
the loss. SGD (not Adam) keeps a parameter difference proportional to the gradient difference.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")  # read when huggingface_hub is imported: never reach the hub
os.environ.setdefault("WANDB_DISABLED", "true")

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402  (after TRL's skip: both come with the `trl` extra)
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402

from grpo_core.integrations.trl import GRPOCoreTrainer, GRPOLinearLoss  # noqa: E402

# TRL 1.16 calls transformers 5.24's deprecated gradient_checkpointing names: their FutureWarnings, not ours
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# cispo: TRL's recommended epsilon_high (5.0) never binds here; 1.1 does, on the second pass over a generation (the
# logged cispo_clip_ratio, asserted > 0), and stays clear of the ratios of exactly 1 (up to rounding) of the first.
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]  # sapo, vespo: TRL's defaults
LOSS_OPTIONS = {"cispo": dict(epsilon_high=1.1)}  # per loss type, over make_trainer's defaults
CLIP_RATIO_KEYS = {"cispo": "cispo_clip_ratio", "sapo": None, "vespo": None}  # TRL's (default: the region's)
# Tolerances. fp32 throughout; the two sides compute the log-probs with different kernels (TRL: its chunked LM
# head; ours: the canonical fixed-order dots and trees) and sum the token terms in different orders, so they agree
# to a few fp32 ulps (measured: losses and KLs of 0.01-0.3 within 9e-8, parameters that moved by ~0.1 within
# 6e-8; cispo's losses of ~0.9 within 1.2e-7 and parameters within 1.2e-7, sapo's KL of 0.32 within 1.4e-7). A loss
# or KL may differ by 1e-6 + 1e-5 * |value| (>10x the measured differences): the absolute part because
# the first step's loss is a cancellation (its advantages sum to ~0: |loss| ~ 1e-8), the relative part because a
# large k3 KL (exp of a log-prob difference) scales its rounding with it (seen: 1.1e-6 at a KL of 1.5, with a
# learning rate of 1.0).
# Parameters (SGD: a difference is the learning rate times a gradient difference): 1e-6. The clip ratio counts
# tokens: it must be equal (one token across the clip bound would be a real divergence of 1 / tokens ~ 0.02).
ATOL, RTOL = 1e-6, 1e-5
PARAM_ATOL = 1e-6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A 1-layer Llama (hidden 32, vocab 12) and its character tokenizer, saved to a folder: TRL loads the policy
    and, with beta > 0, the reference model from that path."""
    path = tmp_path_factory.mktemp("tiny_llama")
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *"abcdefgh", " "])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def toy_reward(completions, **kwargs) -> list[float]:
    """Varies within a group (the completions are random characters), so the advantages are not zero."""
    return [sum(ord(ch) % 7 for ch in completion) / 8.0 + 0.1 * len(completion) for completion in completions]


def make_trainer(model_path: str, out_dir, trainer_cls, *, loss_type: str, beta: float, num_iterations: int = 2,
                 **overrides):
    """The trainer of the run shape above; `overrides`: further `GRPOConfig` arguments (`delta=...`)."""
    config = dict(
        output_dir=str(out_dir), use_cpu=True, bf16=False, seed=0, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1, max_steps=4, optim="sgd", learning_rate=0.3,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=2, num_generations=4,
        num_iterations=num_iterations, max_completion_length=8, loss_type=loss_type, beta=beta, temperature=0.9,
        epsilon=0.2, epsilon_high=0.28, use_bias_correction_kl=False)  # TRL 1.16's default is True: a case sets it
    dataset = Dataset.from_dict({"prompt": ["abc", "hag", "bead", "cafe", "dh", "g e"]})
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    return trainer_cls(model=model_path, reward_funcs=toy_reward, args=trl.GRPOConfig(**{**config, **overrides}),
                       train_dataset=dataset, processing_class=tokenizer)


def train(model_path: str, out_dir, trainer_cls, **options):
    """Trains 4 steps (`options`: `make_trainer`'s); returns the logged step records, the parameters after each step
    and the initial ones."""
    trainer = make_trainer(model_path, out_dir, trainer_cls, **options)
    snapshots = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots.append({name: p.detach().clone() for name, p in model.named_parameters()})

    trainer.add_callback(Snapshot())
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [record for record in trainer.state.log_history if "loss" in record]
    assert len(logs) == len(snapshots) == 4
    return logs, snapshots, initial


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def compare(theirs, ours, beta: float, loss_type: str, on_policy: bool = False) -> dict:
    """Asserts agreement step by step; returns the largest differences (printed with `-s`)."""
    (logs_t, params_t, initial), (logs_o, params_o, _) = theirs, ours
    clip_key = CLIP_RATIO_KEYS.get(loss_type, "clip_ratio/region_mean")
    clip_keys = [] if clip_key is None else [clip_key]
    # Ours logs the clip ratio TRL logs for the loss type (sapo: none, and TRL none either), nothing else of the kind
    assert {key for record in logs_o for key in record if "clip_ratio" in key} == set(clip_keys)
    if clip_key is None:
        assert not {key for record in logs_t for key in record if "clip_ratio" in key}
    keys = ["loss", "entropy", *clip_keys] + (["kl"] if beta else []) + (
        ["vespo/phi_seq_mean"] if loss_type == "vespo" else []) + (["policy_loss"] if "policy_loss" in logs_t[0] else [])
    assert {k for record in logs_o for k in record if k.startswith(("entropy", "policy_loss"))} == \
           {k for record in logs_t for k in record if k.startswith(("entropy", "policy_loss"))}
    worst = dict.fromkeys(keys + ["params"], 0.0)
    for step, (lt, lo, pt, po) in enumerate(zip(logs_t, logs_o, params_t, params_o), start=1):
        for key in keys:
            diff = abs(lt[key] - lo[key])
            worst[key] = max(worst[key], diff)
            limit = 0.0 if key == clip_key else ATOL + RTOL * abs(lt[key])
            assert diff <= limit, f"step {step}: {key} {lt[key]!r} (TRL) vs {lo[key]!r} (ours), |diff| {diff:.3e}"
        if "entropy_coef" in lt:  # the adaptive controller's coefficient: the same decisions
            assert lt["entropy_coef"] == lo["entropy_coef"], f"step {step}: entropy_coef"
        diff = max_param_diff(pt, po)
        worst["params"] = max(worst["params"], diff)
        assert diff <= PARAM_ATOL, f"step {step}: parameters differ by up to {diff:.3e}"
    # Not vacuous: training moved the parameters, rewards varied within groups, losses are not zero, lengths differ
    # (so the normalizers differ), and the second pass over a batch clipped tokens (cispo: its clamp bound; sapo
    # clips nothing) and saw a KL.
    assert max_param_diff(params_t[-1], initial) > 1e-2
    assert all(record["frac_reward_zero_std"] < 1 for record in logs_t if "frac_reward_zero_std" in record)
    assert max(abs(record["loss"]) for record in logs_t) > 1e-2
    assert any(record["completions/min_length"] < record["completions/max_length"] for record in logs_t
               if "completions/min_length" in record)
    if clip_key is not None:
        clipped = max(record[clip_key] for record in logs_t)
        assert clipped == 0.0 if on_policy else clipped > 0  # on-policy, the ratio is exactly 1
    if beta:
        assert max(record["kl"] for record in logs_t) > 1e-3
    if loss_type == "vespo":  # the second pass over a generation weighs its sequences away from 1
        assert max(abs(record["vespo/phi_seq_mean"] - 1.0) for record in logs_t) > 1e-3
    return worst


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_trainer_matches_trl(tiny_model, tmp_path, loss_type, beta):
    options = LOSS_OPTIONS.get(loss_type, {})
    theirs = train(tiny_model, tmp_path / "trl", trl.GRPOTrainer, loss_type=loss_type, beta=beta, **options)
    ours = train(tiny_model, tmp_path / "ours", GRPOCoreTrainer, loss_type=loss_type, beta=beta, **options)
    worst = compare(theirs, ours, beta, loss_type)
    print(f"{loss_type} beta={beta}: largest |TRL - ours|: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


def test_trainer_matches_trl_on_policy(tiny_model, tmp_path):
    """num_iterations=1, steps_per_generation <= accumulation: TRL passes no old log-probs (ratio exactly 1)."""
    theirs = train(tiny_model, tmp_path / "trl", trl.GRPOTrainer, loss_type="dapo", beta=0.04, num_iterations=1)
    ours = train(tiny_model, tmp_path / "ours", GRPOCoreTrainer, loss_type="dapo", beta=0.04, num_iterations=1)
    worst = compare(theirs, ours, 0.04, "dapo", on_policy=True)
    print("on-policy dapo beta=0.04: largest |TRL - ours|: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


# Each option changes TRL's own training in its case (asserted: TRL without it ends elsewhere), so a loss that
# ignored it would fail. `delta` clamps the unclipped ratio above. Above 1 + epsilon_high (as TRL recommends) it binds
# only where the advantage is negative and the ratio above delta, which training makes rare: past 1.28 never in these
# runs, past 1.1 on the second pass over the second generation (step 4); hence epsilon_high=0.05 and delta=1.1.
# (Below 1 + epsilon_high, TRL's logged clip ratio counts the clamped ratio, the loss's the ratio: they differ.)
# `use_bias_correction_kl` (the KL times the ratio) changes the gradient from step 2 on (step 1 starts from the
# reference's parameters: a KL of 0). SAPO's temperatures change the gradient only where the ratio is not 1 (its
# slope there is 1 whatever the temperature), so only through the second pass over a generation.
# GSPO (`importance_sampling_level="sequence"`) with the clip range its paper and TRL recommend (3e-4 / 4e-4): the
# sequence ratios of the second pass over a generation cross it (a mean log-ratio varies less than a token's).
DELTA = dict(delta=1.1, epsilon_high=0.05)
SAPO_TEMPERATURES = dict(sapo_temperature_pos=2.0, sapo_temperature_neg=4.0)
VESPO_GAMMA = dict(vespo_k_pos=0.5, vespo_lambda_pos=1.0, vespo_k_neg=6.0, vespo_lambda_neg=4.0)
# The entropy options: a bonus, the top-entropy mask, and TRL's adaptive controller with a target above the tiny
# model's entropy (~2.4 nats over 12 tokens), so that the bonus applies from the second step on and grows.
ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=3.0, entropy_coef_delta=0.1)
# With the top-entropy mask, the controller reads the kept tokens' mean (2.464-2.479 nats in TRL's run), above the
# mean over all tokens (2.448-2.477): at a target between them, TRL lowers the coefficient at steps 1 and 2, raises
# it after (the bonus applies at step 4); a controller reading all tokens would raise it at step 2 already.
ADAPTIVE_KEPT = dict(ADAPTIVE, top_entropy_quantile=0.4, entropy_target=2.4715, entropy_coef_delta=0.01)
# The off-policy mask's threshold: 1e-3, not 0, which would sit on the rounding of the first pass over a generation
# (TRL's log-probs and ours differ by ~1e-7 there, where an unchanged policy's mean log-ratio is 0).
GSPO = dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)
OPTIONS = {"delta": ["delta"], "use_bias_correction_kl": ["use_bias_correction_kl"],  # each proof drops these
           "sapo temperatures": list(SAPO_TEMPERATURES), "vespo gamma": list(VESPO_GAMMA),
           "entropy bonus": ["entropy_coef"], "entropy mask": ["top_entropy_quantile"],
           "adaptive entropy": ["use_adaptive_entropy", "entropy_target", "entropy_coef_delta"],
           "sequence level": ["importance_sampling_level"],
           "off-policy mask": ["off_policy_mask_threshold"]}


@pytest.mark.parametrize("loss_type, beta, options", [
    ("dapo", 0.0, DELTA),
    ("dapo", 0.04, dict(use_bias_correction_kl=True)),
    ("grpo", 0.04, dict(DELTA, use_bias_correction_kl=True)),
    ("sapo", 0.04, SAPO_TEMPERATURES),
    ("grpo", 0.04, GSPO),
    ("luspo", 0.0, GSPO),
    ("dapo", 0.04, dict(GSPO, use_bias_correction_kl=True)),
    ("sapo", 0.04, dict(importance_sampling_level="sequence")),
    ("cispo", 0.0, dict(importance_sampling_level="sequence", epsilon_high=1.02)),
    ("dapo", 0.04, dict(off_policy_mask_threshold=1e-3)),
    ("grpo", 0.0, dict(importance_sampling_level="sequence", off_policy_mask_threshold=1e-3)),
    ("vespo", 0.04, dict(VESPO_GAMMA, use_bias_correction_kl=True)),
    ("dapo", 0.04, dict(entropy_coef=0.05)),
    ("grpo", 0.0, dict(top_entropy_quantile=0.4, entropy_coef=0.02)),
    ("dapo", 0.0, ADAPTIVE),
    ("dapo", 0.0, ADAPTIVE_KEPT),
], ids=["delta", "bias_correction_kl", "grpo-delta-bias_correction_kl", "sapo_temperatures", "gspo-grpo",
        "gspo-luspo", "gspo-dapo-bias_correction_kl", "gspo-sapo", "gspo-cispo", "off_policy_mask",
        "gspo-grpo-off_policy_mask", "vespo-gamma-bias_correction_kl", "entropy_bonus", "top_entropy_quantile",
        "adaptive_entropy", "adaptive_entropy-top_entropy_quantile"])
def test_trainer_matches_trl_with_option(tiny_model, tmp_path, loss_type, beta, options):
    theirs = train(tiny_model, tmp_path / "trl", trl.GRPOTrainer, loss_type=loss_type, beta=beta, **options)
    ours = train(tiny_model, tmp_path / "ours", GRPOCoreTrainer, loss_type=loss_type, beta=beta, **options)
    worst = compare(theirs, ours, beta, loss_type)
    gaps = {}
    for name, dropped in OPTIONS.items():  # not vacuous: TRL without the option ends elsewhere
        if dropped[0] in options:
            without = {k: v for k, v in options.items() if k not in dropped}
            plain = train(tiny_model, tmp_path / dropped[0], trl.GRPOTrainer, loss_type=loss_type, beta=beta,
                          **without)
            gaps[name] = max(max_param_diff(a, b) for a, b in zip(theirs[1], plain[1]))
            assert gaps[name] > 100 * PARAM_ATOL, f"{name} does not change TRL's training: the case proves nothing"
    print(f"{loss_type} beta={beta} {options}: largest |TRL - ours|: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
          + "; TRL's parameters without " + ", ".join(f"{k} move by {v:.2e}" for k, v in gaps.items()))


@pytest.mark.parametrize("loss_type", ["dapo", "vespo"])
def test_vllm_importance_sampling_matches_trl(tiny_model, tmp_path, loss_type):
    """TRL's vLLM importance sampling correction without vLLM: both trainers' `_compute_loss` on one batch made here
    with `inputs["importance_sampling_ratio"]` (`[B, T]`, then `[B, 1]`; vespo: `[B, T]`, TRL's only modes for it,
    in its gamma weight), with `use_vllm` and `vllm_importance_sampling_correction` set on the instances (TRL's
    condition for applying it). Eval mode: the accumulation scaling is the training tests' part. Same loss and
    gradients; TRL's loss without the correction, and (dapo) the shift that putting the ratio on the KL term too would
    make, are far outside the tolerance. The ratio is 1 on masked tokens, as TRL makes it."""
    trainers = [make_trainer(tiny_model, tmp_path / cls.__name__, cls, loss_type=loss_type, beta=0.04)
                for cls in (trl.GRPOTrainer, GRPOCoreTrainer)]
    for trainer in trainers:
        trainer.model.eval()
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    g = torch.Generator().manual_seed(0)
    B, P, T = 8, 3, 8
    prompt_ids, completion_ids = torch.randint(3, 12, (B, P), generator=g), torch.randint(1, 12, (B, T), generator=g)
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B,), generator=g)[:, None]).long()  # lengths 1 to T
    completion_ids = completion_ids * mask  # padded with <pad> = 0, as TRL pads
    with torch.no_grad():
        logp = trainers[0]._get_per_token_logps_and_entropies(
            trainers[0].model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([torch.ones_like(prompt_ids), mask], 1), T)[0]
    ref = logp + torch.randn(B, T, generator=g)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                  completion_mask=mask, advantages=torch.randn(B, generator=g), num_items_in_batch=mask.sum(),
                  old_per_token_logps=logp + 0.2 * torch.randn(B, T, generator=g), ref_per_token_logps=ref)
    kl = torch.exp(ref - logp) - (ref - logp) - 1.0  # TRL's k3 term (use_bias_correction_kl=False)

    def loss_and_grads(trainer, ratio):
        trainer.model.zero_grad()
        given = {} if ratio is None else {"importance_sampling_ratio": ratio}
        loss = trainer._compute_loss(trainer.model, {**inputs, **given})
        loss.backward()
        return loss.item(), {name: p.grad.clone() for name, p in trainer.model.named_parameters()}

    for shape in [(B, T), (B, 1)] if loss_type == "dapo" else [(B, T)]:
        ratio = 0.5 + 1.5 * torch.rand(shape, generator=g)
        if shape == (B, T):
            ratio = torch.where(mask.bool(), ratio, 1.0)
        (loss_t, grads_t), (loss_o, grads_o) = (loss_and_grads(trainer, ratio) for trainer in trainers)
        loss_diff, grad_diff = abs(loss_t - loss_o), max_param_diff(grads_t, grads_o)
        tol = ATOL + RTOL * abs(loss_t)
        assert loss_diff <= tol, f"{list(shape)}: loss {loss_t!r} (TRL) vs {loss_o!r} (ours)"
        assert grad_diff <= PARAM_ATOL, f"{list(shape)}: gradients differ by up to {grad_diff:.3e}"
        trainers[0].vllm_importance_sampling_correction = False  # not vacuous: the ratio changes TRL's loss ...
        loss_off, grads_off = loss_and_grads(trainers[0], None)
        trainers[0].vllm_importance_sampling_correction = True
        assert abs(loss_off - loss_t) > 100 * tol and max_param_diff(grads_off, grads_t) > 100 * PARAM_ATOL
        # ... and a ratio on the KL term too would add this (dapo in eval: over the active tokens)
        kl_shift = 0.04 * (mask * kl * (ratio - 1.0)).sum().item() / mask.sum().item()
        assert loss_type == "vespo" or abs(kl_shift) > 100 * tol
        print(f"{loss_type}: vLLM importance sampling ratio {list(shape)}: largest |TRL - ours|: loss "
              f"{loss_diff:.2e}, gradients {grad_diff:.2e}; without the ratio the loss moves by "
              f"{abs(loss_off - loss_t):.2e}")


def test_trl_baseline_is_deterministic(tiny_model, tmp_path):
    """The comparison's premise: two identical TRL runs give the same bits (seeded sampling, CPU, fp32)."""
    a, b = (train(tiny_model, tmp_path / name, trl.GRPOTrainer, loss_type="dapo", beta=0.04) for name in "ab")
    assert [{k: v for k, v in r.items() if k != "step_time"} for r in a[0]] == \
           [{k: v for k, v in r.items() if k != "step_time"} for r in b[0]]
    for pa, pb in zip(a[1], b[1]):
        assert all(torch.equal(pa[name], pb[name]) for name in pa)


def test_a_deferred_bad_value_raises_before_its_optimizer_step(tiny_model, tmp_path, monkeypatch):
    """On CUDA the loss defers its value checks (`pending`); the trainer reads them before each optimizer step. Here
    (the CPU's torch kernels check in the call) the third micro-batch's loss leaves a bad check pending, as a GPU call
    would: training stops before the second step's optimizer step, the first one taken."""
    from grpo_core import LossContractError, pending
    from grpo_core.integrations import trl as ours

    class Pending:  # a flag the GPU has not produced yet
        def query(self):
            return False

        def synchronize(self):
            pass

    def planted():
        raise LossContractError("advantages: planted")

    calls, result = [], ours.GRPOLinearLoss.result  # what the trainer calls, once a micro-batch

    def leaves_a_bad_check(self, *args, **kwargs):
        calls.append(len(calls) + 1)
        out = result(self, *args, **kwargs)
        if len(calls) == 3:
            pending._enqueue(pending._Check(0, "linear_grpo_loss (triton kernels)", torch.ones((), dtype=torch.int32),
                                            Pending(), planted))
        return out

    monkeypatch.setattr(ours.GRPOLinearLoss, "result", leaves_a_bad_check)
    monkeypatch.setattr(pending, "_local", type(pending._local)())  # this test's own queue, whatever happens
    trainer = make_trainer(tiny_model, tmp_path, GRPOCoreTrainer, loss_type="dapo", beta=0.0, max_steps=2)
    assert trainer.grpo_core_loss.check_values == "deferred"  # one process (`tests/trl_world.py`: two, "sync")
    steps = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    trainer.add_callback(Steps())
    with pytest.raises(LossContractError, match=r"^linear_grpo_loss \(triton kernels\) \(call #0, checked after it "
                                                r"returned\): advantages: planted$"):
        trainer.train()
    assert steps == [1] and calls == [1, 2, 3, 4]
    pending.raise_pending()  # nothing left


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="vespa"), "loss_type"),
    (dict(loss_type="vespo", delta=2.0), "delta"),
    (dict(importance_sampling_level="segment"), "importance_sampling_level"),
    (dict(loss_type="dr_grpo"), "max_completion_length"),
    (dict(loss_type="cispo", delta=2.0), "delta"),
    (dict(loss_type="sapo", delta=2.0), "delta"),
])
def test_linear_loss_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLinearLoss(**kwargs)


def test_linear_loss_cispo_and_sapo_on_policy():
    """No longer refused; on-policy (ratio 1) each has a closed form, in float64 here: cispo (Liger's default
    epsilon_high 0.2 clamps every ratio) `-sum(0.2 * A * logp) / active tokens`, its clip ratio the share of active
    tokens with A > 0; sapo `mean over sequences of -2 / tau * A` (a sequence without active tokens adds 0), tau
    the temperature of A's sign, its clip ratio 0."""
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 6, 5, 8, 16
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    ids, mask = torch.randint(0, V, (B, T), generator=g), torch.rand(B, T, generator=g) < 0.7
    mask[0] = False
    adv = torch.randn(B, generator=g)
    assert (adv > 0).any() and (adv < 0).any()
    logp = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, ids[..., None])[..., 0]
    a_tok = adv.double()[:, None].expand(B, T)[mask]
    loss, (clip,) = GRPOLinearLoss(beta=0.0, loss_type="cispo")(hidden, weight, ids, mask, adv)
    assert math.isclose(loss.item(), -(0.2 * a_tok * logp[mask]).sum().item() / mask.sum().item(), rel_tol=1e-5)
    assert clip.item() == (a_tok > 0).float().mean().item() > 0  # a count over the tokens, divided in fp32
    for pos, neg in [(1.0, 1.05), (0.5, 3.0)]:  # TRL's defaults, and others: they reach the loss
        loss, (clip,) = GRPOLinearLoss(beta=0.0, loss_type="sapo", sapo_temperature_pos=pos,
                                       sapo_temperature_neg=neg)(hidden, weight, ids, mask, adv)
        tau = torch.where(adv > 0, pos, neg).double()
        expected = torch.where(mask.any(-1), -2.0 / tau * adv.double(), 0.0).mean().item()
        assert math.isclose(loss.item(), expected, rel_tol=1e-5) and clip.item() == 0.0


def test_linear_loss_liger_interface():
    """Liger's metrics tuple: (kl, clip_ratio) with beta != 0, (clip_ratio,) without; the reference by its hidden
    states gives what its log-probs give; use_ref_model=False makes the KL zero; vllm_is_ratio weighs the surrogate
    term alone ([B, 1] as its [B, T] broadcast)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 4, 5, 8, 16
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    ids, mask = torch.randint(0, V, (B, T), generator=g), torch.rand(B, T, generator=g) < 0.8
    adv = torch.randn(B, generator=g)
    ref_hidden = hidden + 0.1 * torch.randn(B, T, H, generator=g)
    ref_logps = torch.log_softmax(ref_hidden @ weight.T, -1).gather(-1, ids[..., None])[..., 0]
    by_logps = GRPOLinearLoss(beta=0.04)(hidden, weight, ids, mask, adv, ref_per_token_logps=ref_logps)
    by_input = GRPOLinearLoss(beta=0.04)(hidden, weight, ids, mask, adv, ref_input=ref_hidden, ref_weight=weight)
    assert len(by_logps[1]) == 2 and by_logps[1][0] > 0
    assert math.isclose(by_logps[0].item(), by_input[0].item(), rel_tol=1e-5)
    assert math.isclose(by_logps[1][0].item(), by_input[1][0].item(), rel_tol=1e-5)
    loss, metrics = GRPOLinearLoss(beta=0.04, use_ref_model=False)(hidden, weight, ids, mask, adv)
    plain, plain_metrics = GRPOLinearLoss(beta=0.0)(hidden, weight, ids, mask, adv)
    assert metrics[0].item() == 0.0 and loss.item() == plain.item() and len(plain_metrics) == 1
    # Twice the ratio adds the surrogate term once more (the KL term unweighted), per sequence as per token
    per_seq = 0.5 + torch.rand(B, 1, generator=g)
    by_seq, by_tok, by_vec = (GRPOLinearLoss(beta=0.04)(hidden, weight, ids, mask, adv, ref_per_token_logps=ref_logps,
                                                        vllm_is_ratio=r)[0].item()
                              for r in (per_seq, per_seq.expand(B, T), per_seq[:, 0]))  # [B]: Liger's [B, 1]
    doubled = GRPOLinearLoss(beta=0.04)(hidden, weight, ids, mask, adv, ref_per_token_logps=ref_logps,
                                        vllm_is_ratio=2 * per_seq)[0].item()
    surrogate = GRPOLinearLoss(beta=0.0)(hidden, weight, ids, mask, adv, vllm_is_ratio=per_seq)[0].item()
    kl_term = 0.04 * by_logps[1][0].item()  # a ratio on it would add over half of it (the ratios are >= 0.5)
    assert abs(surrogate) > 1e-3 and kl_term > 1e-3 * abs(surrogate)  # not vacuous: neither term is negligible
    assert by_seq == by_tok == by_vec and math.isclose(doubled - by_seq, surrogate, rel_tol=1e-5)


def test_loss_module_imports_without_trl():
    """`GRPOLinearLoss` needs torch only: the module imports, and the loss runs, with TRL and transformers
    unimportable."""
    code = ("import sys; sys.modules.update(trl=None, transformers=None, accelerate=None)\n"
            "import torch; from grpo_core.integrations.trl import GRPOLinearLoss\n"
            "x = torch.randn(2, 3, 4, requires_grad=True)\n"
            "loss, m = GRPOLinearLoss(beta=0.0)(x, torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long),"
            " torch.ones(2, 3), torch.tensor([1.0, -1.0]))\n"
            "loss.backward(); assert x.grad is not None and m[0].item() >= 0.0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
