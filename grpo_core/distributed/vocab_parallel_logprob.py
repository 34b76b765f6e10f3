"""Vocab-parallel selected log-probs whose bits do not depend on the TP degree.

The vocabulary is cut into tiles of `tile_width` columns (a power of two set by the contract, never by TP);
TP shards are unions of whole tiles. Each tile gives an fp32 `(max, sumexp)` pair from fixed pairwise trees;
the pairs and the selected logit travel by `all_gather` (an exact copy) and every rank merges all tiles in
global tile order with the same trees. TP = 1 runs the very same per-tile arithmetic, so every TP degree
produces the same log-sum-exp, log-probs and gradient bits. Masked rows are never read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..contract import LogprobContract, LossContractError
from ..reduction import tree_max, tree_sum


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    # A tile (or row) of -inf logits has max -inf; shifting by 0 instead keeps its exp terms 0 rather than NaN.
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def tile_stats(x: torch.Tensor, tile_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile `(max, sumexp)` of fp32 rows `[n, width_local]` whose first column starts a tile: `[n, tiles]`."""
    n, width = x.shape
    tiles = -(-width // tile_width)
    x = F.pad(x, (0, tiles * tile_width - width), value=float("-inf")).view(n, tiles, tile_width)
    m = tree_max(x)
    s = tree_sum(torch.exp(x - _finite_or_zero(m).unsqueeze(-1)))
    return m, s


def merge_tiles(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp `[n]` from all tiles' `(max, sumexp)` `[n, num_tiles]`, merged in global tile order."""
    big = tree_max(m)
    scaled = s * torch.exp(m - _finite_or_zero(big).unsqueeze(-1))
    return big + torch.log(tree_sum(scaled))


def _gather_tiles(m: torch.Tensor, s: torch.Tensor, selected: torch.Tensor, contract: LogprobContract,
                  tp_group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All ranks' tile stats in global tile order `[n, num_tiles]` and every rank's selected logit `[tp, n]`."""
    width = contract.tile_width
    tiles = [-(-(hi - lo) // width) for lo, hi in contract.vocab_shard_bounds]
    most = max(tiles)
    pad = most - m.shape[1]
    packed = torch.cat([F.pad(m, (0, pad), value=float("-inf")), F.pad(s, (0, pad)), selected.unsqueeze(-1)], 1)
    parts = [torch.empty_like(packed) for _ in tiles]
    dist.all_gather(parts, packed.contiguous(), group=tp_group)
    m_all = torch.cat([p[:, :k] for p, k in zip(parts, tiles)], 1)
    s_all = torch.cat([p[:, most:most + k] for p, k in zip(parts, tiles)], 1)
    return m_all, s_all, torch.stack([p[:, -1] for p in parts])


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, action_ids: torch.Tensor, contract: LogprobContract, tp_group: Any):
        x = logits.float()
        lo, hi = contract.local_bounds
        local_ids = action_ids.long() - lo
        owned = (local_ids >= 0) & (local_ids < hi - lo)
        picked = x.gather(1, local_ids.clamp(0, hi - lo - 1).unsqueeze(1)).squeeze(1)  # read, then keep only owned
        selected = torch.where(owned, picked, torch.zeros_like(picked))
        m, s = tile_stats(x, contract.tile_width)
        if len(contract.vocab_shard_bounds) > 1:
            m, s, selected_all = _gather_tiles(m, s, selected, contract, tp_group)
            starts = torch.tensor([b[0] for b in contract.vocab_shard_bounds[1:]], device=x.device)
            owner = torch.bucketize(action_ids.long(), starts, right=True)
            selected = selected_all.gather(0, owner.unsqueeze(0)).squeeze(0)
        lse = merge_tiles(m, s)
        ctx.save_for_backward(x, local_ids, lse)
        ctx.dtype = logits.dtype
        return selected - lse, lse

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_lse: torch.Tensor):
        x, local_ids, lse = ctx.saved_tensors
        # d logp / d x = onehot(action) - softmax(x); an elementwise formula, identical at every TP degree.
        cols = torch.arange(x.shape[1], device=x.device)
        onehot = (cols.unsqueeze(0) == local_ids.unsqueeze(1)).to(x.dtype)
        grad = grad_logp.unsqueeze(1) * (onehot - torch.exp(x - lse.unsqueeze(1)))
        if grad_lse is not None:
            grad = grad + grad_lse.unsqueeze(1) * torch.exp(x - lse.unsqueeze(1))
        return grad.to(ctx.dtype), None, None, None


class VocabParallelLogprobOp:
    """`logp, lse = op(local_logits [num_tokens, local_vocab], action_ids [num_tokens], contract=..., tp_group=...)`.

    `action_ids` are global ids. With `mask [num_tokens]`, masked rows are never read and give `logp = lse = 0`
    and an exactly zero gradient. Both outputs are fp32 and identical, bit for bit, at every TP degree.
    """

    backend = "distributed"

    def __call__(self, local_logits: torch.Tensor, action_ids: torch.Tensor, *, contract: LogprobContract,
                 tp_group: Any = None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(contract, LogprobContract):
            raise LossContractError(f"contract: expected a LogprobContract, got {type(contract).__name__}")
        lo, hi = contract.local_bounds
        expected = (contract.num_tokens, hi - lo)
        if not isinstance(local_logits, torch.Tensor) or tuple(local_logits.shape) != expected:
            got = list(local_logits.shape) if isinstance(local_logits, torch.Tensor) else type(local_logits).__name__
            raise LossContractError(f"local_logits: expected [num_tokens, local_vocab] = {list(expected)} from the "
                                    f"logprob contract, got {got}")
        if not isinstance(action_ids, torch.Tensor) or tuple(action_ids.shape) != (contract.num_tokens,):
            raise LossContractError(f"action_ids: expected shape [{contract.num_tokens}], got "
                                    f"{list(getattr(action_ids, 'shape', []))}")
        if mask is None:
            mask = torch.ones_like(action_ids, dtype=torch.bool)
        ids = action_ids[mask]
        bad = (ids < 0) | (ids >= contract.vocab_size)
        if bool(bad.any()):
            raise LossContractError(f"action_ids: expected ids in [0, {contract.vocab_size}), got "
                                    f"{ids[bad][:8].tolist()}")
        logp, lse = _VocabParallelLogprob.apply(local_logits[mask], ids, contract, tp_group)
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=local_logits.device)
        return zeros.masked_scatter(mask, logp), zeros.masked_scatter(mask, lse)
