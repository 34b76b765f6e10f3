"""Per-token log-probs of the policy and the reference from one streaming pass over the vocabulary.

`_logprob_fwd_kernel` reads each active token's policy row and reference row once (online max / sum-exp in fp32,
one exp per element) and, in single-pass mode, computes the GRPO gradient coefficient of the token and writes
`g * (onehot - softmax)` in the same program, re-reading the policy row while it is still in L2. Masked tokens
read no logits. `_logprob_grad_kernel` is the classic second pass (two-pass mode and the `ratio_kl` backward).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..contract import check_inputs
from ..native.ratio_kl import ratio_and_kl

BLOCK_V = int(os.environ.get("GRPO_TRITON_BLOCK_V", 4096))  # vocabulary chunk per loop iteration
NUM_WARPS = int(os.environ.get("GRPO_TRITON_NUM_WARPS", 8))


@triton.jit
def _online_update(x, m, s):
    m_new = tl.maximum(m, tl.max(x, 0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk of -inf logits adds 0, not NaN
    return m_new, s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)


@triton.jit
def _rows_lse(x_row_ptr, r_row_ptr, V, HAS_REF: tl.constexpr, BLOCK: tl.constexpr):
    """Online log-sum-exp of the policy row (and the reference row, in the same loop) in fp32: one exp per
    element, one rescale per chunk. Both rows stream together, so twice the bytes are in flight per step."""
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    m_ref = tl.full((), float("-inf"), tl.float32)
    s_ref = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + cols
        x = tl.load(x_row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        if HAS_REF:
            r = tl.load(r_row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            m_ref, s_ref = _online_update(r, m_ref, s_ref)
        m, s = _online_update(x, m, s)
    return m + tl.log(s), m_ref + tl.log(s_ref)


@triton.jit
def _write_grad(x_row_ptr, g_row_ptr, V, lse, coef, action, active, BLOCK: tl.constexpr):
    """`coef * (onehot(action) - exp(x - lse))` in the gradient's dtype; exact zeros when not active."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        offs = start + cols
        inside = offs < V
        x = tl.load(x_row_ptr + offs, mask=offs < tl.where(active, V, 0), other=0.0).to(tl.float32)
        grad = coef * (tl.where(offs == action, 1.0, 0.0) - tl.exp(x - lse))
        grad = tl.where(active, grad, 0.0)
        tl.store(g_row_ptr + offs, grad.to(g_row_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _logprob_fwd_kernel(
    x_ptr,  # policy logits [N, V], rows `stride_x` apart
    r_ptr,  # reference logits [N, V], rows `stride_r` apart (read only with HAS_REF)
    ids_ptr,  # action ids [N]
    mask_ptr,  # completion mask [N], nonzero = active
    out_ptr,  # out: fp32 [3, N] = logp, logp_ref, lse (0.0 on masked tokens)
    err_ptr,  # out: int32 [1], set to 1 when an active id is outside [0, V)
    old_ptr,  # old log-probs [N] fp32 (SINGLE_PASS)
    adv_ptr,  # advantages [N // T] fp32 (SINGLE_PASS)
    w_ptr,  # normalizer weight per sequence [N // T] fp32 (SINGLE_PASS)
    g_ptr,  # out: gradient [N, V] in the logits dtype, rows `stride_g` apart (SINGLE_PASS)
    N, T, V,
    stride_x, stride_r, stride_g,
    clip_low, clip_high, beta,
    # Meta-parameters
    HAS_REF: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    active = tl.load(mask_ptr + row) != 0
    action = tl.load(ids_ptr + row).to(tl.int64)
    valid = (action >= 0) & (action < V)
    tl.store(err_ptr, 1, mask=active & ~valid)
    active = active & valid
    logp = tl.zeros((), tl.float32)
    logp_ref = tl.zeros((), tl.float32)
    lse = tl.zeros((), tl.float32)
    if active:
        lse, lse_ref = _rows_lse(x_ptr + row * stride_x, r_ptr + row * stride_r, V, HAS_REF, BLOCK)
        logp = tl.load(x_ptr + row * stride_x + action).to(tl.float32) - lse
        if HAS_REF:
            logp_ref = tl.load(r_ptr + row * stride_r + action).to(tl.float32) - lse_ref
    tl.store(out_ptr + row, logp)
    tl.store(out_ptr + N + row, logp_ref)
    tl.store(out_ptr + 2 * N + row, lse)
    if SINGLE_PASS:
        # d loss / d logp of this token: w * (d policy / d logp + beta * d kl / d logp).
        seq = row // T
        adv = tl.load(adv_ptr + seq)
        ratio = tl.exp(logp - tl.load(old_ptr + row))
        unclipped = ratio * adv
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high) * adv
        coef = tl.where(unclipped <= clipped, -unclipped, 0.0)
        if HAS_REF:
            coef += beta * (1.0 - tl.exp(logp_ref - logp))
        coef = coef * tl.load(w_ptr + seq)
        _write_grad(x_ptr + row * stride_x, g_ptr + row * stride_g, V, lse, coef, action, active, BLOCK)


@triton.jit
def _logprob_grad_kernel(
    x_ptr,  # policy logits [N, V], rows `stride_x` apart
    ids_ptr,  # action ids [N]
    mask_ptr,  # completion mask [N]
    lse_ptr,  # policy log-sum-exp [N] fp32 from the forward
    coef_ptr,  # d loss / d logp per token [N] fp32
    g_ptr,  # out: gradient [N, V], rows `stride_g` apart
    V, stride_x, stride_g,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    action = tl.load(ids_ptr + row).to(tl.int64)
    active = (tl.load(mask_ptr + row) != 0) & (action >= 0) & (action < V)
    _write_grad(x_ptr + row * stride_x, g_ptr + row * stride_g, V, tl.load(lse_ptr + row), tl.load(coef_ptr + row),
                action, active, BLOCK)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`[B, T, V]` as `[N, V]` rows with unit column stride (a copy only when the layout demands one)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _block(V: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(V))


@triton_op("grpo_core::token_logprobs", mutates_args={})
def token_logprobs(policy: torch.Tensor, ref: torch.Tensor | None, ids: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out [3, N] = logp, logp_ref, lse, err [1])` for `[B, T, V]` logits; one pass over each active row."""
    x = _rows(policy)
    r = _rows(ref) if ref is not None else x
    N, V = x.shape
    ids, mask = ids.contiguous().view(-1), mask.contiguous().view(-1)
    out = torch.empty(3, N, dtype=torch.float32, device=x.device)
    err = torch.zeros(1, dtype=torch.int32, device=x.device)
    wrap_triton(_logprob_fwd_kernel)[(N,)](
        x, r, ids, mask, out, err, out, out, out, x, N, 1, V, x.stride(0), r.stride(0), 0,
        0.0, 0.0, 0.0, HAS_REF=ref is not None, SINGLE_PASS=False, BLOCK=_block(V), num_warps=NUM_WARPS)
    return out, err


@triton_op("grpo_core::token_logprob_grad", mutates_args={})
def token_logprob_grad(policy: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, lse: torch.Tensor,
                       coef: torch.Tensor) -> torch.Tensor:
    """`coef * (onehot - softmax(policy))` per token, `[B, T, V]` in the logits dtype; zeros on masked tokens."""
    x = _rows(policy)
    N, V = x.shape
    grad = torch.empty((N, V), dtype=policy.dtype, device=policy.device)
    wrap_triton(_logprob_grad_kernel)[(N,)](
        x, ids.contiguous().view(-1), mask.contiguous().view(-1), lse.contiguous(), coef.float().contiguous().view(-1),
        grad, V,
        x.stride(0), grad.stride(0), BLOCK=_block(V), num_warps=NUM_WARPS)
    return grad.view(policy.shape)


def _setup(ctx, inputs, output):
    policy, _, ids, mask = inputs
    out, _ = output
    ctx.save_for_backward(policy, ids, mask, out[2])


def _backward(ctx, grad_out, grad_err):
    policy, ids, mask, lse = ctx.saved_tensors
    # Only logp (row 0) depends on the policy; logp_ref and lse are treated as constants of the loss.
    return token_logprob_grad(policy, ids, mask, lse, grad_out[0]), None, None, None


token_logprobs.register_autograd(_backward, setup_context=_setup)


def check_values_after(err: torch.Tensor, policy_logits, ref_logits, action_ids, old_logps, rewards,
                       completion_mask, beta: float) -> None:
    """One device sync after the kernels: if a kernel flagged an id, or a reward or mask value is bad, rerun the
    full checks for the precise error. (The kernels never read out of bounds: flagged tokens are skipped.)"""
    bad = err.any()
    if rewards is not None:
        bad = bad | ~torch.isfinite(rewards).all()
    if completion_mask.dtype != torch.bool:
        bad = bad | ((completion_mask != 0) & (completion_mask != 1)).any()
    if torch.compiler.is_compiling():  # no Python branch on device data inside a graph: a device-side assert
        torch._assert_async(~bad, "grpo_core: bad action_ids, rewards or completion_mask (run eagerly for details)")
    elif bool(bad):
        check_inputs(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, beta=beta)


class TritonRatioKLOp:
    """`ratio, kl = op(policy_logits, ref_logits, action_ids, completion_mask, old_logps)`, each fp32 `[B, T]`."""

    backend = "triton"

    def __call__(self, policy_logits, ref_logits, action_ids, completion_mask, old_logps):
        mask = check_inputs(policy_logits, ref_logits, action_ids, old_logps, None, completion_mask, beta=1.0,
                            values=False)
        out, err = token_logprobs(policy_logits, ref_logits, action_ids, mask.view(torch.int8))
        check_values_after(err, policy_logits, ref_logits, action_ids, old_logps, None, completion_mask, 1.0)
        shape = mask.shape
        return ratio_and_kl(out[0].view(shape), out[1].view(shape), old_logps, mask)
