"""The native reference op against an independent float64 oracle, plus invariances and registry dispatch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_bitwise_equal, assert_close_verbose, make_inputs
from grpo_core import BackendUnavailableError, GRPOLossContract, LossContractError, kernel_registry
from grpo_core.native import NativeGRPOLossOp

native = kernel_registry.get_op("grpo_loss", backend="native")


def oracle(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, *, clip_eps, clip_eps_high,
           beta, groups, normalizer, constant=None, std="population"):
    """GRPO written out in float64 with plain loops; shares no code with grpo_core."""
    x = policy_logits.detach().double().requires_grad_(True)
    B, T, V = x.shape
    mask = completion_mask.bool()
    lse = x.max(-1, keepdim=True).values
    logp_all = x - (lse + (x - lse).exp().sum(-1, keepdim=True).log())
    logp = logp_all.gather(-1, action_ids[..., None])[..., 0]
    r = ref_logits.double() if ref_logits is not None else None
    adv = torch.zeros(B, dtype=torch.float64)
    for a, b in zip(groups[:-1], groups[1:]):
        g = rewards[a:b].double()
        mean = g.sum() / len(g)
        if std == "none":
            adv[a:b] = g - mean
        else:
            var = ((g - mean) ** 2).sum() / (len(g) - (1 if std == "unbiased" else 0))
            adv[a:b] = (g - mean) / max(math.sqrt(var), 1e-6)
    pol_tok = torch.zeros(B, T, dtype=torch.float64)
    kl_tok = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            ratio = torch.exp(logp[i, t] - old_logps[i, t].double())
            unclipped, clipped = ratio * adv[i], ratio.clamp(1 - clip_eps, 1 + clip_eps_high) * adv[i]
            pol_tok[i, t] = -(unclipped if unclipped <= clipped else clipped)
            if r is not None:
                lr = r[i, t] - torch.logsumexp(r[i, t], 0)
                d = lr[action_ids[i, t]] - logp[i, t]
                kl_tok[i, t] = d.exp() - d - 1
    counts = mask.sum(-1)

    def norm(tok):
        if normalizer == "global_active_tokens":
            return tok.sum() / max(int(counts.sum()), 1)
        if normalizer == "per_sequence_then_mean":
            seqs = [tok[i].sum() / counts[i] for i in range(B) if counts[i] > 0]
            return sum(seqs) / len(seqs) if seqs else torch.zeros((), dtype=torch.float64)
        return tok.sum() / constant

    policy_loss, kl = norm(pol_tok), norm(kl_tok)
    loss = policy_loss + beta * kl + 0.0 * x.sum()  # keeps a graph when no token is active
    loss.backward()
    return loss.detach(), policy_loss.detach(), kl.detach(), x.grad, pol_tok.sum(-1).detach(), adv


GROUPINGS = {"uniform4": dict(samples_per_prompt=4), "csr": dict(group_boundaries=[0, 3, 5, 8])}
NORMALIZERS = [("global_active_tokens", None), ("per_sequence_then_mean", None), ("fixed_constant", 64.0)]


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("normalizer,constant", NORMALIZERS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
def test_native_matches_float64_oracle(grouping, normalizer, constant, beta, clip):
    inp = make_inputs(8, 6, 37, seed=hash((grouping, normalizer, beta, clip)) % 1000, empty_rows=(2,))
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
    msg = _call_every_path({**inp, "rewards": None}, "^rewards: expected a torch.Tensor, got None$")
    pytest.importorskip("triton")
    triton = kernel_registry.get_op("grpo_loss", backend="triton")  # the shared checks run before any kernel
    inp = {k: v.to("cuda" if torch.cuda.is_available() else "cpu") for k, v in inp.items()}  # CPU: interpreter
    for bad, want in (({"rewards": None}, msg), ({"policy_logits": inp["policy_logits"].cpu().numpy()},
                                                 "policy_logits: expected a torch.Tensor, got numpy.ndarray")):
        with pytest.raises(LossContractError, match=want):
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
