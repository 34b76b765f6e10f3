"""One matmul with one fixed configuration, for the fused linear loss: `C = [C +] A @ B [+ bias]`, fp32 out.

Every launch uses the same tile sizes, warps and stages, whatever the shapes, and walks K from 0 upward in steps
of `block_k` with one fp32 accumulator per output tile (no split-K, no autotuning). So an output element's bits
depend only on its row of A, its column of B and the accumulator it starts from, never on how many rows or columns
the call has, where they sit, or the chunk they came in: a token's logits are the same bits in any batch and any
vocabulary shard, and a sum over K continued from a stored accumulator (`accumulate=True`) is the sum the longer
call would have made, provided the split falls on a multiple of `block_k` (vocabulary shards start on tiles;
token chunks are multiples of `BLOCK_K`). How the tensor cores add within one step is the architecture's: these
bits are per GPU architecture, not the canonical math's.

The kernel is persistent: one program per streaming multiprocessor (`_programs`), each walking the output tiles
`programs` apart (faster than a program per tile on each product of the loss at H = 3584: the A/B below; over the
whole loss 5-8% faster at H = 1536 and 3584, 2% slower at H = 896: benchmarks/README.md). Which program takes a tile,
and in which order, changes no bit. Operands reach shared memory by the tensor memory accelerator on Hopper
and later (`tma=True`, where the layout allows: 16-bit operands, rows 16-byte aligned), else by pointer loads; the
tiles, the K order and the tensor-core instructions are the same either way, and so are the bits
(`tests/test_linear.py` checks it on the GPU).

`matmul_stats` ends the same kernel with the row kernel's tile statistics of each output tile's rows
(`canonical._tiles` on the accumulator, a tile of the vocabulary being a power of two that divides the output tile's
256 columns) and each row's selected value, instead of storing C: the log-probs without the logits' fp32 round trip
through memory, the same bits as `row_stats` over the stored logits.

`scaled_cast` hands a product's fp32 accumulator over in a narrower dtype, scaled, in one pass (H100, a `dW` of
151936 x 3584 into bf16: 1.19 ms, where `torch.mul(x, g, out=...)` took 2.12 and a plain copy into bf16 1.06).

Under the interpreter `tl.dot` is a BLAS call whose order of adds depends on a row's place in the tile (and which
cannot take bf16): there each step adds the fp32 products one K after the other instead, on smaller tiles (the
interpreter's largest block holds 2**20 elements).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .canonical import _INTERPRET, _INTERPRETED, _max, _row_max, _tiles
from .launch import cdiv

# One H100 A/B (bf16, 4096 tokens, H 3584, V 151936, dz slices of 32768 columns; TFLOP/s logits / dH / dW; torch.mm
# at the same shapes 761 / 696 / 713): one program per tile, TMA 664 / 689 and pointer loads on dW 505; persistent,
# pointer loads 677 / 539 / 494, TMA 652 / 703 / 630 (4 stages: 649 / 693 / 600). The same bits in every variant.
BLOCK_M, BLOCK_N, BLOCK_K = (32, 64, 64) if _INTERPRET else (128, 256, 64)  # the interpreter: its largest block
NUM_WARPS, NUM_STAGES = 8, 3
GROUP_M = 8  # output tiles walked in groups of rows (L2 reuse); the order of programs never changes a bit
INTERPRETER_PROGRAMS = 3  # the persistent loop under the interpreter (several tiles a program)


@triton.jit
def _load(ptr, row0, col0, rows_left, cols_left, stride_r, stride_c, TMA: tl.constexpr, T: tl.constexpr,
          R: tl.constexpr, C: tl.constexpr):
    """The `[R, C]` block at (`row0`, `col0`) of an operand: by TMA from a descriptor over its row-major storage
    (transposed storage, `T`: the block `[C, R]` at (`col0`, `row0`), then `.T`), or by masked pointer loads
    (zeros past `rows_left` / `cols_left`)."""
    if TMA:
        if T:
            block = ptr.load([col0, row0]).T
        else:
            block = ptr.load([row0, col0])
    else:
        r, c = tl.arange(0, R), tl.arange(0, C)
        offs = (row0 + r).to(tl.int64)[:, None] * stride_r + (col0 + c).to(tl.int64)[None, :] * stride_c
        block = tl.load(ptr + offs, mask=(r[:, None] < rows_left) & (c[None, :] < cols_left), other=0.0)
    return block


@triton.jit
def _stats(x, rm, n0, ids_ptr, sel_ptr, stats_ptr, M, N, lo, tiles, R: tl.constexpr, C: tl.constexpr,
           W: tl.constexpr, LOG2W: tl.constexpr, ENTROPY: tl.constexpr):
    """The tile statistics (`canonical._tiles`) of rows `rm` of an output tile `x` `[R, C]` (columns from `n0`,
    scaled, -inf past N) to `stats_ptr`, and each row's value at its column `ids - lo` to `sel_ptr` where the tile
    holds it."""
    PER: tl.constexpr = C // W  # tiles per row
    m, s, u = _tiles(tl.reshape(x, (R * PER, W)), 1.0, R * PER, W, LOG2W, False, False, ENTROPY)
    t = n0 // W + tl.arange(0, PER)
    offs = rm[:, None] * tiles + t[None, :]
    ok = (rm[:, None] < M) & (t[None, :] < tiles)
    plane = tl.cast(M, tl.int64) * tiles
    tl.store(stats_ptr + offs, tl.reshape(m, (R, PER)), mask=ok)
    tl.store(stats_ptr + plane + offs, tl.reshape(s, (R, PER)), mask=ok)
    if ENTROPY:
        tl.store(stats_ptr + 2 * plane + offs, tl.reshape(u, (R, PER)), mask=ok)
    a = tl.load(ids_ptr + rm, mask=rm < M, other=-1) - lo
    cols = n0 + tl.arange(0, C)
    if _INTERPRETED:
        z = _row_max(tl.where(cols[None, :] == a[:, None], x, float("-inf")))
    else:
        z = tl.reduce(tl.where(cols[None, :] == a[:, None], x, float("-inf")), 1, _max)  # the one column's value
    tl.store(sel_ptr + rm, z, mask=(rm < M) & (a >= n0) & (a < n0 + C) & (a < N))


@triton.jit
def _matmul_kernel(
    a_ptr,  # A [M, K] (pointer with strides, or a TMA descriptor over A's row-major storage: A_T for A^T's)
    b_ptr,  # B [K, N] (likewise; B_T: over B^T's storage)
    c_ptr,  # in/out: fp32 C [M, N] (ACCUMULATE: read first; not with STATS)
    bias_ptr,  # [N] added once at the end (HAS_BIAS)
    ids_ptr,  # STATS: each row's column [M] (int64, minus `lo`), whose value goes to sel_ptr
    sel_ptr,  # STATS, out: fp32 [M], the value at each row's column (times `inv`), where it lies in [0, N)
    stats_ptr,  # STATS, out: fp32 [2 + ENTROPY, M, tiles], the tile statistics of each row times `inv`
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    lo, tiles, inv,  # STATS: the ids' offset, cdiv(N, W), the inverse temperature (fp32, SCALE)
    # Meta-parameters
    ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    STATS: tl.constexpr,  # C's tile statistics and selected values instead of C (`canonical.row_stats`' bits)
    W: tl.constexpr, LOG2W: tl.constexpr, SCALE: tl.constexpr, ENTROPY: tl.constexpr,  # STATS: as `_tiles`'s
    TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=False):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * tiles_n)) % rows_in_group
        pid_n = (tile % (GROUP_M * tiles_n)) // rows_in_group
        m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        rm = m0.to(tl.int64) + tl.arange(0, BLOCK_M)
        rn = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        c_mask = (rm[:, None] < M) & (rn[None, :] < N)
        if ACCUMULATE:
            acc = tl.load(c_ptrs, mask=c_mask, other=0.0)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
            k0 = k * BLOCK_K
            a = _load(a_ptr, m0, k0, M - m0, K - k0, stride_am, stride_ak, TMA, A_T, BLOCK_M, BLOCK_K)
            b = _load(b_ptr, k0, n0, K - k0, N - n0, stride_bk, stride_bn, TMA, B_T, BLOCK_K, BLOCK_N)
            if _INTERPRETED:  # products in fp32, added in K order
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
            elif IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if STATS:  # the row kernel's tiles from the accumulator: columns past N are -inf, as its masked loads
            x = tl.where(rn[None, :] < N, acc * inv if SCALE else acc, float("-inf"))
            _stats(x, rm, n0, ids_ptr, sel_ptr, stats_ptr, M, N, lo, tiles, BLOCK_M, BLOCK_N, W, LOG2W, ENTROPY)
        else:
            tl.store(c_ptrs, acc, mask=c_mask)


@functools.cache
def _programs(device: torch.device) -> int:
    """The persistent kernel's programs: one per streaming multiprocessor (`INTERPRETER_PROGRAMS` off CUDA)."""
    if _INTERPRET or device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _descriptor(t: torch.Tensor, block: list[int]):
    """A TMA descriptor over `t` (or over `t.T` when that is the row-major one) and whether it is transposed, or
    None when TMA cannot read it (16-bit data, 16-byte aligned rows, Hopper or later, not the interpreter)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    if _INTERPRET or not t.is_cuda or t.element_size() != 2 or torch.cuda.get_device_capability(t.device)[0] < 9:
        return None
    for storage, transposed, shape in ((t, False, block), (t.T, True, block[::-1])):
        if (storage.stride(1) == 1 and storage.data_ptr() % 16 == 0 and (storage.stride(0) * 2) % 16 == 0
                and storage.shape[1] >= 8):
            return TensorDescriptor.from_tensor(storage, shape), transposed
    return None


def _launch(device: torch.device, M: int, N: int, *args, **meta) -> None:
    """`_matmul_kernel` over an `[M, N]` output, one program per SM at most, with the one configuration."""
    programs = _programs(device)
    _matmul_kernel[(min(programs, cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)),)](
        *args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M, PROGRAMS=programs,
        NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **meta)


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, accumulate: bool = False,
           bias: torch.Tensor | None = None, block_k: int = BLOCK_K, tma: bool = True) -> torch.Tensor:
    """`out = [out +] a @ b [+ bias]` with fp32 `out` `[M, N]`; `a` `[M, K]` and `b` `[K, N]` of one dtype, any
    strides (pass transposed views, nothing is copied). fp32 inputs use IEEE fp32 products (no TF32). `block_k`
    (16 to `BLOCK_K`, a power of two): the K step. `tma=False`: pointer loads (the same bits)."""
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=torch.float32, device=a.device)
    if not (M and N):
        return out
    da = _descriptor(a, [BLOCK_M, block_k]) if tma else None
    db = _descriptor(b, [block_k, BLOCK_N]) if da is not None else None
    use_tma = db is not None
    _launch(a.device, M, N, da[0] if use_tma else a, db[0] if use_tma else b, out,
            bias if bias is not None else out, out, out, out, M, N, K, a.stride(0), a.stride(1), b.stride(0),
            b.stride(1), out.stride(0), out.stride(1), 0, 0, 1.0,
            ACCUMULATE=accumulate, HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32, STATS=False, W=1,
            LOG2W=0, SCALE=False, ENTROPY=False, TMA=use_tma, A_T=use_tma and da[1],
            B_T=use_tma and db[1], BLOCK_K=block_k)
    return out


def stats_fit(width: int) -> bool:
    """Whether `matmul_stats` takes tiles of `width` columns: a power of two that divides the output tile's columns."""
    return width & (width - 1) == 0 and 16 <= width <= BLOCK_N


def matmul_stats(a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, lo: int, width: int, inv: float = 1.0,
                 entropy: bool = False, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """`(m, s, selected(, u))` of `z = (a @ b [+ bias]) * inv` without storing z: `canonical.row_stats`' tile
    statistics `[M, cdiv(N, width)]` of each row of z (the columns of b: the vocabulary's from `lo`, on a tile) and
    its value at column `ids - lo` (0.0 where that is not one of z's columns), the bits of `row_stats` over the
    stored z, from the same accumulator, one launch. `width`: `stats_fit`."""
    M, K = a.shape
    N = b.shape[1]
    if not stats_fit(width):
        raise ValueError(f"width: expected a power of two from 16 to {BLOCK_N}, got {width}")
    tiles = cdiv(N, width)
    stats = torch.empty((2 + entropy, M, tiles), dtype=torch.float32, device=a.device)
    sel = torch.zeros(M, dtype=torch.float32, device=a.device)
    if M and N:
        _launch(a.device, M, N, a, b, sel, bias if bias is not None else sel, ids.to(torch.int64).contiguous(), sel,
                stats, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), 0, 0, lo, tiles, inv,
                ACCUMULATE=False, HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32, STATS=True, W=width,
                LOG2W=width.bit_length() - 1, SCALE=inv != 1.0, ENTROPY=entropy, TMA=False, A_T=False, B_T=False,
                BLOCK_K=BLOCK_K, enable_fp_fusion=False)  # `inv * z - m` as the row kernel rounds it: two roundings
    return (stats[0], stats[1], sel, *stats[2:])


@triton.jit
def _scaled_cast_kernel(x_ptr, g_ptr, y_ptr, n, BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    y = tl.load(x_ptr + offs, mask=keep) * tl.load(g_ptr)
    if BF16:  # to the nearest even by the bits: the interpreter's conversion truncates (a NaN: 0x7FC0)
        b = y.to(tl.uint32, bitcast=True)
        b = tl.where(y != y, 0x7FC00000, b + 0x7FFF + ((b >> 16) & 1)) >> 16
        tl.store(y_ptr + offs, b.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=keep)
    else:
        tl.store(y_ptr + offs, y.to(tl.float16), mask=keep)


def scaled_cast(x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x * g` (contiguous fp32 `x`, fp32 `g` `[]` on its device) rounded once to the nearest even `dtype` (bf16 or
    fp16): the bits of `torch.mul(x, g, out=torch.empty_like(x, dtype=dtype))` but a NaN's (a NaN still), in one
    pass."""
    if x.dtype != torch.float32 or not x.is_contiguous() or dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"scaled_cast: expected contiguous fp32 x and a bf16 or fp16 dtype, got {x.dtype} "
                         f"(contiguous: {x.is_contiguous()}) to {dtype}")
    y = torch.empty_like(x, dtype=dtype)
    if x.numel():
        block = 1024 if _INTERPRET else 8192
        _scaled_cast_kernel[(cdiv(x.numel(), block),)](x, g.to(torch.float32).reshape(1), y, x.numel(),
                                                       BF16=dtype == torch.bfloat16, BLOCK=block, num_warps=8)
    return y
