"""TritonGRPOLossOp: the GRPO loss from one streaming pass over each active row.

Two-pass mode (the default): the forward streams each active policy and reference row once, together, for the
log-probs; the backward streams the policy rows again and writes `coef * (onehot - softmax)`, where `coef`, the
token's `d loss / d logp`, is computed in the kernel from the saved log-probs. One kernel per sequence forms the
token sums and one program applies the normalizer.

Single-pass mode (`single_pass=True`): the advantages and the normalizer weights are known before the pass, so
the forward kernel computes `coef` right after the row's log-sum-exp and writes the gradient in the same program;
the backward only hands it over (scaled when `grad_output != 1`). It saves HBM traffic only if the gradient
loop's re-read of the policy row hits L2. Measured on the H200 (bf16, 8192 rows of 64-297 KiB, one warp per row,
every row in flight at once), it does not: the re-read streams from HBM, and the two-pass kernels were faster at
every vocabulary size (benchmarks/README.md), so two-pass is the default. Memory: both hold one gradient (logits
dtype) at the peak; single pass allocates it in the forward. `inplace=True` (single pass, eager only) writes it
into `policy_logits`' own storage, overwriting the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..contract import AdvantageStd, TokenNormalizer
from ..native.grpo_loss import loss_options
from ..reduction import token_weights
from .group_norm import group_advantages
from .ratio_kl import _f32, check_values_after, flat, launch_forward, launch_grad

BLOCK_T = 1024


@triton.jit
def _sequence_sums_kernel(
    out_ptr,  # fp32 [3, N] = logp, logp_ref, lse from the row kernel
    old_ptr,  # old log-probs [N] fp32
    adv_ptr,  # advantages [B] fp32
    mask_ptr,  # completion mask [N]
    ids_ptr,  # action ids [N] (tokens with an out-of-range id count as masked; the call raises afterwards)
    seq_ptr,  # out: fp32 [2, B] = per-sequence token sums of the clipped surrogate and of the k3 KL
    B, T, V, clip_low, clip_high,
    # Meta-parameters
    HAS_REF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    clip_low, clip_high = _f32(clip_low), _f32(clip_high)  # Inductor passes fp64 scalars
    N = B * T
    adv = tl.load(adv_ptr + b)
    acc_policy = tl.zeros((BLOCK,), tl.float32)
    acc_kl = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, T, BLOCK):
        t = start + tl.arange(0, BLOCK)
        row = b * T + t
        inside = t < T
        action = tl.load(ids_ptr + row, mask=inside, other=0)
        active = (tl.load(mask_ptr + row, mask=inside, other=0) != 0) & (action >= 0) & (action < V)
        logp = tl.load(out_ptr + row, mask=inside, other=0.0)
        ratio = tl.exp(tl.where(active, logp - tl.load(old_ptr + row, mask=active, other=0.0), 0.0))
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
        acc_policy += tl.where(active, -tl.minimum(ratio * adv, clipped * adv), 0.0)
        if HAS_REF:
            d = tl.where(active, tl.load(out_ptr + N + row, mask=inside, other=0.0) - logp, 0.0)
            acc_kl += tl.exp(d) - d - 1.0
    tl.store(seq_ptr + b, tl.sum(acc_policy, 0))
    tl.store(seq_ptr + B + b, tl.sum(acc_kl, 0))


@triton.jit
def _finish_kernel(
    seq_ptr,  # fp32 [2, B] per-sequence token sums (policy, KL)
    counts_ptr,  # int64 [B] active tokens per sequence
    scalars_ptr,  # out: fp32 [3] = loss, policy_loss, kl
    B, beta, constant,
    # Meta-parameters
    NORMALIZER: tl.constexpr,  # 0 global_active_tokens, 1 per_sequence_then_mean, 2 fixed_constant
    BLOCK: tl.constexpr,
):
    beta, constant = _f32(beta), _f32(constant)
    acc_policy = tl.zeros((BLOCK,), tl.float32)
    acc_kl = tl.zeros((BLOCK,), tl.float32)
    acc_n = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, B, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < B
        p = tl.load(seq_ptr + i, mask=inside, other=0.0)
        k = tl.load(seq_ptr + B + i, mask=inside, other=0.0)
        c = tl.load(counts_ptr + i, mask=inside, other=0)
        if NORMALIZER == 1:
            denom = tl.maximum(c, 1).to(tl.float32)
            p = tl.where(c > 0, p / denom, 0.0)
            k = tl.where(c > 0, k / denom, 0.0)
            c = tl.where(c > 0, 1, 0).to(tl.int64)  # count sequences, not tokens
        acc_policy += p
        acc_kl += k
        acc_n += c
    if NORMALIZER == 2:
        denom = constant
    else:
        denom = tl.maximum(tl.sum(acc_n, 0), 1).to(tl.float32)
    policy_loss = tl.sum(acc_policy, 0) / denom
    kl = tl.sum(acc_kl, 0) / denom
    tl.store(scalars_ptr, policy_loss + beta * kl)
    tl.store(scalars_ptr + 1, policy_loss)
    tl.store(scalars_ptr + 2, kl)


_NORMALIZERS = {TokenNormalizer.GLOBAL_ACTIVE_TOKENS: 0, TokenNormalizer.PER_SEQUENCE_THEN_MEAN: 1,
                TokenNormalizer.FIXED_CONSTANT: 2}


def _forward(launch, policy, ref, ids, mask, old, adv, weight, counts, clip_low, clip_high, beta, single_pass,
             normalizer, constant, grad=None):
    """All launches of the forward. `grad`: where the single pass writes the gradient (default: a new tensor)."""
    B, T, V = policy.shape
    if grad is None:
        grad = torch.empty(policy.shape if single_pass else (0,), dtype=policy.dtype, device=policy.device)
    out, err = launch_forward(launch, policy, ref, ids, mask, old, adv, weight, grad if single_pass else None,
                              clip_low, clip_high, beta)
    seq = torch.empty(2, B, dtype=torch.float32, device=out.device)
    launch(_sequence_sums_kernel)[(B,)](out, flat(old), adv, flat(mask), flat(ids), seq, B, T, V, clip_low, clip_high,
                                        HAS_REF=ref is not None, BLOCK=min(BLOCK_T, triton.next_power_of_2(T)))
    scalars = torch.empty(3, dtype=torch.float32, device=out.device)
    launch(_finish_kernel)[(1,)](seq, counts, scalars, B, beta, constant, NORMALIZER=normalizer,
                                 BLOCK=min(1024, triton.next_power_of_2(B)))
    return out, err, scalars, grad


@triton_op("grpo_core::grpo_forward", mutates_args={})
def grpo_forward(policy: torch.Tensor, ref: torch.Tensor | None, ids: torch.Tensor, mask: torch.Tensor,
                 old: torch.Tensor, adv: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, clip_low: float,
                 clip_high: float, beta: float, single_pass: bool, normalizer: int, constant: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out [3, N], err [1], scalars [3] = loss, policy_loss, kl, grad)`: per-token log-probs, the bad-id flag,
    the normalized loss, and in single-pass mode `d loss / d policy` (else an empty tensor)."""
    return _forward(wrap_triton, policy, ref, ids, mask, old, adv, weight, counts, clip_low, clip_high, beta,
                    single_pass, normalizer, constant)


@triton_op("grpo_core::grpo_backward", mutates_args={})
def grpo_backward(policy: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, old: torch.Tensor,
                  adv: torch.Tensor, weight: torch.Tensor, grad_loss: torch.Tensor, clip_low: float, clip_high: float,
                  beta: float, has_ref: bool) -> torch.Tensor:
    """Two-pass backward: the gradient from a second stream over the policy rows."""
    return launch_grad(wrap_triton, policy, ids, mask, out, grad_loss.reshape(1), old, adv, weight, clip_low,
                       clip_high, beta, has_ref)


class _GRPOLoss(torch.autograd.Function):
    """Forward: the loss from the kernels' outputs. Backward: the precomputed gradient (single pass) or a
    second pass over the policy rows (two pass), scaled by `grad_output` in either case."""

    @staticmethod
    def forward(ctx, policy, loss, grad, ids, mask, out, old, adv, weight, opts):
        ctx.opts = opts
        ctx.save_for_backward(policy, grad, ids, mask, out, old, adv, weight)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        policy, grad, ids, mask, out, old, adv, weight = ctx.saved_tensors
        if grad.numel() == 0:  # two pass
            args = (policy, ids, mask, out, old, adv, weight, grad_loss.float(), *ctx.opts)
            if torch.compiler.is_compiling():
                grad = grpo_backward(*args)
            else:
                grad = launch_grad(lambda k: k, *args[:4], args[7].reshape(1), *args[4:7], *ctx.opts)
        elif torch.compiler.is_compiling() or not bool(grad_loss == 1.0):  # loss.backward(): no extra pass
            grad = grad * grad_loss.to(grad.dtype)
        return (grad,) + (None,) * 9


class TritonGRPOLossOp:
    """Same call as the native op (`NativeGRPOLossOp.__call__`), plus `single_pass` (compute the gradient during
    the forward) and `inplace` (implies single pass: the gradient overwrites `policy_logits`)."""

    backend = "triton"

    def __call__(self, policy_logits: torch.Tensor, ref_logits: torch.Tensor | None, action_ids: torch.Tensor,
                 old_logps: torch.Tensor, rewards: torch.Tensor, completion_mask: torch.Tensor,
                 clip_eps: float = 0.2, beta: float = 0.04, samples_per_prompt: int | None = None,
                 group_boundaries: Any = None, *, clip_eps_high: float | None = None,
                 normalizer: TokenNormalizer | str = TokenNormalizer.GLOBAL_ACTIVE_TOKENS,
                 normalizer_constant: float | None = None, advantage_std: AdvantageStd | str = AdvantageStd.POPULATION,
                 single_pass: bool = False, inplace: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        o = loss_options(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, clip_eps, beta,
                         samples_per_prompt, group_boundaries, clip_eps_high, normalizer, normalizer_constant,
                         advantage_std, values=False)
        wants_grad = policy_logits.requires_grad and torch.is_grad_enabled()
        single = wants_grad and (bool(single_pass) or inplace)
        if inplace and not wants_grad:
            raise ValueError("inplace: writing the gradient into policy_logits needs policy_logits.requires_grad "
                             "and grad mode on")
        old = old_logps.float()
        adv, reward_err = group_advantages(rewards, o.groups, o.std)
        counts = o.mask.sum(-1)
        weight = token_weights(counts, o.normalizer, o.constant)
        clip = (o.clip_eps, o.clip_eps_high, o.beta)
        x = policy_logits.detach()
        args = (ref_logits, action_ids, o.mask, old, adv, weight, counts, *clip, single, _NORMALIZERS[o.normalizer],
                o.constant or 1.0)
        if inplace:  # the kernel writes the gradient over the logits it has just read: eager only
            out, err, scalars, grad = _forward(lambda k: k, x, *args, grad=x)
        elif torch.compiler.is_compiling():
            out, err, scalars, grad = grpo_forward(x, *args)
        else:
            out, err, scalars, grad = _forward(lambda k: k, x, *args)
        loss, policy_loss, kl = scalars[0], scalars[1], scalars[2]
        check_values_after(err + reward_err, policy_logits, ref_logits, action_ids, old_logps, rewards,
                           completion_mask, o.beta)
        if wants_grad:
            loss = _GRPOLoss.apply(policy_logits, loss, grad, action_ids, o.mask, out, old, adv, weight,
                                   (*clip, ref_logits is not None))
        return loss, policy_loss, kl
