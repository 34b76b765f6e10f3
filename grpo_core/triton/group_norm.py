"""Group-relative advantages on the GPU: one program per CSR group of any size (chunked loops, no size cap)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..canonical import STD_EPS, STD_FLOOR
from ..contract import FP32_MAX, AdvantageStd

BLOCK = 1024
FP32_MAX_TL = tl.constexpr(FP32_MAX)  # the kernels' FP32_MAX: a kernel reads a global only as a constexpr
MODES = {AdvantageStd.POPULATION: 0, AdvantageStd.UNBIASED: 1, AdvantageStd.NONE: 2, AdvantageStd.UNBIASED_EPS: 3}


@triton.jit
def group_stats(r_ptr, lo, hi, floor, eps, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """`(mean, scale, bad)` of the rewards `r_ptr[lo:hi]` in fp32: the advantage is `(r - mean) * scale`, with
    `scale = 1 / max(std, floor)` (population or Bessel std), `1 / (Bessel std + eps)` (unbiased_eps, TRL's) or 1
    (no std); `scale` is NaN where the variance overflows fp32 (NaN advantages, as `canonical.group_advantages`
    gives); `bad` is 1 when a reward is not finite."""
    n = (hi - lo).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(lo, hi, BLOCK):
        r = tl.load(r_ptr + start + cols, mask=start + cols < hi, other=0.0)
        bad = tl.maximum(bad, ((r != r) | (tl.abs(r) == float("inf"))).to(tl.int32))
        acc += r
    mean = tl.sum(acc, 0) / n
    scale = 1.0
    if MODE != 2:
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(lo, hi, BLOCK):
            inside = start + cols < hi
            d = tl.where(inside, tl.load(r_ptr + start + cols, mask=inside, other=0.0) - mean, 0.0)
            acc += d * d
        var = tl.sum(acc, 0) / (n if MODE == 0 else n - 1.0)
        if MODE == 3:
            scale = 1.0 / (tl.sqrt(var) + eps)
        else:
            scale = 1.0 / tl.maximum(tl.sqrt(var), floor)
        scale = tl.where(var <= FP32_MAX_TL, scale, float("nan"))  # an overflow is not a std of inf (scale 0)
    return mean, scale, tl.max(bad, 0)


@triton.jit
def _group_norm_kernel(
    r_ptr,  # rewards [S] fp32
    bounds_ptr,  # CSR group offsets [G + 1] int64
    adv_ptr,  # out: advantages [S] fp32
    flag_ptr,  # out: int32 [G], 1 where the group holds a non-finite reward
    floor,  # std floor (1e-6)
    eps,  # added to the Bessel std under unbiased_eps (1e-4)
    # Meta-parameters
    MODE: tl.constexpr,  # 0 population std, 1 unbiased std, 2 no std, 3 unbiased std + eps
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0)
    floor, eps = tl.cast(floor, tl.float32), tl.cast(eps, tl.float32)  # Inductor passes fp64 scalars
    lo = tl.load(bounds_ptr + g)
    hi = tl.load(bounds_ptr + g + 1)
    mean, scale, bad = group_stats(r_ptr, lo, hi, floor, eps, MODE, BLOCK)
    tl.store(flag_ptr + g, bad)
    cols = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        inside = start + cols < hi
        r = tl.load(r_ptr + start + cols, mask=inside, other=0.0)
        tl.store(adv_ptr + start + cols, (r - mean) * scale, mask=inside)


def _launch(launch, rewards: torch.Tensor, bounds: torch.Tensor, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    adv = torch.empty_like(rewards)
    flags = torch.empty(bounds.numel() - 1, dtype=torch.int32, device=rewards.device)
    launch(_group_norm_kernel)[(bounds.numel() - 1,)](rewards, bounds, adv, flags, STD_FLOOR, STD_EPS, MODE=mode,
                                                    BLOCK=BLOCK)
    return adv, flags


@triton_op("grpo_core::group_advantages", mutates_args={})
def _group_advantages(rewards: torch.Tensor, bounds: torch.Tensor, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(wrap_triton, rewards, bounds, mode)


@functools.lru_cache(maxsize=64)
def group_tensors(group_boundaries: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(bounds [G + 1] int64, group of each sequence [S] int32)` on `device`. Cached: a host-to-device copy
    from pageable memory would wait for the whole stream on every call."""
    sizes = torch.tensor(group_boundaries[1:]) - torch.tensor(group_boundaries[:-1])
    group_of = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), sizes)
    return torch.tensor(group_boundaries, dtype=torch.int64).to(device), group_of.to(device)


def group_advantages(rewards: torch.Tensor, group_boundaries: tuple[int, ...], std: AdvantageStd
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(r - mean_g) / max(std_g, 1e-6)` (`/ (std_g + 1e-4)` under unbiased_eps, `r - mean_g` without std) per CSR
    group, fp32 `[S]`, and int32 flags `[G]`, 1 for each group that holds a non-finite reward. Eager calls launch
    directly (no custom-op dispatch)."""
    bounds = group_tensors(tuple(group_boundaries), rewards.device)[0]
    r = rewards.to(torch.float32).contiguous()
    if torch.compiler.is_compiling():
        return _group_advantages(r, bounds, MODES[std])
    return _launch(lambda k: k, r, bounds, MODES[std])
