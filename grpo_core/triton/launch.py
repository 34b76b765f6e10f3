"""Kernel twins: one specialized by Triton, one not, for the degenerate shapes that break specialization."""

from __future__ import annotations

import triton


def twins(fn, names: list[str]) -> tuple:
    """`(specialized, general)` JIT kernels of `fn`. Triton turns an int argument equal to 1 into a constant and
    records which ones are divisible by 16; the divisibility lets row loads vectorize, but a vocabulary of 1 (a row
    stride of 1) broke a compiler pass (TritonGPUCoalesce). `names` (V and the row strides) are left unspecialized
    in the general twin, which `pick` chooses only for those shapes."""
    return triton.jit(fn), triton.jit(do_not_specialize=names)(fn)


def pick(kernels: tuple, *sizes: int):
    """The general twin when any of `sizes` (V, row strides) is 0 or 1, else the specialized one."""
    return kernels[1] if min(sizes) <= 1 else kernels[0]
