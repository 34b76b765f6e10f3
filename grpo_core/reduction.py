"""Fixed-order reductions and the token normalizers.

Every float sum in grpo-core goes through `tree_sum`: a pairwise tree of elementwise adds over the extent padded
to a power of two. Its shape depends only on the extent, never on the number of rows, threads or ranks, and
zero padding leaves it unchanged (`x + 0 == x`), which gives batch and padding invariance for free.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .contract import TokenNormalizer


def tree_reduce(x: torch.Tensor, op: Callable, identity: float, dim: int = -1) -> torch.Tensor:
    """Reduces `dim` by halving: `x[..., :h] op x[..., h:]` on the extent padded with `identity` to 2**k."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n), value=identity)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = op(x[..., :half], x[..., half:])
    return x[..., 0]


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    # `+ 0.0` turns -0.0 into +0.0 first, so an all-(-0.0) extent sums to +0.0 whatever its padding.
    return tree_reduce(x + 0.0, torch.add, 0.0, dim)


def tree_max(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return tree_reduce(x, torch.maximum, float("-inf"), dim)


def _div(total: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    # Divide by a device tensor, not a Python scalar: CUDA turns scalar division into a reciprocal multiply.
    if not isinstance(count, torch.Tensor):
        count = torch.full((), float(count), device=total.device)  # a fill, not a blocking host-to-device copy
    return total / count.to(total.dtype)


def normalize(per_sequence: torch.Tensor, counts: torch.Tensor, normalizer: TokenNormalizer,
              constant: float | None) -> torch.Tensor:
    """Applies the token normalizer to per-sequence token sums `[S]` (fp32) with integer active counts `[S]`.

    A batch without any active token gives exactly 0.0 (its token sums are all zero; the denominator is 1).
    """
    if normalizer is TokenNormalizer.GLOBAL_ACTIVE_TOKENS:
        return _div(tree_sum(per_sequence), counts.sum().clamp(min=1))
    if normalizer is TokenNormalizer.PER_SEQUENCE_THEN_MEAN:
        active = counts > 0
        denom = torch.where(active, counts, torch.ones_like(counts)).to(per_sequence.dtype)
        means = torch.where(active, per_sequence / denom, torch.zeros_like(per_sequence))
        return _div(tree_sum(means), active.sum().clamp(min=1))
    if normalizer is TokenNormalizer.FIXED_CONSTANT:
        return _div(tree_sum(per_sequence), constant)
    raise AssertionError(normalizer)

