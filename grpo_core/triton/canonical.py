"""The deterministic path's kernels: the canonical math of `grpo_core/canonical.py`, operation for operation.

Every function here repeats one of `canonical.py` with the same IEEE operations in the same order, so the
kernels give the torch reference's bits, hence the golden's, on every GPU and under the interpreter. What
makes that hold: kernels compile with `enable_fp_fusion=False` (no FMA), divide with `div_rn`, never call the
GPU's approximate exp / log, propagate NaN through max / min like torch, and build every sum as the same tree
of adjacent pairs (`tl.split` of a trailing dimension of two: one add, the only possible order).

- `_row_kernel`, one program per token row and tensor (policy, reference): the row streams in chunks of `NT`
  vocabulary tiles of `W` columns; each tile gives `(max, sum exp(x - max))`, collected in registers, and one
  tree of adjacent pairs merges them all at the end: the tree of `canonical.merge_stats` (the padded tile count
  `CHUNKS * NT` only adds identity leaves). With TP > 1 it writes the per-tile statistics instead; they travel
  by `all_gather` and `_merge_kernel` merges them in global tile order.
- `_sequence_kernel`, one program per sequence: the token terms and their tree sums over `padded_seq_len`.
- `_grad_kernel`, one program per token row: `coef * (onehot - exp(x - lse))` in the logits' dtype.
Masked rows are never read.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import canonical as C
from .launch import pick, twins

# Settings from one H200 sweep (bf16, V = 32768 and 151936, 2026-11-30; benchmarks/README.md): the row kernel with
# (2048 columns, 2 warps) took 3.16 / 7.32 ms against 4.94 / 7.41 with (4096, 4) and 3.20 / 9.65 with (1024, 2).
CHUNK = 2048  # vocabulary columns per loop iteration of the row kernels
ROW_WARPS = 2
GRAD_BLOCK = 4096  # columns per loop iteration of the gradient kernel
BLOCK_T = 1024  # tokens per loop iteration of the sequence kernel
NUM_WARPS = 4  # the other kernels
MAX_TILE = CHUNK  # the row kernels hold one tile per chunk at least

_LOG2E, _ROUND = tl.constexpr(C.LOG2E), tl.constexpr(C.ROUND)
_LN2_HI, _LN2_LO = tl.constexpr(C.LN2_HI), tl.constexpr(C.LN2_LO)
_Q0, _Q1, _Q2 = tl.constexpr(C.EXP_Q[0]), tl.constexpr(C.EXP_Q[1]), tl.constexpr(C.EXP_Q[2])
_Q3, _Q4 = tl.constexpr(C.EXP_Q[3]), tl.constexpr(C.EXP_Q[4])
_L0, _L1, _L2 = tl.constexpr(C.LOG_Q[0]), tl.constexpr(C.LOG_Q[1]), tl.constexpr(C.LOG_Q[2])
_EXP_MIN, _EXP_MAX, _TINY = tl.constexpr(C.EXP_MIN), tl.constexpr(C.EXP_MAX), tl.constexpr(C.TINY)
_SQRT_HALF_BITS = tl.constexpr(C.SQRT_HALF_BITS)
_ALL = tl.constexpr(tl.PropagateNan.ALL)
# The interpreter truncates fp32 -> bf16 (the GPU and torch round to nearest even): round with integer ops there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _max(a, b):
    return tl.maximum(a, b, propagate_nan=_ALL)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b, propagate_nan=_ALL)


@triton.jit
def _poly(xc):
    """`p = exp(r)` of the reduced argument and `n`, as in `canonical.exp`."""
    n = (xc * _LOG2E + _ROUND) - _ROUND
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    q = (r * _Q4 + _Q3) * r + _Q2
    q = (q * r + _Q1) * r + _Q0
    return (q * (r * r) + r) + 1.0, n.to(tl.int32)


@triton.jit
def _pow2(k):
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """`canonical.exp`."""
    p, k = _poly(_min(_max(x, _EXP_MIN), _EXP_MAX))
    half = ((k + 256) >> 1) - 128
    p = (p * _pow2(half)) * _pow2(k - half)
    return tl.where(p < _TINY, 0.0, p)


@triton.jit
def exp_nonpos(x):
    """`canonical.exp` for `x <= 0` (or NaN), the same bits with one scaling: 2**k is exact down to k = -126,
    and below it both give 0 after the flush."""
    p, k = _poly(_max(x, _EXP_MIN))
    p = p * (tl.maximum(k + 127, 0) << 23).to(tl.float32, bitcast=True)
    return tl.where(p < _TINY, 0.0, p)


@triton.jit
def log(x):
    """`canonical.log`."""
    t = x.to(tl.int32, bitcast=True) - _SQRT_HALF_BITS
    k = (t >> 23).to(tl.float32)
    f = ((t & 0x7FFFFF) + _SQRT_HALF_BITS).to(tl.float32, bitcast=True) - 1.0
    s = tl.math.div_rn(f, f + 2.0)
    z = s * s
    R = z * (_L0 + z * (_L1 + z * _L2))
    hfsq = (f * 0.5) * f
    return k * _LN2_HI - ((hfsq - (s * (hfsq + R) + k * _LN2_LO)) - f)


@triton.jit
def _pair_sum(x, N: tl.constexpr, LOG2N: tl.constexpr):
    """`canonical.pair_sum` of `[N]` (a power of two): adjacent pairs, level by level."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0, as `+ 0.0` does
    for k in tl.static_range(LOG2N):
        a, b = tl.split(tl.reshape(x, (N >> (k + 1), 2)))
        x = a + b
    return tl.sum(x, 0)


@triton.jit
def _merge(m, s, N: tl.constexpr, LOG2N: tl.constexpr):
    """`canonical.merge_stats` of `[N]` pairs (a power of two, padded with `(-inf, 0)`): one `(M, S)`.

    One exp per merge: the larger side's factor is exp(0) = 1 exactly, so `s1 * exp(m1 - M) + s2 * exp(m2 - M)`
    has the bits of the larger side's `s` plus the other `s` times one exp."""
    for k in tl.static_range(LOG2N):
        m1, m2 = tl.split(tl.reshape(m, (N >> (k + 1), 2)))
        s1, s2 = tl.split(tl.reshape(s, (N >> (k + 1), 2)))
        m = _max(m1, m2)
        e = exp_nonpos(_min(m1, m2) - tl.where(m == float("-inf"), 0.0, m))
        s = tl.where(m1 >= m2, s1 + s2 * e, s1 * e + s2)
    return tl.max(m, 0), tl.sum(s, 0)


@triton.jit
def _tiles(row_ptr, start, V, inv, NT: tl.constexpr, W: tl.constexpr, LOG2W: tl.constexpr, SCALE: tl.constexpr):
    """`canonical.tile_stats` of the `NT` tiles from tile `start` of one row (its logits times `inv`, the inverse
    temperature, with SCALE): `[NT]` maxima and sums."""
    cols = (start + tl.arange(0, NT))[:, None] * W + tl.arange(0, W)[None, :]
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    if SCALE:
        x = x * inv
    m = tl.max(x, 1)  # exact in any order; a row with a NaN has a NaN sum whatever its max, and raises
    m = tl.where(m == 0.0, 0.0, m)
    e = exp_nonpos(x - tl.where(m == float("-inf"), 0.0, m)[:, None])
    for k in tl.static_range(LOG2W):
        a, b = tl.split(tl.reshape(e, (NT, W >> (k + 1), 2)))
        e = a + b
    return m, tl.reshape(e, (NT,))


@triton.jit
def _lse(m, s):
    """`canonical.lse`: NaN unless the row was finite with at least one finite logit."""
    finite = (tl.abs(m) < float("inf")) & (s >= 1.0)
    return tl.where(finite, m + log(tl.where(finite, s, 1.0)), float("nan"))


@triton.jit
def _row_lse(row_ptr, V, tiles, inv, NT: tl.constexpr, W: tl.constexpr, LOG2W: tl.constexpr, LOG2NT: tl.constexpr,
             CHUNKS: tl.constexpr, LOG2C: tl.constexpr, SCALE: tl.constexpr):
    """lse of one row: its tiles' statistics collected in registers `[CHUNKS, NT]` (global tile order when
    flattened), then one merge tree over all of them."""
    chunk = tl.arange(0, CHUNKS)[:, None]
    ms = tl.full((CHUNKS, NT), float("-inf"), tl.float32)
    ss = tl.zeros((CHUNKS, NT), tl.float32)
    for c in range(0, tl.cdiv(tiles, NT)):
        m, s = _tiles(row_ptr, c * NT, V, inv, NT, W, LOG2W, SCALE)
        ms = tl.where(chunk == c, m[None, :], ms)
        ss = tl.where(chunk == c, s[None, :], ss)
    m, s = _merge(tl.reshape(ms, (CHUNKS * NT,)), tl.reshape(ss, (CHUNKS * NT,)), CHUNKS * NT, LOG2C + LOG2NT)
    return _lse(m, s)


@triton.jit
def _row(row_ptr, row, out_ptr, stats_ptr, which, a, owned, N, V, tiles, inv, STATS: tl.constexpr, W: tl.constexpr,
         LOG2W: tl.constexpr, NT: tl.constexpr, LOG2NT: tl.constexpr, CHUNKS: tl.constexpr, LOG2C: tl.constexpr,
         SCALE: tl.constexpr):
    """One active row of tensor `which` (0 policy, 1 reference): its selected logit, and its lse or tile stats."""
    z = tl.load(row_ptr + a, mask=owned, other=0.0).to(tl.float32)
    if SCALE:
        z = z * inv
    tl.store(out_ptr + 2 * which * N + row, z)
    if STATS:
        for c in range(0, tl.cdiv(tiles, NT)):
            t = c * NT + tl.arange(0, NT)
            m, s = _tiles(row_ptr, c * NT, V, inv, NT, W, LOG2W, SCALE)
            tl.store(stats_ptr + (2 * which * N + row) * tiles + t, m, mask=t < tiles)
            tl.store(stats_ptr + ((2 * which + 1) * N + row) * tiles + t, s, mask=t < tiles)
    else:
        lse = _row_lse(row_ptr, V, tiles, inv, NT, W, LOG2W, LOG2NT, CHUNKS, LOG2C, SCALE)
        tl.store(out_ptr + (2 * which + 1) * N + row, lse)


def _row_kernel(
    x_ptr,  # policy logits [N, V] (this rank's vocabulary shard), rows `stride_x` apart
    r_ptr,  # reference logits [N, V], rows `stride_r` apart (read by the programs of grid axis 1 = 1)
    ids_ptr,  # global action ids [N]
    mask_ptr,  # completion mask [N], nonzero = active
    out_ptr,  # out: fp32 [4, N] = selected logit, lse, and the same for the reference (0.0 on masked rows)
    stats_ptr,  # out (STATS): fp32 [2 (policy, ref), 2 (max, sumexp), N, tiles] per-tile statistics
    N, V, stride_x, stride_r, lo, tiles,
    inv,  # the inverse temperature, fp32 (SCALE)
    # Meta-parameters
    SCALE: tl.constexpr,  # temperature != 1: the logits are multiplied by `inv` as they are read
    STATS: tl.constexpr,  # TP > 1: write the tiles' statistics, no lse
    W: tl.constexpr, LOG2W: tl.constexpr,  # tile width (a power of two)
    NT: tl.constexpr, LOG2NT: tl.constexpr,  # tiles per chunk
    CHUNKS: tl.constexpr, LOG2C: tl.constexpr,  # chunks per row, padded to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)  # 0: the policy row, 1: the reference row (a program each)
    inv = tl.cast(inv, tl.float32)
    if tl.load(mask_ptr + row) != 0:
        a = tl.load(ids_ptr + row).to(tl.int64) - lo
        owned = (a >= 0) & (a < V)
        if which == 0:
            _row(x_ptr + row * stride_x, row, out_ptr, stats_ptr, which, a, owned, N, V, tiles, inv, STATS, W, LOG2W,
                 NT, LOG2NT, CHUNKS, LOG2C, SCALE)
        else:
            _row(r_ptr + row * stride_r, row, out_ptr, stats_ptr, which, a, owned, N, V, tiles, inv, STATS, W, LOG2W,
                 NT, LOG2NT, CHUNKS, LOG2C, SCALE)
    else:
        tl.store(out_ptr + 2 * which * N + row, 0.0)
        tl.store(out_ptr + (2 * which + 1) * N + row, 0.0)


@triton.jit
def _merge_kernel(
    stats_ptr,  # fp32 [2 (max, sumexp), N, tiles]: every rank's tiles in global order
    mask_ptr,  # completion mask [N]
    lse_ptr,  # out: fp32 [N] (0.0 on masked rows)
    N, tiles,
    # Meta-parameters
    NT: tl.constexpr, LOG2NT: tl.constexpr, CHUNKS: tl.constexpr, LOG2C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lse = 0.0
    if tl.load(mask_ptr + row) != 0:
        idx = tl.arange(0, CHUNKS)
        ms = tl.full((CHUNKS,), float("-inf"), tl.float32)
        ss = tl.zeros((CHUNKS,), tl.float32)
        for c in range(0, tl.cdiv(tiles, NT)):
            t = c * NT + tl.arange(0, NT)
            m = tl.load(stats_ptr + row * tiles + t, mask=t < tiles, other=float("-inf"))
            s = tl.load(stats_ptr + (N + row) * tiles + t, mask=t < tiles, other=0.0)
            mc, sc = _merge(m, s, NT, LOG2NT)
            ms = tl.where(idx == c, mc, ms)
            ss = tl.where(idx == c, sc, ss)
        m, s = _merge(ms, ss, CHUNKS, LOG2C)
        lse = _lse(m, s)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _token_terms(logp, logp_ref, old, active, adv, clip_lo, clip_hi, HAS_REF: tl.constexpr):
    """`canonical.ratio_and_kl` and `canonical.clipped_surrogate` of one block of tokens."""
    ratio = exp(tl.where(active, logp - old, 0.0))
    policy = -_min(ratio * adv, _min(_max(ratio, clip_lo), clip_hi) * adv)
    kl = tl.zeros_like(ratio)
    if HAS_REF:
        d = tl.where(active, logp_ref - logp, 0.0)
        kl = (exp(d) - d) - 1.0
    return ratio, tl.where(active, policy, 0.0), kl


@triton.jit
def _sequence_kernel(
    logp_ptr,  # fp32 [B, T] policy log-probs (0.0 on masked tokens)
    ref_ptr,  # fp32 [B, T] reference log-probs (HAS_REF)
    old_ptr,  # fp32 [B, T] old log-probs
    mask_ptr,  # completion mask [B, T]
    adv_ptr,  # fp32 [B] advantages (TOKEN_ADV: [B, T])
    out_ptr,  # out: fp32 [2, B] = each sequence's token sums of the surrogate and of the KL
    bad_ptr,  # out: int64 [B], 1 where an active token's log-prob (policy or reference) is not finite
    B, T, clip_lo, clip_hi,
    # Meta-parameters
    HAS_REF: tl.constexpr,
    TOKEN_ADV: tl.constexpr,  # an advantage per token
    BLOCK: tl.constexpr, LOG2B: tl.constexpr,  # tokens per chunk (a power of two)
    CHUNKS: tl.constexpr, LOG2C: tl.constexpr,  # chunks, padded to a power of two
):
    b = tl.program_id(0).to(tl.int64)
    clip_lo, clip_hi = tl.cast(clip_lo, tl.float32), tl.cast(clip_hi, tl.float32)
    idx = tl.arange(0, CHUNKS)
    pol = tl.zeros((CHUNKS,), tl.float32)
    kls = tl.zeros((CHUNKS,), tl.float32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for c in range(0, tl.cdiv(T, BLOCK)):
        t = c * BLOCK + tl.arange(0, BLOCK)
        active = tl.load(mask_ptr + b * T + t, mask=t < T, other=0) != 0
        logp = tl.load(logp_ptr + b * T + t, mask=active, other=0.0)
        logp_ref = tl.load(ref_ptr + b * T + t, mask=active, other=0.0) if HAS_REF else logp
        old = tl.load(old_ptr + b * T + t, mask=active, other=0.0)
        if TOKEN_ADV:
            adv = tl.load(adv_ptr + b * T + t, mask=active, other=0.0)
        else:
            adv = tl.load(adv_ptr + b)
        _, policy, kl = _token_terms(logp, logp_ref, old, active, adv, clip_lo, clip_hi, HAS_REF)
        bad = tl.maximum(bad, (active & ~((tl.abs(logp) < float("inf")) & (tl.abs(logp_ref) < float("inf"))))
                         .to(tl.int32))
        pol = tl.where(idx == c, _pair_sum(policy, BLOCK, LOG2B), pol)
        kls = tl.where(idx == c, _pair_sum(kl, BLOCK, LOG2B), kls)
    tl.store(out_ptr + b, _pair_sum(pol, CHUNKS, LOG2C))
    tl.store(out_ptr + B + b, _pair_sum(kls, CHUNKS, LOG2C))
    tl.store(bad_ptr + b, tl.max(bad, 0).to(tl.int64))


def _grad_kernel(
    x_ptr,  # policy logits [N, V], rows `stride_x` apart
    ids_ptr,  # global action ids [N]
    mask_ptr,  # completion mask [N]
    logp_ptr,  # fp32 [N] policy log-probs
    ref_ptr,  # fp32 [N] reference log-probs (HAS_REF)
    old_ptr,  # fp32 [N] old log-probs
    adv_ptr,  # fp32 [N // T] advantages of this rank's sequences (TOKEN_ADV: [N], one per token)
    w_ptr,  # fp32 [N // T] normalizer weights of this rank's sequences
    lse_ptr,  # fp32 [N] the policy rows' log-sum-exp over the whole vocabulary
    g_out_ptr,  # fp32 [1] d(output) / d(loss)
    g_ptr,  # out: gradient [N, V] in the logits' dtype (BF16_BITS: its int16 view), rows `stride_g` apart
    T, V, stride_x, stride_g, lo, clip_lo, clip_hi, beta,
    inv,  # the inverse temperature, fp32 (SCALE)
    # Meta-parameters
    HAS_REF: tl.constexpr,
    TOKEN_ADV: tl.constexpr,
    SCALE: tl.constexpr,  # temperature != 1: d loss / d x = inv * d loss / d (x * inv)
    BF16_BITS: tl.constexpr,  # round to bf16 with integer ops (round to nearest even, as torch does)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    clip_lo, clip_hi, beta = tl.cast(clip_lo, tl.float32), tl.cast(clip_hi, tl.float32), tl.cast(beta, tl.float32)
    inv = tl.cast(inv, tl.float32)
    g_row = g_ptr + row * stride_g
    cols = tl.arange(0, BLOCK)
    if tl.load(mask_ptr + row) != 0:
        seq = row // T
        logp = tl.load(logp_ptr + row)
        logp_ref = tl.load(ref_ptr + row) if HAS_REF else logp
        adv = tl.load(adv_ptr + row) if TOKEN_ADV else tl.load(adv_ptr + seq)
        ratio = exp(logp - tl.load(old_ptr + row))
        unclipped = ratio * adv
        coef = tl.where(unclipped <= _min(_max(ratio, clip_lo), clip_hi) * adv, -unclipped, 0.0)
        if HAS_REF:
            coef = coef + beta * (1.0 - exp(logp_ref - logp))
        coef = (coef * tl.load(w_ptr + seq)) * tl.load(g_out_ptr)
        if SCALE:
            coef = coef * inv
        lse = tl.load(lse_ptr + row)
        a = tl.load(ids_ptr + row).to(tl.int64) - lo
        x_row = x_ptr + row * stride_x
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < V, other=0.0).to(tl.float32)
            if SCALE:
                x = x * inv
            onehot = tl.where(c == a, 1.0, 0.0)
            grad = coef * (onehot - exp_nonpos(x - lse))
            if BF16_BITS:
                b = grad.to(tl.int32, bitcast=True)
                tl.store(g_row + c, ((b + (0x7FFF + ((b >> 16) & 1))) >> 16).to(tl.int16), mask=c < V)
            else:
                tl.store(g_row + c, grad.to(g_ptr.dtype.element_ty), mask=c < V)
    else:
        for start in range(0, V, BLOCK):
            c = start + cols
            tl.store(g_row + c, tl.zeros((BLOCK,), g_ptr.dtype.element_ty), mask=c < V)


_ROW = twins(_row_kernel, ["V", "stride_x", "stride_r"])
_GRAD = twins(_grad_kernel, ["V", "stride_x", "stride_g"])


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _tiling(tiles: int, width: int) -> dict:
    nt = max(1, CHUNK // width)
    chunks = triton.next_power_of_2(max(1, -(-tiles // nt)))
    return dict(NT=nt, LOG2NT=_log2(nt), CHUNKS=chunks, LOG2C=_log2(chunks))


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _fp(warps: int | None = None) -> dict:
    return dict(num_warps=warps or NUM_WARPS, enable_fp_fusion=False)


def row_lse(policy: torch.Tensor, ref: torch.Tensor | None, ids: torch.Tensor, mask: torch.Tensor, lo: int,
            width: int, stats: bool, inv: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass over each active row of `[n, T, V_local]` logits (policy and reference, a program each), scaled by
    `inv` (the fp32 inverse temperature; 1.0: not scaled).

    `out` is fp32 `[4, n * T]` = selected logit (0.0 where this shard does not own the id), lse, and the same
    for the reference; with `stats` (TP > 1) the lse rows are not computed and the per-tile statistics come back
    as fp32 `[2, 2, n * T, tiles]` instead."""
    x = _rows2d(policy)
    r = _rows2d(ref) if ref is not None else x
    N, V = x.shape
    tiles = -(-V // width)
    out = torch.zeros(4, N, dtype=torch.float32, device=x.device)
    st = torch.empty((2, 2, N, tiles) if stats else (1,), dtype=torch.float32, device=x.device)
    if N:
        pick(_ROW, V, x.stride(0), r.stride(0))[(N, 1 + (ref is not None))](
            x, r, ids.reshape(-1).contiguous(), mask.reshape(-1).contiguous(), out, st, N, V, x.stride(0), r.stride(0),
            lo, tiles, inv, SCALE=inv != 1.0, STATS=stats, W=width, LOG2W=_log2(width), **_tiling(tiles, width),
            **_fp(ROW_WARPS))
    return out, (st if stats else None)


def merge_lse(stats: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """lse `[N]` from the gathered per-tile statistics `[2, N, tiles]` (global tile order) of the active rows."""
    _, N, tiles = stats.shape
    lse = torch.empty(N, dtype=torch.float32, device=stats.device)
    if N:
        _merge_kernel[(N,)](stats.contiguous(), mask.reshape(-1).contiguous(), lse, N, tiles,
                            **_tiling(tiles, width), **_fp())
    return lse


def sequence_sums(logp: torch.Tensor, logp_ref: torch.Tensor | None, old: torch.Tensor, mask: torch.Tensor,
                  adv: torch.Tensor, clip_lo: float, clip_hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's token sums `[2, B]` (surrogate, KL) and int64 flags `[B]` of non-finite log-probs; `adv` is
    `[B]`, or `[B, T]` (an advantage per token)."""
    B, T = mask.shape
    out = torch.empty(2, B, dtype=torch.float32, device=logp.device)
    bad = torch.empty(B, dtype=torch.int64, device=logp.device)
    block = min(BLOCK_T, triton.next_power_of_2(max(T, 1)))
    chunks = triton.next_power_of_2(max(1, -(-T // block)))
    if B:
        _sequence_kernel[(B,)](logp.contiguous(), (logp_ref if logp_ref is not None else logp).contiguous(),
                               old.to(torch.float32).contiguous(), mask.contiguous(), adv.contiguous(), out, bad, B,
                               T, clip_lo, clip_hi, HAS_REF=logp_ref is not None, TOKEN_ADV=adv.dim() == 2,
                               BLOCK=block, LOG2B=_log2(block),
                               CHUNKS=chunks, LOG2C=_log2(chunks), **_fp())
    return out, bad


def grad(policy: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor,
         logp_ref: torch.Tensor | None, old: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor, lse: torch.Tensor,
         grad_loss: torch.Tensor, lo: int, clip_lo: float, clip_hi: float, beta: float, inv: float = 1.0
         ) -> torch.Tensor:
    """`d loss / d policy` `[n, T, V_local]` in the logits' dtype (exact zeros on masked rows); `adv` `[n]` or
    `[n, T]`; `inv` the fp32 inverse temperature."""
    x = _rows2d(policy)
    N, V = x.shape
    g = torch.empty((N, V), dtype=policy.dtype, device=policy.device)
    bf16_bits = _INTERPRET and g.dtype == torch.bfloat16
    if N and V:
        pick(_GRAD, V, x.stride(0), g.stride(0))[(N,)](
            x, ids.reshape(-1).contiguous(), mask.reshape(-1).contiguous(), logp.contiguous(),
            (logp_ref if logp_ref is not None else logp).contiguous(), old.to(torch.float32).contiguous(),
            adv.contiguous(), weights.contiguous(), lse.contiguous(), grad_loss.to(torch.float32).reshape(1),
            g.view(torch.int16) if bf16_bits else g, mask.shape[-1], V, x.stride(0), g.stride(0), lo, clip_lo, clip_hi,
            beta, inv, HAS_REF=logp_ref is not None, TOKEN_ADV=adv.dim() == 2, SCALE=inv != 1.0, BF16_BITS=bf16_bits,
            BLOCK=min(GRAD_BLOCK, triton.next_power_of_2(V)), **_fp())
    return g.view(policy.shape)
