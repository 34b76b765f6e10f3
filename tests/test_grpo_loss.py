"""The native reference op against an independent float64 oracle, plus invariances and registry dispatch."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_bitwise_equal, assert_close_verbose, case_seed, make_inputs
from grpo_core import BackendUnavailableError, GRPOLossContract, LossContractError, kernel_registry
from grpo_core.native import NativeGRPOLossOp

native = kernel_registry.get_op("grpo_loss", backend="native")


def oracle(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, *, clip_eps, clip_eps_high,
           beta, groups=None, normalizer, constant=None, std="population", temperature=1.0, advantages=None,
           metrics=False):
    """GRPO written out in float64 with plain loops; shares no code with grpo_core. `advantages` (given, `[B]` or
    `[B, T]`) replace the rewards; `temperature` divides the logits; `constant` is dr_grpo's max length for
    'sequences_times_max_length'. `metrics=True` also returns TRL's clip fraction, the mean ratio and the KL's
    token mean."""
    x = policy_logits.detach().double().requires_grad_(True)
    B, T, V = x.shape
    mask = completion_mask.bool()
    z = x / temperature
    lse = z.max(-1, keepdim=True).values
    logp_all = z - (lse + (z - lse).exp().sum(-1, keepdim=True).log())
    logp = logp_all.gather(-1, action_ids[..., None])[..., 0]
    r = ref_logits.double() / temperature if ref_logits is not None else None
    adv = torch.zeros(B, T, dtype=torch.float64)
    if advantages is not None:
        adv[:] = advantages.double() if advantages.dim() == 2 else advantages.double()[:, None]
    else:
        for a, b in zip(groups[:-1], groups[1:]):
            g = rewards[a:b].double()
            mean = g.sum() / len(g)
            if std == "none":
                adv[a:b] = (g - mean)[:, None]
            elif std == "unbiased_eps":  # TRL: Bessel std + 1e-4, no floor
                adv[a:b] = ((g - mean) / (math.sqrt(((g - mean) ** 2).sum() / (len(g) - 1)) + 1e-4))[:, None]
            else:
                var = ((g - mean) ** 2).sum() / (len(g) - (1 if std == "unbiased" else 0))
                adv[a:b] = ((g - mean) / max(math.sqrt(var), 1e-6))[:, None]
    pol_tok = torch.zeros(B, T, dtype=torch.float64)
    kl_tok = torch.zeros(B, T, dtype=torch.float64)
    clipped_tokens, ratio_sum = 0, 0.0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            ratio = torch.exp(logp[i, t] - old_logps[i, t].double())
            unclipped, clipped = ratio * adv[i, t], ratio.clamp(1 - clip_eps, 1 + clip_eps_high) * adv[i, t]
            pol_tok[i, t] = -(unclipped if unclipped <= clipped else clipped)
            ratio_sum += ratio.item()
            clipped_tokens += bool((ratio < 1 - clip_eps and adv[i, t] < 0) or (ratio > 1 + clip_eps_high
                                                                               and adv[i, t] > 0))
            if r is not None:
                lr = r[i, t] - torch.logsumexp(r[i, t], 0)
                d = lr[action_ids[i, t]] - logp[i, t]
                kl_tok[i, t] = d.exp() - d - 1
    counts = mask.sum(-1)

    def norm(tok):
        if normalizer == "global_active_tokens":
            return tok.sum() / max(int(counts.sum()), 1)
        if normalizer in ("per_sequence_then_mean", "per_sequence_then_batch_mean"):
            seqs = [tok[i].sum() / counts[i] for i in range(B) if counts[i] > 0]
            total = sum(seqs) if seqs else torch.zeros((), dtype=torch.float64)
            return total / (B if normalizer == "per_sequence_then_batch_mean" else max(len(seqs), 1))
        if normalizer == "sequences_times_max_length":
            return tok.sum() / (B * constant)
        if normalizer == "sequence_sums_then_batch_mean":
            return tok.sum() / B
        return tok.sum() / constant

    policy_loss, kl = norm(pol_tok), norm(kl_tok)
    loss = policy_loss + beta * kl + 0.0 * x.sum()  # keeps a graph when no token is active
    loss.backward()
    out = (loss.detach(), policy_loss.detach(), kl.detach(), x.grad, pol_tok.sum(-1).detach(), adv[:, 0])
    if metrics:
        n = max(int(counts.sum()), 1)
        out += (clipped_tokens / n, ratio_sum / n, kl_tok.sum().item() / n)
    return out


GROUPINGS = {"uniform4": dict(samples_per_prompt=4), "csr": dict(group_boundaries=[0, 3, 5, 8])}
NORMALIZERS = [("global_active_tokens", None), ("per_sequence_then_mean", None), ("fixed_constant", 64.0)]


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("normalizer,constant", NORMALIZERS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
def test_native_matches_float64_oracle(grouping, normalizer, constant, beta, clip):
    inp = make_inputs(8, 6, 37, seed=case_seed(grouping, normalizer, beta, clip), empty_rows=(2,))
    groups = list(range(0, 9, 4)) if grouping == "uniform4" else GROUPINGS["csr"]["group_boundaries"]
    exp_loss, exp_pol, exp_kl, exp_grad, _, _ = oracle(**inp, clip_eps=clip[0], clip_eps_high=clip[1], beta=beta,
                                                       groups=groups, normalizer=normalizer, constant=constant)
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss, pol, kl = native(**{**inp, "policy_logits": x}, clip_eps=clip[0], clip_eps_high=clip[1], beta=beta,
                           normalizer=normalizer, normalizer_constant=constant, **GROUPINGS[grouping])
    loss.backward()
    assert loss.dtype == pol.dtype == kl.dtype == torch.float32
    assert not pol.requires_grad and not kl.requires_grad
    for name, got, want in (("loss", loss, exp_loss), ("policy_loss", pol, exp_pol), ("kl", kl, exp_kl)):
        assert_close_verbose(got, want, atol=1e-5, rtol=1e-4, what=name)
    assert_close_verbose(x.grad, exp_grad, atol=1e-6, rtol=1e-4, what="grad")
    assert bool((x.grad[2] == 0).all())  # the empty sequence


@pytest.mark.parametrize("std", ["population", "unbiased", "none"])
def test_contract_path_vectors_match_oracle(std):
    from grpo_core import GRPOLossContract
    inp = make_inputs(6, 5, 19, seed=3)
    groups = [0, 2, 6]
    contract = GRPOLossContract(num_sequences=6, padded_seq_len=5, vocab_size=19, beta=0.1, group_boundaries=groups,
                                advantage_std=std)
    dispatched = kernel_registry.get_loss_op(contract)
    assert dispatched.backend == "native"
    res = dispatched.op.apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], inp["rewards"],
                              contract=contract, completion_mask=inp["completion_mask"],
                              ref_local_logits=inp["ref_logits"])
    exp = oracle(**inp, clip_eps=0.2, clip_eps_high=0.2, beta=0.1, groups=groups, normalizer="global_active_tokens",
                 std=std)
    assert_close_verbose(res.per_sequence_policy, exp[4], atol=1e-5, rtol=1e-4, what="per_sequence_policy")
    assert_close_verbose(res.advantages, exp[5], atol=1e-5, rtol=1e-5, what="advantages")
    assert res.per_sequence_active_tokens.tolist() == inp["completion_mask"].sum(-1).tolist()
    loss, pol, kl = res
    assert_close_verbose(loss, exp[0], atol=1e-5, rtol=1e-4, what="loss")
    assert res.provenance["backend"] == "native" and res.provenance["fingerprint"] == contract.fingerprint()


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_logits_compute_in_fp32(dtype, atol):
    inp = make_inputs(4, 5, 33, seed=5, dtype=dtype)
    loss, _, _ = native(**inp, samples_per_prompt=2)
    ref, _, _ = native(**{**inp, "policy_logits": inp["policy_logits"].float(),
                          "ref_logits": inp["ref_logits"].float()}, samples_per_prompt=2)
    assert loss.dtype == torch.float32
    assert_close_verbose(loss, ref, atol=0, rtol=0, what="same upcast values, same fp32 math")
    x = inp["policy_logits"].clone().requires_grad_(True)
    native(**{**inp, "policy_logits": x}, samples_per_prompt=2)[0].backward()
    assert x.grad.dtype == dtype


def test_masked_tokens_do_not_matter():
    inp = make_inputs(4, 7, 23, seed=7)
    mask = inp["completion_mask"]
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss, pol, kl = native(**{**inp, "policy_logits": x}, samples_per_prompt=2)
    loss.backward()
    assert bool((x.grad[~mask] == 0).all()) and (x.grad[~mask].view(torch.int32) == 0).all()
    noisy = dict(inp)
    junk = torch.full_like(inp["policy_logits"], float("nan"))
    noisy["policy_logits"] = torch.where(mask[..., None], inp["policy_logits"], junk)
    noisy["ref_logits"] = torch.where(mask[..., None], inp["ref_logits"], torch.full_like(junk, float("inf")))
    noisy["action_ids"] = torch.where(mask, inp["action_ids"], torch.full_like(inp["action_ids"], -100))
    noisy["old_logps"] = torch.where(mask, inp["old_logps"], torch.full_like(inp["old_logps"], float("nan")))
    y = noisy["policy_logits"].clone().requires_grad_(True)
    loss2, pol2, kl2 = native(**{**noisy, "policy_logits": y}, samples_per_prompt=2)
    loss2.backward()
    for name, a, b in (("loss", loss, loss2), ("policy", pol, pol2), ("kl", kl, kl2), ("grad", x.grad, y.grad)):
        assert_bitwise_equal(a, b, name)


def test_sgd_step_lowers_the_loss():
    inp = make_inputs(8, 6, 29, seed=11)
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss, _, _ = native(**{**inp, "policy_logits": x}, samples_per_prompt=4)
    loss.backward()
    with torch.no_grad():
        stepped = x - 0.5 * x.grad / x.grad.norm()
    after, _, _ = native(**{**inp, "policy_logits": stepped}, samples_per_prompt=4)
    assert after.item() < loss.item()


def test_batch_without_active_tokens_gives_zero_not_nan():
    for normalizer, constant in NORMALIZERS:
        inp = make_inputs(4, 3, 11, seed=2)
        inp["completion_mask"] = torch.zeros_like(inp["completion_mask"])
        x = inp["policy_logits"].clone().requires_grad_(True)
        loss, pol, kl = native(**{**inp, "policy_logits": x}, samples_per_prompt=2, normalizer=normalizer,
                               normalizer_constant=constant)
        loss.backward()
        assert loss.item() == 0.0 and pol.item() == 0.0 and kl.item() == 0.0
        assert bool((x.grad == 0).all())


def test_ratio_kl_op():
    inp = make_inputs(3, 4, 17, seed=4)
    ratio, kl = kernel_registry.get_op("ratio_kl")(inp["policy_logits"], inp["ref_logits"], inp["action_ids"],
                                                   inp["completion_mask"], inp["old_logps"])
    mask = inp["completion_mask"]
    assert ratio.shape == kl.shape == (3, 4) and ratio.dtype == kl.dtype == torch.float32
    assert bool((ratio[~mask] == 1).all()) and bool((kl[~mask] == 0).all())
    logp = torch.log_softmax(inp["policy_logits"].double(), -1).gather(-1, inp["action_ids"][..., None])[..., 0]
    lref = torch.log_softmax(inp["ref_logits"].double(), -1).gather(-1, inp["action_ids"][..., None])[..., 0]
    d = lref - logp
    assert_close_verbose(ratio[mask], (logp - inp["old_logps"].double()).exp()[mask], atol=1e-6, rtol=1e-5, what="r")
    assert_close_verbose(kl[mask], (d.exp() - d - 1)[mask], atol=1e-6, rtol=1e-5, what="kl")
    assert bool((kl >= 0).all())


def test_registry_dispatch():
    auto = kernel_registry.get_op("grpo_loss")
    inp = make_inputs(4, 3, 11, seed=1)
    loss_auto = auto(**inp, samples_per_prompt=2)[0]
    assert auto.last_backend == "native"  # CPU tensors: triton is never chosen
    assert_bitwise_equal(loss_auto, native(**inp, samples_per_prompt=2)[0], "auto vs explicit native")
    with pytest.raises(BackendUnavailableError, match="expected one of"):
        kernel_registry.get_op("grpo_loss", backend="no-such-backend")
    with pytest.raises(KeyError, match="name: expected one of"):
        kernel_registry.get_op("no_such_op")
    assert "native" in kernel_registry.backends("grpo_loss")


def test_registry_explicit_backend_raises_with_reasons_and_auto_never_hides_failures():
    from grpo_core.registry import KernelRegistry
    reg = KernelRegistry()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    reg.register_op("op", "fast", lambda: broken,
                    reasons=lambda args, kwargs, explicit: [] if args[0] > 0 else ["x must be positive"])
    reg.register_op("op", "slow", lambda: (lambda x: "slow"))
    with pytest.raises(BackendUnavailableError, match="x must be positive"):
        reg.get_op("op", backend="fast")(-1)
    auto = reg.get_op("op")
    assert auto(-1) == "slow" and auto.last_rejected == {"fast": ["x must be positive"]}
    with pytest.raises(RuntimeError, match="kernel exploded"):  # chosen backend fails: no silent fallback
        auto(1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register_op("op", "slow", lambda: None)


def test_get_loss_op_reports_rejections():
    from grpo_core import DeterminismScope, GRPOLossContract
    c = GRPOLossContract(num_sequences=4, padded_seq_len=3, vocab_size=11, samples_per_prompt=2,
                         determinism_scope=DeterminismScope.TOPOLOGY_INVARIANT)
    with pytest.raises(BackendUnavailableError, match="determinism_scope"):
        kernel_registry.get_loss_op(c, backend="native")
    with pytest.raises(LossContractError, match="contract: expected a GRPOLossContract"):
        kernel_registry.get_loss_op("not a contract")


@pytest.mark.parametrize("bad,match", [
    (dict(policy_logits=torch.zeros(4, 3)), "policy_logits: expected a 3-D tensor"),
    (dict(policy_logits=torch.zeros(4, 3, 11, dtype=torch.float64)), "policy_logits: expected dtype"),
    (dict(ref_logits=torch.zeros(4, 3, 12)), r"ref_logits: expected shape"),
    (dict(ref_logits=None), "ref_logits: required when beta > 0"),
    (dict(action_ids=torch.full((4, 3), 11)), r"action_ids: expected ids in \[0, 11\)"),
    (dict(action_ids=torch.full((4, 3), -1)), r"action_ids: expected ids in \[0, 11\)"),
    (dict(action_ids=torch.zeros(4, 3)), "action_ids: expected dtype int64 or int32"),
    (dict(completion_mask=torch.ones(12, dtype=torch.bool)), "completion_mask: expected a 2-D tensor"),
    (dict(completion_mask=torch.full((4, 3), 2)), "completion_mask: expected bool or 0/1"),
    (dict(rewards=torch.zeros(4, 1)), r"rewards: expected shape \[B\]"),
    (dict(rewards=torch.tensor([0.0, float("nan"), 1.0, 2.0])), "rewards: expected finite values"),
    (dict(old_logps=torch.zeros(4, 2)), r"old_logps: expected shape"),
    (dict(samples_per_prompt=3), "samples_per_prompt: expected a divisor"),
    (dict(samples_per_prompt=2, group_boundaries=[0, 2, 4]), "expected exactly one of them, got both"),
    (dict(samples_per_prompt=None), "expected exactly one of them, got neither"),
    (dict(samples_per_prompt=None, group_boundaries=[0, 3, 2, 4]), "group_boundaries: expected strictly"),
    (dict(samples_per_prompt=None, group_boundaries=[0, 2, 3]), "group_boundaries: expected CSR offsets"),
    (dict(samples_per_prompt=None, group_boundaries=[0, 1, 4]), "hold a single sequence"),
    (dict(samples_per_prompt=1), "samples_per_prompt: expected >= 2 under advantage_std='population'"),
    (dict(clip_eps=1.5), "clip_eps: expected a finite float"),
    (dict(beta=-0.1), "beta: expected a finite float"),
    (dict(normalizer="sum"), "normalizer: expected one of"),
    (dict(normalizer="fixed_constant"), "normalizer_constant: expected a positive float"),
    (dict(normalizer_constant=4.0), "normalizer_constant: only used with"),
])
def test_bad_inputs_raise_naming_the_argument(bad, match):
    inp = make_inputs(4, 3, 11, seed=0)
    kwargs = {"samples_per_prompt": 2, **bad}
    with pytest.raises(LossContractError, match=match):
        native(**{**inp, **{k: v for k, v in kwargs.items() if k in inp}},
               **{k: v for k, v in kwargs.items() if k not in inp})


def test_singleton_groups_allowed_without_std():
    inp = make_inputs(4, 3, 11, seed=0)
    loss, pol, _ = native(**inp, samples_per_prompt=1, advantage_std="none")
    assert pol.item() == 0.0  # each reward minus its own mean is exactly zero


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_native_matches_oracle(data):
    sizes = data.draw(st.lists(st.integers(2, 4), min_size=1, max_size=3), label="group sizes")
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    B, T, V = bounds[-1], data.draw(st.integers(1, 5), label="T"), data.draw(st.integers(2, 40), label="V")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    active = data.draw(st.sampled_from([0.0, 0.3, 1.0]), label="active")
    inp = make_inputs(B, T, V, seed=seed, active=active)
    if active == 0.0:
        inp["completion_mask"][:] = False
    normalizer, constant = data.draw(st.sampled_from(NORMALIZERS), label="normalizer")
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss, _, _ = native(**{**inp, "policy_logits": x}, group_boundaries=bounds, beta=0.05, normalizer=normalizer,
                        normalizer_constant=constant)
    loss.backward()
    exp = oracle(**inp, clip_eps=0.2, clip_eps_high=0.2, beta=0.05, groups=bounds, normalizer=normalizer,
                 constant=constant)
    assert math.isfinite(loss.item())
    assert_close_verbose(loss, exp[0], atol=1e-5, rtol=1e-4, what="loss")
    assert_close_verbose(x.grad, exp[3], atol=1e-6, rtol=1e-4, what="grad")


# Issue 12, "no silent wrong answers": every bad input is a LossContractError naming the argument, the same words
# from every path (plain call, automatic choice, contract path); masked tokens may hold anything.

def _call_every_path(inp: dict, match: str, **options) -> str:
    """Calls the native op, the automatic choice and the native contract path; each must raise `match`; returns
    the message, which must be the same from all three."""
    messages = []
    for op in (native, kernel_registry.get_op("grpo_loss")):
        with pytest.raises(LossContractError, match=match) as exc:
            op(**inp, samples_per_prompt=2, **options)
        messages.append(str(exc.value))
    with pytest.raises(LossContractError, match=match) as exc:  # a bad option fails in the contract itself
        contract = GRPOLossContract(num_sequences=4, padded_seq_len=3, vocab_size=11, samples_per_prompt=2,
                                    **options)
        NativeGRPOLossOp().apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], inp["rewards"],
                                 contract=contract, completion_mask=inp["completion_mask"],
                                 ref_local_logits=inp["ref_logits"])
    messages.append(str(exc.value))
    assert len(set(messages)) == 1, messages
    return messages[0]


TENSOR_ARGS = ["policy_logits", "ref_logits", "action_ids", "old_logps", "rewards", "completion_mask"]


@pytest.mark.parametrize("name", TENSOR_ARGS)
@pytest.mark.parametrize("kind", ["numpy", "list", "meta"])
def test_wrong_types_raise_naming_the_argument(name, kind):
    inp = make_inputs(4, 3, 11, seed=0)
    value = {"numpy": lambda t: t.numpy(), "list": lambda t: t.tolist(), "meta": lambda t: t.to("meta")}[kind](
        inp[name])
    got = {"numpy": "got numpy.ndarray; convert it with torch.from_numpy", "list": "got list",
           "meta": "expected a tensor with data .* got a meta-device tensor"}[kind]
    optional = " or None" if name == "ref_logits" and kind != "meta" else ""
    expected = f"expected a torch.Tensor{optional}, " if kind != "meta" else ""
    _call_every_path({**inp, name: value}, f"^{name}: {expected}{got}")


def test_rewards_none_and_explicit_triton_raise_the_same_error():
    inp = make_inputs(4, 3, 11, seed=0)
    msg = _call_every_path({**inp, "rewards": None}, r"^rewards: expected a torch.Tensor, got None, and advantages "
                                                     r"is None too: pass exactly one of rewards / advantages")
    pytest.importorskip("triton")
    triton = kernel_registry.get_op("grpo_loss", backend="triton")  # the shared checks run before any kernel
    inp = {k: v.to("cuda" if torch.cuda.is_available() else "cpu") for k, v in inp.items()}  # CPU: interpreter
    for bad, want in (({"rewards": None}, msg), ({"policy_logits": inp["policy_logits"].cpu().numpy()},
                                                 "policy_logits: expected a torch.Tensor, got numpy.ndarray")):
        with pytest.raises(LossContractError, match=re.escape(want)):
            triton(**{**inp, **bad}, samples_per_prompt=2)


@pytest.mark.parametrize("option,value,match", [
    ("beta", 1e39, "beta: expected a float that is finite in float32 .* got 1e\\+39"),
    ("clip_eps_high", 1e39, "clip_eps_high: expected a float that is finite in float32"),
    ("normalizer_constant", 1e39, "normalizer_constant: expected a float that is finite in float32"),
    ("normalizer_constant", 1e-46, "normalizer_constant: expected a normal float32 .* got 1e-46, which is 0.0"),
    ("normalizer_constant", 1e-40, "normalizer_constant: expected a normal float32 .* got 1e-40"),  # subnormal
])
def test_options_that_overflow_float32_raise_naming_the_option(option, value, match):
    inp = make_inputs(4, 3, 11, seed=0)
    fixed = {"normalizer": "fixed_constant"} if option == "normalizer_constant" else {}
    _call_every_path(inp, match, **fixed, **{option: value})


def test_options_at_the_float32_limits_are_accepted():
    inp = make_inputs(4, 3, 11, seed=0)
    top, tiny = float.fromhex("0x1.fffffep+127"), float.fromhex("0x1p-126")
    native(**inp, samples_per_prompt=2, clip_eps_high=top)
    loss, _, _ = native(**inp, samples_per_prompt=2, normalizer="fixed_constant", normalizer_constant=tiny)
    assert loss.dtype == torch.float32


def test_rewards_are_checked_after_the_cast_to_float32():
    inp = make_inputs(4, 3, 11, seed=0)
    rewards = inp["rewards"].double()
    rewards[2] = 1e300  # finite in float64, inf in float32
    _call_every_path({**inp, "rewards": rewards}, r"^rewards: expected finite values, got non-finite at sequences "
                                                  r"\[2\] \(checked in float32")
    ints = torch.tensor([3, -2, 7, 1])  # integer rewards stay legal
    native(**{**inp, "rewards": ints}, samples_per_prompt=2)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e300])
def test_old_logps_must_be_finite_at_active_tokens(value):
    inp = make_inputs(4, 3, 11, seed=0)
    mask = inp["completion_mask"]
    mask[1, 2], mask[3, 1] = True, False
    old = inp["old_logps"].double()
    old[1, 2] = value  # 1e300 is finite in float64 but inf in float32, the loss's precision
    _call_every_path({**inp, "old_logps": old},
                     r"^old_logps: expected finite values at active tokens, got non-finite at \(b, t\) \[\(1, 2\)\]$")
    old = inp["old_logps"].double()
    want = native(**inp, samples_per_prompt=2)
    old[3, 1] = value  # masked: never read
    got = native(**{**inp, "old_logps": old}, samples_per_prompt=2)
    for a, b, what in zip(got, want, ("loss", "policy_loss", "kl")):
        assert_bitwise_equal(a, b, what)


@pytest.mark.parametrize("which", ["policy_logits", "ref_logits"])
@pytest.mark.parametrize("value,cause", [
    (float("nan"), r"NaN at \(b, t\) \[\(1, 2\)\]: the row holds a NaN or \+inf logit"),
    (float("inf"), r"NaN at \(b, t\) \[\(1, 2\)\]: the row holds a NaN or \+inf logit"),
    ("-inf at the action", r"-inf at \(b, t\) \[\(1, 2\)\]: the action's logit is -inf \(probability 0\)"),
])
def test_non_finite_logprobs_at_active_tokens_raise(which, value, cause):
    inp = make_inputs(4, 3, 11, seed=0)
    inp["completion_mask"][1, 2] = True
    logits = inp[which].clone()
    action = int(inp["action_ids"][1, 2])
    if value == "-inf at the action":
        logits[1, 2, action] = float("-inf")
    else:
        logits[1, 2, (action + 3) % 11] = value
    _call_every_path({**inp, which: logits},
                     f"^{which}: expected finite log-probabilities at active tokens, got {cause}")
    with pytest.raises(LossContractError, match=f"^{which}: expected finite log-probabilities"):
        kernel_registry.get_op("ratio_kl", backend="native")(*(logits if n == which else inp[n] for n in (
            "policy_logits", "ref_logits", "action_ids", "completion_mask", "old_logps")))


def test_minus_inf_logits_off_the_action_are_vocabulary_masking():
    inp = make_inputs(4, 3, 11, seed=0)
    banned = (inp["action_ids"].unsqueeze(-1) + 1 + torch.arange(3)) % 11  # three columns off each action
    results = []
    for fill in (float("-inf"), -1e4):  # exp(-1e4 - max) is 0.0 in float32 too: the same numbers
        masked = {name: inp[name].scatter(-1, banned, fill) for name in ("policy_logits", "ref_logits")}
        x = masked["policy_logits"].clone().requires_grad_(True)
        loss, pol, kl = native(**{**inp, **masked, "policy_logits": x}, samples_per_prompt=2)
        loss.backward()
        results.append((loss, pol, kl, x.grad))
    loss, pol, kl, grad = results[0]
    assert all(math.isfinite(v.item()) for v in (loss, pol, kl)) and bool(torch.isfinite(grad).all())
    assert bool((grad.gather(-1, banned) == 0).all())  # probability 0: no gradient
    for a, b, what in zip(results[0], results[1], ("loss", "policy_loss", "kl", "grad")):
        assert_bitwise_equal(a, b, what)


def test_only_policy_logits_get_a_gradient():
    inp = make_inputs(4, 3, 11, seed=0)
    leaves = {k: inp[k].clone().requires_grad_(True) for k in ("policy_logits", "ref_logits", "old_logps", "rewards")}
    loss, _, _ = native(**{**inp, **leaves}, samples_per_prompt=2)
    loss.backward()
    assert leaves["policy_logits"].grad is not None
    assert {k: v.grad for k, v in leaves.items() if k != "policy_logits"} == dict.fromkeys(
        ("ref_logits", "old_logps", "rewards"))
    frozen = {k: v for k, v in leaves.items() if k != "policy_logits"}
    loss, _, _ = native(**{**inp, **frozen}, samples_per_prompt=2)  # policy without grad: no graph at all
    assert not loss.requires_grad
    ratio, kl = kernel_registry.get_op("ratio_kl", backend="native")(
        inp["policy_logits"], frozen["ref_logits"], inp["action_ids"], inp["completion_mask"], frozen["old_logps"])
    assert not ratio.requires_grad and not kl.requires_grad


# Issue 15: the options of the loss people already run (temperature, given advantages, TRL / Liger loss types,
# TRL's std, the metrics a trainer logs), each against the float64 oracle, on the plain call and the contract path.

def _given_advantages(inp: dict, kind: str) -> torch.Tensor:
    """Advantages computed elsewhere: `[B]` or `[B, T]`, NaN where no active token reads them (must not matter)."""
    g = torch.Generator().manual_seed(17)
    B, T = inp["completion_mask"].shape
    if kind == "sequence":
        adv = torch.randn(B, generator=g)
        return torch.where(inp["completion_mask"].any(-1), adv, float("nan"))
    return torch.where(inp["completion_mask"], torch.randn(B, T, generator=g), float("nan"))


SOURCES = ["rewards", "rewards_unbiased_eps", "sequence", "token"]
LOSS_TYPES = [(None, None, "global_active_tokens", None), ("grpo", None, "per_sequence_then_batch_mean", None),
              ("bnpo", None, "global_active_tokens", None), ("dapo", None, "global_active_tokens", None),
              ("dr_grpo", None, "sequences_times_max_length", 6), ("dr_grpo", 50, "sequences_times_max_length", 50),
              ("luspo", None, "sequence_sums_then_batch_mean", None)]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("loss_type,max_len,normalizer,constant", LOSS_TYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_migration_options_match_float64_oracle(source, loss_type, max_len, normalizer, constant, temperature, beta):
    inp = make_inputs(8, 6, 37, seed=case_seed(source, loss_type, max_len, temperature, beta), empty_rows=(2,))
    groups = [0, 3, 5, 8]
    kw = dict(clip_eps=0.2, clip_eps_high=0.28, beta=beta, temperature=temperature, loss_type=loss_type,
              max_completion_length=max_len)
    if source.startswith("rewards"):
        std = "unbiased_eps" if source == "rewards_unbiased_eps" else None
        kw.update(group_boundaries=groups, advantage_std=std)
        exp = oracle(**inp, clip_eps=0.2, clip_eps_high=0.28, beta=beta, groups=groups, normalizer=normalizer,
                     constant=constant, std=std or "population", temperature=temperature)
    else:
        adv = _given_advantages(inp, source)
        kw.update(advantages=adv)
        inp = {**inp, "rewards": None}
        exp = oracle(**inp, clip_eps=0.2, clip_eps_high=0.28, beta=beta, normalizer=normalizer, constant=constant,
                     temperature=temperature, advantages=torch.nan_to_num(adv))
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss, pol, kl = native(**{**inp, "policy_logits": x}, **kw)
    loss.backward()
    for name, got, want in (("loss", loss, exp[0]), ("policy_loss", pol, exp[1]), ("kl", kl, exp[2])):
        assert_close_verbose(got, want, atol=1e-5, rtol=1e-4, what=name)
    assert_close_verbose(x.grad, exp[3], atol=1e-6, rtol=1e-4, what="grad")
    assert bool((x.grad[2] == 0).all())  # the empty sequence


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_contract_path_options_and_metrics_match_oracle(source, temperature):
    inp = make_inputs(6, 5, 19, seed=3, empty_rows=(4,))
    given = None if source.startswith("rewards") else _given_advantages(inp, source)
    std = "unbiased_eps" if source == "rewards_unbiased_eps" else None
    contract = GRPOLossContract(num_sequences=6, padded_seq_len=5, vocab_size=19, beta=0.1, clip_eps=0.1,
                                clip_eps_high=0.15,
                                temperature=temperature, loss_type="grpo", advantage_std=std,
                                **({"group_boundaries": [0, 2, 6]} if given is None else
                                   {"advantages_input": source}))
    res = kernel_registry.get_loss_op(contract).op.apply(
        inp["policy_logits"], inp["action_ids"], inp["old_logps"], None if given is not None else inp["rewards"],
        contract=contract, completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"],
        advantages=given)
    exp = oracle(**inp, clip_eps=0.1, clip_eps_high=0.15, beta=0.1, groups=[0, 2, 6], std=std or "population",
                 normalizer="per_sequence_then_batch_mean", temperature=temperature, metrics=True,
                 advantages=None if given is None else torch.nan_to_num(given))
    assert_close_verbose(res.loss, exp[0], atol=1e-5, rtol=1e-4, what="loss")
    assert_close_verbose(res.per_sequence_policy, exp[4], atol=1e-5, rtol=1e-4, what="per_sequence_policy")
    if given is None:
        assert_close_verbose(res.advantages, exp[5], atol=1e-5, rtol=1e-5, what="advantages")
    else:  # reported as given (fp32), NaN where nothing reads them included
        assert_bitwise_equal(res.advantages, given.float(), "advantages as given")
    for name, want in (("clip_fraction", exp[6]), ("mean_ratio", exp[7]), ("kl_token_mean", exp[8])):
        got = getattr(res, name)
        assert got.dtype == torch.float32 and got.dim() == 0 and not got.requires_grad
        assert_close_verbose(got, torch.tensor(want), atol=1e-6, rtol=1e-5, what=name)
    assert 0 < exp[6] < 1, "vacuity: some tokens must be clipped and some not"


def test_metrics_on_a_hand_example():
    """ratio 0.5 / 1.0 / 2.0 against clip 0.2: with A < 0 only the low one is clipped, with A > 0 only the high."""
    from grpo_core import canonical
    ratio = torch.tensor([[0.5, 1.0, 2.0], [0.5, 1.0, 2.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    lo, hi = canonical.clip_bounds(0.2, 0.2, ratio)
    for adv, per_seq in ((torch.tensor([-1.0, 1.0]), [1, 0]), (torch.tensor([[1.0, 0.0, 1.0], [-1.0, -1.0, -1.0]]),
                                                              [1, 1])):
        ratio_sums, clipped = canonical.sequence_metrics(ratio, adv, mask, lo, hi)
        assert clipped.tolist() == per_seq and ratio_sums.tolist() == [3.5, 1.5]
        kl_sums = torch.tensor([0.25, 0.5])
        frac, mean_ratio, kl_mean = canonical.batch_metrics(ratio_sums, kl_sums, clipped, mask.sum(-1))
        f32 = [torch.tensor(v, dtype=torch.float32).item() for v in (sum(per_seq) / 5, 1.0, 0.75 / 5)]
        assert [frac.item(), mean_ratio.item(), kl_mean.item()] == f32
    zero = canonical.batch_metrics(torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.int64),
                                   torch.zeros(2, dtype=torch.int64))
    assert [t.item() for t in zero] == [0.0, 0.0, 0.0]  # no active token: 0, not NaN


def test_temperature_one_is_the_default_math_bit_for_bit():
    inp = make_inputs(4, 5, 23, seed=8)
    x, y = (inp["policy_logits"].clone().requires_grad_(True) for _ in range(2))
    a = native(**{**inp, "policy_logits": x}, samples_per_prompt=2)
    b = native(**{**inp, "policy_logits": y}, samples_per_prompt=2, temperature=1.0, loss_type="bnpo")
    a[0].backward()
    b[0].backward()
    for name, u, v in (("loss", a[0], b[0]), ("policy", a[1], b[1]), ("kl", a[2], b[2]), ("grad", x.grad, y.grad)):
        assert_bitwise_equal(u, v, name)
    c = native(**inp, samples_per_prompt=2, temperature=0.5)
    assert c[0].item() != a[0].item()  # vacuity: a temperature changes the numbers


def test_temperature_is_the_loss_of_scaled_logits_with_the_chain_rule():
    inp = make_inputs(4, 5, 23, seed=9)
    t = 0.6
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss, _, _ = native(**{**inp, "policy_logits": x}, samples_per_prompt=2, temperature=t)
    loss.backward()
    z = (inp["policy_logits"] / t).requires_grad_(True)
    want, _, _ = native(**{**inp, "policy_logits": z, "ref_logits": inp["ref_logits"] / t}, samples_per_prompt=2)
    want.backward()
    assert_close_verbose(loss, want, atol=1e-6, rtol=1e-5, what="loss")
    assert_close_verbose(x.grad, z.grad / t, atol=1e-7, rtol=1e-5, what="grad = dL/dz / temperature")


def test_given_advantages_equal_to_the_group_advantages_give_the_same_loss():
    inp = make_inputs(8, 6, 29, seed=12, empty_rows=(5,))
    res = NativeGRPOLossOp().apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], inp["rewards"],
                                   contract=GRPOLossContract(num_sequences=8, padded_seq_len=6, vocab_size=29,
                                                             samples_per_prompt=4),
                                   completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"])
    seq = native(**{**inp, "rewards": None}, advantages=res.advantages)
    tok = native(**{**inp, "rewards": None}, advantages=res.advantages[:, None].expand(8, 6))
    for got in (seq, tok):
        for a, b, what in zip(got, res, ("loss", "policy_loss", "kl")):
            assert_bitwise_equal(a, b, what)


def test_masked_advantages_may_hold_anything():
    inp = make_inputs(4, 6, 23, seed=13, empty_rows=(1,))
    mask = inp["completion_mask"]
    for kind in ("sequence", "token"):
        adv = _given_advantages(inp, kind)
        results = []
        for fill in (float("nan"), 0.0, 1e30):
            given = torch.where(mask if kind == "token" else mask.any(-1), adv, fill)
            x = inp["policy_logits"].clone().requires_grad_(True)
            loss, pol, kl = native(**{**inp, "policy_logits": x, "rewards": None}, advantages=given)
            loss.backward()
            results.append((loss, pol, kl, x.grad))
        assert math.isfinite(results[0][0].item())
        for other in results[1:]:
            for a, b, what in zip(results[0], other, ("loss", "policy", "kl", "grad")):
                assert_bitwise_equal(a, b, f"{kind} {what}")


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=0), r"^temperature: expected a finite float > 0 whose reciprocal is a finite normal float32"),
    (dict(temperature=-1.0), r"^temperature: expected a finite float > 0"),
    (dict(temperature=float("inf")), r"^temperature: expected a finite float > 0"),
    (dict(temperature=float("nan")), r"^temperature: expected a finite float > 0"),
    (dict(temperature=1e39), r"^temperature: expected a float that is finite in float32 .* got 1e\+39"),
    (dict(temperature=1e-39), r"^temperature: expected a finite float > 0 whose reciprocal .* got 1e-39"),
    (dict(temperature=1e38), r"^temperature: expected a finite float > 0 whose reciprocal .* got 1e\+38"),
    (dict(temperature="0.9"), r"^temperature: expected a float, got str"),
    (dict(loss_type="gspo"), r"^loss_type: expected one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', "
                             r"'luspo', 'vespo', got 'gspo'$"),
    (dict(loss_type="GRPO"), r"^loss_type: expected one of"),
    (dict(loss_type="grpo", normalizer="global_active_tokens"),
     r"^loss_type / normalizer: loss_type='grpo' is normalizer='per_sequence_then_batch_mean', but "
     r"normalizer='global_active_tokens' was given too"),
    (dict(loss_type="dapo", normalizer="fixed_constant", normalizer_constant=8.0), r"^loss_type / normalizer"),
    (dict(max_completion_length=16), r"^max_completion_length: only used with loss_type='dr_grpo'"),
    (dict(loss_type="dr_grpo", max_completion_length=0), r"^max_completion_length: expected an int >= 1"),
    (dict(loss_type="dr_grpo", max_completion_length=16.0), r"^max_completion_length: expected an int"),
    (dict(advantage_std="trl"), r"^advantage_std: expected one of .*'unbiased_eps'"),
])
def test_bad_migration_options_raise_naming_the_argument(bad, match):
    _call_every_path(make_inputs(4, 3, 11, seed=0), match, **bad)


@pytest.mark.parametrize("make_bad,match", [
    (lambda i: dict(advantages=torch.zeros(4, 2)), r"^advantages: expected shape \[B\] = \[4\] \(one per sequence\) "
                                                   r"or \[B, T\] = \[4, 3\] \(one per token\), got \[4, 2\]"),
    (lambda i: dict(advantages=torch.zeros(5)), r"^advantages: expected shape \[B\] = \[4\]"),
    (lambda i: dict(advantages=torch.zeros(4, 3, 1)), r"^advantages: expected shape"),
    (lambda i: dict(advantages=torch.zeros(4, dtype=torch.int64)), r"^advantages: expected a floating dtype"),
    (lambda i: dict(advantages=torch.zeros(4).numpy()), r"^advantages: expected a torch.Tensor, got numpy.ndarray"),
    (lambda i: dict(advantages=torch.zeros(4, 3).index_put_((torch.tensor([1]), torch.tensor([0])),
                                                            torch.tensor(float("nan")))),
     r"^advantages: expected finite values at active tokens, got non-finite at \(b, t\) \[\(1, 0\)\]"),
    (lambda i: dict(advantages=torch.tensor([0.0, 1e300, 0.0, 0.0], dtype=torch.float64)),
     r"^advantages: expected finite values for sequences with an active token, got non-finite at sequences \[1\] "
     r"\(checked in float32\)"),
    (lambda i: dict(advantages=torch.zeros(4), rewards=i["rewards"]),
     r"^rewards / advantages: expected exactly one of them, got both"),
    (lambda i: dict(advantages=torch.zeros(4), samples_per_prompt=2),
     r"^samples_per_prompt: only used to normalize rewards per group, but the advantages are given"),
    (lambda i: dict(advantages=torch.zeros(4), group_boundaries=[0, 2, 4]), r"^group_boundaries: only used to"),
    (lambda i: dict(advantages=torch.zeros(4), advantage_std="population"),
     r"^advantage_std: only used to normalize rewards, but the advantages are given"),
])
def test_bad_advantages_raise_naming_the_argument(make_bad, match):
    inp = make_inputs(4, 3, 11, seed=0)
    bad = make_bad(inp)
    kwargs = {"rewards": None, "samples_per_prompt": None, **bad}
    for op in (native, kernel_registry.get_op("grpo_loss")):
        with pytest.raises(LossContractError, match=match):
            op(**{**inp, **{k: v for k, v in kwargs.items() if k in inp}},
               **{k: v for k, v in kwargs.items() if k not in inp})


def test_contract_path_takes_the_input_its_contract_declares():
    inp = make_inputs(4, 3, 11, seed=0)
    apply = NativeGRPOLossOp().apply

    def run(contract, rewards, advantages):
        return apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], rewards, contract=contract,
                     completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"],
                     advantages=advantages)

    base = dict(num_sequences=4, padded_seq_len=3, vocab_size=11)
    by_rewards = GRPOLossContract(**base, samples_per_prompt=2)
    by_token = GRPOLossContract(**base, advantages_input="token")
    with pytest.raises(LossContractError, match=r"^advantages: the contract takes rewards \(advantages_input="
                                                r"'rewards'\), got advantages \[B\]"):
        run(by_rewards, None, torch.zeros(4))
    with pytest.raises(LossContractError, match=r"^rewards: the contract takes advantages \[B, T\] \(one per token\) "
                                                r"\(advantages_input='token'\), got rewards"):
        run(by_token, inp["rewards"], None)
    with pytest.raises(LossContractError, match=r"^advantages: the contract takes advantages \[B, T\]"):
        run(by_token, None, torch.zeros(4))
    with pytest.raises(LossContractError, match=r"^rewards / advantages: expected exactly one of them, got both"):
        run(by_token, inp["rewards"], torch.zeros(4, 3))
    assert run(by_token, None, torch.zeros(4, 3)).advantages.shape == (4, 3)


# The Triton op takes every option (tests/test_triton_grpo_loss.py compares its numbers): the automatic choice
# rejects it for CPU tensors only, for the device, whatever the options.

MIGRATION_OPTIONS = [dict(temperature=0.9), dict(loss_type="grpo"), dict(loss_type="dr_grpo", max_completion_length=8),
                     dict(normalizer="per_sequence_then_batch_mean"), dict(advantage_std="unbiased_eps"),
                     dict(rewards=None, samples_per_prompt=None, advantages=torch.zeros(4)),
                     dict(rewards=None, samples_per_prompt=None, advantages=torch.zeros(4, 3))]


@pytest.mark.parametrize("options", MIGRATION_OPTIONS)
def test_auto_rejects_triton_for_the_device_only_whatever_the_options(options):
    inp = make_inputs(4, 3, 11, seed=0)
    kwargs = {"samples_per_prompt": 2, **options}
    call = ({k: v for k, v in kwargs.items() if k in inp}, {k: v for k, v in kwargs.items() if k not in inp})
    auto = kernel_registry.get_op("grpo_loss")
    got = auto(**{**inp, **call[0]}, **call[1])
    want = native(**{**inp, **call[0]}, **call[1])
    assert auto.last_backend == "native"
    assert len(auto.last_rejected["triton"]) == 1 and "needs CUDA tensors" in auto.last_rejected["triton"][0], \
        auto.last_rejected
    for a, b, what in zip(got, want, ("loss", "policy_loss", "kl")):
        assert_bitwise_equal(a, b, what)


def test_triton_checks_option_values_with_the_native_words():
    pytest.importorskip("triton")
    inp = make_inputs(4, 3, 11, seed=0, device="cuda" if torch.cuda.is_available() else "cpu")
    triton = kernel_registry.get_op("grpo_loss", backend="triton")
    for bad, match in ((dict(temperature=0.0), r"^temperature: expected a finite float > 0"),
                       (dict(loss_type="gspo"), r"^loss_type: expected one of"),
                       (dict(max_completion_length=8), r"^max_completion_length: only used with loss_type='dr_grpo'"),
                       (dict(loss_type="grpo", normalizer="fixed_constant"), r"^loss_type / normalizer: "),
                       (dict(advantage_std="trl"), r"^advantage_std: expected one of")):
        for op in (native, triton):
            with pytest.raises(LossContractError, match=match):
                op(**inp, samples_per_prompt=2, **bad)


def test_triton_serves_bnpo_and_dapo_as_global_active_tokens():
    pytest.importorskip("triton")
    inp = make_inputs(4, 3, 11, seed=0, device="cuda" if torch.cuda.is_available() else "cpu")
    triton = kernel_registry.get_op("grpo_loss", backend="triton")
    want = triton(**inp, samples_per_prompt=2)
    for loss_type in ("bnpo", "dapo"):
        got = triton(**inp, samples_per_prompt=2, loss_type=loss_type, temperature=1.0)
        for a, b, what in zip(got, want, ("loss", "policy_loss", "kl")):
            assert_bitwise_equal(a, b, f"{loss_type} {what}")
