"""Exact on-policy (`grpo_core.exact`): under the mode the log-prob `generate` samples each token with is, bit for bit,
the one the trainer's forward and `linear_logprobs` give it; a row's completion and log-probs do not depend on the rows
beside it; what the mode does not cover is refused by name. Tiny Llama and Qwen2 models, the CPU forms."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,  # noqa: E402
                          Qwen2ForCausalLM)

from grpo_core.exact import exact_on_policy  # noqa: E402
from grpo_core.integrations.trl_run import SamplerLogps  # noqa: E402
from grpo_core.linear import linear_logprobs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
EOS, TEMPERATURE, NEW = 1, 0.8, 12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA the linear layers run on the Triton matmul


def tiny(kind: str, dtype: torch.dtype, hidden: int = 32, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = dict(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
              eos_token_id=EOS, bos_token_id=2, **extra)
    model = LlamaForCausalLM(LlamaConfig(**kw)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw))
    return model.to(DEVICE, dtype).eval()


def prompts(B: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`B` left-padded prompts of 3 to 8 tokens."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 9, (B,), generator=gen).tolist()
    ids, mask = torch.zeros(B, max(lens), dtype=torch.long), torch.zeros(B, max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, -n:], mask[i, -n:] = torch.randint(3, 96, (n,), generator=gen), 1
    return ids.to(DEVICE), mask.to(DEVICE)


def completion_mask(completions: torch.Tensor) -> torch.Tensor:
    """Every token up to and including the first EOS (TRL's)."""
    eos = (completions == EOS).int()
    return (eos.cumsum(1) - eos) == 0


def trainer_logps(model, ids, mask, completions) -> torch.Tensor:
    """The trainer's log-probs of `completions`: the backbone over prompt + completion (no position ids given, as
    TRL's forward), then `linear_logprobs` at the sampling temperature; 0.0 past each completion's end."""
    cm = completion_mask(completions)
    with torch.no_grad():
        h = model.model(input_ids=torch.cat([ids, completions], 1),
                        attention_mask=torch.cat([mask, cm.long()], 1)).last_hidden_state
    T = completions.shape[1]
    return linear_logprobs(h[:, -T - 1:-1], model.lm_head.weight, completions, cm, temperature=TEMPERATURE)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def generate(model, ids, mask, use_cache=True, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True,
                          temperature=TEMPERATURE, top_k=0, use_cache=use_cache, **kw)[:, ids.shape[1]:]


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "no_cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_samplers_logprobs_are_the_trainers_bit_for_bit(kind, dtype, use_cache):
    """16 ragged prompts, 12 sampled tokens each: every sampled token's log-prob, as the sampler drew it, has the bits
    the trainer's forward gives it. Without the mode, transformers' sampler and the same trainer disagree (the
    vacuity guard: bf16, most tokens)."""
    model = tiny(kind, dtype)
    ids, mask = prompts(16)
    with exact_on_policy(model, seed=3) as mode:
        completions = generate(model, ids, mask, use_cache)
        sampler = mode.logps
        trainer = trainer_logps(model, ids, mask, completions)
    cm = completion_mask(completions)
    assert cm.sum() >= 100 and sampler.shape == completions.shape
    assert torch.equal(bits(sampler.masked_fill(~cm, 0.0)), bits(trainer))
    if dtype == torch.bfloat16 and use_cache:
        hf = SamplerLogps(model, TEMPERATURE)
        with hf.capture():
            completions = generate(model, ids, mask)
        got = torch.nn.utils.rnn.pad_sequence(
            [torch.from_numpy(r) for r in hf.of([c.tolist() for c in completions])], batch_first=True).to(DEVICE)
        cm = completion_mask(completions)
        with exact_on_policy(model):
            trainer = trainer_logps(model, ids, mask, completions)
        assert ((bits(got.masked_fill(~cm, 0.0)) != bits(trainer)) & cm).sum() > cm.sum() // 2


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_row_alone_is_the_row_in_a_batch(kind):
    """The sampler is keyed by the prompt: a prompt generated alone (no padding, one row) gives the tokens and
    log-prob bits it gets among 16 ragged rows, and the trainer's forward of it alone gives them too. (Fails with
    the linear layers on `F.linear`, or with the attention's keys not moved past the padding: fp32, hidden 128.)"""
    model = tiny(kind, torch.float32, hidden=128)
    ids, mask = prompts(16)
    with exact_on_policy(model, seed=5) as mode:
        batch = generate(model, ids, mask)
        batch_logps = mode.logps
        for row in (3, 7):
            n = int(mask[row].sum())
            alone = generate(model, ids[row:row + 1, -n:], mask[row:row + 1, -n:])
            t = alone.shape[1]  # shorter when it ended (EOS): the batch's row is padding after that
            assert torch.equal(alone[0], batch[row, :t]) and (batch[row, t:] == 0).all()
            assert torch.equal(bits(mode.logps[0]), bits(batch_logps[row, :t]))
            cm = completion_mask(alone)
            trained = trainer_logps(model, ids[row:row + 1, -n:], mask[row:row + 1, -n:], alone)
            assert torch.equal(bits(trained), bits(batch_logps[row:row + 1, :t].masked_fill(~cm, 0.0)))


def test_keys_seed_and_greedy():
    """Explicit keys choose the draws: two rows of one prompt with different keys sample differently, the same key
    the same; another seed other completions; `do_sample=False` takes the trainer's argmax."""
    model = tiny("llama", torch.float32)
    ids, mask = prompts(1)
    ids, mask = ids.repeat(3, 1), mask.repeat(3, 1)
    with exact_on_policy(model, seed=0) as mode:
        mode.keys = torch.tensor([7, 7, 8], device=DEVICE)
        out = generate(model, ids, mask)
        assert torch.equal(out[0], out[1]) and not torch.equal(out[0], out[2])
        default = generate(model, ids, mask)  # default keys: the occurrence of the prompt among the rows
        assert not torch.equal(default[0], default[1])
        greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
        assert torch.equal(greedy[:, ids.shape[1]], (h @ model.lm_head.weight.T).argmax(-1))
        assert torch.equal(greedy[0], greedy[1])
    with exact_on_policy(model, seed=1):
        assert not torch.equal(generate(model, ids, mask), default)


def test_the_mode_leaves_the_model_as_it_was():
    """After the block the model's forward gives its own bits again, `generate` is transformers' and a module's own
    forward (TRL's fp32 LM head sets one) is back; a second mode on the model is refused while the first is on."""
    model = tiny("qwen2", torch.float32)
    ids, mask = prompts(4)
    own = model.lm_head.forward = functools.partial(torch.nn.Linear.forward, model.lm_head)
    before = model(input_ids=ids, attention_mask=mask).logits
    with exact_on_policy(model):
        with pytest.raises(ValueError, match="model: expected a model without an exact mode"):
            exact_on_policy(model).__enter__()
        inside = model(input_ids=ids, attention_mask=mask).logits
        assert "generate" in model.__dict__ and model.config._attn_implementation == "grpo_core_exact"
    after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(bits(before), bits(after)) and not torch.equal(bits(before), bits(inside))
    assert "generate" not in model.__dict__ and model.lm_head.forward is own
    assert not any("forward" in m.__dict__ for m in model.modules() if m is not model.lm_head)


def test_training_under_the_mode():
    """With gradients on, the forward keeps the mode's bits, and the gradients are those of the model's own formulas
    (to rounding)."""
    model = tiny("llama", torch.float32)
    ids, mask = prompts(4)
    plain = model(input_ids=ids, attention_mask=mask).logits
    plain.square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with exact_on_policy(model):
        with torch.no_grad():
            frozen = model(input_ids=ids, attention_mask=mask).logits
        logits = model(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(bits(frozen), bits(logits))
        logits.square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def refused(make, match: str, **generate_kw) -> None:
    with pytest.raises(ValueError, match=match):
        model = make()
        with exact_on_policy(model):
            generate(model, *prompts(2), **generate_kw)


def test_what_the_mode_does_not_cover_is_refused_by_name():
    refused(lambda: GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96)),
            r"model: the exact mode covers llama, qwen2, qwen3 causal LMs .* got GPT2LMHeadModel")
    refused(lambda: tiny("llama", torch.float32, hidden_act="gelu"), "hidden_act: .* got 'gelu'")
    refused(lambda: tiny("qwen2", torch.float32, use_sliding_window=True, sliding_window=4, max_window_layers=0),
            "layer_types: .* sliding-window")
    refused(lambda: tiny("llama", torch.float32, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0}),
            "model.rotary_emb: .* got rope_type 'dynamic'")

    def foreign():
        model = tiny("llama", torch.float32)
        model.model.layers[1].mlp.act_fn = torch.nn.GELU()
        return model
    refused(foreign, r"model.layers.1.mlp.act_fn: the exact mode does not cover a GELU module")
    model = functools.partial(tiny, "llama", torch.float32)
    for name, value in (("top_p", 0.9), ("repetition_penalty", 1.1), ("min_new_tokens", 2), ("num_beams", 2)):
        with pytest.raises(ValueError, match=f"{name}: the exact mode samples the whole"):
            m = model()
            with exact_on_policy(m):
                m.generate(input_ids=prompts(2)[0], max_new_tokens=2, do_sample=True, **{name: value})
    with pytest.raises(ValueError, match="top_k: .* got 50"):
        m = model()
        with exact_on_policy(m):
            m.generate(input_ids=prompts(2)[0], max_new_tokens=2, do_sample=True, top_k=50)
    m = model()
    ids, mask = prompts(2)
    with exact_on_policy(m) as mode:
        for kw, match in (({"num_return_sequences": 2}, "num_return_sequences: .* got 2"),
                          ({"temperature": 0.0}, "temperature: expected"),
                          ({"max_new_tokens": 130}, "max_new_tokens: a prompt of 8 tokens and 130 new ones need "
                                                    "137 positions, more than the model's max_position_embeddings"),
                          ({}, r"keys: expected an int64 tensor \[2\] \(one per row\), got list")):
            mode.keys = [1, 2] if not kw else torch.tensor([7, 7], device=DEVICE)
            with pytest.raises(ValueError, match=match):
                m.generate(input_ids=ids, attention_mask=mask, do_sample=True, **{"max_new_tokens": 2, **kw})
            assert mode.keys is None  # a refused call's keys are not the next call's


def test_the_noise_is_gumbel_to_its_tails():
    """The noise's mean and variance are the standard Gumbel's (Euler's constant, pi^2 / 6), and the exponential
    under it takes a uniform with a floating exponent: the smallest hashes give noise past 44 (a 23-bit uniform stops
    at 16.6, so that a token more than about 17 below the best logit would never be drawn)."""
    from grpo_core.exact import _exponential, gumbel
    g = gumbel(3, torch.arange(64, device=DEVICE), 5, 1 << 14).double()
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - 1.6449) < 0.03
    zero = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert -torch.log(_exponential(zero, zero, zero)).item() > 44.0
    assert 0.69 < _exponential(zero, zero + (1 << 31), zero).item() < 16.7  # w in [1/2, 1)


def test_the_trainer_exactly_on_policy(tmp_path, tmp_path_factory):
    """`GRPOCoreTrainer(exact_on_policy=True)` (4 steps, two generations, the tests' TRL run, beta 0.04): every
    completion token's sampler log-prob has the trainer's bits, the logged difference is 0.0, `harness diff` says 0
    tokens with other bits and a KL of 0; the reference model (identical weights at step 1) gives the policy's bits
    too; a sampling setting the mode cannot honour is refused before training."""
    pytest.importorskip("trl")
    from test_trl import tiny_model
    from test_trl_record import harness_diff, recorded

    from grpo_core.integrations.trl import GRPOCoreTrainer
    from grpo_core.rollouts import read_rollouts
    from harness.training import sampler_mismatch

    path = tiny_model.__wrapped__(tmp_path_factory)
    seen = []

    class Watch(GRPOCoreTrainer):
        def _grpo_core_loss(self, unwrapped, inputs, num_items, entropy_coef):
            if self.state.global_step == 0:
                mask = inputs["completion_mask"].bool()
                seen.append((inputs["ref_per_token_logps"][mask], inputs["old_per_token_logps"][mask]))
            return super()._grpo_core_loss(unwrapped, inputs, num_items, entropy_coef)

    exact = functools.partial(GRPOCoreTrainer, exact_on_policy=True, record_sampler=True)
    a, logs = recorded(path, tmp_path / "a", functools.partial(Watch, exact_on_policy=True, record_sampler=True))
    assert len(seen) == 2 and all(torch.equal(bits(ref), bits(old)) for ref, old in seen)
    st = sampler_mismatch(read_rollouts(a))["steps"]
    assert st["tokens"].sum() >= 40 and st["other_bits"].sum() == 0 and st["max_abs_delta"].max() == 0.0
    assert (st["k3_kl"] == 0.0).all() and (st["min_ratio"] == 1.0).all() and (st["max_ratio"] == 1.0).all()
    assert [r["sampling/sampling_logp_difference/max"] for r in logs if "sampling/sampling_logp_difference/max" in r]
    assert all(r.get("sampling/sampling_logp_difference/max", 0.0) == 0.0 for r in logs)
    b, _ = recorded(path, tmp_path / "b", exact)
    proc = harness_diff(a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sampler vs trainer, A: 0 of" in proc.stdout and "k3 KL 0;" in proc.stdout
    with pytest.raises(ValueError, match="top_p: the exact mode samples the whole"):
        recorded(path, tmp_path / "c", exact, top_p=0.9)
