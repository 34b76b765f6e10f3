"""The deterministic path's kernels: the canonical math of `grpo_core/canonical.py`, operation for operation.

Every function here repeats one of `canonical.py` with the same IEEE operations in the same order, so the
kernels give the torch reference's bits, hence the golden's, on every GPU and under the interpreter. What
makes that hold: kernels compile with `enable_fp_fusion=False` (an FMA only where `tl.fma` is written, as
`canonical.fma` is), divide with `div_rn`, never call the GPU's approximate exp / log, propagate NaN through
max / min like torch, and build every sum as the same tree of adjacent pairs (`tl.split` of a trailing
dimension of two, or `tl.sum` over it: one add, the only possible order).

- `_row_kernel`, one program per token row and tensor (policy, reference): the row streams in chunks of `NT`
  vocabulary tiles of `W` columns, read as aligned 16-byte vectors wherever the row starts when the data is 16-byte
  aligned and a row holds a chunk and a vector (`_shifts`; else plain loads, `_load`); each
  tile's `(max, sum exp(x - max))` goes to memory (`[tokens, V / W]` pairs, a `W`-th of the row's floats), with
  the row's selected logit.
- `_merge_kernel`, one program per block of rows: the tree of `canonical.merge_stats` over each row's tile
  statistics, in global tile order (with TP > 1 every rank's, gathered), padded with identity leaves to a power
  of two, then the lse (and the log-probs, from the selected logits).
- `_advantages_kernel`, one program per group: `canonical.group_advantages`.
- `_sequence_kernel`, one program per sequence: the token terms and their tree sums over `padded_seq_len`, the
  metrics' per-sequence parts, and a flag for any bad input value.
- `_finish_kernel`, one program: the loss, the metrics and the normalizer's token weights from the whole batch's
  per-sequence vectors.
- `_grad_kernel`, one program per token row: `coef * (onehot - exp(x - lse))` in the logits' dtype.
Masked rows are never read.
"""

from __future__ import annotations

import functools
import math
import os
import struct

import torch
import triton
import triton.language as tl

from .. import canonical as C
from ..contract import AdvantageStd, Surrogate, TokenNormalizer
from .group_norm import FP32_MAX_TL, MODES, group_tensors
from .launch import SURROGATES, cdiv, finish_options, next_power_of_2, pick, twins

# Settings from one H200 sweep (benchmarks/README.md, 2026-11-30), bf16 32x256x32768 / 16x1024x151936: the row kernel
# with (4096 columns, 4 warps) took 0.554 / 5.05 ms against 0.574 / 5.13 with (2048, 2) and 0.569 / 5.14 with (8192, 8);
# the merge kernel with blocks of 8192 statistics 0.049 / 0.203 ms, 16384 0.027 / 0.240, 4096 0.029 / 0.354 (and 1.43 ms
# against 0.064 at 32x256x131072), each row in one block then (before MERGE_TILES). With the FMA exp (policy and
# reference rows, 8192x32768 / 8192x131072 / 16384x151936), `SUM_PAIRS` took 0.620 / 2.507 / 5.854 ms on fp32 rows
# against 0.664 / 2.646 / 6.146 without, but 0.478 / 1.890 / 4.410 against 0.467 / 1.845 / 4.346 on bf16 rows, and
# 2.50 against 1.97 ms on fp32 rows of 50257 (rows not on 16-byte boundaries).
CHUNK = 4096  # vocabulary columns per loop iteration of the row kernel
ROW_WARPS = 4
TAIL_CHUNK = 1024  # columns per masked chunk after a row's whole chunks (one bf16 vector per thread of ROW_WARPS)
MERGE_BLOCK = 8192  # tile statistics per loop iteration of the merge kernel (rows x tiles)
# A row's tiles per loop iteration of the merge kernel, at most (`merge_blocks`): a row in one block is padded to a
# power of two, whose padding merges are issued like the others. Warp instructions per row of the sm_90 code
# (`benchmarks/sass_row_kernel.py --merge`), one block against blocks of 256: 3496 against 1732 at 1187 tiles
# (V = 151936), 1644 against 1405 at 1024, 750 against 725 at 393.
MERGE_TILES = 256
MERGE_CHUNKS = 64  # a row's blocks, at most, while blocks of MERGE_BLOCK hold it (the kernel's [ROWS, CHUNKS] sums)
GRAD_BLOCK = 4096  # columns per loop iteration of the gradient kernel
BLOCK_T = 1024  # tokens per loop iteration of the sequence kernel
BLOCK_S = 1024  # sequences per loop iteration of the finish kernel
NUM_WARPS = 4  # the other kernels
MAX_TILE = CHUNK  # the row kernels hold one tile per chunk at least

_LOG2E, _ROUND = tl.constexpr(C.LOG2E), tl.constexpr(C.ROUND)
_ROUND_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", C.ROUND))[0])  # n = t_bits - ROUND_BITS
_LN2_HI, _LN2_LO = tl.constexpr(C.LN2_HI), tl.constexpr(C.LN2_LO)
_NEG_LN2_HI, _NEG_LN2_LO = tl.constexpr(-C.LN2_HI), tl.constexpr(-C.LN2_LO)
_Q0, _Q1, _Q2 = tl.constexpr(C.EXP_Q[0]), tl.constexpr(C.EXP_Q[1]), tl.constexpr(C.EXP_Q[2])
_Q3, _Q4 = tl.constexpr(C.EXP_Q[3]), tl.constexpr(C.EXP_Q[4])
_L0, _L1, _L2 = tl.constexpr(C.LOG_Q[0]), tl.constexpr(C.LOG_Q[1]), tl.constexpr(C.LOG_Q[2])
_EXP_MIN, _EXP_MAX, _TINY = tl.constexpr(C.EXP_MIN), tl.constexpr(C.EXP_MAX), tl.constexpr(C.TINY)
_EXP_NONZERO = tl.constexpr(C.EXP_NONZERO)
_SQRT_HALF_BITS = tl.constexpr(C.SQRT_HALF_BITS)
_ALL = tl.constexpr(tl.PropagateNan.ALL)
# The interpreter truncates fp32 -> bf16 (the GPU and torch round to nearest even): round with integer ops there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED = tl.constexpr(_INTERPRET)  # branches: `_fma`, `exp_nonpos_loop`, `_tiles`; matmul's `_stats`, kernel


@triton.jit
def _max(a, b):
    return tl.maximum(a, b, propagate_nan=_ALL)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b, propagate_nan=_ALL)


@triton.jit
def _row_max(x):
    """The interpreter's `tl.reduce(x, 1, _max)`: each row's maximum of `x` `[R, C]`, NaN where the row holds one
    (exact in any order). The interpreter runs a `tl.reduce` with a combine function element by element in Python
    (35% of the fused linear loss's layout test, `test_linear.py`, went there); here numpy's maximum runs over the
    row without its NaNs (`np.nanmax` would warn), and a test for NaN puts one back. The GPU's code reduces with
    `_max` in place (a call of this would change its instructions)."""
    nan = tl.max((x != x).to(tl.int32), 1) > 0
    return tl.where(nan, float("nan"), tl.max(tl.where(x == x, x, float("-inf")), 1))


@triton.jit
def _fma_probe(x_ptr):
    tl.store(x_ptr, tl.fma(tl.load(x_ptr), tl.load(x_ptr + 1), tl.load(x_ptr + 2)))


def _interpreter_fma_rounds_once() -> bool:
    """Whether the interpreter's `tl.fma` rounds once (Triton 3.9's does, in C; 3.6's rounds the product and then
    the sum): (1 + 2**-23) * -(1 - 2**-23) * 2**-24 + (1 + 2**-23) = 1 + 2**-24 + 2**-70 rounds up to 1 + 2**-23
    once; the product rounded to fp32 first, or the sum to float64 first, leaves the tie 1 + 2**-24: 1 (even)."""
    x = torch.tensor([1 + 2**-23, -(1 - 2**-23) * 2**-24, 1 + 2**-23], dtype=torch.float32, device="cpu")
    _fma_probe[(1,)](x)
    return x[0].item() == 1 + 2**-23


# The interpreter's `_fma`: its own fma where that rounds once (a third of the time of an interpreted test went to
# the emulation's fifteen block operations a call), the emulation elsewhere.
_NATIVE_FMA = tl.constexpr(_INTERPRET and _interpreter_fma_rounds_once())


@triton.jit
def _fma(a, b, c):
    """`canonical.fma`: `a * b + c` rounded once. The interpreter gives a positive NaN, as the GPU does (`exp_nonpos`
    keeps a NaN only if it is positive; x86 makes a negative one of inf * 0), with its own fma where that rounds
    once (`_NATIVE_FMA`), else computed the way `canonical.fma` does (finite or NaN operands: its callers clamp
    theirs). These branches are not compiled for the GPU."""
    if _INTERPRETED:
        if _NATIVE_FMA:
            r = tl.fma(a, b, c)
            return tl.where(r == r, r, float("nan"))
        else:
            p = a.to(tl.float64) * b
            c = c + tl.full(p.shape, -0.0, tl.float64)  # a float64 block; x + -0.0 is x, -0.0 included
            s = p + c
            t = s - p
            err = (p - (s - t)) + (c - t)  # p + c == s + err exactly
            bits = s.to(tl.int64, bitcast=True)
            bits = tl.where((err != 0) & ((bits & 1) == 0), bits + tl.where((err > 0) == (s > 0), 1, -1), bits)
            return tl.where(s == s, bits.to(tl.float64, bitcast=True).to(tl.float32), float("nan"))
    else:
        return tl.fma(a, b, c)


@triton.jit
def _poly(xc):
    """`p = exp(r)` of the reduced argument, as in `canonical.exp`, and `n` as the bits of `t = ROUND + n` (its
    integer part: `n = t_bits - ROUND_BITS`, `n << 23 == t_bits << 23` since ROUND_BITS << 23 wraps to 0)."""
    t = _fma(xc, _LOG2E, _ROUND)
    n = t - _ROUND
    r = _fma(n, _NEG_LN2_LO, _fma(n, _NEG_LN2_HI, xc))  # -n * c == n * -c exactly: no negation to issue
    q = _fma(_fma(_fma(_fma(r, _Q4, _Q3), r, _Q2), r, _Q1), r, _Q0)
    return _fma(_fma(q, r, 1.0), r, 1.0), t.to(tl.int32, bitcast=True)


@triton.jit
def _pow2(k):
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """`canonical.exp`."""
    p, t = _poly(_min(_max(x, _EXP_MIN), _EXP_MAX))
    k = t - _ROUND_BITS
    half = ((k + 256) >> 1) - 128
    p = (p * _pow2(half)) * _pow2(k - half)
    return tl.where(p < _TINY, 0.0, p)


@triton.jit
def exp_nonpos(x):
    """`canonical.exp` for `x <= 0` (or NaN), the same bits with an integer add: `p * 2**k` is exact while it is
    normal, and where its exponent field would drop to 0 or below both give 0 after the flush."""
    p, t = _poly(_max(x, _EXP_MIN))
    bits = p.to(tl.int32, bitcast=True) + tl.where(x == x, t << 23, 0)  # a NaN stays NaN (not FP32_MAX)
    return tl.where(bits < 0x800000, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def exp_nonpos_loop(x):
    """`exp_nonpos` for the row and gradient kernels' loops, the same bits except that a NaN gives 0.0 (the gradient
    kernel restores it per row; the row kernel's tiles rely on it: in a tile of -inf alone each difference to the
    maximum is NaN, and 0.0 is the reference's exp(-inf), `_tiles`): no clamp, the flush decided by `x`
    against `canonical.EXP_NONZERO` (where `exp` stops being 0: `canonical.exp`'s threshold, checked over every fp32
    in [-104, -80]), two instructions fewer per element."""
    if _INTERPRETED:
        x = _max(x, _EXP_MIN)  # `_fma`'s emulation would warn on inf - inf; the result is not taken
    p, t = _poly(x)
    bits = p.to(tl.int32, bitcast=True) + (t << 23)
    return tl.where(x >= _EXP_NONZERO, bits.to(tl.float32, bitcast=True), 0.0)


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
def _merge(m, s, u, R: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr, ENTROPY: tl.constexpr):
    """`canonical.merge_stats` of `[R, N]` pairs (`N` a power of two, padded with `(-inf, 0)`; ENTROPY: triples
    with `u`, padded with 0): `[R]` each (`u` returned as given without ENTROPY).

    One exp per merge: the larger side's factor is exp(0) = 1 exactly, so `s1 * exp(m1 - M) + s2 * exp(m2 - M)`
    has the bits of the larger side's `s` plus the other `s` times one exp (and `u`'s terms likewise: the larger
    side's `(u + s * 0) * 1`)."""
    for k in tl.static_range(LOG2N):
        m1, m2 = tl.split(tl.reshape(m, (R, N >> (k + 1), 2)))
        s1, s2 = tl.split(tl.reshape(s, (R, N >> (k + 1), 2)))
        m = _max(m1, m2)
        shift = tl.where(m == float("-inf"), 0.0, m)
        e = exp_nonpos(_min(m1, m2) - shift)
        if ENTROPY:
            u1, u2 = tl.split(tl.reshape(u, (R, N >> (k + 1), 2)))
            d1, d2 = m1 - shift, m2 - shift
            e1, e2 = tl.where(m1 >= m2, 1.0, e), tl.where(m1 >= m2, e, 1.0)
            u = (tl.where(s1 > 0.0, (u1 + s1 * d1) * e1, 0.0) + tl.where(s2 > 0.0, (u2 + s2 * d2) * e2, 0.0))
        s = tl.where(m1 >= m2, s1 + s2 * e, s1 * e + s2)
    if ENTROPY:
        u = tl.reshape(u, (R,))
    return tl.reshape(m, (R,)), tl.reshape(s, (R,)), u


@triton.jit
def _tile_sums(e, NT: tl.constexpr, W: tl.constexpr, LOG2W: tl.constexpr, SUM_PAIRS: tl.constexpr):
    """`canonical.pair_sum` of each of `NT` tiles `[NT, W]`. SUM_PAIRS adds each level's pairs with `tl.sum` over a
    dimension of two instead of `tl.split`: the same single add, in another register layout."""
    for k in tl.static_range(LOG2W):
        if SUM_PAIRS:
            e = tl.sum(tl.reshape(e, (NT, W >> (k + 1), 2)), 2)
        else:
            a, b = tl.split(tl.reshape(e, (NT, W >> (k + 1), 2)))
            e = a + b
    return tl.reshape(e, (NT,))


@triton.jit
def _columns(y, R: tl.constexpr, VEC: tl.constexpr):
    """The `VEC` (4 or 8) columns of `[R, VEC]`, `[R]` each, in order: register moves within a thread, since a
    thread holds a loaded vector whole."""
    if VEC == 8:
        even, odd = tl.split(tl.reshape(y, (R, 2, 2, 2)))
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        c0, c4 = tl.split(e0)
        c2, c6 = tl.split(e1)
        c1, c5 = tl.split(o0)
        c3, c7 = tl.split(o1)
        return c0, c1, c2, c3, c4, c5, c6, c7
    else:
        even, odd = tl.split(tl.reshape(y, (R, 2, 2)))
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        return c0, c1, c2, c3


@triton.jit
def _at(a, b, k: tl.constexpr, VEC: tl.constexpr):
    if k < VEC:
        return a[k]
    else:
        return b[k - VEC]


@triton.jit
def _window(y, y2, S: tl.constexpr, R: tl.constexpr, VEC: tl.constexpr):
    """`[R, VEC]`: each row's columns `S .. S + VEC - 1` of `y` followed by `y2` (the next vector)."""
    a, b = _columns(y, R, VEC), _columns(y2, R, VEC)
    if VEC == 8:
        even = tl.join(tl.join(_at(a, b, S, VEC), _at(a, b, S + 4, VEC)),
                       tl.join(_at(a, b, S + 2, VEC), _at(a, b, S + 6, VEC)))
        odd = tl.join(tl.join(_at(a, b, S + 1, VEC), _at(a, b, S + 5, VEC)),
                      tl.join(_at(a, b, S + 3, VEC), _at(a, b, S + 7, VEC)))
    else:
        even = tl.join(_at(a, b, S, VEC), _at(a, b, S + 2, VEC))
        odd = tl.join(_at(a, b, S + 1, VEC), _at(a, b, S + 3, VEC))
    return tl.reshape(tl.join(even, odd), (R, VEC))


@triton.jit
def _load(ptr, start, V, NT: tl.constexpr, W: tl.constexpr, S: tl.constexpr, VEC: tl.constexpr, MASK: tl.constexpr):
    """The loads of the tiles from tile `start` of one row (`NT` of `W` columns), `(y, y2)` for `_chunk`. S < 0:
    `ptr` is the row's start, the loads masked (-inf past the row's end), y2 is y. S >= 0: `ptr` points S elements
    before the row's start, at a 16-byte boundary (`VEC` elements), and every load is of whole aligned vectors: y
    the chunk's, y2 (at S > 0; else y) those one vector further, bf16 as int32 words (two elements each, converted
    by `_chunk`). Rows at any offset (V = 50257) then read as aligned ones do: with plain loads a thread held one
    element, the tiles' reductions crossed threads at every level, and the kernel took 128-136 registers on the H200.
    Without MASK the chunk (and at S > 0 the vector after it) lies in the row, but for chunk 0's first
    vector, which at S > 0 reads the S elements before the row (inside the tensor: `ptr` is not before its data,
    and they are not used); with MASK no load reaches outside the row but for the other half of a word holding the
    row's first or last element (in the same aligned 4 bytes, hence mapped memory, even past the tensor's end after
    its last row; a memory checker on an allocation of the tensor's exact size may report it), not used."""
    if S < 0:
        cols = (start + tl.arange(0, NT))[:, None] * W + tl.arange(0, W)[None, :]
        y = tl.load(ptr + cols, mask=cols < V, other=float("-inf"))
        return y, y
    else:
        P: tl.constexpr = 2 if ptr.dtype.element_ty == tl.bfloat16 else 1  # elements per unit loaded
        if P == 2:
            ptr = ptr.to(tl.pointer_type(tl.int32))
        H: tl.constexpr = VEC // P  # units per vector
        o = start * W // P + tl.arange(0, NT * W // VEC)[:, None] * H + tl.arange(0, H)[None, :]
        if MASK:  # unit o holds elements P * o .. P * o + P - 1 from `ptr`, the row's are S .. S + V - 1
            y = tl.load(ptr + o, mask=(P * o + P - 1 >= S) & (P * o - S < V), other=float("-inf") if P == 1 else 0)
        else:
            y = tl.load(ptr + o)
        y2 = y
        if S > 0:
            if MASK:
                y2 = tl.load(ptr + o + H, mask=P * (o + H) - S < V, other=float("-inf") if P == 1 else 0)
            else:
                y2 = tl.load(ptr + o + H)
        return y, y2


@triton.jit
def _half(w, HIGH: tl.constexpr):
    """The bf16 in the high (HIGH) or low half of each int32 word `w`, as fp32 (exact): one instruction (-65536 is
    0xFFFF0000)."""
    if HIGH:
        return (w & -65536).to(tl.float32, bitcast=True)
    else:
        return (w << 16).to(tl.float32, bitcast=True)


@triton.jit
def _chunk(y, y2, start, V, NT: tl.constexpr, W: tl.constexpr, S: tl.constexpr, VEC: tl.constexpr,
           MASK: tl.constexpr):
    """The `[NT, W]` logits of `_load`'s `(y, y2)` (bf16 as fp32): at S > 0 each vector of the chunk taken from two
    of the loaded ones (`_window`). bf16: element 2k of a vector is the low half of word k from S // 2 at even S,
    the high half at odd S; element 2k + 1 the other half of that word at even S, the low half of word k from
    S // 2 + 1 at odd S: a shift or a mask each, where converting loaded bf16 took 1.5 instructions per element."""
    if S < 0:
        return y
    elif y.dtype == tl.int32:
        R: tl.constexpr = NT * W // 8
        a, b = y, y
        if S > 0:
            a, b = _window(y, y2, S // 2, R, 4), _window(y, y2, (S + 1) // 2, R, 4)
        x = tl.reshape(tl.join(_half(a, S % 2 == 1), _half(b, S % 2 == 0)), (R, 8))
        if MASK:
            e = start * W + tl.arange(0, R)[:, None] * 8 + tl.arange(0, 8)[None, :]
            x = tl.where(e < V, x, float("-inf"))
        return tl.reshape(x, (NT, W))
    else:
        if S > 0:
            y = _window(y, y2, S, NT * W // VEC, VEC)
        return tl.reshape(y, (NT, W))


@triton.jit
def _tiles(x, inv, NT: tl.constexpr, W: tl.constexpr, LOG2W: tl.constexpr, SCALE: tl.constexpr,
           SUM_PAIRS: tl.constexpr, ENTROPY: tl.constexpr):
    """`canonical.tile_stats` of `NT` tiles `x` `[NT, W]` of one row (its logits times `inv`, the inverse
    temperature, with SCALE): `[NT]` maxima, sums and (ENTROPY, else 0) the entropy's sums; a tile of -inf alone
    gives (-inf, 0, 0) through NaN differences (`exp_nonpos_loop`). A tile whose maximum is NaN or +inf has a sum
    other than the reference's NaN; nothing reads it: the row's lse and entropy are NaN by the maximum alone (`_lse`,
    `_entropy`)."""
    x = x.to(tl.float32)
    if SCALE:
        x = x * inv
    # m: exact in any order (NaN if the tile holds one: the row raises); -0.0 -> +0.0
    if _INTERPRETED:  # the same `m` and `e`, faster (`_row_max`), without numpy's warning on -inf - -inf
        m = _row_max(x) + 0.0
        d = x - tl.where(m == float("-inf"), 0.0, m)[:, None]
    else:
        m = tl.reduce(x, 1, _max) + 0.0
        d = x - m[:, None]  # NaN in a tile of -inf alone: `e` is 0.0 there, the reference's exp(-inf - 0.0)
    e = exp_nonpos_loop(d)  # 0.0 where `exp_nonpos` gives NaN: tiles of -inf alone, tiles whose maximum is NaN or +inf
    u = tl.zeros((NT,), tl.float32)
    if ENTROPY:
        u = e * d
        u = _tile_sums(tl.where((e > 0.0) & (u != 0.0), u, 0.0), NT, W, LOG2W, SUM_PAIRS)  # -0.0 -> +0.0, as pair_sum
    return m, _tile_sums(e, NT, W, LOG2W, SUM_PAIRS), u


@triton.jit
def _lse(m, s):
    """`canonical.lse`: NaN unless the row was finite with at least one finite logit."""
    finite = (tl.abs(m) < float("inf")) & (s >= 1.0)
    return tl.where(finite, m + log(tl.where(finite, s, 1.0)), float("nan"))


@triton.jit
def _chunks(ptr, lo, hi, m_ptr, s_offset, V, tiles, inv, SCALE: tl.constexpr, W: tl.constexpr,
            LOG2W: tl.constexpr, NT: tl.constexpr, SUM_PAIRS: tl.constexpr, ENTROPY: tl.constexpr, S: tl.constexpr,
            VEC: tl.constexpr, MASK: tl.constexpr = True):
    """Chunks `lo .. hi - 1` of one row (`_load`, `_chunk`): their tiles' statistics (`_stats`). Without MASK
    (whole chunks) each chunk's loads are issued a chunk ahead (the last chunk's twice): on the H200, fp32
    rows of 131072 then took 2.06 against 2.39 ms (forward), bf16 rows the same time."""
    if MASK:
        for c in range(lo, hi):
            y, y2 = _load(ptr, c * NT, V, NT, W, S, VEC, MASK)
            _stats(m_ptr, s_offset, tiles, c, _chunk(y, y2, c * NT, V, NT, W, S, VEC, MASK), inv, SCALE, W, LOG2W,
                   NT, SUM_PAIRS, ENTROPY)
    elif lo < hi:
        y, y2 = _load(ptr, lo * NT, V, NT, W, S, VEC, MASK)
        for c in range(lo, hi):
            y_next, y2_next = _load(ptr, tl.minimum(c + 1, hi - 1) * NT, V, NT, W, S, VEC, MASK)
            _stats(m_ptr, s_offset, tiles, c, _chunk(y, y2, c * NT, V, NT, W, S, VEC, MASK), inv, SCALE, W, LOG2W,
                   NT, SUM_PAIRS, ENTROPY)
            y, y2 = y_next, y2_next


@triton.jit
def _stats(m_ptr, s_offset, tiles, c, x, inv, SCALE: tl.constexpr, W: tl.constexpr, LOG2W: tl.constexpr,
           NT: tl.constexpr, SUM_PAIRS: tl.constexpr, ENTROPY: tl.constexpr):
    """The statistics of chunk `c`'s tiles `x` (`_tiles`) to `m_ptr` (maxima), `m_ptr + s_offset` (sums) and
    (ENTROPY) `m_ptr + 2 * s_offset` (the entropy's sums)."""
    t = c * NT + tl.arange(0, NT)
    m, s, u = _tiles(x, inv, NT, W, LOG2W, SCALE, SUM_PAIRS, ENTROPY)
    tl.store(m_ptr + t, m, mask=t < tiles)
    tl.store(m_ptr + s_offset + t, s, mask=t < tiles)
    if ENTROPY:
        tl.store(m_ptr + 2 * s_offset + t, u, mask=t < tiles)


@triton.jit
def _row(ptr, row, stride, a, m_ptr, s_offset, V, tiles, inv, SCALE: tl.constexpr, W: tl.constexpr,
         LOG2W: tl.constexpr, NT: tl.constexpr, NT_TAIL: tl.constexpr, SUM_PAIRS: tl.constexpr, ENTROPY: tl.constexpr,
         VEC: tl.constexpr, SHIFTS: tl.constexpr):
    """One active row (`row` of the tensor at `ptr`): its tiles' statistics (`_chunks`); returns the selected logit
    (column `a`, 0.0 when this shard does not own it). SHIFTS > 0: `ptr` is 16-byte aligned and every row starts
    fewer than SHIFTS elements after a 16-byte boundary (`VEC` elements): a branch per offset (`_load`'s S), its
    whole chunks unmasked, the rest masked in chunks of NT_TAIL tiles (a row of 151936 ends in 3 tiles; computed as a
    chunk of 32, they had been 2.4% of its work). SHIFTS = 0: plain loads."""
    chunks = tl.cdiv(tiles, NT)
    start = row * stride
    if SHIFTS > 0:
        shift = start % VEC
        base = ptr + tl.multiple_of(start - shift, VEC)
        for S in tl.static_range(SHIFTS):
            if shift == S:
                # the whole chunks that lie in the row with the vector after them (read, not used, at S > 0)
                full = tl.maximum(tl.minimum((V - (VEC if S > 0 else 0)) // (NT * W), chunks), 0)
                _chunks(base, 0, full, m_ptr, s_offset, V, tiles, inv, SCALE, W, LOG2W, NT, SUM_PAIRS, ENTROPY, S,
                        VEC, False)
                _chunks(base, full * (NT // NT_TAIL), tl.cdiv(tiles, NT_TAIL), m_ptr, s_offset, V, tiles, inv, SCALE,
                        W, LOG2W, NT_TAIL, SUM_PAIRS, ENTROPY, S, VEC, True)
    else:
        _chunks(ptr + start, 0, chunks, m_ptr, s_offset, V, tiles, inv, SCALE, W, LOG2W, NT, SUM_PAIRS, ENTROPY, -1,
                VEC)
    z = tl.load(ptr + start + a, mask=(a >= 0) & (a < V), other=0.0).to(tl.float32)
    if SCALE:
        z = z * inv
    return z


def _row_kernel(
    x_ptr,  # policy logits [N, V] (this rank's vocabulary shard), rows `stride_x` apart
    r_ptr,  # reference logits [N, V], rows `stride_r` apart (read by the programs of grid axis 1 = 1)
    ids_ptr,  # global action ids [N]
    mask_ptr,  # completion mask [N], nonzero = active
    sel_ptr,  # out: fp32 [2, N] = the selected logit of the policy and the reference rows (0.0 where not owned)
    stats_ptr,  # out: fp32 [2 (policy, ref), P (max, sumexp[, entropy sums]), N, tiles] per-tile statistics
    N, V, stride_x, stride_r, lo, tiles,
    plane,  # N * tiles, the statistics of one (tensor, max / sum) (an int64 argument from 2**31 on)
    inv,  # the inverse temperature, fp32 (SCALE)
    period_x, period_r,  # rows `period` apart start at the same offset from a 16-byte boundary (`_period`)
    # Meta-parameters
    SCALE: tl.constexpr,  # temperature != 1: the logits are multiplied by `inv` as they are read
    W: tl.constexpr, LOG2W: tl.constexpr,  # tile width (a power of two)
    NT: tl.constexpr,  # tiles per chunk
    NT_TAIL: tl.constexpr,  # tiles per masked chunk after a row's whole chunks (a power of two, at most NT)
    SUM_PAIRS: tl.constexpr,  # `_tiles`; on the H200 faster for fp32 rows on 16-byte boundaries, slower otherwise
    ENTROPY: tl.constexpr,  # the policy rows' entropy sums too (P = 3 planes per tensor, else 2)
    VEC_X: tl.constexpr, VEC_R: tl.constexpr,  # elements per 16 bytes of each tensor
    SHIFTS_X: tl.constexpr, SHIFTS_R: tl.constexpr,  # `_row`'s SHIFTS of each tensor
    SHARED: tl.constexpr,  # one copy of `_row` for both tensors: one dtype, the same SHIFTS, no entropy
):
    which = tl.program_id(1)  # 0: the policy row, 1: the reference row (a program each)
    # The programs take the rows of one offset after another (rows k, k + period, ...), so that the programs that
    # run together run one of `_row`'s branches: with all of them at once, the code (8 branches of 12 KB each for
    # bf16) overflowed the instruction cache and V = 50257 took 2.8x the time of the same rows at aligned starts.
    period = tl.where(which == 0, period_x, period_r).to(tl.int64)
    per = tl.cdiv(N, period)
    pid = tl.program_id(0).to(tl.int64)
    row = (pid % per) * period + pid // per
    inside = (row < N) & (pid < per * period)  # the grid's last few programs have no row
    inv = tl.cast(inv, tl.float32)
    z = 0.0
    if tl.load(mask_ptr + row, mask=inside, other=0) != 0:
        a = tl.load(ids_ptr + row).to(tl.int64) - lo
        if SHARED:
            z = _row(tl.where(which == 0, x_ptr, r_ptr), row, tl.where(which == 0, stride_x, stride_r), a,
                     stats_ptr + which.to(tl.int64) * 2 * plane + row * tiles, plane, V, tiles, inv, SCALE, W, LOG2W,
                     NT, NT_TAIL, SUM_PAIRS, False, VEC_X, SHIFTS_X)
        elif which == 0:
            z = _row(x_ptr, row, stride_x, a, stats_ptr + row * tiles, plane, V, tiles, inv, SCALE, W, LOG2W, NT,
                     NT_TAIL, SUM_PAIRS, ENTROPY, VEC_X, SHIFTS_X)
        else:
            z = _row(r_ptr, row, stride_r, a, stats_ptr + (2 + ENTROPY) * plane.to(tl.int64) + row * tiles, plane, V,
                     tiles, inv, SCALE, W, LOG2W, NT, NT_TAIL, SUM_PAIRS, False, VEC_R, SHIFTS_R)
    tl.store(sel_ptr + which * N + row, z, mask=inside)


@triton.jit
def _entropy(m, s, u):
    """`canonical.entropy_of`: `log(S) - U / S`, NaN where `_lse` is."""
    finite = (tl.abs(m) < float("inf")) & (s >= 1.0)
    s = tl.where(finite, s, 1.0)
    return tl.where(finite, log(s) - tl.math.div_rn(u, s), float("nan"))


@triton.jit
def _merge_kernel(
    stats_ptr,  # fp32 [K, P, N, tiles]: K tensors' per-tile statistics (max, sumexp[, entropy sums]), global order
    mask_ptr,  # completion mask [N]
    lse_ptr,  # out: fp32 [K, N] (0.0 on masked rows)
    ent_ptr,  # out (ENTROPY): fp32 [N], the first tensor's entropies (0.0 on masked rows)
    sel_ptr,  # in / out (LOGP): fp32 [K, N], the selected logits, replaced by the log-probs (0.0 on masked rows)
    N, tiles,
    plane,  # N * tiles
    # Meta-parameters
    ROWS: tl.constexpr,  # rows per program
    BT: tl.constexpr, LOG2BT: tl.constexpr,  # tiles per loop iteration (a power of two)
    CHUNKS: tl.constexpr, LOG2C: tl.constexpr,  # loop iterations, padded to a power of two
    ENTROPY: tl.constexpr,  # P = 3 (the first tensor's third plane holds the entropy sums), else 2
    LOGP: tl.constexpr,  # sel_ptr's selected logits become the log-probs
):
    k = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_ptr = stats_ptr + k.to(tl.int64) * (2 + ENTROPY) * plane
    active = tl.load(mask_ptr + rows, mask=rows < N, other=0) != 0
    chunk = tl.arange(0, CHUNKS)[None, :]
    ms = tl.full((ROWS, CHUNKS), float("-inf"), tl.float32)
    ss = tl.zeros((ROWS, CHUNKS), tl.float32)
    us = tl.zeros((ROWS, CHUNKS), tl.float32)
    for c in range(0, tl.cdiv(tiles, BT)):
        t = c * BT + tl.arange(0, BT)
        at = rows[:, None] * tiles + t[None, :]
        read = active[:, None] & (t < tiles)[None, :]
        u = tl.zeros((ROWS, BT), tl.float32)
        if ENTROPY:
            if k == 0:  # the first tensor's (the others' third plane is not read)
                u = tl.load(m_ptr + 2 * plane + at, mask=read, other=0.0)
        m, s, u = _merge(tl.load(m_ptr + at, mask=read, other=float("-inf")),
                         tl.load(m_ptr + plane + at, mask=read, other=0.0), u, ROWS, BT, LOG2BT, ENTROPY)
        ms = tl.where(chunk == c, m[:, None], ms)
        ss = tl.where(chunk == c, s[:, None], ss)
        if ENTROPY:
            us = tl.where(chunk == c, u[:, None], us)
    m, s, u = _merge(ms, ss, us, ROWS, CHUNKS, LOG2C, ENTROPY)
    lse = tl.where(active, _lse(m, s), 0.0)
    tl.store(lse_ptr + k.to(tl.int64) * N + rows, lse, mask=rows < N)
    if LOGP:
        at = sel_ptr + k.to(tl.int64) * N + rows
        tl.store(at, tl.where(active, tl.load(at, mask=rows < N, other=0.0) - lse, 0.0), mask=rows < N)
    if ENTROPY:
        if k == 0:
            tl.store(ent_ptr + rows, tl.where(active, _entropy(m, s, u), 0.0), mask=rows < N)


@triton.jit
def sigmoid(x):
    """`canonical.sigmoid`."""
    t = exp(-tl.abs(x))
    return tl.math.div_rn(tl.where(x >= 0, 1.0, t), 1.0 + t)


@triton.jit
def _token_terms(logp, logp_ref, old, active, adv, clip_lo, clip_hi, delta, w_is, tau_pos, tau_neg, given,
                 HAS_REF: tl.constexpr, HAS_IS: tl.constexpr, BIAS_KL: tl.constexpr, SURROGATE: tl.constexpr,
                 GIVEN_RATIO: tl.constexpr):
    """`canonical.ratio_and_kl` and `canonical.clipped_surrogate` of one block of tokens (`delta`: +inf without
    one, where `min` changes nothing; `w_is`: the importance weights, HAS_IS; SURROGATE: 0 clipped, 1 CISPO, 2 SAPO,
    3 VESPO (its gamma weight in `w_is`);
    GIVEN_RATIO: the ratio is `given`, GSPO's sequence ratio)."""
    if GIVEN_RATIO:
        ratio = given
    else:
        ratio = exp(tl.where(active, logp - old, 0.0))
    if SURROGATE == 1:
        policy = -((_min(ratio, clip_hi) * adv) * logp)
    elif SURROGATE == 3:
        policy = -(adv * logp)
    elif SURROGATE == 2:
        tau = tl.where(adv > 0, tau_pos, tau_neg)
        policy = -(tl.math.div_rn(sigmoid(tau * (ratio - 1.0)) * 4.0, tau) * adv)
    else:
        policy = -_min(_min(ratio, delta) * adv, _min(_max(ratio, clip_lo), clip_hi) * adv)
    if HAS_IS:
        policy = policy * w_is
    kl = tl.zeros_like(ratio)
    if HAS_REF:
        d = tl.where(active, logp_ref - logp, 0.0)
        kl = (exp(d) - d) - 1.0
        if BIAS_KL:
            kl = kl * ratio
    return ratio, tl.where(active, policy, 0.0), kl


@triton.jit
def _sequence_kernel(
    logp_ptr,  # fp32 [B, T] policy log-probs (0.0 on masked tokens)
    ref_ptr,  # fp32 [B, T] reference log-probs (HAS_REF)
    old_ptr,  # fp32 [B, T] old log-probs
    mask_ptr,  # completion mask [B, T] as given, nonzero = active
    ids_ptr,  # global action ids [B, T]
    adv_ptr,  # fp32 [B] advantages (TOKEN_ADV: [B, T]); only what active tokens read is read
    r_ptr,  # fp32 [B] rewards (REWARDS)
    is_ptr,  # fp32 [B, T] importance weights (HAS_IS)
    ratio_ptr,  # fp32 [B, T] the tokens' ratios (GIVEN_RATIO; `canonical.ratio_and_kl(..., sequence=True)`)
    out_ptr,  # out: fp32 [3, B] = each sequence's token sums of the surrogate, the KL and the ratio
    ints_ptr,  # out: int64 [3, B] = active tokens, bad-value flag, clipped tokens (`canonical.clipped_tokens`)
    B, T, vocab, clip_lo, clip_hi, delta, tau_pos, tau_neg,  # tau_*: SAPO's temperatures
    # Meta-parameters
    HAS_REF: tl.constexpr,
    HAS_IS: tl.constexpr,
    BIAS_KL: tl.constexpr,  # the KL term times the ratio
    SURROGATE: tl.constexpr,  # 0 clipped, 1 CISPO, 2 SAPO, 3 VESPO
    GIVEN_RATIO: tl.constexpr,
    TOKEN_ADV: tl.constexpr,  # an advantage per token
    REWARDS: tl.constexpr,  # the advantages come from the rewards: flag a non-finite reward or advantage
    CHECK_MASK: tl.constexpr,  # the mask is not bool: flag active values other than 1
    BLOCK: tl.constexpr, LOG2B: tl.constexpr,  # tokens per chunk (a power of two)
    CHUNKS: tl.constexpr, LOG2C: tl.constexpr,  # chunks, padded to a power of two
):
    """The bad-value flag is set where an active token has an id outside `[0, vocab)`, a mask value other than 1,
    a non-finite old log-prob, advantage or log-prob (policy or reference), an importance weight that is not finite
    and >= 0, or where the reward or the advantage derived from the rewards is not finite."""
    b = tl.program_id(0).to(tl.int64)
    clip_lo, clip_hi, delta = tl.cast(clip_lo, tl.float32), tl.cast(clip_hi, tl.float32), tl.cast(delta, tl.float32)
    tau_pos, tau_neg = tl.cast(tau_pos, tl.float32), tl.cast(tau_neg, tl.float32)
    idx = tl.arange(0, CHUNKS)
    pol = tl.zeros((CHUNKS,), tl.float32)
    kls = tl.zeros((CHUNKS,), tl.float32)
    rat = tl.zeros((CHUNKS,), tl.float32)
    bad = tl.zeros((BLOCK,), tl.int32)
    count = tl.zeros((BLOCK,), tl.int32)
    clipped = tl.zeros((BLOCK,), tl.int32)
    for c in range(0, tl.cdiv(T, BLOCK)):
        t = c * BLOCK + tl.arange(0, BLOCK)
        raw = tl.load(mask_ptr + b * T + t, mask=t < T, other=0)
        active = raw != 0
        ids = tl.load(ids_ptr + b * T + t, mask=active, other=0)
        logp = tl.load(logp_ptr + b * T + t, mask=active, other=0.0)
        logp_ref = tl.load(ref_ptr + b * T + t, mask=active, other=0.0) if HAS_REF else logp
        old = tl.load(old_ptr + b * T + t, mask=active, other=0.0)
        if TOKEN_ADV:
            adv = tl.load(adv_ptr + b * T + t, mask=active, other=0.0)
        else:  # the sequence's advantage at every token
            adv = tl.load(adv_ptr + b + 0 * t, mask=active, other=0.0)
        w_is = tl.load(is_ptr + b * T + t, mask=active, other=0.0) if HAS_IS else adv
        given = tl.load(ratio_ptr + b * T + t, mask=active, other=1.0) if GIVEN_RATIO else adv
        ratio, policy, kl = _token_terms(logp, logp_ref, old, active, adv, clip_lo, clip_hi, delta, w_is, tau_pos,
                                         tau_neg, given, HAS_REF, HAS_IS, BIAS_KL, SURROGATE, GIVEN_RATIO)
        finite = ((tl.abs(logp) < float("inf")) & (tl.abs(logp_ref) < float("inf")) & (tl.abs(old) < float("inf"))
                  & (tl.abs(adv) < float("inf")) & (ids >= 0) & (ids < vocab))
        if HAS_IS:
            finite = finite & (w_is >= 0.0) & (w_is < float("inf"))
        if CHECK_MASK:
            finite = finite & (raw == 1)
        bad = tl.maximum(bad, (active & ~finite).to(tl.int32))
        count += active.to(tl.int32)
        clipped += (active & (((ratio < clip_lo) & (adv < 0)) | ((ratio > clip_hi) & (adv > 0)))).to(tl.int32)
        pol = tl.where(idx == c, _pair_sum(policy, BLOCK, LOG2B), pol)
        kls = tl.where(idx == c, _pair_sum(kl, BLOCK, LOG2B), kls)
        rat = tl.where(idx == c, _pair_sum(tl.where(active, ratio, 0.0), BLOCK, LOG2B), rat)
    tl.store(out_ptr + b, _pair_sum(pol, CHUNKS, LOG2C))
    tl.store(out_ptr + B + b, _pair_sum(kls, CHUNKS, LOG2C))
    tl.store(out_ptr + 2 * B + b, _pair_sum(rat, CHUNKS, LOG2C))
    flag = tl.max(bad, 0)
    if REWARDS:
        finite = (tl.abs(tl.load(r_ptr + b)) < float("inf")) & (tl.abs(tl.load(adv_ptr + b)) < float("inf"))
        flag = tl.maximum(flag, (~finite).to(tl.int32))
    tl.store(ints_ptr + b, tl.sum(count, 0).to(tl.int64))
    tl.store(ints_ptr + B + b, flag.to(tl.int64))
    tl.store(ints_ptr + 2 * B + b, tl.sum(clipped, 0).to(tl.int64))


@triton.jit
def _advantages_kernel(
    r_ptr,  # fp32 [S] rewards (the whole batch's)
    bounds_ptr,  # int64 [G + 1] CSR group offsets
    adv_ptr,  # out: fp32 [S]
    floor, eps,
    # Meta-parameters
    STD: tl.constexpr,  # 0 population, 1 unbiased (both clamped at `floor`), 2 none, 3 unbiased + `eps` (TRL's)
    P2: tl.constexpr, LOG2P: tl.constexpr,  # the largest group, padded to a power of two
):
    """`canonical.group_advantages`, one program per group: its rewards zero-padded to `P2`, the same trees."""
    g = tl.program_id(0)
    lo, hi = tl.load(bounds_ptr + g), tl.load(bounds_ptr + g + 1)
    floor, eps = tl.cast(floor, tl.float32), tl.cast(eps, tl.float32)
    i = tl.arange(0, P2)
    valid = i < hi - lo
    r = tl.load(r_ptr + lo + i, mask=valid, other=0.0)
    n = (hi - lo).to(tl.float32)
    centered = r - tl.math.div_rn(_pair_sum(r, P2, LOG2P), n)
    if STD != 2:
        dev = tl.where(valid, centered, 0.0)
        var = tl.math.div_rn(_pair_sum(dev * dev, P2, LOG2P), n if STD == 0 else n - 1.0)
        var = tl.where(var <= FP32_MAX_TL, var, float("nan"))
        sd = tl.where(var < _TINY, 0.0, tl.math.sqrt_rn(var))  # `canonical.sqrt`: correctly rounded
        centered = tl.math.div_rn(centered, sd + eps if STD == 3 else _max(sd, floor))
    tl.store(adv_ptr + lo + i, centered, mask=valid)


@triton.jit
def _finish_kernel(
    sums_ptr,  # fp32 [3, S] each sequence's token sums: surrogate, KL, ratio (the whole batch's)
    ints_ptr,  # int64 [3, S]: active tokens, bad-value flag, clipped tokens
    out_ptr,  # out: fp32 [6] = loss, policy_loss, kl, clip_fraction, mean_ratio, kl_token_mean
    w_ptr,  # out: fp32 [S] token weights (`canonical.token_weights`)
    flag_ptr,  # out: int64 0-d = the largest flag, or 1 where the loss is not finite
    S, beta, constant,  # constant: the denominator when DENOM == "constant"
    # Meta-parameters
    MEANS: tl.constexpr,  # each sequence's token sums are divided by its active tokens first (0 when it has none)
    DENOM: tl.constexpr,  # "tokens" (the batch's active tokens), "sequences" (those with one) or "constant"
    BLOCK: tl.constexpr, LOG2B: tl.constexpr,  # sequences per chunk (a power of two)
    CHUNKS: tl.constexpr, LOG2C: tl.constexpr,  # chunks, padded to a power of two
):
    """`canonical.combine`, `canonical.batch_metrics` and `canonical.token_weights`, in one program."""
    beta, constant = tl.cast(beta, tl.float32), tl.cast(constant, tl.float32)
    idx = tl.arange(0, CHUNKS)
    pol = tl.zeros((CHUNKS,), tl.float32)
    kls = tl.zeros((CHUNKS,), tl.float32)
    kl_sums = tl.zeros((CHUNKS,), tl.float32)
    ratios = tl.zeros((CHUNKS,), tl.float32)
    tokens = tl.zeros((BLOCK,), tl.int64)
    seqs = tl.zeros((BLOCK,), tl.int64)
    clipped = tl.zeros((BLOCK,), tl.int64)
    bad = tl.zeros((BLOCK,), tl.int64)
    for c in range(0, tl.cdiv(S, BLOCK)):
        i = c * BLOCK + tl.arange(0, BLOCK)
        inside = i < S
        n = tl.load(ints_ptr + i, mask=inside, other=0)
        bad = tl.maximum(bad, tl.load(ints_ptr + S + i, mask=inside, other=0))
        clipped += tl.load(ints_ptr + 2 * S + i, mask=inside, other=0)
        tokens += n
        seqs += (n > 0).to(tl.int64)
        p = tl.load(sums_ptr + i, mask=inside, other=0.0)
        k = tl.load(sums_ptr + S + i, mask=inside, other=0.0)
        kl_sums = tl.where(idx == c, _pair_sum(k, BLOCK, LOG2B), kl_sums)
        ratios = tl.where(idx == c, _pair_sum(tl.load(sums_ptr + 2 * S + i, mask=inside, other=0.0), BLOCK, LOG2B),
                          ratios)
        if MEANS:
            d = tl.maximum(n, 1).to(tl.float32)
            p = tl.where(n > 0, tl.math.div_rn(p, d), 0.0)
            k = tl.where(n > 0, tl.math.div_rn(k, d), 0.0)
        pol = tl.where(idx == c, _pair_sum(p, BLOCK, LOG2B), pol)
        kls = tl.where(idx == c, _pair_sum(k, BLOCK, LOG2B), kls)
    n_tokens = tl.maximum(tl.sum(tokens, 0), 1).to(tl.float32)
    n_seqs = tl.maximum(tl.sum(seqs, 0), 1).to(tl.float32)
    denom = n_tokens if DENOM == "tokens" else (n_seqs if DENOM == "sequences" else constant)
    policy = tl.math.div_rn(_pair_sum(pol, CHUNKS, LOG2C), denom)
    kl = tl.math.div_rn(_pair_sum(kls, CHUNKS, LOG2C), denom)
    loss = policy + beta * kl
    tl.store(out_ptr, loss)
    tl.store(out_ptr + 1, policy)
    tl.store(out_ptr + 2, kl)
    tl.store(out_ptr + 3, tl.math.div_rn(tl.sum(clipped, 0).to(tl.float32), n_tokens))
    tl.store(out_ptr + 4, tl.math.div_rn(_pair_sum(ratios, CHUNKS, LOG2C), n_tokens))
    tl.store(out_ptr + 5, tl.math.div_rn(_pair_sum(kl_sums, CHUNKS, LOG2C), n_tokens))
    loss_bad = tl.where(tl.abs(loss) <= FP32_MAX_TL, 0, 1).to(tl.int64)  # a NaN compares false: flagged too
    tl.store(flag_ptr, tl.maximum(tl.max(bad, 0), loss_bad))
    for c in range(0, tl.cdiv(S, BLOCK)):
        i = c * BLOCK + tl.arange(0, BLOCK)
        n = tl.load(ints_ptr + i, mask=i < S, other=0)
        one = tl.full((BLOCK,), 1.0, tl.float32)
        if MEANS:
            w = tl.where(n > 0, tl.math.div_rn(one, tl.maximum(n, 1).to(tl.float32) * denom), 0.0)
        else:
            w = tl.math.div_rn(one, denom)
        tl.store(w_ptr + i, w, mask=i < S)


@triton.jit
def _grad_block(x_row, g_row, c, mask, a, coef, lse, ch, h, inv, SCALE: tl.constexpr, ENTROPY: tl.constexpr,
                BF16_BITS: tl.constexpr):
    """`_grad_kernel`'s gradient at columns `c` of one row (`a`: the action's column; `mask` None: all inside)."""
    if mask is None:
        x = tl.load(x_row + c).to(tl.float32)
    else:
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
    if SCALE:
        x = x * inv
    onehot = tl.where(c == a, 1.0, 0.0)
    lp = x - lse
    p = exp_nonpos_loop(lp)
    grad = coef * (onehot - p)
    if ENTROPY:
        grad = grad + ch * tl.where(p > 0.0, p * (lp + h), 0.0)
    if BF16_BITS:
        b = grad.to(tl.int32, bitcast=True)
        grad = ((b + (0x7FFF + ((b >> 16) & 1))) >> 16).to(tl.int16)
    else:
        grad = grad.to(g_row.dtype.element_ty)
    if mask is None:
        tl.store(g_row + c, grad)
    else:
        tl.store(g_row + c, grad, mask=mask)


def _grad_kernel(
    x_ptr,  # policy logits [N, V], rows `stride_x` apart
    ids_ptr,  # global action ids [N]
    mask_ptr,  # completion mask [N]
    logp_ptr,  # fp32 [N] policy log-probs
    ref_ptr,  # fp32 [N] reference log-probs (HAS_REF)
    old_ptr,  # fp32 [N] old log-probs
    adv_ptr,  # fp32 [N // T] advantages of this rank's sequences (TOKEN_ADV: [N], one per token)
    w_ptr,  # fp32 [N // T] normalizer weights of this rank's sequences
    is_ptr,  # fp32 [N] importance weights (HAS_IS)
    lse_ptr,  # fp32 [N] the policy rows' log-sum-exp over the whole vocabulary
    g_out_ptr,  # fp32 [1] d(output) / d(loss)
    coef_ptr,  # fp32 [N] d loss / d logp per token (GIVEN_COEF: `canonical.sequence_coef`, GSPO's)
    ch_ptr,  # fp32 [N] each token's weight in the entropy bonus, times d(output) / d(loss) (ENTROPY)
    ent_ptr,  # fp32 [N] each token's entropy (ENTROPY)
    g_ptr,  # out: gradient [N, V] in the logits' dtype (BF16_BITS: its int16 view), rows `stride_g` apart
    T, V, stride_x, stride_g, lo, clip_lo, clip_hi, beta, delta, tau_pos, tau_neg,
    inv,  # the inverse temperature, fp32 (SCALE)
    # Meta-parameters
    HAS_REF: tl.constexpr,
    HAS_IS: tl.constexpr,
    BIAS_KL: tl.constexpr,
    SURROGATE: tl.constexpr,  # 0 clipped, 1 CISPO, 2 SAPO, 3 VESPO
    GIVEN_COEF: tl.constexpr,  # the coefficient is read from coef_ptr (weighted), not computed
    TOKEN_ADV: tl.constexpr,
    SCALE: tl.constexpr,  # temperature != 1: d loss / d x = inv * d loss / d (x * inv)
    BF16_BITS: tl.constexpr,  # round to bf16 with integer ops (round to nearest even, as torch does)
    ENTROPY: tl.constexpr,  # plus the entropy bonus's term `ch * (p * ((z - lse) + h))` (`write_grad`'s)
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,  # > 0: elements per 16 bytes; both tensors 16-byte aligned, their rows at the same offsets
):
    row = tl.program_id(0).to(tl.int64)
    clip_lo, clip_hi, beta = tl.cast(clip_lo, tl.float32), tl.cast(clip_hi, tl.float32), tl.cast(beta, tl.float32)
    inv, delta = tl.cast(inv, tl.float32), tl.cast(delta, tl.float32)
    tau_pos, tau_neg = tl.cast(tau_pos, tl.float32), tl.cast(tau_neg, tl.float32)
    g_row = g_ptr + row * stride_g
    cols = tl.arange(0, BLOCK)
    if tl.load(mask_ptr + row) != 0:
        if GIVEN_COEF:
            coef = tl.load(coef_ptr + row) * tl.load(g_out_ptr)
        else:
            seq = row // T
            logp = tl.load(logp_ptr + row)
            logp_ref = tl.load(ref_ptr + row) if HAS_REF else logp
            adv = tl.load(adv_ptr + row) if TOKEN_ADV else tl.load(adv_ptr + seq)
            ratio = exp(logp - tl.load(old_ptr + row))
            if SURROGATE == 1:
                coef = -(_min(ratio, clip_hi) * adv)
            elif SURROGATE == 3:
                coef = -adv
            elif SURROGATE == 2:
                s = sigmoid(tl.where(adv > 0, tau_pos, tau_neg) * (ratio - 1.0))
                coef = -((((s * (1.0 - s)) * 4.0) * ratio) * adv)
            else:
                # the minimum's branch, and whether its clamp passes the ratio (+inf delta: the first branch's always
                # does, and where the second is the smaller one it clamped the ratio)
                clipped = _min(_max(ratio, clip_lo), clip_hi) * adv
                taken = tl.where(_min(ratio, delta) * adv <= clipped, ratio <= delta,
                                 (ratio >= clip_lo) & (ratio <= clip_hi))
                coef = tl.where(taken, -(ratio * adv), 0.0)
            if HAS_IS:
                coef = coef * tl.load(is_ptr + row)
            if HAS_REF:
                d = logp_ref - logp
                if BIAS_KL:
                    dkl = -(d * ratio)
                else:
                    dkl = 1.0 - exp(d)
                coef = coef + beta * dkl
            coef = (coef * tl.load(w_ptr + seq)) * tl.load(g_out_ptr)
        if SCALE:
            coef = coef * inv
        ch = 0.0
        h = 0.0
        if ENTROPY:
            ch = tl.load(ch_ptr + row)
            if SCALE:
                ch = ch * inv
            h = tl.load(ent_ptr + row)
        lse = tl.load(lse_ptr + row)
        coef = tl.where(lse == lse, coef, float("nan"))  # `exp_nonpos_loop` gives 0.0 where `exp_nonpos` gives NaN
        a = tl.load(ids_ptr + row).to(tl.int64) - lo
        if VEC > 0:
            # Rows not known to start on 16-byte boundaries (`_grad_vec`), both tensors' at the same offsets: the
            # blocks start at the boundary before the row (aligned vectors; column = offset - shift), masked only in
            # the row's first and last block.
            start_x = row * stride_x
            shift = (start_x % VEC).to(tl.int32)
            x_row = x_ptr + tl.multiple_of(start_x - shift, VEC)
            g_row = g_ptr + tl.multiple_of(row * stride_g - shift, VEC)
            a = tl.where((a >= 0) & (a < V), a, -1).to(tl.int32) + shift  # int32 compares per element
            end = V + shift
            last = (end - 1) // BLOCK * BLOCK  # the last block's start
            _grad_block(x_row, g_row, cols, (cols >= shift) & (cols < end), a, coef, lse, ch, h, inv, SCALE, ENTROPY,
                        BF16_BITS)
            for b in range(BLOCK, last, BLOCK):
                _grad_block(x_row, g_row, b + cols, None, a, coef, lse, ch, h, inv, SCALE, ENTROPY, BF16_BITS)
            if last > 0:
                _grad_block(x_row, g_row, last + cols, last + cols < end, a, coef, lse, ch, h, inv, SCALE, ENTROPY,
                            BF16_BITS)
        else:
            x_row = x_ptr + row * stride_x
            for start in range(0, V, BLOCK):
                c = start + cols
                _grad_block(x_row, g_row, c, c < V, a, coef, lse, ch, h, inv, SCALE, ENTROPY, BF16_BITS)
    else:
        for start in range(0, V, BLOCK):
            c = start + cols
            tl.store(g_row + c, tl.zeros((BLOCK,), g_ptr.dtype.element_ty), mask=c < V)


_ROW = twins(_row_kernel, ["V", "stride_x", "stride_r"])
_GRAD = twins(_grad_kernel, ["V", "stride_x", "stride_g"])


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _vec(t: torch.Tensor) -> int:
    return 16 // t.element_size()


def _grad_vec(x: torch.Tensor, g: torch.Tensor, V: int, block: int) -> int:
    """`_grad_kernel`'s VEC: the elements per 16 bytes, for aligned blocks, when both tensors' data is 16-byte aligned,
    they share a dtype, their rows start at the same offsets (row strides equal modulo a vector) and a block holds a
    vector (the first block covers the row's offset); else 0, the plain loop, which vectorizes only where Triton
    sees V and both row strides divisible by 16 (then it is taken: it beat aligned blocks on such rows)."""
    vec = _vec(x)
    if V % 16 == 0 and x.stride(0) % 16 == 0 and g.stride(0) % 16 == 0:
        return 0
    same = x.dtype == g.dtype and x.stride(0) % vec == g.stride(0) % vec
    return vec if same and x.data_ptr() % 16 == 0 and g.data_ptr() % 16 == 0 and 4 <= vec <= block else 0


def _shifts(t: torch.Tensor, chunk: int) -> int:
    """`_row`'s SHIFTS for the rows of `t` `[N, V]` read in chunks of `chunk` columns: 0 (plain loads) unless its
    data is 16-byte aligned, a vector holds 4 or 8 elements and a row holds a whole chunk and a vector more (else
    the branches would compile, 8 for bf16, for masked chunks only); then 1 where every row is aligned, else a
    branch per offset."""
    vec = _vec(t)
    if t.data_ptr() % 16 or vec not in (4, 8) or chunk < vec or t.shape[1] - vec < chunk:
        return 0
    return 1 if t.stride(0) % vec == 0 or t.shape[0] <= 1 else vec


def _period(t: torch.Tensor, shifts: int) -> int:
    """How many rows of `t` apart two rows start at the same offset from a 16-byte boundary (1 without branches)."""
    return 1 if shifts <= 1 else _vec(t) // math.gcd(t.stride(0) % _vec(t), _vec(t))


def _fp(warps: int | None = None) -> dict:
    return dict(num_warps=warps or NUM_WARPS, enable_fp_fusion=False)


@triton.jit
def _map_kernel(x_ptr, y_ptr, n, SIGMOID: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(y_ptr + i, sigmoid(x) if SIGMOID else exp(x), mask=i < n)


def _map(x: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    x = x.to(torch.float32).contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _map_kernel[(cdiv(x.numel(), 1024),)](x, y, x.numel(), SIGMOID=sigmoid, BLOCK=1024, **_fp())
    return y


def exp_of(x: torch.Tensor) -> torch.Tensor:
    """`canonical.exp` of an fp32 tensor in one launch (the torch form launches dozens of small kernels)."""
    return _map(x, False)


def sigmoid_of(x: torch.Tensor) -> torch.Tensor:
    """`canonical.sigmoid` of an fp32 tensor in one launch."""
    return _map(x, True)


def row_stats(policy: torch.Tensor, ref: torch.Tensor | None, ids: torch.Tensor, mask: torch.Tensor, lo: int,
              width: int, inv: float = 1.0, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over each active row of `[n, T, V_local]` logits (policy and reference, a program each), scaled by
    `inv` (the fp32 inverse temperature; 1.0: not scaled): `(selected, stats)`, fp32 `[2, n * T]` selected logits
    (0.0 where this shard does not own the id) and `[2, 2, n * T, tiles]` per-tile `(max, sumexp)` of the policy
    and the reference rows (without a reference, only `[0]` of each is written). `entropy`: `[2, 3, n * T, tiles]`,
    the policy's third plane its tiles' entropy sums (`canonical.tile_stats(..., entropy=True)`). The sums of tiles
    whose maximum is NaN or +inf are not the reference's (`_tiles`); nothing reads them."""
    x = _rows2d(policy)
    r = _rows2d(ref) if ref is not None else x
    N, V = x.shape
    tiles = cdiv(V, width)
    sel = torch.empty(2, N, dtype=torch.float32, device=x.device)
    stats = torch.empty(2, 2 + entropy, N, tiles, dtype=torch.float32, device=x.device)
    nt = max(1, min(CHUNK // width, next_power_of_2(tiles)))
    shifts = (_shifts(x, nt * width), _shifts(r, nt * width))
    periods = [_period(t, n) for t, n in zip((x, r), shifts)]
    if N:
        pick(_ROW, V, x.stride(0), r.stride(0))[(max(p * cdiv(N, p) for p in periods), 1 + (ref is not None))](
            x, r, ids.reshape(-1).contiguous(), mask.reshape(-1).contiguous(), sel, stats, N, V, x.stride(0),
            r.stride(0), lo, tiles, N * tiles, inv, *periods, SCALE=inv != 1.0, W=width, LOG2W=_log2(width), NT=nt,
            NT_TAIL=max(1, min(nt, max(TAIL_CHUNK, _vec(x), _vec(r)) // width)),  # a vector at least
            SUM_PAIRS=all(t.dtype == torch.float32 and t.data_ptr() % 16 == 0 and t.stride(0) % 4 == 0 for t in (x, r)),
            ENTROPY=entropy, VEC_X=_vec(x), VEC_R=_vec(r), SHIFTS_X=shifts[0], SHIFTS_R=shifts[1],
            SHARED=not entropy and x.dtype == r.dtype and shifts[0] == shifts[1], **_fp(ROW_WARPS))
    return sel, stats


def merge_blocks(N: int, tiles: int) -> tuple[int, int, int]:
    """The merge kernel's `(ROWS, BT, CHUNKS)` for `N` rows of `tiles` statistics: blocks of BT tiles, a power of two
    up to MERGE_TILES (more where a row would take over MERGE_CHUNKS blocks). `BT * CHUNKS` is the row's tiles padded
    to a power of two, so the kernel's tree, BT's then CHUNKS', is `canonical.merge_stats`'s node for node."""
    bt = min(MERGE_BLOCK, next_power_of_2(max(tiles, 1)),
             max(MERGE_TILES, next_power_of_2(cdiv(tiles, MERGE_CHUNKS))))
    return min(MERGE_BLOCK // bt, next_power_of_2(max(N, 1))), bt, next_power_of_2(cdiv(tiles, bt))


def merge_lse(stats: torch.Tensor, mask: torch.Tensor, entropy: bool = False, selected: torch.Tensor | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """lse `[K, N]` (0.0 on masked rows) from the per-tile statistics `[K, 2, N, tiles]` (global tile order) of K
    tensors' rows. `entropy` (`[K, 3, N, tiles]`): `(lse, the first tensor's entropies [N])`
    (`canonical.entropy_of`). `selected` (contiguous fp32 `[K, N]`, the selected logits): replaced in place by the
    log-probs `selected - lse` (0.0 on masked rows)."""
    K, _, N, tiles = stats.shape
    if selected is not None and (selected.shape != (K, N) or selected.dtype != torch.float32
                                 or not selected.is_contiguous()):
        raise ValueError(f"selected: expected contiguous fp32 [{K}, {N}], got {selected.dtype} "
                         f"{list(selected.shape)} (contiguous: {selected.is_contiguous()})")
    lse = torch.empty(K, N, dtype=torch.float32, device=stats.device)
    ent = torch.empty(N, dtype=torch.float32, device=stats.device) if entropy else lse  # (lse: not written)
    rows, bt, chunks = merge_blocks(N, tiles)
    if N and K:
        _merge_kernel[(cdiv(N, rows), K)](stats.contiguous(), mask.reshape(-1).contiguous(), lse, ent,
                                          lse if selected is None else selected, N, tiles, N * tiles,
                                          ROWS=rows, BT=bt, LOG2BT=_log2(bt), CHUNKS=chunks, LOG2C=_log2(chunks),
                                          ENTROPY=entropy, LOGP=selected is not None, **_fp())
    return (lse, ent) if entropy else lse


def sequence_sums(logp: torch.Tensor, logp_ref: torch.Tensor | None, old: torch.Tensor, mask: torch.Tensor,
                  ids: torch.Tensor, adv: torch.Tensor, rewards: torch.Tensor | None, vocab: int, clip_lo: float,
                  clip_hi: float, delta: float | None = None, is_ratio: torch.Tensor | None = None,
                  bias_kl: bool = False, surrogate: Surrogate = Surrogate.CLIPPED,
                  taus: tuple[float, float] | None = None, ratio: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: fp32 `[3, B]` token sums (surrogate, KL, ratio) and int64 `[3, B]` (active tokens, bad-value
    flag, clipped tokens). `mask` is the completion mask as given; `adv` `[B]` or `[B, T]` (an advantage per
    token), read only where an active token reads it; `rewards` (fp32 `[B]` or None) are checked; `delta`,
    `is_ratio` (fp32 `[B, T]`), `bias_kl`, `surrogate` and `taus` as in `canonical.clipped_surrogate` /
    `ratio_and_kl` (`clip_lo`, `clip_hi`: `canonical.bounds`); `ratio` (fp32 `[B, T]`): the tokens' ratios as
    given (GSPO's), instead of `exp(logp - old)`."""
    B, T = mask.shape
    out = torch.empty(3, B, dtype=torch.float32, device=logp.device)
    ints = torch.empty(3, B, dtype=torch.int64, device=logp.device)
    block = min(BLOCK_T, next_power_of_2(max(T, 1)))
    chunks = next_power_of_2(max(1, cdiv(T, block)))
    if B:
        _sequence_kernel[(B,)](logp.contiguous(), (logp_ref if logp_ref is not None else logp).contiguous(),
                               old.to(torch.float32).contiguous(), mask.contiguous(), ids.contiguous(),
                               adv.contiguous(), rewards.contiguous() if rewards is not None else adv,
                               logp if is_ratio is None else is_ratio.contiguous(),
                               logp if ratio is None else ratio.contiguous(), out, ints, B, T, vocab, clip_lo,
                               clip_hi, math.inf if delta is None else delta, *(taus or (1.0, 1.0)),
                               HAS_REF=logp_ref is not None, HAS_IS=is_ratio is not None, BIAS_KL=bias_kl,
                               SURROGATE=SURROGATES[surrogate], GIVEN_RATIO=ratio is not None,
                               TOKEN_ADV=adv.dim() == 2, REWARDS=rewards is not None,
                               CHECK_MASK=mask.dtype != torch.bool, BLOCK=block,
                               LOG2B=_log2(block), CHUNKS=chunks, LOG2C=_log2(chunks), **_fp())
    return out, ints


@functools.lru_cache(maxsize=64)
def _largest_group(groups: tuple[int, ...]) -> int:
    return next_power_of_2(max(hi - lo for lo, hi in zip(groups, groups[1:])))


def group_advantages(rewards: torch.Tensor, groups: tuple[int, ...], std: AdvantageStd) -> torch.Tensor:
    """`canonical.group_advantages` of fp32 `rewards` `[S]` in CSR `groups`."""
    bounds, p2 = group_tensors(tuple(groups), rewards.device)[0], _largest_group(tuple(groups))
    adv = torch.empty_like(rewards)
    _advantages_kernel[(len(groups) - 1,)](rewards.contiguous(), bounds, adv, C.STD_FLOOR, C.STD_EPS, STD=MODES[std],
                                           P2=p2, LOG2P=_log2(p2), **_fp())
    return adv


def finish(sums: torch.Tensor, ints: torch.Tensor, beta: float, normalizer: TokenNormalizer,
           constant: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the whole batch's per-sequence `sums` fp32 `[3, S]` and `ints` int64 `[3, S]` (`sequence_sums`):
    `(scalars [6] = loss, policy_loss, kl, clip_fraction, mean_ratio, kl_token_mean, token weights [S], the
    largest flag (0-d int64))`, the bits of `canonical.combine`, `batch_metrics` and `token_weights`."""
    S = sums.shape[1]
    means, denom, constant = finish_options(normalizer, constant, S)
    out = torch.empty(6, dtype=torch.float32, device=sums.device)
    w = torch.empty(S, dtype=torch.float32, device=sums.device)
    flag = torch.empty((), dtype=torch.int64, device=sums.device)
    block = min(BLOCK_S, next_power_of_2(max(S, 1)))
    chunks = next_power_of_2(max(1, cdiv(S, block)))
    _finish_kernel[(1,)](sums.contiguous(), ints.contiguous(), out, w, flag, S, beta, constant, MEANS=means,
                         DENOM=denom, BLOCK=block, LOG2B=_log2(block), CHUNKS=chunks, LOG2C=_log2(chunks),
                         **_fp())
    return out, w, flag


def grad(policy: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor,
         logp_ref: torch.Tensor | None, old: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor, lse: torch.Tensor,
         grad_loss: torch.Tensor, lo: int, clip_lo: float, clip_hi: float, beta: float, inv: float = 1.0,
         out: torch.Tensor | None = None, delta: float | None = None, is_ratio: torch.Tensor | None = None,
         bias_kl: bool = False, surrogate: Surrogate = Surrogate.CLIPPED, taus: tuple[float, float] | None = None,
         coef: torch.Tensor | None = None, entropy: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`d loss / d policy` `[n, T, V_local]` in the logits' dtype (exact zeros on masked rows); `adv` `[n]` or
    `[n, T]`; `inv` the fp32 inverse temperature; `delta`, `is_ratio` (fp32, a weight per token), `bias_kl`,
    `surrogate` and `taus` as in `canonical.token_coef`. `out`: `[n * T, V_local]` rows to write instead (any dtype
    and row stride; never the logits' own bytes: a program's threads do not read a row in step with its writes).
    `coef` (fp32 `[n, T]`, weighted: `canonical.sequence_coef`): each token's `d loss / d logp` as given. `entropy`
    (`(coef_h, h)`, fp32 `[n * T]` each): the entropy bonus's weight per token (times `grad_loss`) and the entropies,
    `write_grad`'s term."""
    x = _rows2d(policy)
    N, V = x.shape
    g = torch.empty((N, V), dtype=policy.dtype, device=policy.device) if out is None else out
    bf16_bits = _INTERPRET and g.dtype == torch.bfloat16
    block = min(GRAD_BLOCK, next_power_of_2(V))
    if N and V:
        pick(_GRAD, V, x.stride(0), g.stride(0))[(N,)](
            x, ids.reshape(-1).contiguous(), mask.reshape(-1).contiguous(), logp.contiguous(),
            (logp_ref if logp_ref is not None else logp).contiguous(), old.to(torch.float32).contiguous(),
            adv.contiguous(), weights.contiguous(), logp if is_ratio is None else is_ratio.contiguous(),
            lse.contiguous(), grad_loss.to(torch.float32).reshape(1), lse if coef is None else coef.contiguous(),
            *((lse, lse) if entropy is None else (t.contiguous() for t in entropy)),
            g.view(torch.int16) if bf16_bits else g,
            mask.shape[-1], V, x.stride(0), g.stride(0), lo, clip_lo, clip_hi, beta,
            math.inf if delta is None else delta, *(taus or (1.0, 1.0)), inv, HAS_REF=logp_ref is not None,
            HAS_IS=is_ratio is not None, BIAS_KL=bias_kl, SURROGATE=SURROGATES[surrogate], GIVEN_COEF=coef is not None,
            TOKEN_ADV=adv.dim() == 2,
            SCALE=inv != 1.0, BF16_BITS=bf16_bits, ENTROPY=entropy is not None,
            BLOCK=block, VEC=_grad_vec(x, g, V, block), **_fp())
    return g.view(policy.shape)
