"""`preflight.bits_digest`, the digest TP peers compare of their hidden states: exact integer math on the bit
pattern, so any one changed bit of a row it reads moves it, a row it leaves out never does, and how it steps over
the rows changes nothing."""

from __future__ import annotations

import pytest
import torch

from grpo_core.distributed import preflight
from grpo_core.distributed.preflight import bits_digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bits_digest_sees_every_bit_of_the_rows_it_reads(dtype, monkeypatch):
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows = torch.tensor([True, True, False, True, True, True])
    want = bits_digest(x, rows)
    assert want.dtype == torch.int64 and want.shape == (2,)
    words = x.view(torch.int16)
    for r in range(6):
        for j in range(words.shape[1]):
            for bit in (0, 15):
                flipped = words.clone()
                flipped[r, j] ^= -32768 if bit == 15 else 1  # the word's top bit or its lowest
                got = bits_digest(flipped.view(dtype), rows)
                if rows[r]:
                    assert (got != want).all(), (r, j, bit)
                else:
                    assert torch.equal(got, want), (r, j, bit)
    swapped = x[[1, 0, 2, 3, 4, 5]]
    assert not torch.equal(bits_digest(swapped, rows), want)  # a reordering changes the weights the rows meet
    monkeypatch.setattr(preflight, "_DIGEST_ELEMENTS", 7)  # one or two rows a step
    assert torch.equal(bits_digest(x, rows), want)


def test_bits_digest_tells_minus_zero_from_zero():
    x, rows = torch.zeros(3, 4), torch.ones(3, dtype=torch.bool)
    assert not torch.equal(bits_digest(-x, rows), bits_digest(x, rows))
