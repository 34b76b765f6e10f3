"""TRL's per-token options on every backend: `delta` (two-sided clipping), `use_bias_correction_kl` (the KL term times
the ratio), the rollout's importance sampling ratio (TRL's `importance_sampling_ratio`, Liger's `vllm_is_ratio`;
`[B, T]` or `[B, 1]`), the loss types `cispo`, `sapo` (with its temperatures), `luspo` (its normalizer) and `vespo`
(its gamma weight), GSPO's sequence-level ratio (`importance_sampling_level="sequence"`, with each of them) and the
off-policy sequence mask
(`off_policy_mask_threshold`, with `sampling_logps`): the fast paths against TRL 1.16's formulas in float64, the
deterministic path's two kernel sets bitwise against each other, and the same errors for bad values everywhere. (The
harness runs them at every TP x DP layout against the goldens: scenarios `token_options_bf16`, `linear_token_options`,
`cispo_bf16`, `sapo_csr`, `luspo_empty`, `gspo_bf16`, `linear_gspo_luspo`, `off_policy_bf16`, `vespo_bf16` and
`linear_vespo`.)"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import HAS_CUDA, assert_bitwise_equal, assert_close_verbose, make_inputs
from grpo_core import GRPOLossContract, LossContractError, kernel_registry
from grpo_core.distributed import DistributedGRPOLossOp
from grpo_core.linear import linear_grpo_loss
from grpo_core.native import NativeGRPOLossOp

DEV = "cuda" if HAS_CUDA else "cpu"
B, T, V, H = 4, 6, 37, 16
LO, HI = 0.2, 0.28
# (options, importance weights): delta 1.05 < 1 + 0.28 makes the clipped branch the minimum where it passes the
# ratio through (its gradient is not zero there); 1.3 sits above the clip range. CISPO clamps the ratio at
# clip_eps_high itself (TRL's and Liger's epsilon_high).
CASES = [(dict(delta=1.05), "token"), (dict(delta=1.3, use_bias_correction_kl=True), "sequence"),
         (dict(use_bias_correction_kl=True), None), (dict(delta=1.1), None), ({}, "token"),
         (dict(loss_type="cispo", clip_eps_high=1.1), "token"), (dict(loss_type="cispo", clip_eps_high=0.9), None),
         (dict(loss_type="sapo", use_bias_correction_kl=True), "sequence"),
         (dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=3.0), None),
         (dict(loss_type="luspo", delta=1.1), "sequence"),
         (dict(importance_sampling_level="sequence", clip_eps_high=0.1), None),
         (dict(importance_sampling_level="sequence", use_bias_correction_kl=True, delta=1.05), "token"),
         (dict(importance_sampling_level="sequence", loss_type="cispo", clip_eps_high=1.02), "sequence"),
         (dict(importance_sampling_level="sequence", loss_type="sapo", use_bias_correction_kl=True), "token"),
         (dict(importance_sampling_level="sequence", loss_type="luspo"), None),
         (dict(off_policy_mask_threshold=-0.05), "token"),
         (dict(off_policy_mask_threshold=-0.05, importance_sampling_level="sequence", use_bias_correction_kl=True),
          None),
         (dict(off_policy_mask_threshold=-0.05, loss_type="sapo"), "sequence"),
         (dict(loss_type="vespo"), "token"),
         (dict(loss_type="vespo", vespo_k_pos=0.5, vespo_lambda_pos=1e-5, vespo_k_neg=-1.0, vespo_lambda_neg=0.5,
               use_bias_correction_kl=True), None),
         (dict(loss_type="vespo", importance_sampling_level="sequence", off_policy_mask_threshold=-0.05,
               use_bias_correction_kl=True), "token")]
IDS = [",".join(f"{k}={v}" for k, v in o.items()) + f",{w}" for o, w in CASES]


def importance_weights(kind: str | None) -> torch.Tensor | None:
    if kind is None:
        return None
    g = torch.Generator().manual_seed(7)
    return (0.5 + torch.rand(B, T if kind == "token" else 1, generator=g)).to(DEV)


def trl_loss(logits, ref_logps, old, adv, mask, is_ratio, beta, loss_type="bnpo", delta=None,
             use_bias_correction_kl=False, clip_eps_high=HI, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
             importance_sampling_level="token", off_policy_mask_threshold=None, sampling=None, vespo_k_pos=2.0,
             vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0):
    """TRL 1.16's `_compute_loss` in float64; cispo and vespo normalized as bnpo (one batch of one process)."""
    lp = torch.log_softmax(logits.double(), -1).gather(-1, INPUTS["action_ids"][..., None])[..., 0]
    m = mask.double()
    log_ratio = lp - old.double()
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_ratio)
    d = ref_logps.double() - lp
    kl = torch.exp(d) - d - 1
    if use_bias_correction_kl:
        kl = kl * coef_1
    a = adv.double()[:, None]
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=clip_eps_high).detach() * a * lp
    elif loss_type == "sapo":
        tau = torch.where(a > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * a
    elif loss_type == "vespo":
        per_token = -vespo_phi(lp - old.double(), m, a, is_ratio, (vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                                                                  vespo_lambda_neg)) * a * lp
        is_ratio = None  # in phi, not on the term
    else:
        coef_2 = torch.clamp(coef_1, 1 - LO, 1 + clip_eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
    if off_policy_mask_threshold is not None:
        kl_div = torch.nan_to_num((old if sampling is None else sampling).double() - lp.detach(), nan=0.0)
        mean_kl = (kl_div * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        per_token = per_token * ((a >= 0) | (mean_kl <= off_policy_mask_threshold)).double()
    if is_ratio is not None:
        per_token = per_token * is_ratio.double()
    per_token = per_token + beta * kl
    if loss_type == "sapo":  # grpo's normalizer
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if loss_type == "luspo":
        return (per_token * m).sum(-1).mean()
    return (per_token * m).sum() / m.sum()


def vespo_phi(log_ratio, m, a, is_ratio, gamma):
    """TRL 1.16's `get_gamma_weights` in float64 (detached), `[B, 1]`; `m` float64 `[B, T]`."""
    k_pos, lambda_pos, k_neg, lambda_neg = gamma
    lower = math.log(1e-8)
    seq = (log_ratio.detach().clamp(-20.0, 20.0) * m).sum(-1, keepdim=True)
    if is_ratio is not None:  # TRL's ratios are 1 on masked tokens (its log-prob difference is masked): ours not
        seq = seq + (torch.log(is_ratio.double()).clamp(lower, 20.0) * m).sum(-1, keepdim=True)
    log_w = seq.clamp(lower, 20.0)
    k = torch.where(a >= 0, k_pos, k_neg)
    lam = torch.where(a >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


INPUTS = make_inputs(B, T, V, seed=11, device=DEV)
ADV = torch.randn(B, generator=torch.Generator().manual_seed(3)).to(DEV)
REF_LOGPS = torch.log_softmax(INPUTS["ref_logits"].double(), -1).gather(
    -1, INPUTS["action_ids"][..., None])[..., 0].float()


def oracle(options: dict, is_ratio):
    x = INPUTS["policy_logits"].double().detach().requires_grad_(True)
    loss = trl_loss(x, REF_LOGPS, INPUTS["old_logps"], ADV, INPUTS["completion_mask"], is_ratio, 0.04, **options)
    loss.backward()
    return loss.detach(), x.grad


def contract(**options) -> GRPOLossContract:
    return GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, **{**dict(clip_eps_high=HI), **options},
                            clip_eps=LO, beta=0.04, advantages_input="sequence", determinism_scope="topology_invariant")


def run(backend: str, options: dict, is_ratio, **kw):
    """`(loss, gradient of the logits)` of one backend on the shared inputs."""
    x = INPUTS["policy_logits"].detach().clone().requires_grad_(True)
    i = INPUTS
    if backend.startswith("distributed"):
        res = DistributedGRPOLossOp(backend.split("/")[1]).apply(
            x, i["action_ids"], i["old_logps"], contract=contract(**options), completion_mask=i["completion_mask"],
            advantages=ADV, ref_logps=REF_LOGPS, importance_sampling_ratio=is_ratio, check_values="sync")
        loss = res.loss
    else:
        op = kernel_registry.get_op("grpo_loss", backend=backend)
        extra = {"check_values": "sync", **kw} if backend == "triton" else {}
        loss = op(x, None, i["action_ids"], i["old_logps"], None, i["completion_mask"], clip_eps=LO, beta=0.04,
                  advantages=ADV, ref_logps=REF_LOGPS, importance_sampling_ratio=is_ratio,
                  **{**dict(clip_eps_high=HI), **options}, **extra)[0]
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("options, weights", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["native", "triton", "triton/single_pass", "distributed/torch",
                                     "distributed/triton"])
def test_backends_match_trl(backend, options, weights):
    is_ratio = importance_weights(weights)
    want_loss, want_grad = oracle(options, is_ratio)
    kw = {"single_pass": True} if backend.endswith("single_pass") else {}
    if kw and (options.get("importance_sampling_level") == "sequence" or "off_policy_mask_threshold" in options
               or options.get("loss_type") == "vespo"):
        with pytest.raises(LossContractError, match="single_pass / inplace: expected False with "
                                                    "importance_sampling_level='sequence', off_policy_mask"):
            run("triton", options, is_ratio, **kw)
        return
    loss, grad = run(backend.split("/")[0] if kw else backend, options, is_ratio, **kw)
    assert_close_verbose(loss, want_loss, atol=1e-6, rtol=1e-5, what=f"{backend} loss")
    assert_close_verbose(grad, want_grad, atol=1e-7, rtol=1e-4, what=f"{backend} grad")


@pytest.mark.parametrize("options, weights", CASES, ids=IDS)
def test_each_option_changes_the_gradient(options, weights):
    """Not vacuous: on these inputs each option moves TRL's gradient (delta binds, the weights are not all 1, each
    loss type and temperature changes the term)."""
    _, plain = oracle({}, None)
    _, with_options = oracle(options, importance_weights(weights))
    assert (with_options - plain).abs().max() > 1e-4
    if "sapo_temperature_pos" in options:
        _, default_taus = oracle({"loss_type": "sapo"}, importance_weights(weights))
        assert (with_options - default_taus).abs().max() > 1e-4


@pytest.mark.parametrize("options, weights", CASES, ids=IDS)
def test_the_deterministic_kernel_sets_agree_bitwise(options, weights):
    is_ratio = importance_weights(weights)
    (la, ga), (lb, gb) = (run(f"distributed/{k}", options, is_ratio) for k in ("torch", "triton"))
    assert_bitwise_equal(la, lb, "loss")
    assert_bitwise_equal(ga, gb, "grad")


def test_sequence_weights_are_token_weights_repeated():
    """`[B, 1]` is `[B, T]` with each sequence's weight at every token, to the bit (deterministic path)."""
    w = importance_weights("sequence")
    options = dict(delta=1.3, use_bias_correction_kl=True)
    (la, ga), (lb, gb) = (run("distributed/torch", options, t) for t in (w, w.expand(B, T).contiguous()))
    assert_bitwise_equal(la, lb, "loss")
    assert_bitwise_equal(ga, gb, "grad")


@pytest.mark.parametrize("options", [dict(delta=1.05, use_bias_correction_kl=True),
                                     dict(loss_type="sapo", sapo_temperature_neg=2.0),
                                     dict(loss_type="cispo", clip_eps_high=1.1),
                                     dict(importance_sampling_level="sequence", delta=1.05,
                                          use_bias_correction_kl=True),
                                     dict(importance_sampling_level="sequence", loss_type="cispo", clip_eps_high=1.02),
                                     dict(off_policy_mask_threshold=-0.05, use_bias_correction_kl=True),
                                     dict(loss_type="vespo", use_bias_correction_kl=True, vespo_k_neg=1.0)],
                         ids=["delta_bias", "sapo", "cispo", "gspo", "gspo_cispo", "off_policy", "vespo"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_linear_loss_matches_trl(kernels, options):
    """The fused linear loss: its hidden-state gradient against TRL's formula on `hidden @ weight.T`."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, T, H, generator=g).to(DEV).requires_grad_(True)
    weight = (0.5 * torch.randn(V, H, generator=g)).to(DEV)
    is_ratio = importance_weights("token")
    logits = (hidden.double() @ weight.double().T).detach().requires_grad_(True)
    want = trl_loss(logits, REF_LOGPS, INPUTS["old_logps"], ADV, INPUTS["completion_mask"], is_ratio, 0.04, **options)
    want.backward()
    res = linear_grpo_loss(hidden, weight, INPUTS["action_ids"], INPUTS["old_logps"], None,
                           INPUTS["completion_mask"], advantages=ADV, ref_logps=REF_LOGPS, clip_eps=LO, beta=0.04,
                           importance_sampling_ratio=is_ratio, kernels=kernels, **{**dict(clip_eps_high=HI), **options})
    res.loss.backward()
    assert_close_verbose(res.loss, want, atol=1e-6, rtol=1e-5, what="loss")
    assert_close_verbose(hidden.grad, logits.grad @ weight.double(), atol=1e-6, rtol=1e-4, what="hidden grad")


def _call(backend: str, is_ratio=None, **options):
    i = INPUTS
    if backend.startswith("distributed"):
        sampling = options.pop("sampling_logps", None)
        c = contract(**options)
        return DistributedGRPOLossOp(backend.split("/")[1]).apply(
            i["policy_logits"], i["action_ids"], i["old_logps"], contract=c, completion_mask=i["completion_mask"],
            advantages=ADV, ref_logps=REF_LOGPS, importance_sampling_ratio=is_ratio, sampling_logps=sampling,
            check_values="sync").loss
    if backend == "linear":
        x = i["policy_logits"].float()
        return linear_grpo_loss(x, torch.eye(V, device=DEV), i["action_ids"], i["old_logps"], None,
                                i["completion_mask"], advantages=ADV, ref_logps=REF_LOGPS,
                                importance_sampling_ratio=is_ratio, kernels="torch", **options).loss
    op = kernel_registry.get_op("grpo_loss", backend=backend)
    extra = {"check_values": "sync"} if backend == "triton" else {}
    return op(i["policy_logits"], None, i["action_ids"], i["old_logps"], None, i["completion_mask"],
              advantages=ADV, ref_logps=REF_LOGPS, importance_sampling_ratio=is_ratio, **options, **extra)[0]


BACKENDS = ["native", "triton", "distributed/torch", "distributed/triton", "linear"]


@pytest.mark.parametrize("options", [{}, dict(loss_type="vespo"), dict(off_policy_mask_threshold=-1.0)],
                         ids=["plain", "vespo", "off_policy"])  # the last two: the kernels read computed weights
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_importance_weights_raise_everywhere(backend, value, options):
    w = importance_weights("token")
    b = int((ADV < 0).nonzero()[0])  # the off-policy mask's threshold -1.0 drops this sequence: checked anyway
    t = int(INPUTS["completion_mask"][b].nonzero()[-1])
    w[b, t] = value
    with pytest.raises(LossContractError, match=rf"importance_sampling_ratio: expected finite values >= 0 at active "
                                                rf"tokens, got others at \(b, t\) \[\({b}, {t}\)\]"):
        _call(backend, w, **options)


@pytest.mark.parametrize("backend", ["native", "triton", "distributed/torch", "distributed/triton"])
def test_masked_importance_weights_are_not_read_and_get_no_gradient(backend):
    w = importance_weights("token")
    b, t = (~INPUTS["completion_mask"]).nonzero()[0].tolist()
    poisoned = w.clone()
    poisoned[b, t] = float("nan")
    options = dict(delta=1.3, use_bias_correction_kl=True)
    (la, ga), (lb, gb) = (run(backend, options, weights) for weights in (poisoned, w))
    assert_bitwise_equal(la, lb, "loss")
    assert_bitwise_equal(ga, gb, "grad")
    leaf = w.clone().requires_grad_(True)  # a constant of the loss, like old_logps
    run(backend, options, leaf)
    assert leaf.grad is None


@pytest.mark.parametrize("is_ratio, match", [
    (torch.ones(B), r"importance_sampling_ratio: expected shape \[B, T\] = \[4, 6\] \(one per token\) or \[B, 1\]"),
    (torch.ones(B, T, 1), r"importance_sampling_ratio: expected shape"),
    (torch.ones(B, T, dtype=torch.int64), "importance_sampling_ratio: expected a floating dtype, got torch.int64"),
    ([[1.0] * T] * B, "importance_sampling_ratio: expected a torch.Tensor or None, got list"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_importance_weights_raise_everywhere(backend, is_ratio, match):
    if isinstance(is_ratio, torch.Tensor):
        is_ratio = is_ratio.to(DEV)
    with pytest.raises(LossContractError, match=match):
        _call(backend, is_ratio)


@pytest.mark.parametrize("options, match", [
    (dict(delta=0.0), "delta: expected a float > 0 that is a finite normal float32"),
    (dict(delta=-1.0), "delta: expected a float > 0"),
    (dict(delta=float("nan")), "delta: expected a float > 0"),
    (dict(delta=1e39), "delta: expected a float > 0 that is a finite normal float32"),
    (dict(delta=1e-40), "delta: expected a float > 0 that is a finite normal float32"),
    (dict(delta="2"), "delta: expected a float or None, got str '2'"),
    (dict(use_bias_correction_kl=1), "use_bias_correction_kl: expected a bool, got int 1"),
    (dict(loss_type="cispo", delta=2.0), "delta: only used with the clipped surrogate"),
    (dict(loss_type="sapo", delta=2.0), "delta: only used with the clipped surrogate"),
    (dict(sapo_temperature_pos=1.0), "sapo_temperature_pos: only used with loss_type='sapo'"),
    (dict(loss_type="dapo", sapo_temperature_neg=1.0), "sapo_temperature_neg: only used with loss_type='sapo'"),
    (dict(loss_type="sapo", sapo_temperature_pos=0.0), "sapo_temperature_pos: expected a float > 0"),
    (dict(loss_type="sapo", sapo_temperature_neg=float("inf")), "sapo_temperature_neg: expected a float > 0"),
    (dict(loss_type="sapo", sapo_temperature_neg="1"), "sapo_temperature_neg: expected a float > 0"),
    (dict(loss_type="vespa"), "loss_type: expected one of"),
    (dict(vespo_k_pos=1.0), "vespo_k_pos: only used with loss_type='vespo'"),
    (dict(loss_type="sapo", vespo_lambda_neg=1.0), "vespo_lambda_neg: only used with loss_type='vespo'"),
    (dict(loss_type="vespo", vespo_lambda_pos=-1.0), "vespo_lambda_pos: expected a finite float >= 0.0"),
    (dict(loss_type="vespo", vespo_k_neg=float("nan")), "vespo_k_neg: expected a finite float, got nan"),
    (dict(loss_type="vespo", vespo_k_pos=1e39), "vespo_k_pos: expected a float that is finite in float32"),
    (dict(loss_type="vespo", delta=2.0), "delta: only used with the clipped surrogate"),
    (dict(loss_type="vespo", vespo_lambda_neg=10**400), "vespo_lambda_neg: expected a finite float, got an int of 1329 "
                                                        "bits"),
    (dict(delta=10**400), "delta: expected a finite float, got an int of 1329 bits"),
    (dict(off_policy_mask_threshold=-10**400), "off_policy_mask_threshold: expected a finite float, got an int"),
    (dict(importance_sampling_level="segment"), "importance_sampling_level: expected one of 'token', 'sequence', "
                                                "got 'segment'"),
    (dict(off_policy_mask_threshold=float("nan")), "off_policy_mask_threshold: expected None or a float that is "
                                                   "finite in float32"),
    (dict(off_policy_mask_threshold=1e39), "off_policy_mask_threshold: expected None or a float"),
    (dict(off_policy_mask_threshold="0.1"), "off_policy_mask_threshold: expected None or a float"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_options_raise_everywhere(backend, options, match):
    with pytest.raises(LossContractError, match=match):
        _call(backend, **options)


def test_fingerprint_moves_only_with_the_options():
    """Old goldens keep their fingerprints: the defaults add nothing; each option, when used, enters it."""
    plain = contract(delta=None, use_bias_correction_kl=False, loss_type=None).fingerprint()
    assert GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, clip_eps=LO, clip_eps_high=HI,
                            beta=0.04, advantages_input="sequence", determinism_scope="topology_invariant"
                            ).fingerprint() == plain == contract(loss_type="dapo").fingerprint()
    prints = {plain, contract(delta=2.0).fingerprint(), contract(delta=2.5).fingerprint(),
              contract(use_bias_correction_kl=True).fingerprint(), contract(loss_type="cispo").fingerprint(),
              contract(loss_type="sapo").fingerprint(),
              contract(loss_type="sapo", sapo_temperature_pos=2.0).fingerprint(),
              contract(importance_sampling_level="sequence").fingerprint(),
              contract(off_policy_mask_threshold=0.1).fingerprint(), contract(loss_type="vespo").fingerprint(),
              contract(loss_type="vespo", vespo_lambda_neg=1.0).fingerprint()}
    assert len(prints) == 11
    assert contract(importance_sampling_level="token").fingerprint() == plain
    # cispo and sapo name a normalizer and a term: a normalizer given replaces theirs (TRL's dapo-like cispo)
    fixed = contract(loss_type="cispo", normalizer="fixed_constant", normalizer_constant=64.0)
    assert fixed.normalizer.value == "fixed_constant" and fixed.surrogate.value == "cispo"
    with pytest.raises(LossContractError, match="loss_type / normalizer"):
        contract(loss_type="dapo", normalizer="fixed_constant", normalizer_constant=64.0)
    default_taus = contract(loss_type="sapo", sapo_temperature_neg=1.05)
    assert contract(loss_type="sapo").fingerprint() == default_taus.fingerprint()
    assert contract(loss_type="vespo").fingerprint() == contract(loss_type="vespo", vespo_k_pos=2.0).fingerprint()


@pytest.mark.parametrize("backend", ["native", "triton", "distributed/torch", "distributed/triton"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_gradient_keeps_its_digits(backend, level):
    """`d (kl * ratio) / d logp = -d * ratio` (d = ref - logp), computed so: written as `((1 - e^d) + kl) * ratio` it
    cancels to a few digits of `e^d` once `d` passes ~12 (the policy far below the reference at the action). At the
    sequence level (here two sequences of one token: the KL's chain term is the token's own) the same."""
    S, T = (1, 2) if level == "token" else (2, 1)
    x = torch.tensor([[0.0, -18.0], [0.0, -30.0]], device=DEV).view(S, T, 2).requires_grad_(True)
    ids, mask = torch.ones(S, T, dtype=torch.long, device=DEV), torch.ones(S, T, dtype=torch.bool, device=DEV)
    logp = torch.log_softmax(x.detach().double(), -1)[..., 1]
    old, ref, adv = logp.float(), torch.zeros(S, T, device=DEV), torch.zeros(S, device=DEV)
    options = dict(use_bias_correction_kl=True, importance_sampling_level=level)
    if backend.startswith("distributed"):
        c = GRPOLossContract(num_sequences=S, padded_seq_len=T, vocab_size=2, beta=0.04, advantages_input="sequence",
                             determinism_scope="topology_invariant", **options)
        loss = DistributedGRPOLossOp(backend.split("/")[1]).apply(x, ids, old, contract=c, completion_mask=mask,
                                                                  advantages=adv, ref_logps=ref).loss
    else:
        loss = kernel_registry.get_op("grpo_loss", backend=backend)(x, None, ids, old, None, mask, beta=0.04,
                                                                     advantages=adv, ref_logps=ref, **options)[0]
    loss.backward()
    ratio, d, p = torch.exp(logp - old.double()), -logp, torch.exp(logp)
    want = -0.04 * d * ratio * (1 - p) / 2  # at the action's logit; two active tokens
    assert_close_verbose(x.grad[..., 1], want, atol=0, rtol=1e-5, what=f"{backend} grad at the action")


@pytest.mark.parametrize("backend", ["distributed/torch", "distributed/triton", "linear"])
def test_sequence_level_clip_fraction_counts_what_trl_counts(backend):
    """GSPO: with an advantage per sequence TRL's clip ratio is a mean over the B sequences (its terms are `[B, 1]`);
    with advantages per token it stays a mean over the active tokens."""
    i, m = INPUTS, INPUTS["completion_mask"]
    lp = torch.log_softmax(i["policy_logits"].double(), -1).gather(-1, i["action_ids"][..., None])[..., 0]
    ratio = torch.exp((((lp - i["old_logps"].double()) * m).sum(-1) / m.sum(-1).clamp(min=1)))
    for adv in (ADV, ADV[:, None].expand(B, T).contiguous()):
        a = adv if adv.dim() == 2 else adv[:, None]
        clipped = ((ratio[:, None] > 1.1) & (a > 0)) | ((ratio[:, None] < 1 - LO) & (a < 0))
        want = clipped.double().mean() if adv.dim() == 1 else (clipped & m).sum() / m.sum()
        options = dict(clip_eps=LO, clip_eps_high=0.1, beta=0.0, importance_sampling_level="sequence")
        if backend == "linear":
            res = linear_grpo_loss(i["policy_logits"].float(), torch.eye(V, device=DEV), i["action_ids"],
                                   i["old_logps"], None, m, advantages=adv, kernels="torch", **options)
        else:
            c = GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, advantages_input="sequence"
                                 if adv.dim() == 1 else "token", determinism_scope="topology_invariant", **options)
            res = DistributedGRPOLossOp(backend.split("/")[1]).apply(i["policy_logits"], i["action_ids"],
                                                                     i["old_logps"], contract=c, completion_mask=m,
                                                                     advantages=adv, check_values="sync")
        assert 0 < want < 1
        assert res.clip_fraction.item() == pytest.approx(want.item(), abs=1e-7)


def _sampling_logps() -> torch.Tensor:
    """The sampler's log-probs: the old ones shifted per sequence (sequence 3, the negative advantage, by +0.2, so its
    mean crosses a threshold of 0.1), one of its active tokens NaN (not scored: counts 0, as in TRL)."""
    s = INPUTS["old_logps"] + torch.tensor([0.0, 0.0, 0.0, 0.2], device=DEV)[:, None]
    s[3, INPUTS["completion_mask"][3].nonzero()[0, 0]] = float("nan")
    return s


@pytest.mark.parametrize("backend", ["native", "triton", "distributed/torch", "distributed/triton", "linear"])
def test_off_policy_mask_reads_the_sampler_log_probs(backend):
    """`sampling_logps` (TRL's `sampling_per_token_logps`) in place of the old log-probs for the off-policy mask: on
    every backend the loss and gradient of TRL's formula; without the NaN's rule (NaN as 0.0), or with the old
    log-probs, the mask would decide otherwise here."""
    sampling, options = _sampling_logps(), dict(off_policy_mask_threshold=0.1)
    x = INPUTS["policy_logits"].double().detach().requires_grad_(True)
    want = trl_loss(x, REF_LOGPS, INPUTS["old_logps"], ADV, INPUTS["completion_mask"], None, 0.04, sampling=sampling,
                    **options)
    want.backward()
    plain = trl_loss(x.detach(), REF_LOGPS, INPUTS["old_logps"], ADV, INPUTS["completion_mask"], None, 0.04, **options)
    assert abs((plain - want).item()) > 1e-3  # the sampler's log-probs drop sequence 3; the old ones keep it
    i = INPUTS
    if backend == "linear":
        hidden = i["policy_logits"].float().detach().requires_grad_(True)
        loss = linear_grpo_loss(hidden, torch.eye(V, device=DEV), i["action_ids"], i["old_logps"], None,
                                i["completion_mask"], advantages=ADV, ref_logps=REF_LOGPS, clip_eps=LO,
                                clip_eps_high=HI, sampling_logps=sampling, kernels="torch", **options).loss
        loss.backward()
        grad = hidden.grad
    else:
        xs = i["policy_logits"].detach().clone().requires_grad_(True)
        if backend.startswith("distributed"):
            loss = DistributedGRPOLossOp(backend.split("/")[1]).apply(
                xs, i["action_ids"], i["old_logps"], contract=contract(**options), completion_mask=i["completion_mask"],
                advantages=ADV, ref_logps=REF_LOGPS, sampling_logps=sampling, check_values="sync").loss
        else:
            extra = {"check_values": "sync"} if backend == "triton" else {}
            loss = kernel_registry.get_op("grpo_loss", backend=backend)(
                xs, None, i["action_ids"], i["old_logps"], None, i["completion_mask"], clip_eps=LO, clip_eps_high=HI,
                beta=0.04, advantages=ADV, ref_logps=REF_LOGPS, sampling_logps=sampling, **options, **extra)[0]
        loss.backward()
        grad = xs.grad
    assert_close_verbose(loss.detach(), want.detach(), atol=1e-6, rtol=1e-5, what=f"{backend} loss")
    assert_close_verbose(grad, x.grad, atol=1e-7, rtol=1e-4, what=f"{backend} grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_sampler_log_probs_raise_everywhere(backend):
    s = _sampling_logps()
    b, t = INPUTS["completion_mask"].nonzero()[5].tolist()
    s[b, t] = float("inf")
    with pytest.raises(LossContractError, match=rf"sampling_logps: expected finite values \(or NaN: not scored\) at "
                                                rf"active tokens, got \+-inf at \(b, t\) \[\({b}, {t}\)\]"):
        _call(backend, off_policy_mask_threshold=0.1, sampling_logps=s)
    with pytest.raises(LossContractError, match="sampling_logps: only read by the off-policy mask"):
        _call(backend, sampling_logps=_sampling_logps())


@pytest.mark.parametrize("backend", ["native", "distributed/torch", "distributed/triton", "linear"])
def test_vespo_reports_trl_gamma_weights(backend):
    """`GRPOLossResult.vespo_phi`: TRL's `get_gamma_weights` per sequence (what TRL logs as `vespo/phi_seq_mean`), and
    with advantages per token each token's, by the sign of its own advantage."""
    i, m = INPUTS, INPUTS["completion_mask"]
    lp = torch.log_softmax(i["policy_logits"].double(), -1).gather(-1, i["action_ids"][..., None])[..., 0]
    gamma, w = (2.0, 3.0, 3.0, 2.0), importance_weights("token")
    for adv in (ADV, torch.randn(B, T, generator=torch.Generator().manual_seed(4)).to(DEV)):
        a = adv.double() if adv.dim() == 2 else adv.double()[:, None]
        want = vespo_phi(lp - i["old_logps"].double(), m.double(), a, w, gamma)
        want = want[:, 0] if adv.dim() == 1 else want * m
        if backend == "linear":
            res = linear_grpo_loss(i["policy_logits"].float(), torch.eye(V, device=DEV), i["action_ids"],
                                   i["old_logps"], None, m, advantages=adv, loss_type="vespo", ref_logps=REF_LOGPS,
                                   importance_sampling_ratio=w, kernels="torch")
        elif backend == "native":
            res = NativeGRPOLossOp().apply(
                i["policy_logits"], i["action_ids"], i["old_logps"], contract=GRPOLossContract(
                    num_sequences=B, padded_seq_len=T, vocab_size=V, loss_type="vespo",
                    advantages_input="sequence" if adv.dim() == 1 else "token"),
                completion_mask=m, advantages=adv, ref_local_logits=i["ref_logits"], importance_sampling_ratio=w)
        else:
            c = GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, loss_type="vespo",
                                 advantages_input="sequence" if adv.dim() == 1 else "token",
                                 determinism_scope="topology_invariant")
            res = DistributedGRPOLossOp(backend.split("/")[1]).apply(
                i["policy_logits"], i["action_ids"], i["old_logps"], contract=c, completion_mask=m, advantages=adv,
                ref_local_logits=i["ref_logits"], importance_sampling_ratio=w, check_values="sync")
        assert (want - 1).abs().max() > 0.1  # not vacuous: the weights are not all 1
        assert_close_verbose(res.vespo_phi, want, atol=1e-6, rtol=1e-5, what=f"{backend} phi")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vespo_refuses_sequence_importance_weights(backend):
    with pytest.raises(LossContractError, match=r"importance_sampling_ratio: expected one per token \[B, T\] with "
                                                r"loss_type='vespo'.* got \[4, 1\]"):
        _call(backend, importance_weights("sequence"), loss_type="vespo")
