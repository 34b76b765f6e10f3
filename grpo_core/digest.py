"""Exact digests of tensors' bits, computed where the tensors live: the training recorder's per-sequence digests and
the preflight's comparison of the hidden states TP peers must share.

`row_digests(x, mask)` is integer arithmetic only (products and sums that cannot overflow, then a remainder), so the
same bits give the same digest on every device and in any summation order. Each element's bit pattern is read as
signed 16-bit words `u[j]` (little-endian: an fp32 is its low word, then its high word); per lane l of `LANES`, a row's
hash is `h_l = (sum_j c_l[j] * u[j]) mod p` with fixed weights `0 < c_l[j] < 2**15` and the prime `p = 2**31 - 1`, and
a sequence's digest is `(sum_r w_l[r] * h_l(row r)) mod p` over its active rows, `r` the row's place among them, with
`0 < w_l[r] < p`. One changed word changes every lane (`|c * delta| < p`, p prime); a row moved to another place
meets other weights; padding rows never enter. A row's sum is one fp64 matmul of the words with the weights: every
product and partial sum is an integer below 2**53, so the matmul is exact whatever its order. Cost: one read of the
tensor, its words as fp64, a matmul with LANES columns.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from .contract import LossContractError

__all__ = ["LANES", "PRIME", "RowDigests", "mantissas", "module_digests", "row_digests"]

PRIME = (1 << 31) - 1
LANES = 4
_CHUNK = 1 << 24  # 16-bit words per step (bounds the fp64 temporaries)
_MAX_WORDS = 1 << 23  # a row's words: below it, a row's sum (< words * 2**30) is below 2**53, exact in fp64
_SIGN_AND_MANTISSA = {torch.float32: 0x807FFFFF, torch.bfloat16: 0x807F, torch.float16: 0x83FF}


@functools.lru_cache(maxsize=32)
def _weights(n: int, salt: int, limit: int, device: torch.device, dtype: torch.dtype = torch.int64,
             pad: bool = False) -> torch.Tensor:
    """`[n, LANES]` in [1, limit): fixed pseudo-random weights (an integer hash of the index and the lane, in int64, so
    that every device makes the same ones), as `dtype`; `pad`: a row of zeros first, then the first n - 1."""
    i = torch.arange(n, dtype=torch.int64, device=device)[:, None] - int(pad)
    lanes = torch.arange(LANES, dtype=torch.int64, device=device)
    x = (i * 0x9E3779B1 + lanes * 0x85EBCA77 + salt * 0xC2B2AE3D) % PRIME
    for mult in (0x27D4EB2F, 0x165667B1):
        x = (x ^ (x >> 15)) * mult % PRIME
    return (x % (limit - 1) + 1).masked_fill_(i < 0, 0).to(dtype)


@functools.lru_cache(maxsize=32)
def _block_weights(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`[sum(widths), k * LANES]` fp64: each tensor's word weights in its own block of rows and columns, zeros
    elsewhere, so that one matmul of the tensors' words side by side gives every tensor's row hashes."""
    return torch.block_diag(*(_weights(w, 1, 1 << 15, device, torch.float64) for w in widths))


class RowDigests:
    """Digests of tensors' rows under one mask `[B, T]` (see the module docstring): each row's weight (0 on padding
    rows) is computed once, on `device`, and the tensors of one call are digested in one matmul. No host sync:
    everything queues on the device with the rest of the step."""

    def __init__(self, mask: torch.Tensor, device: torch.device):
        self.B, self.T = B, T = mask.shape
        mask = mask.to(device=device, dtype=torch.bool)
        place = mask.cumsum(1).mul_(mask)  # 1 + a row's place among its sequence's active rows; 0 on padding
        self.row_weights = _weights(T + 1, 2, PRIME, device, pad=True)[place]  # [B, T, LANES]

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        """`[B, LANES]` int64 for each `x` `[B, T, ...]` of a 2-, 4- or 8-byte dtype: the digest of each sequence's rows
        `x[b, t]` (flattened) with `mask[b, t]`, in order of t."""
        B, T = self.B, self.T
        for x in xs:
            if x.shape[:2] != (B, T):
                raise LossContractError(f"x: expected [B, T, ...] with [B, T] = {[B, T]} like the mask, got "
                                        f"{list(x.shape)}")
            if x.element_size() not in (2, 4, 8):
                raise LossContractError(f"x: expected a dtype of 2, 4 or 8 bytes, got {x.dtype}")
        if B * T == 0:  # no row (a rank without sequences): every digest is that of no rows
            return [torch.zeros((B, LANES), dtype=torch.int64, device=self.row_weights.device) for _ in xs]
        words = [x.detach().reshape(B * T, -1).contiguous().view(torch.int16) for x in xs]
        widths = tuple(w.shape[1] for w in words)
        if max(widths) >= _MAX_WORDS:
            raise LossContractError(f"x: expected fewer than {_MAX_WORDS} 16-bit words a row, got {max(widths)}")
        cols = _block_weights(widths, words[0].device)
        step = max(1, _CHUNK // max(sum(widths), 1))

        def chunk(lo: int) -> torch.Tensor:  # rows lo.. of the words side by side (a copy of a chunk's rows at most)
            part = [w[lo:lo + step] for w in words]
            return part[0] if len(part) == 1 else torch.cat(part, 1)

        # an fp64 matmul of integers: every product < 2**30 and every partial sum < 2**53 is exact, in any order
        h = [chunk(lo).double() @ cols for lo in range(0, B * T, step)]
        h = (h[0] if len(h) == 1 else torch.cat(h)).long().remainder_(PRIME).view(B, T, len(xs), LANES)
        out = h.mul_(self.row_weights[:, :, None]).remainder_(PRIME).sum(1).remainder_(PRIME)  # terms < 2**31
        return list(out.unbind(1))


def row_digests(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, LANES]` int64: for each sequence b, the digest of the rows `x[b, t]` (flattened) with `mask[b, t]`, in
    order of t (see the module docstring). `x` `[B, T, ...]` of a 2-, 4- or 8-byte dtype. No host sync."""
    return RowDigests(mask, x.device)(x)[0]


def mantissas(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of `x` with the exponent bits cleared (sign and mantissa kept): unchanged when `x` is scaled
    by a power of two (normal numbers and zeros)."""
    if x.dtype not in _SIGN_AND_MANTISSA:
        raise LossContractError(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    width = 8 * x.element_size()
    mask = _SIGN_AND_MANTISSA[x.dtype] - (1 << width)  # the sign bit is set: as a signed integer of that width
    return x.contiguous().view(torch.int32 if width == 32 else torch.int16) & mask


@contextlib.contextmanager
def module_digests(modules: dict[str, torch.nn.Module], mask: torch.Tensor) -> Iterator[dict[str, torch.Tensor]]:
    """While the context is open, each module's output rows `[B, T, ...]` (a tuple's first tensor) are digested under
    `mask` `[B, T]` in a forward hook, on the device, without a host sync: yields `{name: [B, LANES] int64}`, filled in
    the order the modules run. The hooks go when the context closes (a recomputation in the backward, as gradient
    checkpointing makes, is not digested again); a module that runs twice inside raises."""
    digests: dict[str, torch.Tensor] = {}
    rows = RowDigests(mask, mask.device)

    def hook(name: str):
        def digest(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if name in digests:
                raise LossContractError(f"modules: expected {name} to run once while its digests are taken, got a "
                                        f"second call")
            digests[name] = rows(out)[0]
        return digest

    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    try:
        yield digests
    finally:
        for h in handles:
            h.remove()
