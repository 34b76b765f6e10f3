"""Exact digests of tensors' bits, computed where the tensors live: the training recorder's per-sequence digests and
the preflight's comparison of the hidden states TP peers must share.

`row_digests(x, mask)` is integer arithmetic only (products and sums that cannot overflow, then a remainder), so the
same bits give the same digest on every device and in any summation order. Each element's bit pattern is read as
signed 16-bit words `u[j]` (little-endian: an fp32 is its low word, then its high word); per lane l of `LANES`, a row's
hash is `h_l = (sum_j c_l[j] * u[j]) mod p` with fixed weights `0 < c_l[j] < 2**15` and the prime `p = 2**31 - 1`, and
a sequence's digest is `(sum_r w_l[r] * h_l(row r)) mod p` over its active rows, `r` the row's place among them, with
`0 < w_l[r] < p`. One changed word changes every lane (`|c * delta| < p`, p prime); a row moved to another place
meets other weights; padding rows never enter. Cost: one read of the tensor and a few int32 passes over it.
"""

from __future__ import annotations

import functools

import torch

from .contract import LossContractError

__all__ = ["LANES", "PRIME", "mantissas", "row_digests"]

PRIME = (1 << 31) - 1
LANES = 4
_CHUNK = 1 << 24  # 16-bit words per step (bounds the int32 temporaries)
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
    order of t (see the module docstring). `x` `[B, T, ...]` of a 2-, 4- or 8-byte dtype."""
    B, T = mask.shape
    if x.shape[:2] != (B, T):
        raise LossContractError(f"x: expected [B, T, ...] with [B, T] = {[B, T]} like the mask, got {list(x.shape)}")
    if x.element_size() not in (2, 4, 8):
        raise LossContractError(f"x: expected a dtype of 2, 4 or 8 bytes, got {x.dtype}")
    mask = mask.to(device=x.device, dtype=torch.bool)
    rows = mask.reshape(-1).nonzero().squeeze(1)
    out = torch.zeros((B, LANES), dtype=torch.int64, device=x.device)
    if rows.numel() == 0:
        return out
    seq, ordinal = rows // T, (mask.cumsum(1) - 1).reshape(-1)[rows]  # the row's place among its active rows
    words = x.detach().reshape(B * T, -1).contiguous().view(torch.int16)
    cols = _weights(words.shape[1], 1, 1 << 15, x.device).to(torch.int32)  # |word * c| < 2**30
    row_w = _weights(T, 2, PRIME, x.device)
    step = max(1, _CHUNK // words.shape[1])
    for start in range(0, rows.numel(), step):
        r = slice(start, start + step)
        chunk = words[rows[r]].to(torch.int32)
        for lane in range(LANES):
            h = (chunk * cols[lane]).sum(-1, dtype=torch.int64) % PRIME  # a row's sum < 2**30 * words
            out[:, lane].index_add_(0, seq[r], h * row_w[lane, ordinal[r]] % PRIME)  # each < 2**31
    return out % PRIME


def mantissas(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of `x` with the exponent bits cleared (sign and mantissa kept): unchanged when `x` is scaled
    by a power of two (normal numbers and zeros)."""
    if x.dtype not in _SIGN_AND_MANTISSA:
        raise LossContractError(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    width = 8 * x.element_size()
    mask = _SIGN_AND_MANTISSA[x.dtype] - (1 << width)  # the sign bit is set: as a signed integer of that width
    return x.contiguous().view(torch.int32 if width == 32 else torch.int16) & mask
