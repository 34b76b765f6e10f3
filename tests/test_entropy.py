"""The policy's token entropies: TRL's entropy bonus (`entropy_coef`, with its gradient) and its top-entropy mask
(`top_entropy_quantile`) on every backend against TRL 1.16's formulas in float64, the entropies reported on the
contract path, the deterministic path's two kernel sets bitwise against each other, the canonical statistic against
float64, and bad options refused everywhere. (The harness runs them at every TP x DP layout against the goldens:
scenarios `entropy_bf16` and `linear_entropy`; `tests/test_trl.py` runs them inside TRL's trainer.)"""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, assert_bitwise_equal, assert_close_verbose, make_inputs
from grpo_core import GRPOLossContract, LossContractError, canonical, kernel_registry
from grpo_core.distributed import DistributedGRPOLossOp
from grpo_core.linear import linear_grpo_loss

DEV = "cuda" if HAS_CUDA else "cpu"
B, T, V, H = 4, 6, 37, 16
INPUTS = make_inputs(B, T, V, seed=11, device=DEV)
ADV = torch.randn(B, generator=torch.Generator().manual_seed(3)).to(DEV)
REF_LOGPS = torch.log_softmax(INPUTS["ref_logits"].double(), -1).gather(
    -1, INPUTS["action_ids"][..., None])[..., 0].float()
# (entropy_coef, top_entropy_quantile, temperature, importance_sampling_level)
CASES = [(0.01, 1.0, 0.7, "token"), (0.0, 0.5, 1.0, "token"), (0.05, 0.3, 1.3, "token"), (0.05, 0.5, 1.0, "sequence")]
IDS = [f"coef={c},top={t},temp={tp},{lv}" for c, t, tp, lv in CASES]


def trl_loss(logits, coef, top, temperature, level):
    """TRL 1.16's `_compute_loss` (dapo, one batch of one process, beta 0.04) in float64: the policy term on the
    kept tokens (`get_high_entropy_mask`), the KL on every active token, minus `coef` times the mean entropy of the
    kept tokens."""
    m = INPUTS["completion_mask"]
    logsm = torch.log_softmax(logits.double() / temperature, -1)
    lp = logsm.gather(-1, INPUTS["action_ids"][..., None])[..., 0]
    ent = -(logsm.exp() * torch.where(torch.isneginf(logsm), 0.0, logsm)).sum(-1)  # 0 log 0 = 0 at a -inf logit
    keep = m
    if top < 1.0:
        keep = m & (ent.detach() * m >= torch.quantile(ent.detach()[m].float(), 1 - top).double())
    log_ratio = lp - INPUTS["old_logps"].double()
    md = m.double()
    if level == "sequence":
        log_ratio = ((log_ratio * md).sum(-1) / md.sum(-1).clamp(min=1.0))[:, None]
    r, a = torch.exp(log_ratio), ADV.double()[:, None]
    d = REF_LOGPS.double() - lp
    per_token = -torch.min(r * a, r.clamp(0.8, 1.2) * a) * keep.double() + 0.04 * (torch.exp(d) - d - 1)
    kept = keep.double()
    loss = (per_token * md).sum() / md.sum() - coef * (ent * kept).sum() / kept.sum()
    return loss, ent.detach() * md, ((ent.detach() * kept).sum(-1), keep.sum(-1))


def contract(coef, top, temperature, level, **kw):
    return GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, beta=0.04, advantages_input="sequence",
                            entropy=True, entropy_coef=coef, top_entropy_quantile=top, temperature=temperature,
                            importance_sampling_level=level, **kw)


def run(backend, coef, top, temperature, level):
    """`(loss, gradient of the logits, the result or None)` of one backend."""
    i = INPUTS
    x = i["policy_logits"].detach().clone().requires_grad_(True)
    res = None
    if backend.startswith("distributed"):
        res = DistributedGRPOLossOp(backend.split("/")[1]).apply(
            x, i["action_ids"], i["old_logps"], contract=contract(coef, top, temperature, level,
                                                                   determinism_scope="topology_invariant"),
            completion_mask=i["completion_mask"], advantages=ADV, ref_logps=REF_LOGPS, check_values="sync")
    elif backend == "native_contract":
        res = kernel_registry.get_loss_op(contract(coef, top, temperature, level), backend="native").op.apply(
            x, i["action_ids"], i["old_logps"], contract=contract(coef, top, temperature, level),
            completion_mask=i["completion_mask"], advantages=ADV, ref_logps=REF_LOGPS)
    elif backend.startswith("linear"):
        x = i["policy_logits"].float().detach().clone().requires_grad_(True)
        res = kernel_registry.get_op("linear_grpo_loss", backend=backend.split("/")[1])(
            x, torch.eye(V, device=DEV), i["action_ids"], i["old_logps"], None, i["completion_mask"], advantages=ADV,
            ref_logps=REF_LOGPS, beta=0.04, temperature=temperature, importance_sampling_level=level, entropy=True,
            entropy_coef=coef, top_entropy_quantile=top)
    else:
        extra = {"check_values": "sync"} if backend == "triton" else {}
        loss = kernel_registry.get_op("grpo_loss", backend=backend)(
            x, None, i["action_ids"], i["old_logps"], None, i["completion_mask"], beta=0.04, advantages=ADV,
            ref_logps=REF_LOGPS, temperature=temperature, importance_sampling_level=level, entropy_coef=coef,
            top_entropy_quantile=top, **extra)[0]
    if res is not None:
        loss = res.loss
    loss.backward()
    return loss.detach(), x.grad, res


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["native", "native_contract", "triton", "distributed/torch", "distributed/triton",
                                     "linear/torch", "linear/triton"])
def test_backends_match_trl(backend, case):
    x = INPUTS["policy_logits"].double().detach().requires_grad_(True)
    want, want_ent, (want_kept, want_kept_tokens) = trl_loss(x, *case)
    want.backward()
    loss, grad, res = run(backend, *case)
    assert_close_verbose(loss, want.detach(), atol=1e-6, rtol=1e-5, what=f"{backend} loss")
    assert_close_verbose(grad, x.grad, atol=1e-7, rtol=1e-4, what=f"{backend} grad")
    if res is not None:  # the reported entropies, and the sums and counts over the kept tokens
        assert_close_verbose(res.token_entropy, want_ent, atol=1e-6, rtol=1e-6, what=f"{backend} token entropies")
        assert_close_verbose(res.per_sequence_kept_entropy, want_kept, atol=1e-6, rtol=1e-6, what=f"{backend} kept")
        assert res.per_sequence_kept_tokens.tolist() == want_kept_tokens.tolist()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_option_changes_the_gradient(case):
    """Not vacuous: the bonus and the mask each move TRL's gradient on these inputs."""
    coef, top, temperature, level = case
    x = INPUTS["policy_logits"].double().detach().requires_grad_(True)
    trl_loss(x, coef, top, temperature, level)[0].backward()
    y = INPUTS["policy_logits"].double().detach().requires_grad_(True)
    trl_loss(y, 0.0, 1.0, temperature, level)[0].backward()
    assert (x.grad - y.grad).abs().max() > 1e-4


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_deterministic_kernel_sets_agree_bitwise(case):
    results, grads = [], []
    for k in ("torch", "triton"):
        x = INPUTS["policy_logits"].detach().clone().requires_grad_(True)
        results.append(DistributedGRPOLossOp(k).apply(
            x, INPUTS["action_ids"], INPUTS["old_logps"],
            contract=contract(*case, determinism_scope="topology_invariant"), completion_mask=INPUTS["completion_mask"],
            advantages=ADV, ref_local_logits=INPUTS["ref_logits"], check_values="sync"))
        results[-1].loss.backward()
        grads.append(x.grad)
    for name in ("loss", "token_entropy", "per_sequence_entropy", "entropy_token_mean", "per_sequence_policy",
                 "per_sequence_kept_entropy", "per_sequence_kept_tokens"):
        assert_bitwise_equal(getattr(results[0], name).detach(), getattr(results[1], name).detach(), name)
    assert_bitwise_equal(grads[0], grads[1], "gradient")


def test_entropy_statistic_matches_float64():
    """`tile_stats(..., entropy=True)`, `merge_stats` and `entropy_of` against float64 over rows of every scale,
    rows of -inf and -0.0 logits included: within 2e-7 + 2e-7 * H (about an ulp of H; the fp32 rounding of S near 1
    bounds a peaked row's); the entropy sums leave `(M, S)` unchanged."""
    g = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 10.0, 100.0):
        x = torch.randn(6, 1000, generator=g) * scale
        x[1, 500:] = float("-inf")
        x[2] = torch.where(x[2] > 0, -0.0, x[2])
        m, s, u = canonical.tile_stats(x, 64, entropy=True)
        M, S, U = canonical.merge_stats(m, s, u)
        want = -(torch.softmax(x.double(), -1) * torch.log_softmax(x.double(), -1)).nan_to_num().sum(-1)
        assert ((canonical.entropy_of(M, S, U).double() - want).abs() <= 2e-7 + 2e-7 * want).all()
        assert all(torch.equal(a, b) for a, b in zip(canonical.merge_stats(*canonical.tile_stats(x, 64)), (M, S)))


def test_entropy_keep_is_trls_quantile():
    """`entropy_keep` keeps exactly the tokens of TRL's `get_high_entropy_mask` (torch.quantile's threshold)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        ent = torch.rand(3, 40, generator=g) * 5
        mask = torch.rand(3, 40, generator=g) < 0.6
        top = float(torch.rand((), generator=g)) * 0.98 + 0.01
        want = mask & (ent * mask >= torch.quantile(ent[mask], 1 - top))
        assert torch.equal(canonical.entropy_keep(ent, mask, top), want)
    assert not canonical.entropy_keep(ent, torch.zeros_like(mask), 0.5).any()


@pytest.mark.parametrize("options, match", [
    (dict(entropy_coef=float("nan")), "entropy_coef: expected a finite float"),
    (dict(entropy_coef=1e39), "entropy_coef: expected a float that is finite in float32"),
    (dict(entropy_coef="0.1"), "entropy_coef: expected a float, got str"),
    (dict(top_entropy_quantile=-0.1), "top_entropy_quantile: expected a finite float >= 0.0 and <= 1.0"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile: expected a finite float >= 0.0 and <= 1.0"),
    (dict(top_entropy_quantile=float("nan")), "top_entropy_quantile: expected a finite float"),
])
@pytest.mark.parametrize("backend", ["native", "triton", "distributed", "linear"])
def test_bad_options_raise_everywhere(backend, options, match):
    i = INPUTS
    with pytest.raises(LossContractError, match=match):
        if backend == "distributed":
            GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, **options)
        elif backend == "linear":
            linear_grpo_loss(i["policy_logits"].float(), torch.eye(V, device=DEV), i["action_ids"], i["old_logps"],
                             None, i["completion_mask"], advantages=ADV, beta=0.0, kernels="torch", **options)
        else:
            kernel_registry.get_op("grpo_loss", backend=backend)(
                i["policy_logits"], None, i["action_ids"], i["old_logps"], None, i["completion_mask"], beta=0.0,
                advantages=ADV, **options)
    with pytest.raises(LossContractError, match="entropy: expected a bool, got int 1"):
        GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, entropy=1)


def test_fingerprint_moves_only_with_the_options():
    """Old fingerprints stay; the report (`entropy=True`: every rank gathers the entropies, so ranks must agree),
    the bonus and the mask enter."""
    def print_of(**kw) -> str:
        return GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, advantages_input="sequence",
                                **kw).fingerprint()

    plain = print_of()
    assert plain == print_of(entropy_coef=0.0, top_entropy_quantile=1.0)
    prints = {plain, print_of(entropy=True), print_of(entropy_coef=0.1), print_of(entropy_coef=0.2),
              print_of(top_entropy_quantile=0.5)}
    assert len(prints) == 5


@pytest.mark.parametrize("backend", ["native", "triton", "distributed/torch", "distributed/triton"])
def test_minus_inf_logits_keep_the_gradient_finite(backend):
    """A -inf logit at an active token (p = 0 there: `p log p` is 0, not 0 * -inf) leaves the loss, the entropies and
    the gradient finite, with the bonus and the mask on; the loss equals the float64 formula's. (The fused linear op's
    logits come from finite hidden states: not here.)"""
    i = INPUTS
    x = i["policy_logits"].detach().clone()
    b, t = i["completion_mask"].nonzero()[2].tolist()
    x[b, t, (i["action_ids"][b, t] + 1) % V] = float("-inf")
    saved, INPUTS["policy_logits"] = INPUTS["policy_logits"], x
    try:
        loss, grad, res = run(backend, 0.05, 0.5, 1.0, "token")
        want, want_ent, _ = trl_loss(x.double(), 0.05, 0.5, 1.0, "token")
    finally:
        INPUTS["policy_logits"] = saved
    assert torch.isfinite(grad).all() and grad[b, t, (i["action_ids"][b, t] + 1) % V] == 0.0
    assert_close_verbose(loss, want, atol=1e-6, rtol=1e-5, what=f"{backend} loss")
    if res is not None:
        assert_close_verbose(res.token_entropy, want_ent, atol=1e-6, rtol=1e-6, what=f"{backend} token entropies")


def test_entropy_keep_asks_for_exact_entropies_near_the_quantile_only():
    """With entropies within the slack of the exact ones (ties among the exact ones included), `entropy_keep` keeps
    the tokens of the exact entropies' mask and asks for the exact values of a few tokens only; where the bound fails
    in the band, it asks for every token."""
    g = torch.Generator().manual_seed(2)
    slack = 2.0 ** -12
    for k in range(300):
        exact = (torch.rand(4, 64, generator=g) * 8).round(decimals=int(k % 3))  # many exact ties
        mask = torch.rand(4, 64, generator=g) < 0.8
        near = exact + (torch.rand(4, 64, generator=g) * 2 - 1) * slack * (1 + exact[mask].max())
        asked = []

        def fill(band):
            asked.append(int(band.sum()))
            return torch.where(band, exact, near)
        top = float(torch.rand((), generator=g))
        want = canonical.entropy_keep(exact, mask, top)
        assert torch.equal(canonical.entropy_keep(near, mask, top, fill, slack), want)
        if k % 3 == 2:  # no ties: only the tokens near the quantile
            assert asked[0] <= 8, asked
    exact = torch.arange(10.0)[None]
    near = exact.clone()
    near[0, 4] = 5.0  # off by more than the slack, in the band: every token exactly
    asked = []
    keep = canonical.entropy_keep(near, torch.ones_like(near, dtype=torch.bool), 0.5,
                                  lambda band: asked.append(int(band.sum())) or torch.where(band, exact, near), slack)
    assert asked == [2, 10] and keep.tolist() == [[False] * 5 + [True] * 5]


def test_online_entropies_are_within_the_slack():
    """The fast op's online entropies against the canonical ones, over rows of every scale, -inf logits and equal
    logits included, both dtypes, with a temperature: within a hundredth of the slack its mask's band assumes."""
    from grpo_core.triton.grpo_loss import ONLINE_ENTROPY_SLACK, _canonical_entropies
    from grpo_core.triton.ratio_kl import launch_forward
    worst = 0.0
    for v in (50257, 151936) if HAS_CUDA else (999,):  # the interpreter is slow
        g = torch.Generator().manual_seed(v)
        for dtype in (torch.bfloat16, torch.float32):
            for scale in (0.01, 1.0, 30.0, 300.0) if HAS_CUDA else (1.0, 30.0):
                x = torch.randn(3, 5, v, generator=g) * scale
                x[0, 0, v // 3:] = float("-inf")
                x[1, 1] = 0.0
                x = x.to(dtype).to(DEV)
                ids = torch.randint(0, v, (3, 5), generator=g).to(DEV)
                mask = torch.ones(3, 5, dtype=torch.bool, device=DEV)
                for inv in (1.0, 1 / 0.7):
                    online = launch_forward(lambda k: k, x, None, ids, mask, None, inv=inv, entropy=True)[3].view(3, 5)
                    exact = _canonical_entropies(x, ids, mask, inv)
                    worst = max(worst, float((online - exact).abs().max() / (1 + exact.max())))
    assert worst <= ONLINE_ENTROPY_SLACK / 100, worst


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_a_row_without_a_finite_logit_raises_with_the_mask(backend):
    """Its entropy is NaN: the quantile's band is skipped and the contract's error comes, not an IndexError."""
    i = INPUTS
    x = i["policy_logits"].detach().clone()
    b, t = i["completion_mask"].nonzero()[0].tolist()
    x[b, t] = float("-inf")
    extra = {"check_values": "sync"} if backend == "triton" else {}
    with pytest.raises(LossContractError, match="policy_logits"):
        kernel_registry.get_op("grpo_loss", backend=backend)(
            x, None, i["action_ids"], i["old_logps"], None, i["completion_mask"], beta=0.0, advantages=ADV,
            top_entropy_quantile=0.5, **extra)


def test_top_entropy_quantile_zero_keeps_the_largest_entropy():
    """0.0 is TRL's "all but the highest entropy token masked": the quantile at 1, the maximum."""
    ent = torch.tensor([[0.5, 2.0, 1.0], [2.0, 0.1, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert canonical.entropy_keep(ent, mask, 0.0).tolist() == [[False, True, False], [True, False, False]]


def test_the_bonus_overflow_raises_on_every_backend():
    """The loss's finiteness is checked with its bonus on the Triton paths too (their kernels flag it before)."""
    i = INPUTS
    for backend in ("native", "triton"):
        extra = {"check_values": "sync"} if backend == "triton" else {}
        with pytest.raises(LossContractError, match="loss: expected a finite float32 loss"):
            kernel_registry.get_op("grpo_loss", backend=backend)(
                i["policy_logits"], None, i["action_ids"], i["old_logps"], None, i["completion_mask"], beta=0.0,
                advantages=ADV, entropy_coef=3e38, **extra)
    for kernels in ("torch", "triton"):
        with pytest.raises(LossContractError, match="loss: expected a finite float32 loss"):
            DistributedGRPOLossOp(kernels).apply(
                i["policy_logits"], i["action_ids"], i["old_logps"], contract=GRPOLossContract(
                    num_sequences=B, padded_seq_len=T, vocab_size=V, beta=0.0, advantages_input="sequence",
                    entropy_coef=3e38, determinism_scope="topology_invariant"),
                completion_mask=i["completion_mask"], advantages=ADV, check_values="sync")


@pytest.mark.parametrize("backend", ["native", "triton", "distributed/torch", "distributed/triton"])
def test_equal_rows_stay_tied(backend):
    """Rows equal in exact math (a group's first completion token, from one prompt) have equal entropies, so the
    quantile splits none of them: with every row equal (an odd vocabulary: rows at every 16-byte alignment), a quantile
    of 0.5 keeps every active token, the loss and gradient of a quantile of 1. (The fast op's online entropies differ
    in their last bits between such rows; its mask reads the canonical ones.)"""
    n, t, v = 3, 8, 999
    g = torch.Generator().manual_seed(5)
    row = torch.randn(v, generator=g) * 3
    x = row.expand(n, t, v).contiguous().to(DEV)
    ids = torch.randint(0, v, (n, t), generator=g).to(DEV)
    old = (torch.randn(n, t, generator=g) * 0.1 - 7).to(DEV)
    mask = (torch.rand(n, t, generator=g) < 0.8).to(DEV)
    adv = torch.randn(n, generator=g).to(DEV)
    out = []
    for top in (0.5, 1.0):
        y = x.clone().requires_grad_(True)
        if backend.startswith("distributed"):
            loss = DistributedGRPOLossOp(backend.split("/")[1]).apply(
                y, ids, old, contract=GRPOLossContract(
                    num_sequences=n, padded_seq_len=t, vocab_size=v, beta=0.0, advantages_input="sequence",
                    entropy_coef=0.05, top_entropy_quantile=top, determinism_scope="topology_invariant"),
                completion_mask=mask, advantages=adv, check_values="sync").loss
        else:
            extra = {"check_values": "sync"} if backend == "triton" else {}
            loss = kernel_registry.get_op("grpo_loss", backend=backend)(
                y, None, ids, old, None, mask, beta=0.0, advantages=adv, entropy_coef=0.05, top_entropy_quantile=top,
                **extra)[0]
        loss.backward()
        out.append((loss.detach(), y.grad.float()))
    assert_close_verbose(out[0][0], out[1][0], atol=1e-6, rtol=1e-6, what=f"{backend} loss")
    assert_close_verbose(out[0][1], out[1][1], atol=1e-6, rtol=1e-4, what=f"{backend} grad")
