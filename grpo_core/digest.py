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

import functools

import torch

from .contract import LossContractError

__all__ = ["LANES", "PRIME", "mantissas", "row_digests"]

PRIME = (1 << 31) - 1
LANES = 4
_CHUNK = 1 << 24  # 16-bit words per step (bounds the fp64 temporaries)
_MAX_WORDS = 1 << 23  # a row's words: below it, a row's sum (< words * 2**30) is below 2**53, exact in fp64
_SIGN_AND_MANTISSA = {torch.float32: 0x807FFFFF, torch.bfloat16: 0x807F, torch.float16: 0x83FF}


@functools.lru_cache(maxsize=16)
def _weights(n: int, salt: int, limit: int, device: torch.device) -> torch.Tensor:
    """`[LANES, n]` int64 in [1, limit): fixed pseudo-random weights (an integer hash of the index and the lane, in
    int64, so that every device makes the same ones)."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    lanes = torch.arange(LANES, dtype=torch.int64, device=device)[:, None]
    x = (i[None] * 0x9E3779B1 + lanes * 0x85EBCA77 + salt * 0xC2B2AE3D) % PRIME
    for mult in (0x27D4EB2F, 0x165667B1):
        x = (x ^ (x >> 15)) * mult % PRIME
    return x % (limit - 1) + 1


def row_digests(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, LANES]` int64: for each sequence b, the digest of the rows `x[b, t]` (flattened) with `mask[b, t]`, in
    order of t (see the module docstring). `x` `[B, T, ...]` of a 2-, 4- or 8-byte dtype. No host sync: it queues on
    the device with the rest of the step."""
    B, T = mask.shape
    if x.shape[:2] != (B, T):
        raise LossContractError(f"x: expected [B, T, ...] with [B, T] = {[B, T]} like the mask, got {list(x.shape)}")
    if x.element_size() not in (2, 4, 8):
        raise LossContractError(f"x: expected a dtype of 2, 4 or 8 bytes, got {x.dtype}")
    dev = x.device
    out = torch.zeros((B, LANES), dtype=torch.int64, device=dev)
    if B * T == 0:  # no row (a rank without sequences): every digest is that of no rows
        return out
    words = x.detach().reshape(B * T, -1).contiguous().view(torch.int16)
    if words.shape[1] >= _MAX_WORDS:
        raise LossContractError(f"x: expected fewer than {_MAX_WORDS} 16-bit words a row, got {words.shape[1]}")
    cols = _weights(words.shape[1], 1, 1 << 15, dev).T.double()  # [words, LANES]
    mask = mask.to(device=dev, dtype=torch.bool)
    ordinal = (mask.cumsum(1) - 1).clamp(min=0).reshape(-1)  # a row's place among its sequence's active rows
    row_w = torch.where(mask.reshape(-1, 1), _weights(T, 2, PRIME, dev).T[ordinal], 0)  # 0 on padding rows
    seq = torch.arange(B, device=dev).repeat_interleave(T)
    step = max(1, _CHUNK // max(words.shape[1], 1))
    for lo in range(0, B * T, step):
        # an fp64 matmul of integers: every product < 2**30 and every partial sum < 2**53 is exact, in any order
        h = (words[lo:lo + step].double() @ cols).long() % PRIME
        out.index_add_(0, seq[lo:lo + step], h * row_w[lo:lo + step] % PRIME)  # each term < 2**31
    return out % PRIME


def mantissas(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of `x` with the exponent bits cleared (sign and mantissa kept): unchanged when `x` is scaled
    by a power of two (normal numbers and zeros)."""
    if x.dtype not in _SIGN_AND_MANTISSA:
        raise LossContractError(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    width = 8 * x.element_size()
    mask = _SIGN_AND_MANTISSA[x.dtype] - (1 << width)  # the sign bit is set: as a signed integer of that width
    return x.contiguous().view(torch.int32 if width == 32 else torch.int16) & mask
