"""TritonGRPOLossOp: the GRPO loss from one streaming pass over each active row.

Two-pass mode (the default): the forward streams each active policy and reference row once, together, for the
log-probs; the backward streams the policy rows again and writes `coef * (onehot - softmax)`, where `coef`, the
token's `d loss / d logp`, is computed in the kernel from the saved log-probs. Besides the row kernel, the
forward launches two small ones after it, so that their host cost overlaps it: one program per sequence (its
group's advantage, its token sums, the bad-value checks) and one program for the normalizer and the weights.

Single-pass mode (`single_pass=True`): the advantages and the normalizer weights are known before the pass, so
the forward kernel computes `coef` right after the row's log-sum-exp and writes the gradient in the same program;
the backward only hands it over (scaled in place by a kernel that returns at once when `grad_output == 1`), once: a
second backward through the same graph (`retain_graph=True`) raises. It
saves HBM traffic only if the gradient loop's re-read of the policy row hits L2; on the H200 (bf16, 8192 rows of
64-297 KiB in flight) it mostly does not, and the two-pass kernels took less GPU time at every profiled
vocabulary (benchmarks/README.md), so two-pass is the default. Memory: both hold one gradient (logits dtype) at the
peak; single pass allocates it in the forward. `inplace=True` (single pass, eager only) writes it into
`policy_logits`' own storage, overwriting the logits.

Every option of the native op is computed in the kernels: a temperature scales the logits as the row kernels read
them; given advantages (`[B]` or `[B, T]`) take the place of the group statistics in the per-sequence kernel; the
normalizer (TRL's `grpo` and `dr_grpo` included) is the finish kernel's.

Bad values (ids outside `[0, V)`, non-finite old log-probs, given advantages or log-probs at active tokens,
non-finite rewards, mask values other than 0 / 1) are flagged by the kernels and turned into the native op's
`LossContractError` without a device sync (`check_values="deferred"`, `pending.py`), after one (`"sync"`), or by
a device-side assert (`"assert"`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .. import canonical, pending
from ..canonical import STD_EPS, STD_FLOOR
from ..checks import loss_options
from ..contract import (DEFAULT_VOCAB_TILE, AdvantageStd, LossContractError, Surrogate, TokenNormalizer,
                        inverse_temperature)
from .canonical import exp_of, merge_lse, row_stats
from .group_norm import FP32_MAX_TL, MODES, group_stats, group_tensors
from .group_norm import BLOCK as GROUP_BLOCK
from .launch import SURROGATES, finish_options, next_power_of_2, pick, twins
from .ratio_kl import _f32, block, check_values_after, flat, launch_forward, launch_grad

BLOCK_T = 1024


@triton.jit
def _sequence_kernel(
    out_ptr,  # fp32 [3, N] = logp, logp_ref, lse from the row kernel (SUMS)
    old_ptr,  # old log-probs [N] fp32 (SUMS)
    r_ptr,  # rewards [B] fp32, or (GIVEN) the given advantages fp32 [B] (TOKEN_ADV: [N])
    bounds_ptr,  # CSR group offsets [G + 1] int64 (not GIVEN)
    group_ptr,  # group of each sequence [B] int32 (not GIVEN)
    mask_ptr,  # completion mask [N], any dtype, nonzero = active
    ids_ptr,  # action ids [N]
    is_ptr,  # importance weights [N] fp32 (HAS_IS)
    ratio_ptr,  # the tokens' ratios [N] fp32 (GIVEN_RATIO: GSPO's sequence ratios)
    adv_ptr,  # out: the advantages the tokens read, fp32 [B] (TOKEN_ADV: [N], 0.0 at inactive tokens)
    seq_ptr,  # out: fp32 [2, B] = per-sequence token sums of the clipped surrogate and of the k3 KL (SUMS)
    counts_ptr,  # out: int64 [B] = active tokens (mask set, id in range)
    flags_ptr,  # out: int32 [1 + B]; flags_ptr[1 + b] = 1 where a mask value is not 0 / 1, an id at an active
    # token is outside [0, V), a reward of the sequence's group, the advantage derived from them (its group's sum
    # or variance overflowed) or a given advantage that an active token reads is not finite, or (SUMS) an active
    # token's old log-prob or log-probs are not finite or its importance weight not finite and >= 0
    B, T, V, lo, hi, delta, tau_pos, tau_neg, floor, eps,  # lo, hi: the ratio's bounds; delta: +inf without one
    # Meta-parameters
    HAS_REF: tl.constexpr,
    HAS_IS: tl.constexpr,
    BIAS_KL: tl.constexpr,  # the KL term times the ratio
    SURROGATE: tl.constexpr,  # 0 clipped, 1 CISPO, 2 SAPO (with tau_pos, tau_neg), 3 VESPO
    GIVEN_RATIO: tl.constexpr,
    SUMS: tl.constexpr,
    CHECK_MASK: tl.constexpr,  # the mask is not bool: its values must be 0 or 1
    GIVEN: tl.constexpr,  # the advantages are given: no group statistics
    TOKEN_ADV: tl.constexpr,  # (GIVEN) one advantage per token
    MODE: tl.constexpr,  # advantage std (not GIVEN): 0 population, 1 unbiased, 2 none, 3 unbiased + eps
    BLOCK: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    lo, hi, delta = _f32(lo), _f32(hi), _f32(delta)  # Inductor passes fp64 scalars
    tau_pos, tau_neg = _f32(tau_pos), _f32(tau_neg)
    N = B * T
    if GIVEN:
        bad_seq = 0
        if not TOKEN_ADV:
            adv = tl.load(r_ptr + b)
    else:
        g = tl.load(group_ptr + b)
        mean, scale, bad_seq = group_stats(r_ptr, tl.load(bounds_ptr + g), tl.load(bounds_ptr + g + 1), _f32(floor),
                                           _f32(eps), MODE, BLOCK_G)
        adv = (tl.load(r_ptr + b) - mean) * scale
        bad_seq = tl.maximum(bad_seq, (~(tl.abs(adv) < float("inf"))).to(tl.int32))  # NaN too
    acc_policy = tl.zeros((BLOCK,), tl.float32)
    acc_kl = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.int32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, T, BLOCK):
        t = start + tl.arange(0, BLOCK)
        row = b * T + t
        inside = t < T
        m = tl.load(mask_ptr + row, mask=inside, other=0)
        action = tl.load(ids_ptr + row, mask=inside, other=0)
        on = m != 0
        valid = (action >= 0) & (action < V)
        wrong = on & ~valid
        if CHECK_MASK:
            wrong = wrong | (on & (m != 1))
        bad = tl.maximum(bad, wrong.to(tl.int32))
        active = on & valid
        count += active.to(tl.int32)
        if TOKEN_ADV:
            a = tl.load(r_ptr + row, mask=active, other=0.0)
            tl.store(adv_ptr + row, a, mask=inside)
            bad = tl.maximum(bad, (active & ~(tl.abs(a) < float("inf"))).to(tl.int32))  # NaN too
        else:
            a = adv
        if SUMS:
            logp = tl.load(out_ptr + row, mask=inside, other=0.0)
            old = tl.load(old_ptr + row, mask=active, other=0.0)
            finite = (tl.abs(logp) < float("inf")) & (tl.abs(old) < float("inf"))  # false for NaN too
            if GIVEN_RATIO:
                ratio = tl.load(ratio_ptr + row, mask=active, other=1.0)
            else:
                ratio = tl.exp(tl.where(active, logp - old, 0.0))
            if SURROGATE == 1:
                policy = -((tl.minimum(ratio, hi) * a) * logp)
            elif SURROGATE == 3:
                policy = -(a * logp)
            elif SURROGATE == 2:
                tau = tl.where(a > 0, tau_pos, tau_neg)
                policy = -(((tl.sigmoid(tau * (ratio - 1.0)) * 4.0) / tau) * a)
            else:
                policy = -tl.minimum(tl.minimum(ratio, delta) * a, tl.minimum(tl.maximum(ratio, lo), hi) * a)
            if HAS_IS:
                w_is = tl.load(is_ptr + row, mask=active, other=0.0)
                finite = finite & (w_is >= 0.0) & (w_is < float("inf"))
                policy = policy * w_is
            acc_policy += tl.where(active, policy, 0.0)
            if HAS_REF:
                logp_ref = tl.load(out_ptr + N + row, mask=inside, other=0.0)
                finite = finite & (tl.abs(logp_ref) < float("inf"))
                d = tl.where(active, logp_ref - logp, 0.0)
                kl = tl.exp(d) - d - 1.0
                if BIAS_KL:
                    kl = kl * ratio
                acc_kl += kl
            bad = tl.maximum(bad, (active & ~finite).to(tl.int32))
    active_tokens = tl.sum(count.to(tl.int64), 0)
    if not TOKEN_ADV:
        tl.store(adv_ptr + b, adv)
        if GIVEN:  # read by the sequence's active tokens, if it has any
            bad_seq = ((active_tokens > 0) & ~(tl.abs(adv) < float("inf"))).to(tl.int32)
    tl.store(counts_ptr + b, active_tokens)
    tl.store(flags_ptr + 1 + b, tl.maximum(tl.max(bad, 0), bad_seq))
    if SUMS:
        tl.store(seq_ptr + b, tl.sum(acc_policy, 0))
        tl.store(seq_ptr + B + b, tl.sum(acc_kl, 0))


@triton.jit
def _finish_kernel(
    seq_ptr,  # fp32 [2, B] per-sequence token sums (policy, KL) (SUMS)
    counts_ptr,  # int64 [B] active tokens per sequence
    weight_ptr,  # out: fp32 [B] = d loss / d (token term) of each sequence's tokens
    scalars_ptr,  # out: fp32 [3] = loss, policy_loss, kl (SUMS)
    flags_ptr,  # int32 [1 + B]: [0] out: any flag set, or 1 where the loss is not finite; [1:] the sequence flags
    B, beta, constant,  # constant: the denominator when DENOM == "constant"
    # Meta-parameters
    MEANS: tl.constexpr,  # each sequence's token sums are divided by its active tokens first (0 when it has none)
    DENOM: tl.constexpr,  # "tokens" (the batch's active tokens), "sequences" (those with one) or "constant"
    SUMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    beta, constant = _f32(beta), _f32(constant)
    acc_policy = tl.zeros((BLOCK,), tl.float32)
    acc_kl = tl.zeros((BLOCK,), tl.float32)
    acc_tokens = tl.zeros((BLOCK,), tl.int64)
    acc_seqs = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, B, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < B
        c = tl.load(counts_ptr + i, mask=inside, other=0)
        acc_tokens += c
        acc_seqs += (c > 0).to(tl.int64)
        if SUMS:
            p = tl.load(seq_ptr + i, mask=inside, other=0.0)
            k = tl.load(seq_ptr + B + i, mask=inside, other=0.0)
            if MEANS:
                tokens = tl.maximum(c, 1).to(tl.float32)
                p = tl.where(c > 0, p / tokens, 0.0)
                k = tl.where(c > 0, k / tokens, 0.0)
            acc_policy += p
            acc_kl += k
    if DENOM == "tokens":
        denom = tl.maximum(tl.sum(acc_tokens, 0), 1).to(tl.float32)
    elif DENOM == "sequences":
        denom = tl.maximum(tl.sum(acc_seqs, 0), 1).to(tl.float32)
    else:
        denom = constant
    for start in range(0, B, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < B
        c = tl.load(counts_ptr + i, mask=inside, other=0)
        if MEANS:
            w = tl.where(c > 0, 1.0 / (tl.maximum(c, 1).to(tl.float32) * denom), 0.0)
        else:
            w = tl.full((BLOCK,), 1.0, tl.float32) / denom
        tl.store(weight_ptr + i, w, mask=inside)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, B, BLOCK):
        i = start + tl.arange(0, BLOCK)
        bad = tl.maximum(bad, tl.load(flags_ptr + 1 + i, mask=i < B, other=0))
    bad = tl.max(bad, 0)
    if SUMS:
        policy_loss = tl.sum(acc_policy, 0) / denom
        kl = tl.sum(acc_kl, 0) / denom
        loss = policy_loss + beta * kl
        tl.store(scalars_ptr, loss)
        tl.store(scalars_ptr + 1, policy_loss)
        tl.store(scalars_ptr + 2, kl)
        bad = tl.maximum(bad, tl.where(tl.abs(loss) <= FP32_MAX_TL, 0, 1))  # a NaN compares false: flagged too
    tl.store(flags_ptr, bad)


def _scale_rows_kernel(g_ptr, s_ptr, V, stride, BLOCK: tl.constexpr):
    """`g *= s` row by row, in place; a no-op (no read, no write) when `s == 1`, as after `loss.backward()`."""
    s = tl.load(s_ptr)
    if s != 1.0:
        row = g_ptr + tl.program_id(0).to(tl.int64) * stride
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            g = tl.load(row + offs, mask=offs < V).to(tl.float32)
            tl.store(row + offs, (g * s).to(g_ptr.dtype.element_ty), mask=offs < V)


_SCALE = twins(_scale_rows_kernel, ["V", "stride"])


def _forward(launch, policy, ref, ids, mask, old, source, bounds, group_of, std, lo, hi, beta, inv,
             single_pass, means, denom, constant, ref_logps=None, delta=math.inf, is_ratio=None, bias_kl=False,
             surrogate=0, tau_pos=1.0, tau_neg=1.0, grad=None, sequence=False, weigh=None, sampling=None,
             entropy=False):
    """All launches of the forward: `(out [3, N] per-token log-probs, adv [B] or [B, T], weight [B], scalars [3] =
    loss, policy_loss, kl, flags int32 [1 + B] ([0]: any bad value), grad)`. `source`: the rewards, or the given
    advantages `[B]` / `[B, T]` when `bounds` and `group_of` are None. `ref_logps` (fp32 `[B * T]`, in place of
    `ref`): the reference's log-probs as given; `delta` (+inf: none), `is_ratio` (fp32 `[B * T]`, 0.0 at masked
    tokens, or None), `bias_kl`, `surrogate` (0 clipped, 1 CISPO, 2 SAPO, 3 VESPO) and its `tau_*` as in
    `canonical.token_coef` (`lo`, `hi`: `canonical.bounds`). Two-pass mode launches the row kernel first, so that the
    host work of the other launches overlaps it. `grad`: where the single pass writes the gradient (default: a new
    tensor). `sequence` (GSPO, two-pass only): the sequence kernel reads each token's ratio from `sequence_ratio`,
    returned in the place of `grad`. `weigh` (two-pass only): `(logp [B, T], adv, is_ratio [B, T] or None) ->
    weights [B, T]`, the importance weights from whole sequences (the off-policy mask, vespo's gamma weight:
    `canonical.importance_weights`), computed once the advantages and the log-probs are known and returned last;
    `sampling` (the off-policy mask's fp32 `[B * T]` sampler log-probs): flagged where +-inf at an active token.
    `entropy` (two-pass only): `out` is `[4, N]`, the policy rows' entropies last, and `weigh` takes them as its
    fourth argument (`[B, T]`)."""
    B, T, V = policy.shape
    dev = policy.device
    ids, mask = flat(ids), flat(mask)
    given = bounds is None
    flags = torch.empty(1 + B, dtype=torch.int32, device=dev)
    adv = torch.empty(source.shape, dtype=torch.float32, device=dev)
    weight = torch.empty(B, dtype=torch.float32, device=dev)
    seq, scalars = torch.empty(2, B, dtype=torch.float32, device=dev), torch.empty(3, dtype=torch.float32, device=dev)
    counts = torch.empty(B, dtype=torch.int64, device=dev)
    if grad is None:
        grad = torch.empty(policy.shape if single_pass else (0,), dtype=policy.dtype, device=dev)

    def rows_kernel():
        return launch_forward(launch, policy, ref, ids, mask, None, old, adv, weight,
                              grad if single_pass else None, lo, hi, beta, inv, ref_logps, delta,
                              is_ratio, bias_kl, surrogate, (tau_pos, tau_neg), entropy)

    def sequences(out, sums, ratio=None):
        launch(_sequence_kernel)[(B,)](
            out, old, source, source if given else bounds, source if given else group_of, mask, ids,
            old if is_ratio is None else is_ratio, old if ratio is None else ratio, adv, seq, counts, flags, B, T, V,
            lo, hi, delta, tau_pos, tau_neg, STD_FLOOR, STD_EPS, HAS_REF=ref is not None or ref_logps is not None,
            HAS_IS=is_ratio is not None, BIAS_KL=bias_kl, SURROGATE=surrogate, GIVEN_RATIO=ratio is not None,
            SUMS=sums, CHECK_MASK=mask.dtype != torch.bool, GIVEN=given, TOKEN_ADV=source.dim() == 2, MODE=std,
            BLOCK=min(BLOCK_T, next_power_of_2(max(T, 1))), BLOCK_G=GROUP_BLOCK)
        launch(_finish_kernel)[(1,)](seq, counts, weight, scalars, flags, B, beta, constant, MEANS=means,
                                     DENOM=denom, SUMS=sums, BLOCK=min(1024, next_power_of_2(B)))

    if single_pass or weigh is not None:  # the gradient coefficient or the weights need the advantages first
        sequences(old, False)  # `old` stands in for the log-probs, which this pass does not read
    out = rows_kernel()
    if sequence:
        grad = sequence_ratio(out[0], old, mask, B)
    given_is = is_ratio
    if weigh is not None:
        is_ratio = weigh(out[0].view(B, T), adv, None if is_ratio is None else is_ratio.view(B, T),
                         out[3].view(B, T) if entropy else None)
        is_ratio = None if is_ratio is None else is_ratio.reshape(-1)
    sequences(out, True, grad if sequence else None)
    # flagged like the other inputs: a +-inf sampling log-prob at an active token, and a bad given importance weight
    # where the kernel reads the computed weights instead
    bad = [] if sampling is None else [torch.isinf(sampling)]
    if weigh is not None and given_is is not None:
        bad.append(~((given_is >= 0.0) & (given_is < math.inf)))
    if bad:
        bad = functools.reduce(torch.logical_or, bad)
        flags[0] = torch.maximum(flags[0], ((mask != 0) & bad).any().to(torch.int32))
    return out, adv, weight, scalars, flags, grad, is_ratio


def sequence_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, B: int) -> torch.Tensor:
    """GSPO's ratio at each token `[N]` (1.0 at masked ones) from the flat log-probs: torch's sum and exp of the
    sequence's mean log-ratio over its active tokens (`canonical.sequence_log_ratio` is the deterministic path's)."""
    on = (mask != 0).view(B, -1)
    log_ratio = torch.where(on, logp.view(B, -1) - old.view(B, -1), 0.0).sum(-1) / on.sum(-1).clamp(min=1)
    return torch.where(on, torch.exp(log_ratio).unsqueeze(-1), 1.0).view(-1)


@triton_op("grpo_core::grpo_forward", mutates_args={})
def grpo_forward(policy: torch.Tensor, ref: torch.Tensor | None, ids: torch.Tensor, mask: torch.Tensor,
                 old: torch.Tensor, source: torch.Tensor, bounds: torch.Tensor | None, group_of: torch.Tensor | None,
                 std: int, lo: float, hi: float, beta: float, inv: float, single_pass: bool, means: bool,
                 denom: str, constant: float, ref_logps: torch.Tensor | None, delta: float,
                 is_ratio: torch.Tensor | None, bias_kl: bool, surrogate: int, tau_pos: float, tau_neg: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out [3, N], adv [B] or [B, T], weight [B], scalars [3] = loss, policy_loss, kl, flags, grad)`: per-token
    log-probs, the advantages and normalizer weights, the loss, the bad-value flags, and in single-pass mode
    `d loss / d policy` (else an empty tensor)."""
    return _forward(wrap_triton, policy, ref, ids, mask, old, source, bounds, group_of, std, lo, hi,
                    beta, inv, single_pass, means, denom, constant, ref_logps, delta, is_ratio, bias_kl, surrogate,
                    tau_pos, tau_neg)[:6]


@triton_op("grpo_core::grpo_backward", mutates_args={})
def grpo_backward(policy: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, old: torch.Tensor,
                  adv: torch.Tensor, weight: torch.Tensor, is_ratio: torch.Tensor | None, grad_loss: torch.Tensor,
                  lo: float, hi: float, beta: float, has_ref: bool, inv: float, delta: float,
                  bias_kl: bool, surrogate: int, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """Two-pass backward: the gradient from a second stream over the policy rows."""
    return launch_grad(wrap_triton, policy, ids, mask, out, grad_loss.reshape(1), old, adv, weight, lo,
                       hi, beta, has_ref, inv, delta, is_ratio, bias_kl, surrogate, (tau_pos, tau_neg))


class _GRPOLoss(torch.autograd.Function):
    """Forward: the loss from the kernels' outputs. Backward: the precomputed gradient (single pass) or a
    second pass over the policy rows (two pass), scaled by `grad_output` in either case."""

    @staticmethod
    def forward(ctx, policy, loss, grad, ids, mask, out, old, adv, weight, is_ratio, opts, sequence=None,
                entropy_weight=None):
        ctx.opts = opts  # lo, hi, beta, has_ref, inv, delta, bias_kl, surrogate, tau_pos, tau_neg
        ctx.sequence = sequence  # GSPO: the surrogate, and `grad` holds the sequence ratios
        ctx.save_for_backward(policy, grad, ids, mask, out, old, adv, weight, is_ratio, entropy_weight)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        policy, grad, ids, mask, out, old, adv, weight, is_ratio, ent_w = ctx.saved_tensors
        grad_loss = grad_loss.float().reshape(1)
        if ctx.sequence is not None:
            grad = _sequence_grad(policy, ids, mask, out, adv, weight, is_ratio, grad, grad_loss, ctx.opts,
                                  ctx.sequence, ent_w)
        elif grad.numel() == 0:  # two pass
            if torch.compiler.is_compiling():
                grad = grpo_backward(policy, ids, mask, out, old, adv, weight, is_ratio, grad_loss, *ctx.opts)
            else:
                *rest, delta, bias_kl, surrogate, tau_pos, tau_neg = ctx.opts  # rest: lo, hi, beta, has_ref, inv
                grad = launch_grad(lambda k: k, policy, ids, mask, out, grad_loss, old, adv, weight, *rest, delta,
                                   is_ratio, bias_kl, surrogate, (tau_pos, tau_neg), ent_w)
        elif torch.compiler.is_compiling():
            grad = grad * grad_loss.to(grad.dtype)
        else:  # scaled in place by a kernel that does nothing when grad_loss == 1: no device sync, no extra pass
            if getattr(ctx, "handed_over", False):  # a second scaling would compound the first
                raise RuntimeError("single_pass: the gradient is computed in the forward and handed over once (scaled "
                                   "in place); call the loss again, or use single_pass=False, for another backward")
            ctx.handed_over = True
            g = grad.view(grad.shape[0] * grad.shape[1], grad.shape[2])  # `inplace`: the logits' row stride
            if g.shape[0] > 0:
                pick(_SCALE, g.shape[1], g.stride(0))[(g.shape[0],)](g, grad_loss, g.shape[1], g.stride(0),
                                                                     BLOCK=block(g.shape[1]))
        return (grad,) + (None,) * 12


def _sequence_grad(policy, ids, mask, out, adv, weight, is_ratio, ratio, grad_loss, opts, surrogate,
                   ent_w=None) -> torch.Tensor:
    """GSPO's backward: `canonical.sequence_coef` (with torch's exp and sigmoid) from the saved log-probs and sequence
    ratios, then the second pass with that coefficient per token."""
    lo, hi, beta, has_ref, inv, delta, bias_kl, _, tau_pos, tau_neg = opts
    on = mask != 0
    B, T = on.shape
    logp, ref = out[0].view(B, T), out[1].view(B, T) if has_ref else None
    coef = canonical.sequence_coef(ratio.view(B, T), logp, ref, adv, weight, on, canonical.fp32(lo, logp),
                                   canonical.fp32(hi, logp), beta, None if delta == math.inf else delta,
                                   None if is_ratio is None else is_ratio.view(B, T), bias_kl, surrogate,
                                   (tau_pos, tau_neg) if surrogate is Surrogate.SAPO else None, exp=torch.exp,
                                   sigmoid=torch.sigmoid)
    return launch_grad(lambda k: k, policy, ids, mask, out, coef * grad_loss, inv=inv,
                       entropy_weight=None if ent_w is None else ent_w * grad_loss)


# The online entropies lie within ONLINE_ENTROPY_SLACK * (1 + the batch's largest) of the canonical ones (a few fp32
# roundings per chunk), with a wide margin: `tests/test_entropy.py` asks for a hundredth of it over logits of scale
# 0.01 to 300, -inf and equal logits, with and without a temperature (on the GPU at V = 50257 and 151936).
ONLINE_ENTROPY_SLACK = 2.0 ** -12


def _canonical_entropies(x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, inv: float) -> torch.Tensor:
    """`[B, T]` entropies of the `[B, T, V]` logits times `inv` at the active tokens of `mask` from fixed tiles
    (`canonical.entropy_of`'s bits on every machine), for `top_entropy_quantile`'s mask: the online entropies' bits
    depend on each row's alignment, so rows equal in exact math (a group's first completion token) could fall on
    both sides of the quantile. Only the tokens near it are read again (`canonical.entropy_keep`'s `exact`)."""
    stats = row_stats(x, None, ids, mask, 0, DEFAULT_VOCAB_TILE, inv, entropy=True)[1]
    return merge_lse(stats[:1], mask, entropy=True)[1].view(mask.shape)


class TritonGRPOLossOp:
    """Same call as the native op (`NativeGRPOLossOp.__call__`, every option), plus `single_pass` (compute the
    gradient during the forward), `inplace` (implies single pass: the gradient overwrites `policy_logits`) and
    `check_values`.

    `importance_sampling_level="sequence"` (GSPO): each token's terms read its sequence's ratio, so no token's
    gradient is known before the whole sequence is read: two-pass only (`single_pass` / `inplace` are refused). The
    sequence kernel reads the ratios (`sequence_ratio`, torch ops on `[B, T]` between the kernels), and the backward
    computes each token's coefficient (`canonical.sequence_coef` on `[B, T]`) before its second pass. The off-policy
    mask (`off_policy_mask_threshold`) and vespo's gamma weight likewise: the advantages first, then the weights from
    the log-probs, which the sequence kernel and the backward read (`canonical.importance_weights`). Eager only. So
    are `entropy_coef` and `top_entropy_quantile`: the row kernel's online entropies; with a quantile below 1, the
    mask is that of the canonical entropies (equal rows stay tied), which replace the online ones of the few tokens
    near the quantile (`_canonical_entropies`, one more read of their rows; `ONLINE_ENTROPY_SLACK` bounds the
    online ones' distance), and the quantile costs a few device syncs.

    `check_values`: a bad id, mask value, reward, given advantage or old log-prob, or a non-finite log-prob,
    raises the native op's `LossContractError`. "deferred" (default): no device sync (the host can run ahead of
    the GPU); the error, naming this call, is raised at the start of a later call of a grpo_core GPU op (at the
    latest `pending.AHEAD` calls later) or by `grpo_core.raise_pending()`, and this call's numbers must not be
    used. "sync": one device sync, raised by this call. "assert": a device-side assert, which surfaces as a CUDA
    error at the next sync and leaves the CUDA context unusable, like an out-of-range target in
    `torch.nn.functional.cross_entropy` (and the only choice inside a compiled graph). The kernels never read out
    of bounds.
    """

    backend = "triton"

    def __call__(self, policy_logits: torch.Tensor, ref_logits: torch.Tensor | None, action_ids: torch.Tensor,
                 old_logps: torch.Tensor, rewards: torch.Tensor | None, completion_mask: torch.Tensor,
                 clip_eps: float = 0.2, beta: float = 0.04, samples_per_prompt: int | None = None,
                 group_boundaries: Any = None, *, clip_eps_high: float | None = None,
                 normalizer: TokenNormalizer | str | None = None, normalizer_constant: float | None = None,
                 advantage_std: AdvantageStd | str | None = None, temperature: float = 1.0,
                 advantages: torch.Tensor | None = None, loss_type: str | None = None,
                 max_completion_length: int | None = None, single_pass: bool = False, inplace: bool = False,
                 check_values: str = "deferred", ref_logps: torch.Tensor | None = None, delta: float | None = None,
                 use_bias_correction_kl: bool = False, importance_sampling_ratio: torch.Tensor | None = None,
                 sapo_temperature_pos: float | None = None, sapo_temperature_neg: float | None = None,
                 importance_sampling_level: str = "token", off_policy_mask_threshold: float | None = None,
                 sampling_logps: torch.Tensor | None = None, vespo_k_pos: float | None = None,
                 vespo_lambda_pos: float | None = None, vespo_k_neg: float | None = None,
                 vespo_lambda_neg: float | None = None, entropy_coef: float = 0.0,
                 top_entropy_quantile: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():
            pending.poll()
        o = loss_options(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, clip_eps, beta,
                         samples_per_prompt, group_boundaries, clip_eps_high, normalizer, normalizer_constant,
                         advantage_std, values=False, temperature=temperature, advantages=advantages,
                         loss_type=loss_type, max_completion_length=max_completion_length, ref_logps=ref_logps,
                         delta=delta, use_bias_correction_kl=use_bias_correction_kl,
                         importance_sampling_ratio=importance_sampling_ratio,
                         sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                         importance_sampling_level=importance_sampling_level,
                         off_policy_mask_threshold=off_policy_mask_threshold, sampling_logps=sampling_logps,
                         vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                         vespo_lambda_neg=vespo_lambda_neg, entropy_coef=entropy_coef,
                         top_entropy_quantile=top_entropy_quantile)
        weighed = o.off_policy is not None or o.gamma is not None or o.top_entropy < 1.0
        whole_sequence = o.sequence_level or weighed or o.entropy  # eager, two-pass
        if whole_sequence and (single_pass or inplace):
            raise LossContractError("single_pass / inplace: expected False with importance_sampling_level='sequence', "
                                    "off_policy_mask_threshold, loss_type='vespo', entropy_coef or "
                                    "top_entropy_quantile (each token's gradient needs its sequence's ratio, mask or "
                                    "gamma weight, or the batch's entropies, known only once every token has been "
                                    "read)")
        wants_grad = policy_logits.requires_grad and torch.is_grad_enabled()
        single = wants_grad and (bool(single_pass) or inplace)
        if inplace and not wants_grad:
            raise ValueError("inplace: writing the gradient into policy_logits needs policy_logits.requires_grad "
                             "and grad mode on")
        clip, inv = (*canonical.bounds(o.clip_eps, o.clip_eps_high, o.surrogate), o.beta), inverse_temperature(
            o.temperature)
        x = policy_logits.detach()
        B, T = o.mask.shape
        old = flat(old_logps.float())  # the kernels index [B * T] and [B] vectors densely: no strides, no offsets
        if advantages is None:
            source, groups = rewards.float().contiguous(), (*group_tensors(o.groups, x.device), MODES[o.std])
        else:  # no group statistics: the kernels read the advantages as given
            source, groups = advantages.detach().float().contiguous(), (None, None, 0)
        given_ref = None if ref_logps is None else flat(ref_logps.detach().float())  # read at active tokens only
        has_ref = ref_logits is not None or given_ref is not None
        is_ratio = (None if importance_sampling_ratio is None else
                    flat(canonical.given_logprobs(importance_sampling_ratio, o.mask)))  # 0.0 at masked tokens
        delta = math.inf if o.delta is None else o.delta
        surrogate = (SURROGATES[o.surrogate], *(o.taus or (1.0, 1.0)))
        args = (ref_logits, action_ids, completion_mask, old, source, *groups, *clip, inv, single,
                *finish_options(o.normalizer, o.constant, B), given_ref, delta, is_ratio, o.bias_kl, *surrogate)
        if inplace:  # the kernel writes the gradient over the logits it has just read: eager only
            out, adv, weight, scalars, flags, grad, _ = _forward(lambda k: k, x, *args, grad=x)
        elif torch.compiler.is_compiling() and not whole_sequence:
            out, adv, weight, scalars, flags, grad = grpo_forward(x, *args)
        else:  # GSPO: `grad` holds the tokens' sequence ratios; the off-policy mask, vespo: the importance weights
            sampling = None if sampling_logps is None else flat(sampling_logps.detach().float())
            keep = o.mask

            def weigh(logp, adv, is_ratio, ent):
                nonlocal keep
                if ent is not None and o.top_entropy < 1.0:
                    def exact(band):  # the canonical entropies in the band, written over the online ones
                        return ent.copy_(torch.where(band, _canonical_entropies(x, action_ids, band, inv), ent))
                    keep = canonical.entropy_keep(ent, o.mask, o.top_entropy, exact, ONLINE_ENTROPY_SLACK)
                return canonical.importance_weights(logp, old.view(B, T), adv, o.mask, is_ratio, o.off_policy,
                                                    None if sampling is None else sampling.view(B, T), o.gamma,
                                                    exp_of, keep)[0]
            out, adv, weight, scalars, flags, grad, is_ratio = _forward(
                lambda k: k, x, *args, sequence=o.sequence_level, sampling=sampling,
                weigh=weigh if weighed else None, entropy=o.entropy)
        loss, policy_loss, kl = scalars[0], scalars[1], scalars[2]
        ent_w = None
        if o.entropy_coef != 0.0:  # TRL's entropy bonus (`canonical.entropy_bonus`), with torch's sum
            ent = out[3].view(B, T)
            bonus, w_h = canonical.entropy_bonus(torch.where(keep, ent, 0.0).sum(-1), keep.sum(-1), o.entropy_coef)
            loss, ent_w = loss - bonus, torch.where(keep, w_h, 0.0).reshape(-1)
            flags[0] = torch.maximum(flags[0], (~torch.isfinite(loss)).to(flags.dtype))  # the loss with its bonus
        check_values_after(flags[0], check_values, "grpo_loss (triton)", policy_logits, ref_logits, action_ids,
                           old_logps, rewards, completion_mask, o.beta, out[0].view(B, T),
                           out[1].view(B, T) if has_ref else None, advantages,
                           None if advantages is not None else (o.groups, o.std), loss, ref_logps,
                           importance_sampling_ratio, sampling_logps)
        if wants_grad:
            loss = _GRPOLoss.apply(policy_logits, loss, grad, action_ids, completion_mask, out, old, adv, weight,
                                   is_ratio, (*clip, has_ref, inv, delta, o.bias_kl, *surrogate),
                                   o.surrogate if o.sequence_level else None, ent_w)
        return loss, policy_loss, kl
