"""What the kernel modules launch with: kernel twins (one specialized by Triton, one not, for the degenerate shapes
that break specialization), host sizes, the finish kernels' normalizer options and the per-token term's code."""

from __future__ import annotations

import triton

from ..contract import Surrogate, TokenNormalizer

SURROGATES = {Surrogate.CLIPPED: 0, Surrogate.CISPO: 1, Surrogate.SAPO: 2, Surrogate.VESPO: 3}  # SURROGATE constexpr


def twins(fn, names: list[str]) -> tuple:
    """`(specialized, general)` JIT kernels of `fn`. Triton turns an int argument equal to 1 into a constant and
    records which ones are divisible by 16; the divisibility lets row loads vectorize, but a vocabulary of 1 (a row
    stride of 1) broke a compiler pass (TritonGPUCoalesce). `names` (V and the row strides) are left unspecialized
    in the general twin, which `pick` chooses only for those shapes."""
    return triton.jit(fn), triton.jit(do_not_specialize=names)(fn)


def pick(kernels: tuple, *sizes: int):
    """The general twin when any of `sizes` (V, row strides) is 0 or 1, else the specialized one."""
    return kernels[1] if min(sizes) <= 1 else kernels[0]


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for the host: Triton's is a constexpr function, whose wrapper costs microseconds a call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for the host (0 for 0), without the constexpr function's wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def finish_options(normalizer: TokenNormalizer, constant: float | None, B: int) -> tuple[bool, str, float]:
    """The finish kernel's `(MEANS, DENOM, constant)` for a token normalizer, with `canonical.normalize`'s constant
    denominators: the batch mean's `B`, dr_grpo's `B * max_completion_length` (`constant`), each rounded once."""
    if normalizer is TokenNormalizer.GLOBAL_ACTIVE_TOKENS:
        return False, "tokens", 1.0
    if normalizer is TokenNormalizer.PER_SEQUENCE_THEN_MEAN:
        return True, "sequences", 1.0
    if normalizer is TokenNormalizer.PER_SEQUENCE_THEN_BATCH_MEAN:
        return True, "constant", float(B)
    if normalizer is TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH:
        return False, "constant", float(B * int(constant))
    if normalizer is TokenNormalizer.SEQUENCE_SUMS_THEN_BATCH_MEAN:
        return False, "constant", float(B)
    return False, "constant", constant  # fixed_constant
