"""Per-token log-probs of the policy and the reference from one streaming pass over the vocabulary.

`_logprob_fwd_kernel` reads each active token's policy row and reference row once, together (online max /
sum-exp in fp32, one exp per element) and, in single-pass mode, computes the token's GRPO gradient coefficient
and writes `coef * (onehot - softmax)` in the same program (a second read of the policy row, which comes from L2
only if the row is still there). Masked tokens (and tokens whose id is out of range, which raise afterwards) read
no logits. Rows are read in chunks aligned to 16-byte boundaries, so that odd vocabularies (50257) still get
vector loads: an active row's first chunk may cover up to 14 bytes of the row before it, which are discarded.
`_logprob_grad_kernel` is the classic second pass (two-pass mode and the `ratio_kl` backward); where both tensors'
rows start on 16-byte boundaries it runs plain chunks from each row's start (`_plain_grad_row`, the same bits).

A temperature (SCALE) multiplies the fp32 logits by `inv = fp32(1 / temperature)` as they are read, in both
kernels, and the gradient wrt the logits is `inv *` the gradient wrt the scaled logits; at temperature 1 the
kernels are those without it.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .. import canonical, pending
from ..checks import check_derived_advantages, check_inputs, check_logprobs, check_loss, stand_in
from ..contract import LossContractError
from .launch import next_power_of_2, pick, twins

# One program per token row, thousands of rows in flight. Defaults from the H200 sweeps in benchmarks/README.md
# (4 warps x 4096-wide chunks x 3 stages were best on average over V = 32768 .. 151936); overridable for sweeps.
BLOCK_V = int(os.environ.get("GRPO_TRITON_BLOCK_V", 4096))  # vocabulary chunk per loop iteration
NUM_WARPS = int(os.environ.get("GRPO_TRITON_NUM_WARPS", 4))
NUM_STAGES = int(os.environ.get("GRPO_TRITON_NUM_STAGES", 3))


@triton.jit
def _f32(x):
    return tl.cast(x, tl.float32)


@triton.jit
def _scaled(x, inv, SCALE: tl.constexpr):
    """Logits as the loss reads them: fp32, times the inverse temperature `inv` with SCALE."""
    x = x.to(tl.float32)
    if SCALE:
        x = x * inv
    return x


@triton.jit
def _online_update(x, m, s, u, ENTROPY: tl.constexpr = False):
    """One chunk `x` into the running max `m` and `sum exp(x - m)` `s`; ENTROPY: and `u = sum exp(x - m) (x - m)`
    (`canonical.tile_stats`' entropy sum, online: the old sums move to the new max before the chunk's add)."""
    m_new = tl.maximum(m, tl.max(x, 0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk of -inf logits adds 0, not NaN
    a = tl.exp(m - shift)
    d = x - shift
    e = tl.exp(d)
    if ENTROPY:
        u = tl.where(s > 0.0, (u + s * (m - shift)) * a, 0.0) + tl.sum(tl.where(e > 0.0, e * d, 0.0), 0)
    return m_new, s * a + tl.sum(e, 0), u


@triton.jit
def _aligned_row(ptr, row, stride, VEC: tl.constexpr):
    """`(base, shift)`: `base` points `shift` elements before the start of `row`, at the 16-byte boundary (`VEC`
    elements) at or before it, so that chunks read from `base` are aligned vectors even when the row stride is
    odd (V = 50257). Assumes a 16-byte-aligned `ptr`, as Triton does when it specializes the kernel for one;
    otherwise the loads stay correct, just narrower. Never before `ptr`: `row * stride - shift >= 0`."""
    start = row * stride
    shift = start % VEC
    return ptr + tl.multiple_of(start - shift, VEC), shift


@triton.jit
def _rows_lse(x_ptr, r_ptr, row, stride_x, stride_r, V, inv, HAS_REF: tl.constexpr, SCALE: tl.constexpr,
              VEC_X: tl.constexpr, VEC_R: tl.constexpr, BLOCK: tl.constexpr, ENTROPY: tl.constexpr = False):
    """Online log-sum-exp of the policy row (and the reference row, in the same loop) in fp32, of the logits
    times `inv` with SCALE: one exp per element, one rescale per chunk. Both rows stream together, so twice the
    bytes are in flight per step. Chunks start at 16-byte boundaries: the body loads are unmasked aligned vectors;
    the few columns before the row (first chunk, in bounds: the previous row) count as -inf, and the tail is read
    in small masked chunks. Returns `(lse, lse_ref, entropy)` (ENTROPY: the policy row's `log s - u / s`, else 0)."""
    cols = tl.arange(0, BLOCK)
    x_base, sx = _aligned_row(x_ptr, row, stride_x, VEC_X)
    r_base, sr = _aligned_row(r_ptr, row, stride_r, VEC_R)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)
    u_ref = tl.zeros((), tl.float32)
    m_ref = tl.zeros((), tl.float32)
    s_ref = tl.full((), 1.0, tl.float32)
    if HAS_REF:
        m_ref = tl.full((), float("-inf"), tl.float32)
        s_ref = tl.zeros((), tl.float32)
    full = (V + tl.minimum(sx, sr)) // BLOCK  # whole chunks that end inside both rows
    if full > 0:  # the first chunk starts before the row (columns < 0: in bounds, the previous row)
        x = tl.where(cols >= sx, _scaled(tl.load(x_base + cols), inv, SCALE), float("-inf"))
        if HAS_REF:
            r = tl.where(cols >= sr, _scaled(tl.load(r_base + cols), inv, SCALE), float("-inf"))
            m_ref, s_ref, u_ref = _online_update(r, m_ref, s_ref, u_ref)
        m, s, u = _online_update(x, m, s, u, ENTROPY)
    for k in range(1, full):  # unmasked, aligned
        offs = k * BLOCK + cols
        x = _scaled(tl.load(x_base + offs), inv, SCALE)
        if HAS_REF:
            m_ref, s_ref, u_ref = _online_update(_scaled(tl.load(r_base + offs), inv, SCALE), m_ref, s_ref, u_ref)
        m, s, u = _online_update(x, m, s, u, ENTROPY)
    SUB: tl.constexpr = 256 if BLOCK > 256 else BLOCK
    tail = tl.arange(0, SUB)
    for start in range(full * BLOCK, V + tl.maximum(sx, sr), SUB):  # small masked chunks: few registers
        offs = start + tail
        x = _scaled(tl.load(x_base + offs, mask=(offs >= sx) & (offs < V + sx), other=float("-inf")), inv, SCALE)
        if HAS_REF:
            r = _scaled(tl.load(r_base + offs, mask=(offs >= sr) & (offs < V + sr), other=float("-inf")), inv, SCALE)
            m_ref, s_ref, u_ref = _online_update(r, m_ref, s_ref, u_ref)
        m, s, u = _online_update(x, m, s, u, ENTROPY)
    ent = tl.zeros((), tl.float32)
    if ENTROPY:
        ent = tl.log(s) - u / s
    return m + tl.log(s), m_ref + tl.log(s_ref), ent


@triton.jit
def _token_coef(logp, logp_ref, old, adv, weight, lo, hi, beta, delta, w_is, tau_pos, tau_neg,
                HAS_REF: tl.constexpr, HAS_IS: tl.constexpr, BIAS_KL: tl.constexpr, SURROGATE: tl.constexpr):
    """d loss / d logp of one token: `weight * (d policy / d logp + beta * d kl / d logp)`, the terms of
    `canonical.token_coef` (`lo`, `hi`: `canonical.bounds`; `delta` +inf: none; `w_is`: the importance weight,
    HAS_IS; BIAS_KL: the KL times the ratio; SURROGATE 0 clipped, 1 CISPO, 2 SAPO with `tau_pos`, `tau_neg`, 3 VESPO,
    its gamma weight in `w_is`)."""
    ratio = tl.exp(logp - old)
    if SURROGATE == 1:
        coef = -(tl.minimum(ratio, hi) * adv)
    elif SURROGATE == 3:
        coef = -adv
    elif SURROGATE == 2:
        s = tl.sigmoid(tl.where(adv > 0, tau_pos, tau_neg) * (ratio - 1.0))
        coef = -((((s * (1.0 - s)) * 4.0) * ratio) * adv)
    else:
        clipped = tl.minimum(tl.maximum(ratio, lo), hi) * adv
        # the minimum's branch, and whether its clamp passes the ratio
        taken = tl.where(tl.minimum(ratio, delta) * adv <= clipped, ratio <= delta, (ratio >= lo) & (ratio <= hi))
        coef = tl.where(taken, -(ratio * adv), 0.0)
    if HAS_IS:
        coef = coef * w_is
    if HAS_REF:
        d = logp_ref - logp
        if BIAS_KL:
            dkl = -(d * ratio)  # d/dlogp (kl * ratio), exactly: no cancellation
        else:
            dkl = 1.0 - tl.exp(d)
        coef += beta * dkl
    return coef * weight


@triton.jit
def _grad_chunk(x_base, g_base, start, shift, V, lse, coef, action, active, inv, ch, h, SCALE: tl.constexpr,
                MASKED: tl.constexpr, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    c = offs - shift  # column
    if MASKED:  # the head (columns before the row belong to the previous row) and the tail
        inside = (c >= 0) & (c < V)
        x = _scaled(tl.load(x_base + offs, mask=(c >= 0) & (c < tl.where(active, V, 0)), other=0.0), inv, SCALE)
    else:
        x = _scaled(tl.load(x_base + offs, mask=tl.arange(0, BLOCK) < tl.where(active, BLOCK, 0), other=0.0), inv,
                    SCALE)
    lp = x - lse
    p = tl.exp(lp)
    grad = coef * (tl.where(c == action, 1.0, 0.0) - p)
    if ENTROPY:
        grad = grad + ch * tl.where(p > 0.0, p * (lp + h), 0.0)
    grad = tl.where(active, grad, 0.0)
    if MASKED:
        tl.store(g_base + offs, grad.to(g_base.dtype.element_ty), mask=inside)
    else:
        tl.store(g_base + offs, grad.to(g_base.dtype.element_ty))


@triton.jit
def _grad_row(x_base, g_base, shift, V, lse, coef, action, active, inv, ch, h, SCALE: tl.constexpr,
              BLOCK: tl.constexpr, SUB: tl.constexpr, ENTROPY: tl.constexpr):
    """Offsets `[shift, V + shift)` from the aligned bases hold the row: a masked `SUB`-wide head when the row
    does not start on a boundary, unmasked aligned `BLOCK`-wide chunks, unmasked `SUB`-wide ones, and one masked
    `SUB`-wide end (masked chunks are scalar loads and stores, so they are kept small)."""
    end = V + shift
    head = tl.where(shift == 0, 0, SUB)
    if shift != 0:
        _grad_chunk(x_base, g_base, 0, shift, V, lse, coef, action, active, inv, ch, h, SCALE, True, SUB, ENTROPY)
    full = tl.maximum(end - head, 0) // BLOCK
    for k in range(0, full):
        _grad_chunk(x_base, g_base, head + k * BLOCK, shift, V, lse, coef, action, active, inv, ch, h, SCALE, False,
                    BLOCK, ENTROPY)
    start = head + full * BLOCK
    subs = tl.maximum(end - start, 0) // SUB
    for j in range(0, subs):
        _grad_chunk(x_base, g_base, start + j * SUB, shift, V, lse, coef, action, active, inv, ch, h, SCALE, False,
                    SUB, ENTROPY)
    if start + subs * SUB < end:
        _grad_chunk(x_base, g_base, start + subs * SUB, shift, V, lse, coef, action, active, inv, ch, h, SCALE, True,
                    SUB, ENTROPY)


@triton.jit
def _write_grad(x_ptr, g_ptr, row, stride_x, stride_g, V, lse, coef, action, active, inv, ch, h,
                SCALE: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
    """`coef * (onehot(action) - exp(x - lse))` in the gradient's dtype for one row, times `inv` with SCALE (`x`:
    the logits times `inv`); exact zeros (and no reads) when not active. Chunks follow the gradient row's 16-byte
    boundaries (aligned, unmasked vector stores in the body); the policy row's loads are aligned too when its start
    sits at the same offset from a boundary. ENTROPY: plus `ch * (p * (log p + h))`, the entropy bonus's term."""
    SUB: tl.constexpr = 256 if BLOCK > 256 else BLOCK
    if SCALE:
        coef = coef * inv
        ch = ch * inv
    g_base, shift = _aligned_row(g_ptr, row, stride_g, VEC)
    x_start = row * stride_x
    if x_start % VEC == shift:
        _grad_row(x_ptr + tl.multiple_of(x_start - shift, VEC), g_base, shift, V, lse, coef, action, active, inv,
                  ch, h, SCALE, BLOCK, SUB, ENTROPY)
    else:  # x_start >= row * stride_g >= shift (the gradient rows are packed), so never before x_ptr
        _grad_row(x_ptr + (x_start - shift), g_base, shift, V, lse, coef, action, active, inv, ch, h, SCALE, BLOCK,
                  SUB, ENTROPY)


@triton.jit
def _plain_grad_row(x_ptr, g_ptr, row, stride_x, stride_g, V, lse, coef, action, active, inv, ch, h,
                    SCALE: tl.constexpr, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
    """`_write_grad` (the same bits) for rows that start on 16-byte boundaries: chunks from the row's start, masked
    only by `c < V`, and an inactive row's zeros stored apart (on the H200, bf16, 12-14% faster than the aligned
    chunks at V = 131072 and 151936, 5% slower where rows start at odd offsets, V = 50257: benchmarks/README.md)."""
    if SCALE:
        coef = coef * inv
        ch = ch * inv
    g_row = g_ptr + row * stride_g
    cols = tl.arange(0, BLOCK)
    if active:
        x_row = x_ptr + row * stride_x
        for start in range(0, V, BLOCK):
            c = start + cols
            lp = _scaled(tl.load(x_row + c, mask=c < V, other=0.0), inv, SCALE) - lse
            p = tl.exp(lp)
            grad = coef * (tl.where(c == action, 1.0, 0.0) - p)
            if ENTROPY:
                grad = grad + ch * tl.where(p > 0.0, p * (lp + h), 0.0)
            tl.store(g_row + c, grad.to(g_ptr.dtype.element_ty), mask=c < V)
    else:
        for start in range(0, V, BLOCK):
            c = start + cols
            tl.store(g_row + c, tl.zeros((BLOCK,), g_ptr.dtype.element_ty), mask=c < V)


def _logprob_fwd_kernel(
    x_ptr,  # policy logits [N, V], rows `stride_x` apart
    r_ptr,  # reference logits [N, V], rows `stride_r` apart (HAS_REF and REF_ROWS), or given fp32 log-probs [N]
    #         (HAS_REF and not REF_ROWS)
    ids_ptr,  # action ids [N]
    mask_ptr,  # completion mask [N], nonzero = active
    out_ptr,  # out: fp32 [3, N] = logp, logp_ref, lse (0.0 on masked tokens); ENTROPY: [4, N], the entropies last
    err_ptr,  # out: int32 [1], set to 1 when an active id is outside [0, V) (FLAG_IDS)
    old_ptr,  # old log-probs [N] fp32 (SINGLE_PASS)
    adv_ptr,  # advantages [N // T] fp32 (SINGLE_PASS; TOKEN_ADV: [N], one per token)
    w_ptr,  # normalizer weight per sequence [N // T] fp32 (SINGLE_PASS)
    is_ptr,  # importance weights [N] fp32 (SINGLE_PASS and HAS_IS)
    g_ptr,  # out: gradient [N, V] in the logits dtype, rows `stride_g` apart (SINGLE_PASS)
    N, T, V,
    stride_x, stride_r, stride_g,
    lo, hi, beta, delta, tau_pos, tau_neg, inv,  # lo, hi: the ratio's bounds; delta: +inf without one; tau_*: SAPO's
    # temperatures; inv: the inverse temperature (SCALE)
    # Meta-parameters
    HAS_REF: tl.constexpr,
    HAS_IS: tl.constexpr,
    BIAS_KL: tl.constexpr,
    SURROGATE: tl.constexpr,  # 0 clipped, 1 CISPO, 2 SAPO, 3 VESPO
    REF_ROWS: tl.constexpr,  # HAS_REF: the reference log-probs from its logits' rows, else as given in `r_ptr`
    SINGLE_PASS: tl.constexpr,
    TOKEN_ADV: tl.constexpr,
    SCALE: tl.constexpr,  # temperature != 1: the logits are multiplied by `inv` as they are read
    FLAG_IDS: tl.constexpr,  # the GRPO op checks the ids in its per-sequence kernel instead
    VEC_X: tl.constexpr,  # elements per 16 bytes of the policy logits (and of the gradient)
    VEC_R: tl.constexpr,  # ... of the reference logits
    BLOCK: tl.constexpr,
    ENTROPY: tl.constexpr = False,  # the policy rows' entropies too (two pass only)
):
    row = tl.program_id(0).to(tl.int64)
    lo, hi, beta, inv = _f32(lo), _f32(hi), _f32(beta), _f32(inv)  # Inductor: fp64
    delta, tau_pos, tau_neg = _f32(delta), _f32(tau_pos), _f32(tau_neg)
    active = tl.load(mask_ptr + row) != 0
    action = tl.load(ids_ptr + row).to(tl.int64)
    valid = (action >= 0) & (action < V)
    if FLAG_IDS:
        tl.store(err_ptr, 1, mask=active & ~valid)
    active = active & valid
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    logp = tl.zeros((), tl.float32)
    logp_ref = tl.zeros((), tl.float32)
    lse = tl.zeros((), tl.float32)
    ent = tl.zeros((), tl.float32)
    if active:
        lse, lse_ref, ent = _rows_lse(x_ptr, r_ptr, row, stride_x, stride_r, V, inv, REF_ROWS, SCALE, VEC_X, VEC_R,
                                      BLOCK, ENTROPY)
        logp = _scaled(tl.load(x_row + action), inv, SCALE) - lse
        if HAS_REF:
            if REF_ROWS:
                logp_ref = _scaled(tl.load(r_row + action), inv, SCALE) - lse_ref
            else:
                logp_ref = tl.load(r_ptr + row)
    tl.store(out_ptr + row, logp)
    tl.store(out_ptr + N + row, logp_ref)
    tl.store(out_ptr + 2 * N + row, lse)
    if ENTROPY:
        tl.store(out_ptr + 3 * N + row, ent)
    if SINGLE_PASS:
        seq = row // T
        adv = tl.load(adv_ptr + row) if TOKEN_ADV else tl.load(adv_ptr + seq)
        w_is = tl.load(is_ptr + row) if HAS_IS else adv
        coef = _token_coef(logp, logp_ref, tl.load(old_ptr + row), adv, tl.load(w_ptr + seq), lo, hi,
                           beta, delta, w_is, tau_pos, tau_neg, HAS_REF, HAS_IS, BIAS_KL, SURROGATE)
        _write_grad(x_ptr, g_ptr, row, stride_x, stride_g, V, lse, coef, action, active, inv, 0.0, 0.0, SCALE, VEC_X,
                    BLOCK, False)


def _logprob_grad_kernel(
    x_ptr,  # policy logits [N, V], rows `stride_x` apart
    ids_ptr,  # action ids [N]
    mask_ptr,  # completion mask [N]
    out_ptr,  # fp32 [3, N] = logp, logp_ref, lse from the forward
    coef_ptr,  # d loss / d logp per token [N] fp32 (COEF_FROM_PTR), else d loss / d loss [1] fp32
    old_ptr,  # old log-probs [N] fp32 (GRPO coefficient)
    adv_ptr,  # advantages [N // T] fp32 (GRPO coefficient; TOKEN_ADV: [N], one per token)
    w_ptr,  # normalizer weight per sequence [N // T] fp32 (GRPO coefficient)
    is_ptr,  # importance weights [N] fp32 (GRPO coefficient, HAS_IS)
    ch_ptr,  # the entropy bonus's weight per token [N] fp32 (ENTROPY; scaled like the coefficient)
    g_ptr,  # out: gradient [N, V], rows `stride_g` apart
    N, T, V, stride_x, stride_g,
    lo, hi, beta, delta, tau_pos, tau_neg, inv,  # lo, hi: the ratio's bounds; delta: +inf without one; tau_*: SAPO's
    # temperatures; inv: the inverse temperature (SCALE)
    # Meta-parameters
    COEF_FROM_PTR: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_IS: tl.constexpr,
    BIAS_KL: tl.constexpr,
    SURROGATE: tl.constexpr,  # 0 clipped, 1 CISPO, 2 SAPO, 3 VESPO
    TOKEN_ADV: tl.constexpr,
    SCALE: tl.constexpr,  # temperature != 1: d loss / d x = inv * d loss / d (x * inv)
    VEC: tl.constexpr,  # elements per 16 bytes of the logits and the gradient
    BLOCK: tl.constexpr,
    ENTROPY: tl.constexpr,  # out_ptr is [4, N] (the entropies last): plus the entropy bonus's term
    PLAIN: tl.constexpr,  # both tensors' rows start on 16-byte boundaries: `_plain_grad_row`
):
    row = tl.program_id(0).to(tl.int64)
    lo, hi, beta, inv = _f32(lo), _f32(hi), _f32(beta), _f32(inv)  # Inductor: fp64
    delta, tau_pos, tau_neg = _f32(delta), _f32(tau_pos), _f32(tau_neg)
    action = tl.load(ids_ptr + row).to(tl.int64)
    active = (tl.load(mask_ptr + row) != 0) & (action >= 0) & (action < V)
    logp = tl.load(out_ptr + row)
    lse = tl.load(out_ptr + 2 * N + row)
    if COEF_FROM_PTR:
        coef = tl.load(coef_ptr + row)
    else:
        seq = row // T
        adv = tl.load(adv_ptr + row) if TOKEN_ADV else tl.load(adv_ptr + seq)
        w_is = tl.load(is_ptr + row) if HAS_IS else adv
        coef = _token_coef(logp, tl.load(out_ptr + N + row), tl.load(old_ptr + row), adv, tl.load(w_ptr + seq),
                           lo, hi, beta, delta, w_is, tau_pos, tau_neg, HAS_REF, HAS_IS, BIAS_KL, SURROGATE
                           ) * tl.load(coef_ptr)
    ch = tl.zeros((), tl.float32)
    h = tl.zeros((), tl.float32)
    if ENTROPY:
        ch = tl.load(ch_ptr + row)
        if not COEF_FROM_PTR:
            ch = ch * tl.load(coef_ptr)
        h = tl.load(out_ptr + 3 * N + row)
    if PLAIN:
        _plain_grad_row(x_ptr, g_ptr, row, stride_x, stride_g, V, lse, coef, action, active, inv, ch, h, SCALE, BLOCK,
                        ENTROPY)
    else:
        _write_grad(x_ptr, g_ptr, row, stride_x, stride_g, V, lse, coef, action, active, inv, ch, h, SCALE, VEC,
                    BLOCK, ENTROPY)


_FWD = twins(_logprob_fwd_kernel, ["V", "stride_x", "stride_r", "stride_g"])
_GRAD = twins(_logprob_grad_kernel, ["V", "stride_x", "stride_g"])


def rows(t: torch.Tensor) -> torch.Tensor:
    """`[B, T, V]` as `[N, V]` rows with unit column stride (a copy only when the layout demands one)."""
    t = t.reshape(t.shape[0] * t.shape[1], t.shape[2])
    return t if t.stride(-1) == 1 else t.contiguous()


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def block(V: int) -> int:
    """Columns per chunk: at least 16, one 16-byte vector of any logits dtype, so that the aligned chunks of
    `_rows_lse` / `_write_grad` never start more than one chunk before a row."""
    return max(16, min(BLOCK_V, next_power_of_2(V)))


def launch_forward(launch, policy, ref, ids, mask, err, old=None, adv=None, weight=None, grad=None, lo=0.0,
                   hi=0.0, beta=0.0, inv=1.0, ref_logps=None, delta=math.inf, is_ratio=None, bias_kl=False,
                   surrogate=0, taus=(1.0, 1.0), entropy: bool = False) -> torch.Tensor:
    """Runs the forward kernel (`launch` is `wrap_triton` inside a triton_op, identity outside one): per-token
    `[3, N]` log-probs of the logits times `inv` (the fp32 inverse temperature); `err [1]` (int32, zeroed by the
    caller; or None) is set to 1 when an active id is out of range. Single pass (`grad`): `adv` is `[B]` or `[B, T]`
    (one per token), `delta` (+inf: none), `is_ratio` (fp32 `[N]` or None) and `bias_kl` as in
    `canonical.token_coef`. `ref_logps` (fp32 `[B, T]`, in place of `ref`): the reference's log-probs as given.
    `entropy` (two pass): `[4, N]`, the policy rows' entropies last."""
    x = rows(policy)
    r = rows(ref) if ref is not None else x
    given = flat(ref_logps) if ref_logps is not None else None
    N, V = x.shape
    out = torch.empty(3 + entropy, N, dtype=torch.float32, device=x.device)
    single = grad is not None
    g = grad.view(N, V) if single else x
    if N == 0 or V == 0:  # T = 0, or V = 0 (no token can be active): nothing to read
        return out.zero_()
    launch(pick(_FWD, V, x.stride(0), r.stride(0), g.stride(0)))[(N,)](
        x, r if given is None else given, flat(ids), flat(mask), out, out if err is None else err,
        flat(old) if single else out, flat(adv) if single else out, weight if single else out,
        out if is_ratio is None else is_ratio, g, N, policy.shape[1], V, x.stride(0), r.stride(0), g.stride(0),
        lo, hi, beta, delta, *taus, inv, HAS_REF=ref is not None or given is not None,
        HAS_IS=single and is_ratio is not None, BIAS_KL=bias_kl, SURROGATE=surrogate, REF_ROWS=ref is not None,
        SINGLE_PASS=single,
        TOKEN_ADV=single and adv.dim() == 2, SCALE=inv != 1.0, FLAG_IDS=err is not None, VEC_X=16 // x.element_size(),
        VEC_R=16 // r.element_size(), BLOCK=block(V), ENTROPY=entropy, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def launch_grad(launch, policy, ids, mask, out, coef, old=None, adv=None, weight=None, lo=0.0, hi=0.0,
                beta=0.0, has_ref=False, inv=1.0, delta=math.inf, is_ratio=None, bias_kl=False, surrogate=0,
                taus=(1.0, 1.0), entropy_weight=None) -> torch.Tensor:
    """Second pass: the gradient `[B, T, V]` in the logits dtype. `coef` is per token `[B, T]`, or, with `old` /
    `adv` (`[B]` or `[B, T]`) / `weight`, the scalar `d loss / d loss` that scales the in-kernel GRPO coefficient;
    `inv`: the fp32 inverse temperature the forward scaled the logits by. `entropy_weight` (fp32 `[N]`, scaled like
    `coef`; `out` `[4, N]` with the entropies): the entropy bonus's weight per token."""
    x = rows(policy)
    N, V = x.shape
    grad = torch.empty((N, V), dtype=policy.dtype, device=policy.device)
    from_ptr = old is None
    if N == 0 or V == 0:
        return grad.view(policy.shape)
    vec = 16 // x.element_size()
    launch(pick(_GRAD, V, x.stride(0), grad.stride(0)))[(N,)](
        x, flat(ids), flat(mask), out, flat(coef.float()), out if from_ptr else flat(old),
        out if from_ptr else flat(adv), out if from_ptr else weight, out if is_ratio is None else is_ratio,
        out if entropy_weight is None else flat(entropy_weight), grad, N,
        policy.shape[1], V, x.stride(0), grad.stride(0), lo, hi, beta, delta, *taus, inv,
        COEF_FROM_PTR=from_ptr, HAS_REF=has_ref, HAS_IS=not from_ptr and is_ratio is not None, BIAS_KL=bias_kl,
        SURROGATE=surrogate,
        TOKEN_ADV=not from_ptr and adv.dim() == 2, SCALE=inv != 1.0, VEC=vec, BLOCK=block(V),
        ENTROPY=entropy_weight is not None,
        PLAIN=all(t.stride(0) % vec == 0 and t.storage_offset() % vec == 0 for t in (x, grad)),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return grad.view(policy.shape)


@triton_op("grpo_core::token_logprobs", mutates_args={})
def token_logprobs(policy: torch.Tensor, ref: torch.Tensor | None, ids: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out [3, N] = logp, logp_ref, lse, err [1])` for `[B, T, V]` logits; one pass over each active row."""
    err = torch.zeros(1, dtype=torch.int32, device=policy.device)
    return launch_forward(wrap_triton, policy, ref, ids, mask, err), err


@triton_op("grpo_core::token_logprob_grad", mutates_args={})
def token_logprob_grad(policy: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, out: torch.Tensor,
                       coef: torch.Tensor) -> torch.Tensor:
    """`coef * (onehot - softmax(policy))` per token, `[B, T, V]` in the logits dtype; zeros on masked tokens."""
    return launch_grad(wrap_triton, policy, ids, mask, out, coef)


def _setup(ctx, inputs, output):
    policy, _, ids, mask = inputs
    ctx.save_for_backward(policy, ids, mask, output[0])


def _backward(ctx, grad_out, grad_err):
    policy, ids, mask, out = ctx.saved_tensors
    # Only logp (row 0) depends on the policy; logp_ref and lse are constants of the loss.
    return token_logprob_grad(policy, ids, mask, out, grad_out[0]), None, None, None


token_logprobs.register_autograd(_backward, setup_context=_setup)


class _TokenLogprobs(torch.autograd.Function):
    """The eager twin of `token_logprobs` (same launches and backward, no custom-op dispatch on the host)."""

    @staticmethod
    def forward(ctx, policy, ref, ids, mask):
        err = torch.zeros(1, dtype=torch.int32, device=policy.device)
        out = launch_forward(lambda k: k, policy, ref, ids, mask, err)
        ctx.save_for_backward(policy, ids, mask, out)
        ctx.mark_non_differentiable(err)
        return out, err

    @staticmethod
    def backward(ctx, grad_out, grad_err):
        policy, ids, mask, out = ctx.saved_tensors
        return launch_grad(lambda k: k, policy, ids, mask, out, grad_out[0]), None, None, None


CHECKS = ("deferred", "sync", "assert")


def check_values_after(bad: torch.Tensor, check_values: str, label: str, policy_logits, ref_logits, action_ids,
                       old_logps, rewards, completion_mask, beta: float, logp: torch.Tensor,
                       logp_ref: torch.Tensor | None, advantages: torch.Tensor | None = None,
                       groups: tuple | None = None, loss: torch.Tensor | None = None, ref_logps=None,
                       importance_sampling_ratio=None, sampling_logps=None) -> None:
    """Turns the kernels' flag (`bad`, 0-d, nonzero when an id, mask value, reward, given advantage or old log-prob
    is bad, a log-prob is not finite, or, with `groups` = `(CSR bounds, advantage std)`, an advantage derived from
    the rewards is not finite, or the `loss` is not finite) into the native op's `LossContractError`, by `check_values`:
    "deferred" (default): no device sync here; the error surfaces at a later call of an op that defers its checks
    (at the latest `pending.AHEAD` calls later), or at `grpo_core.raise_pending()` (`pending.py`); "sync": one
    device sync, raised by this call; "assert": a device-side assert (it ends the process's CUDA context), also
    the only choice inside a compiled graph. The kernels never read out of bounds: flagged tokens are skipped."""
    if check_values not in CHECKS:
        raise LossContractError(f"check_values: expected one of {CHECKS}, got {check_values!r}")
    if check_values == "assert" or torch.compiler.is_compiling():
        torch._assert_async(bad == 0, "grpo_core: bad action_ids, rewards, old_logps, advantages, "
                                      "importance_sampling_ratio or completion_mask values, non-finite log-probs or a "
                                      "non-finite loss (check_values='sync' gives the precise error)")
        return
    # What the precise check reads; the logits only lend their shape, dtype and device.
    kept = [None if t is None else t.detach() for t in (action_ids, old_logps, rewards, completion_mask, advantages,
                                                        ref_logps, importance_sampling_ratio, sampling_logps)]
    logits = [None if t is None else (t.shape, t.dtype, t.device) for t in (policy_logits, ref_logits)]

    def recheck() -> None:
        mask = check_inputs(*(None if t is None else stand_in(*t) for t in logits), *kept[:4], beta=beta,
                            rewards_required=rewards is not None, advantages=kept[4], ref_logps=kept[5],
                            importance_sampling_ratio=kept[6], sampling_logps=kept[7])
        check_logprobs(logp, logp_ref, mask)
        if groups is not None:
            r = kept[2].to(torch.float32)
            check_derived_advantages(canonical.group_advantages(r, *groups), r, groups[0])
        if loss is not None:
            check_loss(loss)

    if check_values == "sync":
        pending.raise_now(bad, recheck)
    else:
        pending.defer(bad, recheck, label)


class TritonRatioKLOp:
    """`ratio, kl = op(policy_logits, ref_logits, action_ids, completion_mask, old_logps)`, each fp32 `[B, T]`."""

    backend = "triton"

    def __call__(self, policy_logits, ref_logits, action_ids, completion_mask, old_logps, *,
                 check_values: str = "deferred"):
        """`check_values`: as in `TritonGRPOLossOp` ("deferred", "sync" or "assert")."""
        if not torch.compiler.is_compiling():
            pending.poll()
        mask = check_inputs(policy_logits, ref_logits, action_ids, old_logps, None, completion_mask, beta=1.0,
                            values=False)
        if torch.compiler.is_compiling():
            out, err = token_logprobs(policy_logits, ref_logits, action_ids, mask)
        else:
            out, err = _TokenLogprobs.apply(policy_logits, ref_logits, action_ids, mask)
        logp, logp_ref = out[0].view(mask.shape), out[1].view(mask.shape)
        finite = torch.isfinite(logp) & torch.isfinite(logp_ref) & torch.isfinite(old_logps)
        bad = err[0] | (mask & ~finite).any()
        if completion_mask.dtype != torch.bool:
            bad = bad | (mask & (completion_mask != 1)).any()
        check_values_after(bad, check_values, "ratio_kl (triton)", policy_logits, ref_logits, action_ids, old_logps,
                           None, completion_mask, 1.0, logp.detach(), logp_ref.detach())
        return canonical.ratio_and_kl(logp, logp_ref, old_logps, mask, exp=torch.exp)
