"""Group-relative advantages: `(r - mean_g(r)) / max(std_g(r), 1e-6)`, fixed-order sums, any group sizes."""

from __future__ import annotations

import torch

from .contract import AdvantageStd
from .reduction import tree_sum

STD_FLOOR = 1e-6


def group_advantages(rewards: torch.Tensor, group_boundaries: tuple[int, ...], std: AdvantageStd) -> torch.Tensor:
    """Normalizes `rewards [S]` within each CSR group; returns fp32 `[S]`.

    The groups are laid out as a zero-padded `[G, max_group]` matrix and reduced with `tree_sum`, so the result
    depends only on the reward vector and the group layout: every rank that holds the gathered rewards computes
    the same bits.
    """
    r = rewards.to(torch.float32)
    bounds = torch.tensor(group_boundaries, device=r.device)
    sizes = bounds[1:] - bounds[:-1]
    group_of = torch.repeat_interleave(torch.arange(len(sizes), device=r.device), sizes, output_size=r.numel())
    slot = torch.arange(r.numel(), device=r.device) - bounds[:-1][group_of]
    width = max(b - a for a, b in zip(group_boundaries[:-1], group_boundaries[1:]))  # no device sync
    grid = r.new_zeros(len(sizes), width).index_put((group_of, slot), r)
    valid = torch.zeros_like(grid, dtype=torch.bool).index_put((group_of, slot), torch.ones_like(r, dtype=torch.bool))
    n = sizes.to(torch.float32)
    mean = tree_sum(grid) / n
    centered = r - mean[group_of]
    if std is AdvantageStd.NONE:
        return centered
    dev = torch.where(valid, grid - mean[:, None], torch.zeros_like(grid))
    var = tree_sum(dev * dev) / (n if std is AdvantageStd.POPULATION else n - 1)
    return centered / torch.clamp(torch.sqrt(var), min=STD_FLOOR)[group_of]
