"""The canonical math: one definition of every number, the same bits on every machine, on the CPU and the GPU.

Every float operation here is one that IEEE 754 specifies exactly and that every torch build, device and
Triton kernel performs the same way: `+ - * /` on fp32, each rounded on its own (no contraction), the fused
multiply-add where it is written (`fma`: one rounding, the GPU's instruction, emulated exactly on the CPU),
comparisons, max / min, select, conversions between float formats and exact integer operations on a float's bit
pattern. exp, log and sqrt are built from those (`exp`, `log`, `sqrt` below), and the sigmoid from exp; their
accuracy is measured over every fp32 input by `benchmarks/canonical_accuracy.py`. Every float sum is a fixed
pairwise tree (`pair_sum`) whose shape depends only on the extent summed, never on the number of rows, threads,
ranks or the device.

Rules that keep the bits portable, relied on throughout:
- constants are exact fp32 values (hex literals), and scalars from the contract become fp32 tensors
  (`fp32`) before they meet a tensor, so no op ever computes in a wider type;
- division is by a tensor, never by a Python scalar (CUDA turns scalar division into a reciprocal multiply);
- results below the smallest normal float are flushed to zero where they can arise (`exp`), so that a device
  that flushes subnormals and one that does not agree; -0.0 is turned into +0.0 before every sum.

The backends use these functions in two ways: the deterministic path (`distributed/`, the Triton kernels of
`triton/canonical.py`) computes everything with them; the fast paths (`native`, `triton`) use the token
formulas with torch's own `exp` (`ratio_and_kl(..., exp=torch.exp)`) and the canonical reductions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .contract import FP32_MAX, AdvantageStd, Surrogate, TokenNormalizer, to_fp32

F32, I32, I64 = torch.float32, torch.int32, torch.int64
TINY = float.fromhex("0x1p-126")  # the smallest normal fp32
STD_FLOOR = float.fromhex("0x1.0c6f7ap-20")  # fp32(1e-6): the advantage std is clamped to at least this
STD_EPS = float.fromhex("0x1.a36e2ep-14")  # fp32(1e-4): added to the Bessel std under 'unbiased_eps' (TRL's)

# exp: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite, each step one fma), exp(r) = 1 + r + r^2 q(r) by Horner's rule
LOG2E = float.fromhex("0x1.715476p+0")
ROUND = float.fromhex("0x1.8p+23")  # adding and subtracting it rounds |t| < 2**22 to the nearest integer
LN2_HI = float.fromhex("0x1.62e4p-1")  # 16 significant bits
LN2_LO = float.fromhex("0x1.7f7d1cp-20")  # ln 2 - LN2_HI, rounded
EXP_Q = (float.fromhex("0x1.fffff8p-2"), float.fromhex("0x1.55548ep-3"), float.fromhex("0x1.555b54p-5"),
         float.fromhex("0x1.123b92p-7"), float.fromhex("0x1.687ef6p-10"))  # minimax, |rel. error| < 2**-28
EXP_MIN, EXP_MAX = -104.0, 89.0  # beyond these exp is 0 (after the flush) or inf whatever the polynomial says
EXP_NONZERO = float.fromhex("-0x1.5d589ep+6")  # exp(x) > 0 exactly for x >= this (-87.3365...), 0.0 below
EXP_CHUNK = 1 << 18  # elements per step of `exp` on large inputs
# log: x = 2**k m with m in [sqrt(1/2), sqrt(2)), log(m) = 2 atanh(s), s = (m - 1) / (m + 1), in fdlibm's form
SQRT_HALF_BITS = 0x3F3504F3
LOG_Q = (float.fromhex("0x1.55557ap-1"), float.fromhex("0x1.995e4cp-2"), float.fromhex("0x1.31ec84p-2"))
# VESPO (TRL's `get_gamma_weights`): log w is clamped to [fp32(log(1e-8)), 20], each token's log-ratio to [-20, 20]
VESPO_LOG_W = (float.fromhex("-0x1.26bb1cp+4"), 20.0)
VESPO_LAMBDA_MIN = 1e-4  # TRL's floor of the gamma weight's rates


def fp32(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 tensor on `like`'s device: a Python float rounded to fp32 once, by the same rule everywhere (in
    Python, so that a value just above the largest fp32 that rounds to it is taken, as the Triton kernels take it)."""
    return torch.full((), to_fp32(value), dtype=F32, device=like.device)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for int32 `k` in [-126, 127], built from the exponent bits (exact)."""
    return ((k + 127) * (1 << 23)).view(F32)


def fma(a: torch.Tensor, b: float | torch.Tensor, c: float | torch.Tensor) -> torch.Tensor:
    """`a * b + c` of fp32 values rounded once to fp32 (IEEE's fusedMultiplyAdd), for finite results.

    In float64 the product is exact (24 + 24 bits) and TwoSum gives the sum's rounding error exactly; rounding
    the sum to odd (an inexact result with an even last bit moves one step toward the exact value) keeps the
    information that makes the final rounding to fp32 a single correct rounding (53 >= 24 + 2 bits)."""
    p = a.double() * torch.as_tensor(b, dtype=F32).double()
    c = torch.as_tensor(c, dtype=F32).double()
    s = p + c
    t = s - p
    err = (p - (s - t)) + (c - t)  # p + c == s + err exactly
    bits = s.view(I64)
    step = torch.where((err > 0) == (s > 0), 1, -1)
    odd = torch.where((err != 0) & (bits & 1 == 0), bits + step, bits)
    return odd.view(torch.float64).to(F32)


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp of fp32 `x`, within 1 ULP of the exact value; results below 2**-126 are 0.0; NaN stays NaN.

    exp(0) is exactly 1, which the tile sums rely on (a tile's largest term is exp(0)). Large inputs go by chunks
    of `EXP_CHUNK` elements, so that `fma`'s float64 temporaries stay in cache (the same bits, several times
    faster on the CPU)."""
    flat = x.reshape(-1)
    if flat.numel() <= EXP_CHUNK:
        return _exp(x)
    out = torch.empty_like(flat)
    for i in range(0, flat.numel(), EXP_CHUNK):
        out[i:i + EXP_CHUNK] = _exp(flat[i:i + EXP_CHUNK])
    return out.view(x.shape)


def _exp(x: torch.Tensor) -> torch.Tensor:
    r = x.clamp(EXP_MIN, EXP_MAX)
    n = fma(r, LOG2E, ROUND) - ROUND
    r = fma(-n, LN2_LO, fma(-n, LN2_HI, r))
    q = fma(fma(fma(fma(r, EXP_Q[4], EXP_Q[3]), r, EXP_Q[2]), r, EXP_Q[1]), r, EXP_Q[0])
    p = fma(fma(q, r, 1.0), r, 1.0)  # 1 + r + r^2 q
    k = n.to(I32)
    half = ((k + 256) >> 1) - 128  # floor(k / 2), shifting only non-negative values
    p = (p * _pow2(half)) * _pow2(k - half)  # two exact scalings keep 2**k representable at both ends
    return p.masked_fill_(p < TINY, 0.0)


def log(x: torch.Tensor) -> torch.Tensor:
    """log of positive normal fp32 `x`, within 1 ULP of the exact value (other inputs: unspecified)."""
    t = x.view(I32) - SQRT_HALF_BITS
    k = (t >> 23).to(F32)
    m = ((t & 0x7FFFFF) + SQRT_HALF_BITS).view(F32)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    R = z * (LOG_Q[0] + z * (LOG_Q[1] + z * LOG_Q[2]))
    hfsq = (f * 0.5) * f
    return k * LN2_HI - ((hfsq - (s * (hfsq + R) + k * LN2_LO)) - f)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded sqrt of fp32 `x >= 0` (subnormals count as 0, inf and NaN stay): Newton steps for a first
    guess, then an exact integer test that moves the 24-bit significand to the nearest one."""
    x = torch.where(x < TINY, 0.0, x)
    y = ((x.view(I32) >> 1) + 0x1FBD1DF5).view(F32)  # within a few percent
    for _ in range(3):
        y = (y + x / y) * 0.5
    bits = x.view(I32).to(I64)
    e = (bits >> 23) - 150  # x = mant * 2**e
    mant = (bits & 0x7FFFFF) | 0x800000
    shift = 24 - (e & 1)  # mant << shift lies in [2**46, 2**48) and e - shift is even
    q = (e - shift) >> 1  # sqrt(x) = sqrt(mant << shift) * 2**q, the first factor in [2**23, 2**24]
    four_m = (mant << shift) * 4
    sig = (y * _pow2(-q.to(I32))).to(I64)
    for _ in range(2):  # the nearest integer Y to sqrt(M) satisfies (2Y - 1)**2 < 4M < (2Y + 1)**2
        sig = sig + ((2 * sig + 1) ** 2 <= four_m).to(I64)
        sig = sig - ((2 * sig - 1) ** 2 >= four_m).to(I64)
    return torch.where(x == 0, 0.0, torch.where(x <= FP32_MAX, sig.to(F32) * _pow2(q.to(I32)), x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The logistic function of fp32 `x` from the canonical `exp`: `t = exp(-|x|)`, then `1 / (1 + t)` for `x >= 0`
    and `t / (1 + t)` below (IEEE division; -inf gives 0, inf 1, NaN NaN)."""
    t = exp(-x.abs())
    return torch.where(x >= 0, torch.ones_like(t), t) / (1.0 + t)


def pair_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` by a fixed tree of adjacent pairs on the extent zero-padded to a power of two.

    Zero padding leaves the tree's value unchanged, so the result depends only on the values, not on the padded
    extent, the number of rows or where they run. -0.0 is turned into +0.0 first."""
    x = x.movedim(dim, -1) + 0.0
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def tile_stats(x: torch.Tensor, width: int, entropy: bool = False) -> tuple[torch.Tensor, ...]:
    """Per-tile `(max, sum exp(x - max))` of fp32 rows `[n, cols]` cut into tiles of `width` (a power of two)
    from column 0: `[n, tiles]` each. Columns past the end count as -inf. A tile of -inf has `(-inf, 0)`.
    `entropy`: also each tile's `pair_sum(e * (x - max))` with `e = exp(x - max)` (0.0 where `e` is 0), for
    `entropy_of` (a tile of -inf: 0)."""
    n, cols = x.shape
    tiles = -(-cols // width)
    x = F.pad(x, (0, tiles * width - cols), value=float("-inf")).view(n, tiles, width)
    m = x.amax(-1) + 0.0  # max is exact in any order; + 0.0 makes a -0.0 maximum +0.0
    shift = torch.where(m == float("-inf"), 0.0, m)
    d = x - shift.unsqueeze(-1)
    e = exp(d)
    if not entropy:
        return m, pair_sum(e)
    return m, pair_sum(e), pair_sum(torch.where(e > 0, e * d, 0.0))


def merge_stats(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Merges `(max, sumexp)` pairs `[..., tiles]` in tile order by a fixed tree of adjacent pairs, on the extent
    padded to a power of two with the identity `(-inf, 0)`: `(M, S)` with `sum exp = S * exp(M)`. With `u`
    (`tile_stats(..., entropy=True)`'s third): also `U = sum exp(z - M) * (z - M)`, each pair's
    `(u + s * (m - M)) * exp(m - M)` (0 for an empty side) added: `(M, S, U)`."""
    n = m.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        m = F.pad(m, (0, width - n), value=float("-inf"))
        s = F.pad(s, (0, width - n))
        u = None if u is None else F.pad(u, (0, width - n))
    while m.shape[-1] > 1:
        m1, m2, s1, s2 = m[..., 0::2], m[..., 1::2], s[..., 0::2], s[..., 1::2]
        m = torch.maximum(m1, m2)
        shift = torch.where(m == float("-inf"), 0.0, m)
        d1, d2 = m1 - shift, m2 - shift
        e1, e2 = exp(d1), exp(d2)
        if u is not None:
            u1, u2 = u[..., 0::2], u[..., 1::2]
            u = (torch.where(s1 > 0, (u1 + s1 * d1) * e1, 0.0) + torch.where(s2 > 0, (u2 + s2 * d2) * e2, 0.0))
        s = s1 * e1 + s2 * e2
    return (m[..., 0], s[..., 0]) if u is None else (m[..., 0], s[..., 0], u[..., 0])


def entropy_of(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The entropy `-sum p log p` of each row from merged `(M, S, U)`: `log(S) - U / S` (both terms >= 0: no
    cancellation); NaN where `lse` is."""
    finite = torch.isfinite(m) & (s >= 1.0)
    s = torch.where(finite, s, 1.0)
    return torch.where(finite, log(s) - u / s, float("nan"))


def lse(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """log-sum-exp from merged `(M, S)`; not finite when the row held a NaN or +inf or was all -inf."""
    finite = torch.isfinite(m) & (s >= 1.0)
    return torch.where(finite, m + log(torch.where(finite, s, 1.0)), float("nan"))


@functools.lru_cache(maxsize=64)
def _group_layout(group_boundaries: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """`(group of each sequence, its slot in the group, group sizes as fp32, valid slots [G, max_group])` on
    `device`. Cached: a copy from pageable host memory would wait for everything queued on the stream."""
    bounds = torch.tensor(group_boundaries)
    sizes = bounds[1:] - bounds[:-1]
    group_of = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    slot = torch.arange(len(group_of)) - bounds[:-1][group_of]
    valid = torch.zeros(len(sizes), int(sizes.max()), dtype=torch.bool).index_put((group_of, slot), torch.tensor(True))
    return tuple(t.to(device) for t in (group_of, slot, sizes.to(F32), valid))


def group_advantages(rewards: torch.Tensor, group_boundaries: tuple[int, ...], std: AdvantageStd) -> torch.Tensor:
    """`(r - mean_g) / max(std_g, fp32(1e-6))` (or `r - mean_g` without std) per CSR group; fp32 `[S]`. Under
    'unbiased_eps' (TRL's): `(r - mean_g) / (sqrt(var_g) + fp32(1e-4))` with the Bessel variance, not clamped. A
    group whose sum or variance overflows fp32 (|r| beyond about 1e19) gets non-finite advantages, and so does a
    group of one under a Bessel std (0 / 0; the contract refuses such groups).

    The groups are laid out as a zero-padded `[G, max_group]` grid and reduced with `pair_sum`, so every rank
    that holds the gathered rewards computes the same bits, on any device."""
    r = rewards.to(F32)
    group_of, slot, n, valid = _group_layout(tuple(group_boundaries), r.device)
    grid = r.new_zeros(valid.shape).index_put((group_of, slot), r)
    mean = pair_sum(grid) / n
    centered = r - mean[group_of]
    if std is AdvantageStd.NONE:
        return centered
    dev = torch.where(valid, grid - mean[:, None], 0.0)
    var = pair_sum(dev * dev) / (n if std is AdvantageStd.POPULATION else n - 1.0)
    var = torch.where(var <= FP32_MAX, var, float("nan"))  # an overflow makes the group's advantages NaN, not 0
    if std is AdvantageStd.UNBIASED_EPS:
        return centered / (sqrt(var) + fp32(STD_EPS, r))[group_of]
    return centered / torch.maximum(sqrt(var), fp32(STD_FLOOR, r))[group_of]


def _count(c: torch.Tensor) -> torch.Tensor:
    return c.clamp(min=1).to(F32)


def _sequences(counts: torch.Tensor) -> torch.Tensor:
    """The number of sequences `S` as an fp32 0-d tensor (the batch's, empty sequences included)."""
    return fp32(float(counts.numel()), counts)


def normalize(per_sequence: torch.Tensor, counts: torch.Tensor, normalizer: TokenNormalizer,
              constant: float | None) -> torch.Tensor:
    """Applies the token normalizer to per-sequence token sums `[S]` (fp32) with integer active counts `[S]`;
    `constant` is `contract.normalizer_value` (the fixed constant, or dr_grpo's max completion length `L`).

    - global_active_tokens: `pair_sum(sums) / fp32(total active tokens)`;
    - per_sequence_then_mean: `means = sums / fp32(count)` (0 for an empty sequence), `pair_sum(means) /
      fp32(non-empty sequences)`; per_sequence_then_batch_mean: the same means, `/ fp32(S)`;
    - fixed_constant: `pair_sum(sums) / fp32(constant)`; sequences_times_max_length: `pair_sum(sums) / fp32(S * L)`
      (the integer product, rounded once); sequence_sums_then_batch_mean: `pair_sum(sums) / fp32(S)`.
    A batch without any active token gives exactly 0.0 (its token sums are all zero; the denominator is >= 1)."""
    if normalizer is TokenNormalizer.GLOBAL_ACTIVE_TOKENS:
        return pair_sum(per_sequence) / _count(counts.sum())
    if normalizer in (TokenNormalizer.PER_SEQUENCE_THEN_MEAN, TokenNormalizer.PER_SEQUENCE_THEN_BATCH_MEAN):
        active = counts > 0
        means = torch.where(active, per_sequence / _count(counts), 0.0)
        if normalizer is TokenNormalizer.PER_SEQUENCE_THEN_BATCH_MEAN:
            return pair_sum(means) / _sequences(counts)
        return pair_sum(means) / _count(active.sum())
    if normalizer is TokenNormalizer.FIXED_CONSTANT:
        return pair_sum(per_sequence) / fp32(constant, per_sequence)
    if normalizer is TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH:
        return pair_sum(per_sequence) / fp32(float(counts.numel() * int(constant)), per_sequence)
    if normalizer is TokenNormalizer.SEQUENCE_SUMS_THEN_BATCH_MEAN:
        return pair_sum(per_sequence) / _sequences(counts)
    raise AssertionError(normalizer)


def token_weights(counts: torch.Tensor, normalizer: TokenNormalizer, constant: float | None) -> torch.Tensor:
    """`d normalize / d token term` of each sequence's tokens, fp32 `[S]` (0 for a sequence without tokens):
    `1 / denominator` of `normalize`, or for the two per-sequence means `1 / (fp32(count) * fp32(sequences))`."""
    one = torch.ones(counts.shape, dtype=F32, device=counts.device)
    if normalizer is TokenNormalizer.GLOBAL_ACTIVE_TOKENS:
        return one / _count(counts.sum())
    if normalizer is TokenNormalizer.PER_SEQUENCE_THEN_MEAN:
        return torch.where(counts > 0, one / (_count(counts) * _count((counts > 0).sum())), 0.0)
    if normalizer is TokenNormalizer.PER_SEQUENCE_THEN_BATCH_MEAN:
        return torch.where(counts > 0, one / (_count(counts) * _sequences(counts)), 0.0)
    if normalizer is TokenNormalizer.FIXED_CONSTANT:
        return one / fp32(constant, one)
    if normalizer is TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH:
        return one / fp32(float(counts.numel() * int(constant)), one)
    if normalizer is TokenNormalizer.SEQUENCE_SUMS_THEN_BATCH_MEAN:
        return one / _sequences(counts)
    raise AssertionError(normalizer)


def combine(per_seq_policy: torch.Tensor, per_seq_kl: torch.Tensor, counts: torch.Tensor, beta: float,
            normalizer: TokenNormalizer, constant: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`loss = N(policy) + beta * N(kl)`; returns `(loss, policy_loss, kl)` with the last two detached."""
    policy_loss = normalize(per_seq_policy, counts, normalizer, constant)
    kl = normalize(per_seq_kl, counts, normalizer, constant)
    loss = policy_loss + fp32(beta, kl) * kl
    return loss, policy_loss.detach(), kl.detach()


def given_logprobs(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-token input given by the caller (the reference model's log-probs `ref_logps`, or the importance
    sampling ratio `[S, T]` or `[S, 1]`) as the kernels read it: fp32 `[S, T]`, detached, 0.0 on masked tokens
    (which may hold anything)."""
    return torch.where(mask, logps.detach().to(F32), 0.0)


def sequence_log_ratio(logp: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's log-ratio of each sequence, fp32 `[S]`: `pair_sum(masked(logp - old)) / fp32(max(count, 1))`, the mean
    over its active tokens (TRL's `importance_sampling_level="sequence"`); 0.0 for a sequence without one."""
    return pair_sum(torch.where(mask, logp - old_logps.to(F32), 0.0)) / _count(mask.sum(-1))


def off_policy_weights(logp: torch.Tensor, sampling_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       threshold: float, is_ratio: torch.Tensor | None) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's `off_policy_mask_threshold`) folded into the importance weights,
    fp32 `[S, T]`: a token keeps its weight (`is_ratio`, `given_logprobs`, or 1.0) where its advantage is >= 0 or its
    sequence's mean of `sampling - logp` over its active tokens is <= `fp32(threshold)` (`pair_sum` / the count; a
    NaN sampling log-prob counts 0.0, as TRL's), else 0.0; 0.0 on masked tokens. Multiplying the policy term by it is
    TRL's `per_token_loss * off_policy_mask`; `logp` is read detached."""
    d = torch.where(mask & ~torch.isnan(sampling_logps), sampling_logps.to(F32) - logp.detach(), 0.0)
    kl = pair_sum(d) / _count(mask.sum(-1))
    keep = mask & ((_per_token(advantages) >= 0) | (kl <= fp32(threshold, kl)).unsqueeze(-1))
    return torch.where(keep, 1.0 if is_ratio is None else is_ratio, 0.0)


def _clamped_log(x: torch.Tensor) -> torch.Tensor:
    """`log(x)` of fp32 `x >= 0` clamped to `VESPO_LOG_W`: the lower bound below the smallest normal float, whose log
    (< -87) the canonical `log` does not cover and the clamp would give anyway (0.0: TRL's log(0) = -inf)."""
    lo, hi = VESPO_LOG_W
    normal = x >= TINY
    return torch.where(normal, log(torch.where(normal, x, 1.0)).clamp(lo, hi), lo)


def vespo_phi(logp: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              is_ratio: torch.Tensor | None, gamma: tuple[float, float, float, float], exp=exp) -> torch.Tensor:
    """VESPO's gamma weight (TRL's `get_gamma_weights`), detached, fp32 `[S, 1]` (advantages per sequence) or `[S, T]`
    (per token): each sequence's `log w = clamp(pair_sum(masked(clamp(logp - old, -20, 20) + clamp(log(is_ratio),
    VESPO_LOG_W))), VESPO_LOG_W)` over its active tokens (the rollout's importance weights `is_ratio`, `given_logprobs`,
    enter in log space; TRL sums the two terms apart), `w = exp(log w)`, and `phi = exp((lam + k * log w) - lam * w)`,
    `(k, lam)` = `gamma`'s `(k_pos, max(lambda_pos, 1e-4))` where `A >= 0`, else `(k_neg, max(lambda_neg, 1e-4))`,
    each rounded once to fp32. 0.0 where phi overflows (TRL's `nan_to_num`). The canonical exp and log: the same bits
    on every backend (`exp`: the Triton kernels pass their one-launch twin, `exp_of`)."""
    lo, hi = VESPO_LOG_W
    log_r = torch.where(mask, (logp.detach() - old_logps.to(F32)).clamp(-20.0, 20.0), 0.0)
    if is_ratio is not None:
        log_r = log_r + torch.where(mask, _clamped_log(is_ratio), 0.0)
    log_w = pair_sum(log_r).clamp(lo, hi).unsqueeze(-1)
    w = exp(log_w)
    k_pos, lam_pos, k_neg, lam_neg = gamma
    nonneg = _per_token(advantages) >= 0
    k = torch.where(nonneg, fp32(k_pos, w), fp32(k_neg, w))
    lam = torch.where(nonneg, fp32(max(lam_pos, VESPO_LAMBDA_MIN), w), fp32(max(lam_neg, VESPO_LAMBDA_MIN), w))
    phi = exp((lam + k * log_w) - lam * w)
    return torch.where(phi <= FP32_MAX, phi, 0.0)


def importance_weights(logp: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       is_ratio: torch.Tensor | None, threshold: float | None = None,
                       sampling_logps: torch.Tensor | None = None,
                       gamma: tuple[float, float, float, float] | None = None, exp=exp,
                       keep: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(weights, phi)`: what each token's policy term is multiplied by, fp32 `[S, T]` (None: nothing), and VESPO's
    gamma weight as reported (`[S]`, or `[S, T]` with advantages per token, 0.0 on masked tokens; None without
    `gamma`). The weights are the rollout's importance weights `is_ratio` (`given_logprobs`); with `gamma` (vespo) its
    `vespo_phi` in their place (they enter phi); with `threshold` the off-policy mask folded in (`off_policy_weights`,
    from `sampling_logps`, default `old_logps`); with `keep` (bool `[S, T]`, `entropy_keep`) 0.0 where it is False,
    unless it is `mask` itself (what `entropy_keep` returns when it keeps every active token: no weight then)."""
    phi = None
    if gamma is not None:
        phi = vespo_phi(logp, old_logps, advantages, mask, is_ratio, gamma, exp)
        is_ratio = torch.where(mask, phi, 0.0)
        phi = phi.squeeze(-1) if advantages.dim() == 1 else is_ratio
    if threshold is not None:
        is_ratio = off_policy_weights(logp, old_logps if sampling_logps is None else sampling_logps, advantages, mask,
                                      threshold, is_ratio)
    if keep is not None and keep is not mask:
        is_ratio = torch.where(keep, 1.0 if is_ratio is None else is_ratio, 0.0)
    return is_ratio, phi


def entropy_keep(entropy: torch.Tensor, mask: torch.Tensor, top: float,
                 exact: Callable[[torch.Tensor], torch.Tensor] | None = None, slack: float = 0.0) -> torch.Tensor:
    """TRL's `get_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile)`, bool `[S, T]`: the active tokens whose
    entropy is >= the `1 - top` quantile of the batch's active entropies (all of them with `top = 1`; none without an
    active token). The quantile is `torch.quantile`'s linear interpolation between the sorted values `v` (`n` of
    them), in fp32 ops without a fused multiply-add: `r = fp32(1 - top) * fp32(n - 1)`, `i = floor(r)`, `w = r - i`,
    `a, b = v[i], v[min(i + 1, n - 1)]`, then `a + w * (b - a)` if `w < 0.5` else `b - (b - a) * (1 - w)`.

    `exact` (assumes `entropy` within `slack * (1 + max entropy)` of the exact entropies at every active token): a
    function of a bool `[S, T]` band that returns the entropies, exact in the band. Only the tokens within twice that
    of `v[i]` or `v[i + 1]` are asked for (those beyond it fall on the same side of the exact quantile, which lies
    among the band's exact values), so the mask is that of the exact entropies; if the bound fails in the band, every
    token is asked for (outside it, a failure goes unseen)."""
    if top == 1.0:
        return mask
    v = entropy[mask].sort().values
    n = v.numel()
    if n == 0:
        return torch.zeros_like(mask)
    r = fp32(1.0 - top, v) * fp32(float(n - 1), v)
    i = int(r.floor())
    j = min(i + 1, n - 1)
    if exact is not None and bool(torch.isfinite(v[-1])):  # (a NaN entropy: the loss raises after)
        d = 2.0 * slack * (1.0 + v[-1])
        band = mask & (entropy >= v[i] - d) & (entropy <= v[j] + d)
        below = int((mask & (entropy < v[i] - d)).sum())
        given, entropy = entropy.clone(), exact(band)
        if ((entropy - given)[band].abs() > d / 2).any():  # the bound fails in the band: every token exactly
            return entropy_keep(exact(mask), mask, top)
        v = entropy[band].sort().values
        i, j = i - below, j - below
    a, b = v[i], v[j]
    w = r - r.floor()
    threshold = torch.where(w < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))
    return mask & (entropy >= threshold)


def token_mean(per_sequence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`pair_sum(per_sequence) / fp32(max(sum(counts), 1))`: a per-token mean from per-sequence sums (the logged
    entropy, TRL's `entropy`)."""
    return pair_sum(per_sequence) / _count(counts.sum())


def entropy_bonus(per_sequence: torch.Tensor, kept: torch.Tensor, coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's entropy bonus `coef * sum(H * kept) / max(sum(kept), 1)` from the per-sequence sums of the kept tokens'
    entropies `[S]` and their counts (int `[S]`): `(fp32(coef) * (pair_sum(per_sequence) / fp32(N)), fp32(coef) /
    fp32(N))`, the bonus (subtracted from the loss) and each kept token's weight in it (`-d loss / d H`)."""
    n = _count(kept.sum())
    c = fp32(coef, n)
    return c * (pair_sum(per_sequence) / n), c / n


def ratio_and_kl(logp: torch.Tensor, logp_ref: torch.Tensor | None, old_logps: torch.Tensor, mask: torch.Tensor,
                 exp=exp, bias_kl: bool = False, sequence: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`ratio = exp(masked(logp - old))` (mask before exp: 1.0 on masked tokens) and `kl = exp(d) - d - 1`
    with `d = masked(logp_ref - logp)` (exactly 0.0 on masked tokens; all zeros without a reference); `bias_kl`
    (TRL's `use_bias_correction_kl`): `kl * ratio`. `sequence` (GSPO): every active token's ratio is its sequence's,
    `exp(sequence_log_ratio)`."""
    zero = torch.zeros_like(logp)
    if sequence:
        ratio = torch.where(mask, exp(sequence_log_ratio(logp, old_logps, mask)).unsqueeze(-1), 1.0)
    else:
        ratio = exp(torch.where(mask, logp - old_logps.to(F32), zero))
    if logp_ref is None:
        return ratio, zero
    d = torch.where(mask, logp_ref - logp, zero)
    kl = exp(d) - d - 1.0
    if not bias_kl:
        return ratio, kl
    if not (torch.is_grad_enabled() and logp.requires_grad):
        return ratio, kl * ratio
    # autograd of the product would give ((1 - e^d) + kl) * ratio, which cancels to a few digits once d passes ~12;
    # the gradient is -d * ratio exactly (`token_coef`'s; at the sequence level `sequence_coef`'s KL term, each token's
    # share of its sequence's chain included), attached to the product's value
    if sequence:
        slope = torch.where(mask, (-d + (pair_sum(kl).unsqueeze(-1) / _count(mask.sum(-1)).unsqueeze(-1) - kl))
                            * ratio, 0.0).detach()
    else:
        slope = (-(d * ratio)).detach()
    return ratio, (kl * ratio).detach() + slope * (logp - logp.detach())


def bounds(clip_eps: float, clip_eps_high: float, surrogate: Surrogate = Surrogate.CLIPPED) -> tuple[float, float]:
    """The ratio's bounds `(lo, hi)` in Python (double): `(1 - clip_eps, 1 + clip_eps_high)` for the clipped
    surrogate; CISPO's `(0, clip_eps_high)` (its upper clamp, as TRL and Liger); SAPO and VESPO clip nothing,
    `(0, inf)`.
    `clipped_tokens` counts the tokens beyond them (no ratio is below 0)."""
    if surrogate is Surrogate.CISPO:
        return 0.0, clip_eps_high
    if surrogate in (Surrogate.SAPO, Surrogate.VESPO):
        return 0.0, float("inf")
    return 1.0 - clip_eps, 1.0 + clip_eps_high


def clip_bounds(clip_eps: float, clip_eps_high: float, like: torch.Tensor,
                surrogate: Surrogate = Surrogate.CLIPPED) -> tuple[torch.Tensor, torch.Tensor]:
    """`bounds(...)` as fp32 0-d tensors: computed in Python (double), rounded once."""
    lo, hi = bounds(clip_eps, clip_eps_high, surrogate)
    return fp32(lo, like), fp32(hi, like)


def _tau(adv: torch.Tensor, taus: tuple[float, float]) -> torch.Tensor:
    """SAPO's temperature per token: `fp32(taus[0])` where `A > 0`, else `fp32(taus[1])`."""
    return torch.where(adv > 0, fp32(taus[0], adv), fp32(taus[1], adv))


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages `[S]` (per sequence) as `[S, 1]` for the token formulas; `[S, T]` (per token) as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def used_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Given advantages (fp32 `[S]` or `[S, T]`) with exactly 0.0 where no active token reads them (masked tokens,
    sequences without an active token), which may hold anything, NaN included: a select, no rounding."""
    return torch.where(mask if advantages.dim() == 2 else mask.any(-1), advantages, 0.0)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, lo: torch.Tensor,
                      hi: torch.Tensor, delta: float | None = None, is_ratio: torch.Tensor | None = None,
                      surrogate: Surrogate = Surrogate.CLIPPED, logp: torch.Tensor | None = None,
                      taus: tuple[float, float] | None = None, sigmoid=sigmoid) -> torch.Tensor:
    """Per-token `-min(ratio * A, clamp(ratio, lo, hi) * A)`, exactly 0.0 on masked tokens; `A` is `[S]` or
    `[S, T]`. `delta` (TRL's two-sided clipping): `min(ratio, fp32(delta)) * A` in the first branch; `is_ratio`
    (fp32 `[S, T]`, `given_logprobs`): the rollout's importance weights, multiplied into the term. CISPO:
    `-((sg(min(ratio, hi)) * A) * logp)`; SAPO: `-(((sigmoid(tau * (ratio - 1)) * 4) / tau) * A)` with `tau` of
    `taus` by the sign of `A`; VESPO: `-(A * logp)`, its gamma weight in `is_ratio` (`importance_weights`)."""
    adv = _per_token(advantages)
    if surrogate is Surrogate.CISPO:
        policy = -((torch.minimum(ratio, hi).detach() * adv) * logp)
    elif surrogate is Surrogate.VESPO:
        policy = -(adv * logp)
    elif surrogate is Surrogate.SAPO:
        tau = _tau(adv, taus)
        policy = -(((sigmoid(tau * (ratio - 1.0)) * 4.0) / tau) * adv)
    else:
        unclipped = ratio if delta is None else torch.clamp(ratio, max=fp32(delta, ratio))
        policy = -torch.minimum(unclipped * adv, torch.clamp(ratio, lo, hi) * adv)
    if is_ratio is not None:
        policy = policy * is_ratio
    return torch.where(mask, policy, 0.0)


def token_coef(ratio: torch.Tensor, logp: torch.Tensor, logp_ref: torch.Tensor | None, advantages: torch.Tensor,
               weights: torch.Tensor, mask: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, beta: float,
               delta: float | None = None, is_ratio: torch.Tensor | None = None, bias_kl: bool = False,
               surrogate: Surrogate = Surrogate.CLIPPED, taus: tuple[float, float] | None = None, exp=exp,
               sigmoid=sigmoid) -> torch.Tensor:
    """`d loss / d logp` per token `[S, T]` (before `grad_output`): `(dpolicy + beta * dkl) * weight`, where the
    surrogate's derivative is `-ratio * A` where the unclipped branch is the minimum (ties included) and 0 where
    the clipped one is; with `delta`, `-ratio * A` where the minimum's branch passes the ratio through its clamp
    (`ratio <= fp32(delta)`, or `lo <= ratio <= hi`), else 0; times `is_ratio` when given. The k3 KL's is
    `1 - exp(d)`, `d = logp_ref - logp`, or with `bias_kl` (the KL times the ratio) `-(d * ratio)`, which is
    `((1 - exp(d)) + kl) * ratio` without its cancellation (that form loses every digit once `d` passes ~12).
    CISPO: `-(min(ratio, hi) * A)` (its weight is a constant); SAPO: `-((((s * (1 - s)) * 4) * ratio) * A)`,
    `s = sigmoid(tau * (ratio - 1))`; VESPO: `-A` (times `is_ratio`, its gamma weight). 0.0 on masked tokens. `A`:
    `[S]` or `[S, T]`. The caller multiplies by `grad_output`, then by `fp32(1 / temperature)` when it is not 1.
    (`exp`, `sigmoid`: the fast op passes torch's.)"""
    adv = _per_token(advantages)
    if surrogate is Surrogate.CISPO:
        coef = -(torch.minimum(ratio, hi) * adv)
    elif surrogate is Surrogate.VESPO:
        coef = -adv
    elif surrogate is Surrogate.SAPO:
        s = sigmoid(_tau(adv, taus) * (ratio - 1.0))
        coef = -((((s * (1.0 - s)) * 4.0) * ratio) * adv)
    else:
        unclipped, clipped = ratio * adv, torch.clamp(ratio, lo, hi) * adv
        if delta is None:
            taken = unclipped <= clipped
        else:  # the minimum's branch, and whether its clamp passes the ratio (bounds included)
            d = fp32(delta, ratio)
            taken = torch.where(torch.minimum(ratio, d) * adv <= clipped, ratio <= d, (ratio >= lo) & (ratio <= hi))
        coef = torch.where(taken, -unclipped, 0.0)
    if is_ratio is not None:
        coef = coef * is_ratio
    if logp_ref is not None:
        d = torch.where(mask, logp_ref - logp, 0.0)
        dkl = -(d * ratio) if bias_kl else 1.0 - exp(d)
        coef = coef + fp32(beta, coef) * dkl
    return torch.where(mask, coef * weights.unsqueeze(-1), 0.0)


def sequence_coef(ratio: torch.Tensor, logp: torch.Tensor, logp_ref: torch.Tensor | None, advantages: torch.Tensor,
                  weights: torch.Tensor, mask: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, beta: float,
                  delta: float | None = None, is_ratio: torch.Tensor | None = None, bias_kl: bool = False,
                  surrogate: Surrogate = Surrogate.CLIPPED, taus: tuple[float, float] | None = None, exp=exp,
                  sigmoid=sigmoid) -> torch.Tensor:
    """`token_coef` where every token reads its sequence's ratio `r = ratio` (GSPO, `ratio_and_kl(...,
    sequence=True)`). A token's log-prob moves `log r` by `1 / n` (`n`: the sequence's active tokens), so each
    token's coefficient is the sequence's chain term plus its own: `pair_sum(through) / fp32(max(n, 1)) + own`,
    where `through` is `token_coef`'s surrogate term (`r * d policy / dr`, weighted; CISPO's and VESPO's terms do not
    read the ratio: none) and `own` is theirs, plus `(beta * dkl) * weight` with the k3 KL's `dkl = 1 - exp(d)`;
    with `bias_kl` (the KL times `r`) `dkl = (-d + (pair_sum(k3) / n - k3)) * r`, `k3 = (exp(d) - d) - 1`: the KL's
    own and chain terms together, exact for a sequence of one token (`-d * r`, where the two apart cancel once `d`
    passes ~12). 0.0 on masked tokens."""
    w = weights.unsqueeze(-1)
    n = _count(mask.sum(-1)).unsqueeze(-1)
    policy = token_coef(ratio, logp, None, advantages, weights, mask, lo, hi, 0.0, delta, is_ratio, False, surrogate,
                        taus, exp, sigmoid)
    zero = torch.zeros_like(policy)
    through, own = (zero, policy) if surrogate in (Surrogate.CISPO, Surrogate.VESPO) else (policy, zero)
    if logp_ref is not None:
        d = torch.where(mask, logp_ref - logp, 0.0)
        e = exp(d)
        if bias_kl:
            k3 = (e - d) - 1.0
            dkl = (-d + (pair_sum(k3).unsqueeze(-1) / n - k3)) * ratio
        else:
            dkl = 1.0 - e
        own = own + (fp32(beta, policy) * dkl) * w
    chain = pair_sum(torch.where(mask, through, 0.0)).unsqueeze(-1) / n
    return torch.where(mask, chain + own, 0.0)


def clipped_tokens(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, lo: torch.Tensor,
                   hi: torch.Tensor) -> torch.Tensor:
    """TRL's clip indicator, bool `[S, T]`: an active token whose ratio is below `lo` with `A < 0` or above `hi`
    with `A > 0` (there the clipped branch is the minimum and the token's surrogate gradient is 0)."""
    adv = _per_token(advantages)
    return mask & (((ratio < lo) & (adv < 0)) | ((ratio > hi) & (adv > 0)))


def sequence_metrics(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, lo: torch.Tensor,
                     hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the ratio summed over its active tokens (`pair_sum`, fp32 `[S]`) and its clipped tokens (exact
    int64 `[S]`); `batch_metrics` finishes them once they cover the batch."""
    return pair_sum(torch.where(mask, ratio, 0.0)), clipped_tokens(ratio, advantages, mask, lo, hi).sum(-1)


def batch_metrics(ratio_sums: torch.Tensor, kl_sums: torch.Tensor, clipped: torch.Tensor, counts: torch.Tensor,
                  sequence: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a trainer logs, fp32 scalars over the batch's active tokens `N = fp32(sum counts)` (1 when there is
    none): `(clip_fraction, mean_ratio, kl_token_mean) = (fp32(sum clipped) / N, pair_sum(ratio_sums) / N,
    pair_sum(kl_sums) / N)`; integer sums are exact. `sequence` (GSPO with an advantage per sequence): the clip
    fraction counts sequences, as TRL does there, `sequence_clip_fraction(clipped)`."""
    tokens = _count(counts.sum())
    clip = sequence_clip_fraction(clipped) if sequence else clipped.sum().to(F32) / tokens
    return clip, pair_sum(ratio_sums) / tokens, pair_sum(kl_sums) / tokens


def sequence_clip_fraction(clipped: torch.Tensor) -> torch.Tensor:
    """The clip fraction at the sequence level (GSPO): the sequences with a clipped token (`clipped`, int `[S]`) over
    all `S` sequences, empty ones included (TRL's mean over `[B, 1]`)."""
    return (clipped > 0).sum().to(F32) / _sequences(clipped)
