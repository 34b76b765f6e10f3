"""Vocab-parallel selected log-probs with the canonical math: the same bits at every TP degree, on every machine.

The vocabulary is cut into tiles of `tile_width` columns (a power of two set by the contract, never by TP); TP
shards are unions of whole tiles. Each tile gives an fp32 `(max, sumexp)` pair (`canonical.tile_stats`); the
pairs and the selected logit travel by `all_gather` (an exact copy) and every rank merges all tiles in global
tile order with the same tree (`canonical.merge_stats`). TP = 1 runs the very same per-tile arithmetic. Only
active rows are read, in chunks, so the extra memory stays `O(rows * vocab / tile_width)`.

`inv_temperature` (an fp32 value, `contract.inverse_temperature`): the logits are read as `z = fp32(x) * inv`,
one multiply per element, wherever they are read (tiles, selected logit, softmax of the gradient); at 1.0 as
`fp32(x)`, nothing multiplied.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import canonical
from ..contract import LogprobContract, LossContractError


def row_chunks(rows: torch.Tensor, cols: int, tile_width: int, total_rows: int) -> Iterator[torch.Tensor]:
    """Splits the row indices `rows` into chunks whose fp32 temporaries stay `O(total_rows * cols / tile_width)`,
    with a floor of 2**20 elements on the CPU and 2**24 on a GPU (fewer launches). Rows are independent, so the
    chunking never changes a bit."""
    floor = 1 << (24 if rows.is_cuda else 20)
    step = max(1, max(floor, total_rows * cols // tile_width) // max(cols, 1))
    return iter(rows.split(step))


def _gather_tiles(stats: list[torch.Tensor], selected: torch.Tensor, contract: LogprobContract,
                  tp_group: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """All ranks' tile stats (`(m, s)` or `(m, s, u)`) in global tile order `[n, num_tiles]` each and every rank's
    selected logit `[tp, n]`."""
    width = contract.tile_width
    tiles = [-(-(hi - lo) // width) for lo, hi in contract.vocab_shard_bounds]
    most = max(tiles)
    pad = most - stats[0].shape[1]
    packed = torch.cat([F.pad(stats[0], (0, pad), value=float("-inf")), *(F.pad(t, (0, pad)) for t in stats[1:]),
                        selected.unsqueeze(-1)], 1)
    parts = [torch.empty_like(packed) for _ in tiles]
    dist.all_gather(parts, packed.contiguous(), group=tp_group)
    merged = [torch.cat([p[:, i * most:i * most + k] for p, k in zip(parts, tiles)], 1) for i in range(len(stats))]
    return merged, torch.stack([p[:, -1] for p in parts])


def gather_tile_stats(m: torch.Tensor, s: torch.Tensor, selected: torch.Tensor, ids: torch.Tensor,
                      contract: LogprobContract, tp_group: Any, u: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, ...]:
    """Every TP rank's tile stats `[n, local tiles]` gathered into global tile order `[n, tiles]`, and the selected
    logit of each row taken from the rank that owns its id (the others hold 0.0 there): `(m, s, selected)`, or with
    `u` (the entropy's tile sums) `(m, s, selected, u)`. TP = 1: unchanged."""
    stats = [m, s] if u is None else [m, s, u]
    if len(contract.vocab_shard_bounds) > 1:
        stats, selected_all = _gather_tiles(stats, selected, contract, tp_group)
        starts = torch.tensor([b[0] for b in contract.vocab_shard_bounds[1:]], device=ids.device)
        owner = torch.bucketize(ids, starts, right=True)
        selected = selected_all.gather(0, owner.unsqueeze(0)).squeeze(0)
    return (stats[0], stats[1], selected, *stats[2:])


def scaled(logits: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """`fp32(logits) * inv_temperature` (an fp32 value); at 1.0 `fp32(logits)` itself."""
    z = logits.float()
    return z if inv_temperature == 1.0 else z * canonical.fp32(inv_temperature, z)


def vocab_parallel_lse(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, contract: LogprobContract,
                       tp_group: Any, inv_temperature: float = 1.0, entropy: bool = False) -> tuple[torch.Tensor, ...]:
    """`(lse, selected logit)` fp32 `[len(rows)]` of the rows `rows` of this rank's `[tokens, local vocab]` shard
    read as `z = fp32(x) * inv_temperature`, for global `ids`. `lse` is NaN for a row that holds a NaN or +inf logit
    or only -inf ones. `entropy`: `(lse, selected, entropy)`, each row's `canonical.entropy_of` (NaN where `lse` is)."""
    m, s, selected, *u = local_tile_stats(logits, rows, ids, contract.local_bounds[0], contract.tile_width,
                                          inv_temperature, entropy)
    m, s, selected, *u = gather_tile_stats(m, s, selected, ids, contract, tp_group, *u)
    merged = canonical.merge_stats(m, s, *u)
    lse = canonical.lse(*merged[:2])
    return (lse, selected) if not entropy else (lse, selected, canonical.entropy_of(*merged))


def local_tile_stats(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, lo: int, tile_width: int,
                     inv_temperature: float = 1.0, entropy: bool = False) -> tuple[torch.Tensor, ...]:
    """`(m, s, selected)` (with `entropy`, `(m, s, selected, u)`) of the rows `rows` of `logits`, the vocabulary's
    columns `[lo, lo + logits.shape[1])` (`lo` on a tile): each tile's `canonical.tile_stats` `[len(rows), tiles]`,
    and the selected logit of each row whose id falls in those columns (0.0 elsewhere)."""
    V = logits.shape[1]
    stats = [canonical.tile_stats(scaled(logits[chunk], inv_temperature), tile_width, entropy)
             for chunk in row_chunks(rows, V, tile_width, logits.shape[0])]
    empty = logits.new_zeros((0, -(-V // tile_width)), dtype=torch.float32)
    m, s, *u = (torch.cat([st[i] for st in stats]) if stats else empty for i in range(2 + entropy))
    local = ids - lo
    owned = (local >= 0) & (local < V)
    selected = torch.where(owned, scaled(logits[rows, local.clamp(0, V - 1)], inv_temperature), 0.0)
    return m, s, selected, *u


def write_grad(grad: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor, local_ids: torch.Tensor,
               lse: torch.Tensor, coef: torch.Tensor, tile_width: int, inv_temperature: float = 1.0,
               entropy: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """`grad[rows] = coef * (onehot(local_ids) - p)` in `grad`'s dtype, chunk by chunk, with `p = exp(z[rows] - lse)`
    and `z = fp32(logits) * inv_temperature` (`coef` already holds the factor `inv_temperature` of `dz / dx`);
    `local_ids` outside this shard give no one-hot column. `entropy = (coef_h, h)` `[len(rows)]` each: plus
    `coef_h * (p * ((z - lse) + h))` (0.0 where `p` is: a -inf logit), `coef_h` times `-d h / dz` of the row's
    entropy `h`."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    start = 0
    for chunk in row_chunks(rows, logits.shape[1], tile_width, logits.shape[0]):
        part = slice(start, start + chunk.numel())
        start = part.stop
        onehot = (cols == local_ids[part].unsqueeze(1)).to(torch.float32)
        logp = scaled(logits[chunk], inv_temperature) - lse[part].unsqueeze(1)
        p = canonical.exp(logp)
        g = coef[part].unsqueeze(1) * (onehot - p)
        if entropy is not None:
            term = torch.where(p > 0, p * (logp + entropy[1][part].unsqueeze(1)), 0.0)  # a -inf logit: p = 0
            g = g + entropy[0][part].unsqueeze(1) * term
        grad[chunk] = g.to(grad.dtype)


class _LogprobGrad(torch.autograd.Function):
    """Forward: the log-probs computed outside autograd. Backward: `grad_logp * (onehot - softmax)`."""

    @staticmethod
    def forward(ctx, logits, logp, rows, local_ids, lse, tile_width):
        ctx.save_for_backward(logits, rows, local_ids, lse)
        ctx.tile_width = tile_width
        return logp.clone()

    @staticmethod
    def backward(ctx, grad_logp):
        logits, rows, local_ids, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        write_grad(grad, logits, rows, local_ids, lse, grad_logp[rows].float(), ctx.tile_width)
        return grad, None, None, None, None, None


class VocabParallelLogprobOp:
    """`logp, lse = op(local_logits [num_tokens, local_vocab], action_ids [num_tokens], contract=..., tp_group=...)`.

    `action_ids` are global ids. With `mask [num_tokens]`, masked rows are never read and give `logp = lse = 0`
    and an exactly zero gradient. Both outputs are fp32 and identical, bit for bit, at every TP degree and on every
    device; `logp` carries a gradient into `local_logits`, `lse` does not.
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
        rows = mask.nonzero().squeeze(1)
        ids = action_ids[rows].long()
        bad = (ids < 0) | (ids >= contract.vocab_size)
        if bool(bad.any()):
            raise LossContractError(f"action_ids: expected ids in [0, {contract.vocab_size}), got "
                                    f"{ids[bad][:8].tolist()}")
        x = local_logits.detach()
        lse_rows, selected = vocab_parallel_lse(x, rows, ids, contract, tp_group)
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=x.device)
        logp, lse = zeros.index_put((rows,), selected - lse_rows), zeros.index_put((rows,), lse_rows)
        if local_logits.requires_grad and torch.is_grad_enabled():
            logp = _LogprobGrad.apply(local_logits, logp, rows, ids - lo, lse_rows, contract.tile_width)
        return logp, lse
