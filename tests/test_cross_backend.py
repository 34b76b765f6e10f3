"""Every backend agrees, or raises the same error: a property test over shapes, dtypes, layouts, masks, options
(those added for migration too: temperature, given advantages, the reference as given log-probs, TRL's loss types
and std) and a sprinkling of bad values.

For each draw, the native op, the fast Triton op and the deterministic path at 1x1 (torch kernels, and Triton
kernels) either all raise `LossContractError` with the same message, or all return results within the dtype's
tolerance of the native op. CI runs a fixed budget (Triton under the interpreter); `GRPO_PROPERTY_EXAMPLES` raises
it (the GPU run uses 200). A failing draw becomes a regular test below."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import HAS_CUDA, assert_close_verbose, make_inputs
from grpo_core import GRPOLossContract, LossContractError, kernel_registry
from grpo_core.contract import inverse_temperature
from grpo_core.native.ratio_kl import selected_logprobs
from grpo_core.distributed import DistributedGRPOLossOp

DEV = "cuda" if HAS_CUDA else "cpu"
EXAMPLES = int(os.environ.get("GRPO_PROPERTY_EXAMPLES", 200 if HAS_CUDA else 20))
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
BAD = ["id_high", "id_negative", "old_nan", "reward_inf", "mask_two", "logit_nan", "logit_inf", "action_minus_inf",
       "ref_nan", "advantage_nan", "ref_logps_nan"]
native = kernel_registry.get_op("grpo_loss", backend="native")
fast = kernel_registry.get_op("grpo_loss", backend="triton")


def relayout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values in another memory layout."""
    if kind == "transposed":
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if kind == "sliced":
        return torch.cat([t, torch.zeros_like(t)], -1)[..., :t.shape[-1]]
    if kind == "offset":
        return torch.cat([torch.zeros(1, dtype=t.dtype, device=t.device), t.reshape(-1)])[1:].view(t.shape)
    return t


def case(draw) -> tuple[dict, dict, str | None]:
    groups = draw(st.sampled_from([(1, "none"), (2, "population"), (3, "unbiased"), (2, "unbiased_eps"),
                                   ("csr", "population"), ("csr", "none"), ("given", "sequence"), ("given", "token")]))
    T, V = draw(st.sampled_from([1, 2, 5])), draw(st.sampled_from([1, 3, 17, 130]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    B = 6
    inp = make_inputs(B, T, V, seed=draw(st.integers(0, 10**6)), dtype=dtype, active=draw(st.sampled_from([0.3, 0.9])),
                      wide=draw(st.booleans()), empty_rows=draw(st.sampled_from([(), (1,), (0, 5)])), device=DEV)
    opts = dict(beta=draw(st.sampled_from([0.0, 0.04])), clip_eps=0.2,
                clip_eps_high=draw(st.sampled_from([0.2, 0.28])),
                normalizer=draw(st.sampled_from(["global_active_tokens", "per_sequence_then_mean", "fixed_constant",
                                                 "per_sequence_then_batch_mean", "sequences_times_max_length",
                                                 "sequence_sums_then_batch_mean"])),
                advantage_std=groups[1], temperature=draw(st.sampled_from([1.0, 0.7])))
    opts["normalizer_constant"] = 9.0 if opts["normalizer"] == "fixed_constant" else None
    opts["max_completion_length"] = 7 if opts["normalizer"] == "sequences_times_max_length" else None
    opts.update(group_boundaries=(0, 2, 6) if groups[0] == "csr" else None,
                samples_per_prompt=None if groups[0] in ("csr", "given") else groups[0])
    if groups[0] == "given":  # advantages computed elsewhere, [B] or [B, T]: no rewards, no group options
        opts["advantage_std"] = inp["rewards"] = None
        shape = (B, T) if groups[1] == "token" else (B,)
        inp["advantages"] = torch.randn(shape, generator=torch.Generator().manual_seed(T * V)).to(DEV)
    if opts["beta"] == 0.0 and draw(st.booleans()):
        inp["ref_logits"] = None
    elif draw(st.booleans()):  # the reference as given log-probs (`ref_logps`), its logits never passed
        inp["ref_logps"] = selected_logprobs(inp["ref_logits"], inp["action_ids"], inp["completion_mask"].bool(),
                                             inverse_temperature(opts["temperature"]))
        inp["ref_logits"] = None
    for name in ("policy_logits", "action_ids", "old_logps", "rewards", "advantages", "completion_mask", "ref_logps"):
        if inp.get(name) is not None:
            inp[name] = relayout(inp[name], draw(st.sampled_from(["dense", "transposed", "sliced", "offset"])))
    bad = draw(st.sampled_from([None] * 4 + BAD))
    active = inp["completion_mask"].nonzero()
    if bad is not None and len(active):
        b, t = active[draw(st.integers(0, len(active) - 1))].tolist()
        if bad == "id_high":
            inp["action_ids"][b, t] = V
        elif bad == "id_negative":
            inp["action_ids"][b, t] = -1
        elif bad == "old_nan":
            inp["old_logps"][b, t] = float("nan")
        elif bad == "reward_inf" and inp["rewards"] is not None:
            inp["rewards"][b] = float("inf")
        elif bad == "advantage_nan" and "advantages" in inp:
            inp["advantages"][(b, t) if inp["advantages"].dim() == 2 else b] = float("nan")
        elif bad == "mask_two":
            inp["completion_mask"] = inp["completion_mask"].to(torch.int32)
            inp["completion_mask"][b, t] = 2
        elif bad in ("logit_nan", "logit_inf"):
            inp["policy_logits"][b, t, draw(st.integers(0, V - 1))] = float("nan" if bad == "logit_nan" else "inf")
        elif bad == "action_minus_inf":
            inp["policy_logits"][b, t, inp["action_ids"][b, t]] = float("-inf")
        elif bad == "ref_nan" and inp["ref_logits"] is not None:
            inp["ref_logits"][b, t, 0] = float("nan")
        elif bad == "ref_logps_nan" and inp.get("ref_logps") is not None:
            inp["ref_logps"][b, t] = float("nan")
    return inp, opts, bad


def run_all(inp: dict, opts: dict) -> dict[str, tuple | str]:
    """Each backend's `(loss, policy_loss, kl, grad)` or its LossContractError message."""
    B, T, V = inp["policy_logits"].shape
    given = inp.get("advantages")

    def contract() -> GRPOLossContract:
        kind = "rewards" if given is None else ("token" if given.dim() == 2 else "sequence")
        return GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, advantages_input=kind,
                                determinism_scope="topology_invariant",
                                **{k: v for k, v in opts.items() if v is not None})

    calls = {
        "native": lambda call: tuple(native(**call, **opts)),
        "triton": lambda call: tuple(fast(**call, **opts, check_values="sync")),
    }
    for kernels in ("torch", "triton"):
        op = DistributedGRPOLossOp(kernels=kernels)
        calls[f"deterministic_{kernels}"] = lambda call, op=op: tuple(op.apply(
            call["policy_logits"], call["action_ids"], call["old_logps"], call["rewards"], contract=contract(),
            completion_mask=call["completion_mask"], ref_local_logits=call["ref_logits"], check_values="sync",
            advantages=call.get("advantages"), ref_logps=call.get("ref_logps")))
    out = {}
    for name, fn in calls.items():
        x = inp["policy_logits"].detach().clone().requires_grad_(True)
        try:
            loss, pol, kl = fn({**inp, "policy_logits": x})
            loss.backward()
            out[name] = (loss.detach(), pol, kl, x.grad)
        except LossContractError as exc:
            out[name] = str(exc)
    return out


def check(inp: dict, opts: dict, bad: str | None) -> None:
    out = run_all(inp, opts)
    errors = {k: v for k, v in out.items() if isinstance(v, str)}
    if errors:
        assert len(errors) == len(out), f"{bad}: only {sorted(errors)} raised: {errors}"
        assert len(set(errors.values())) == 1, f"{bad}: different messages: {errors}"
        return
    atol, rtol = TOL[inp["policy_logits"].dtype]
    want = out["native"]
    for name, got in out.items():
        for what, a, b in zip(("loss", "policy_loss", "kl", "grad"), got, want):
            assert_close_verbose(a.float(), b.float(), atol=atol, rtol=rtol, what=f"{name} {what} ({bad})")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_backends_agree_or_raise_the_same_error(data):
    check(*case(data.draw))


# --- regular tests: inputs each backend once answered differently (issue 23) ----------------------------------------

def errors_of(inp: dict, opts: dict) -> set[str]:
    """The one message every backend raised (asserts each raised `LossContractError`)."""
    out = run_all(inp, opts)
    assert all(isinstance(v, str) for v in out.values()), {k: v for k, v in out.items() if not isinstance(v, str)}
    assert len(set(out.values())) == 1, out
    return set(out.values())


@pytest.mark.parametrize("length,shown", [(2**127, "about 1.7e+38"), (2**200, "about 1.61e+60"),
                                          (2**1100, "an int of 1101 bits")], ids=["2**127", "2**200", "2**1100"])
def test_a_dr_grpo_length_that_float32_cannot_hold_is_refused_in_the_same_words(length, shown):
    """dr_grpo divides by fp32(B * max_completion_length): 4 * 2**127 overflows it, as do 2**200 (a RuntimeError on
    native, a loss of 0.0 on Triton) and 2**1100 (an OverflowError)."""
    inp = make_inputs(4, 3, 17, seed=1, device=DEV)
    opts = dict(beta=0.04, samples_per_prompt=2, loss_type="dr_grpo", max_completion_length=length)
    assert errors_of(inp, opts) == {
        "max_completion_length: expected an int whose product with the number of sequences (4) is finite in float32 "
        f"(at most 3.4028234663852886e+38; the loss divides by it), got {shown}"}
    check(inp, {**opts, "max_completion_length": 2**100}, None)  # 4 * 2**100 is finite: every backend agrees


@pytest.mark.parametrize("std,rewards", [("population", [3e38, -3e38]), ("unbiased_eps", [3e38, -3e38]),
                                         ("unbiased", [-3e38, 3e38]), ("none", [3e38, 3e38])])
@pytest.mark.parametrize("groups", ["uniform", "csr"])
def test_rewards_whose_group_statistics_overflow_are_refused_in_the_same_words(std, rewards, groups):
    """Finite fp32 rewards whose group variance (or, without a std, sum) overflows: native gave NaN and the fast
    Triton op a finite loss; the distributed op's error is every backend's now."""
    inp = make_inputs(4, 3, 17, seed=1, device=DEV)
    inp["rewards"] = torch.tensor(rewards + [0.5, -1.0], device=DEV)
    opts = dict(beta=0.04, advantage_std=std, **({"samples_per_prompt": 2} if groups == "uniform" else
                                                 {"group_boundaries": (0, 2, 4)}))
    assert errors_of(inp, opts) == {"rewards: the advantages of sequences [0, 1] are not finite: the sum or the "
                                    "variance of their group's rewards overflows float32 (|reward| up to 3e+38); "
                                    "scale the rewards down"}
    inp["rewards"] = torch.tensor([3e18, -3e18, 0.5, -1.0], device=DEV)  # large, but the variance is finite
    check(inp, opts, None)


@pytest.mark.parametrize("shape", ["sequence", "token"])
def test_a_loss_that_overflows_float32_is_refused_in_the_same_words(shape):
    """Finite given advantages of 3e38: the policy terms overflow, and every backend returned -inf or NaN with no
    error; each raises the same `LossContractError` now, and a large advantage whose loss stays finite still runs."""
    inp = make_inputs(4, 3, 17, seed=1, device=DEV)
    inp["rewards"] = None
    inp["advantages"] = torch.full((4, 3) if shape == "token" else (4,), 3e38, device=DEV)
    assert errors_of(inp, dict(beta=0.04)) == {
        "loss: expected a finite float32 loss from finite inputs, got a non-finite one: an advantage times a ratio, "
        "a KL term, or a sum of them overflows float32; scale the rewards or advantages down"}
    inp["advantages"] = torch.full_like(inp["advantages"], 1e30)
    check(inp, dict(beta=0.04), None)


def test_a_nan_beta_is_named_without_an_upper_bound():
    inp = make_inputs(4, 3, 17, seed=1, device=DEV)
    assert errors_of(inp, dict(beta=float("nan"), samples_per_prompt=2)) == {
        "beta: expected a finite float >= 0.0, got nan"}
