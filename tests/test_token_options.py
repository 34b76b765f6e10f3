"""TRL's `delta` (two-sided clipping), `use_bias_correction_kl` (the KL term times the ratio) and the rollout's
importance sampling ratio (TRL's `importance_sampling_ratio`, Liger's `vllm_is_ratio`; `[B, T]` or `[B, 1]`) on
every backend: the fast paths against TRL 1.16's formulas in float64, the deterministic path's two kernel sets
bitwise against each other, and the same errors for bad values everywhere. (The harness runs them at every TP x DP
layout against the goldens: scenarios `token_options_bf16` and `linear_token_options`.)"""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, assert_bitwise_equal, assert_close_verbose, make_inputs
from grpo_core import GRPOLossContract, LossContractError, kernel_registry
from grpo_core.distributed import DistributedGRPOLossOp
from grpo_core.linear import linear_grpo_loss

DEV = "cuda" if HAS_CUDA else "cpu"
B, T, V, H = 4, 6, 37, 16
LO, HI = 0.2, 0.28
# (delta, use_bias_correction_kl, importance weights): delta 1.05 < 1 + 0.28 makes the clipped branch the minimum
# where it passes the ratio through (its gradient is not zero there); 1.3 sits above the clip range
CASES = [(1.05, False, "token"), (1.3, True, "sequence"), (None, True, None), (1.1, False, None),
         (None, False, "token")]


def importance_weights(kind: str | None) -> torch.Tensor | None:
    if kind is None:
        return None
    g = torch.Generator().manual_seed(7)
    return (0.5 + torch.rand(B, T if kind == "token" else 1, generator=g)).to(DEV)


def trl_loss(logits, ref_logps, old, adv, mask, *, delta, bias, is_ratio, beta):
    """TRL 1.16's `_compute_loss` (token level, loss_type bnpo) in float64."""
    lp = torch.log_softmax(logits.double(), -1).gather(-1, INPUTS["action_ids"][..., None])[..., 0]
    coef_1 = torch.exp(lp - old.double())
    coef_2 = torch.clamp(coef_1, 1 - LO, 1 + HI)
    d = ref_logps.double() - lp
    kl = torch.exp(d) - d - 1
    if bias:
        kl = kl * coef_1
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    a = adv.double()[:, None]
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    if is_ratio is not None:
        per_token = per_token * is_ratio.double()
    per_token = per_token + beta * kl
    m = mask.double()
    return (per_token * m).sum() / m.sum()


INPUTS = make_inputs(B, T, V, seed=11, device=DEV)
ADV = torch.randn(B, generator=torch.Generator().manual_seed(3)).to(DEV)
REF_LOGPS = torch.log_softmax(INPUTS["ref_logits"].double(), -1).gather(
    -1, INPUTS["action_ids"][..., None])[..., 0].float()


def oracle(delta, bias, is_ratio, logits=None):
    x = (INPUTS["policy_logits"] if logits is None else logits).double().detach().requires_grad_(True)
    loss = trl_loss(x, REF_LOGPS, INPUTS["old_logps"], ADV, INPUTS["completion_mask"], delta=delta, bias=bias,
                    is_ratio=is_ratio, beta=0.04)
    loss.backward()
    return loss.detach(), x.grad


def contract(delta, bias, **kw) -> GRPOLossContract:
    return GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, clip_eps=LO, clip_eps_high=HI,
                            beta=0.04, advantages_input="sequence", delta=delta, use_bias_correction_kl=bias,
                            determinism_scope="topology_invariant", **kw)


def run(backend: str, delta, bias, is_ratio, **kw):
    """`(loss, gradient of the logits)` of one backend on the shared inputs."""
    x = INPUTS["policy_logits"].detach().clone().requires_grad_(True)
    i = INPUTS
    if backend.startswith("distributed"):
        res = DistributedGRPOLossOp(backend.split("/")[1]).apply(
            x, i["action_ids"], i["old_logps"], contract=contract(delta, bias), completion_mask=i["completion_mask"],
            advantages=ADV, ref_logps=REF_LOGPS, importance_sampling_ratio=is_ratio, check_values="sync")
        loss = res.loss
    else:
        op = kernel_registry.get_op("grpo_loss", backend=backend)
        extra = {"check_values": "sync", **kw} if backend == "triton" else {}
        loss = op(x, None, i["action_ids"], i["old_logps"], None, i["completion_mask"], clip_eps=LO,
                  clip_eps_high=HI, beta=0.04, advantages=ADV, ref_logps=REF_LOGPS, delta=delta,
                  use_bias_correction_kl=bias, importance_sampling_ratio=is_ratio, **extra)[0]
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("delta, bias, weights", CASES)
@pytest.mark.parametrize("backend", ["native", "triton", "triton/single_pass", "distributed/torch",
                                     "distributed/triton"])
def test_backends_match_trl(backend, delta, bias, weights):
    is_ratio = importance_weights(weights)
    want_loss, want_grad = oracle(delta, bias, is_ratio)
    kw = {"single_pass": True} if backend.endswith("single_pass") else {}
    loss, grad = run(backend.split("/")[0] if kw else backend, delta, bias, is_ratio, **kw)
    assert_close_verbose(loss, want_loss, atol=1e-6, rtol=1e-5, what=f"{backend} loss")
    assert_close_verbose(grad, want_grad, atol=1e-7, rtol=1e-4, what=f"{backend} grad")


@pytest.mark.parametrize("delta, bias, weights", CASES)
def test_each_option_changes_the_loss(delta, bias, weights):
    """Not vacuous: on these inputs each option moves TRL's gradient (delta binds, the weights are not all 1)."""
    _, plain = oracle(None, False, None)
    _, with_options = oracle(delta, bias, importance_weights(weights))
    assert (with_options - plain).abs().max() > 1e-4


@pytest.mark.parametrize("delta, bias, weights", CASES[:3])
def test_the_deterministic_kernel_sets_agree_bitwise(delta, bias, weights):
    is_ratio = importance_weights(weights)
    (la, ga), (lb, gb) = (run(f"distributed/{k}", delta, bias, is_ratio) for k in ("torch", "triton"))
    assert_bitwise_equal(la, lb, "loss")
    assert_bitwise_equal(ga, gb, "grad")


def test_sequence_weights_are_token_weights_repeated():
    """`[B, 1]` is `[B, T]` with each sequence's weight at every token, to the bit (deterministic path)."""
    w = importance_weights("sequence")
    (la, ga), (lb, gb) = (run("distributed/torch", 1.3, True, t) for t in (w, w.expand(B, T).contiguous()))
    assert_bitwise_equal(la, lb, "loss")
    assert_bitwise_equal(ga, gb, "grad")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_linear_loss_matches_trl(kernels):
    """The fused linear loss: its hidden-state gradient against TRL's formula on `hidden @ weight.T`."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, T, H, generator=g).to(DEV).requires_grad_(True)
    weight = (0.5 * torch.randn(V, H, generator=g)).to(DEV)
    is_ratio = importance_weights("token")
    logits = (hidden.double() @ weight.double().T).detach().requires_grad_(True)
    want = trl_loss(logits, REF_LOGPS, INPUTS["old_logps"], ADV, INPUTS["completion_mask"], delta=1.05, bias=True,
                    is_ratio=is_ratio, beta=0.04)
    want.backward()
    res = linear_grpo_loss(hidden, weight, INPUTS["action_ids"], INPUTS["old_logps"], None,
                           INPUTS["completion_mask"], advantages=ADV, ref_logps=REF_LOGPS, clip_eps=LO,
                           clip_eps_high=HI, beta=0.04, delta=1.05, use_bias_correction_kl=True,
                           importance_sampling_ratio=is_ratio, kernels=kernels)
    res.loss.backward()
    assert_close_verbose(res.loss, want, atol=1e-6, rtol=1e-5, what="loss")
    assert_close_verbose(hidden.grad, logits.grad @ weight.double(), atol=1e-6, rtol=1e-4, what="hidden grad")


def _call(backend: str, is_ratio=None, **options):
    i = INPUTS
    if backend.startswith("distributed"):
        c = contract(options.get("delta"), options.get("use_bias_correction_kl", False))
        return DistributedGRPOLossOp(backend.split("/")[1]).apply(
            i["policy_logits"], i["action_ids"], i["old_logps"], contract=c, completion_mask=i["completion_mask"],
            advantages=ADV, ref_logps=REF_LOGPS, importance_sampling_ratio=is_ratio, check_values="sync").loss
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


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_importance_weights_raise_everywhere(backend, value):
    w = importance_weights("token")
    b, t = INPUTS["completion_mask"].nonzero()[3].tolist()
    w[b, t] = value
    with pytest.raises(LossContractError, match=rf"importance_sampling_ratio: expected finite values >= 0 at active "
                                                rf"tokens, got others at \(b, t\) \[\({b}, {t}\)\]"):
        _call(backend, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_importance_weights_are_not_read(backend):
    w = importance_weights("token")
    b, t = (~INPUTS["completion_mask"]).nonzero()[0].tolist()
    poisoned = w.clone()
    poisoned[b, t] = float("nan")
    assert_bitwise_equal(_call(backend, poisoned), _call(backend, w), "loss")


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
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_options_raise_everywhere(backend, options, match):
    with pytest.raises(LossContractError, match=match):
        _call(backend, **options)


def test_fingerprint_moves_only_with_the_options():
    """Old goldens keep their fingerprints: the defaults add nothing; each option, when used, enters it."""
    plain = contract(None, False).fingerprint()
    assert GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, clip_eps=LO, clip_eps_high=HI,
                            beta=0.04, advantages_input="sequence", determinism_scope="topology_invariant"
                            ).fingerprint() == plain
    prints = {plain, contract(2.0, False).fingerprint(), contract(2.5, False).fingerprint(),
              contract(None, True).fingerprint()}
    assert len(prints) == 4
