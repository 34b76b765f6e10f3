"""`grpo_core.digest`: the recorder's per-sequence digests and the preflight's comparison of TP peers' hidden states.
Against a pure-Python oracle of its definition; every bit of an active row moves it, a padding row never does, the
summation's steps change nothing; `mantissas` sees everything but a power-of-two scale."""

from __future__ import annotations

import struct

import pytest
import torch

from grpo_core import digest
from grpo_core.digest import LANES, PRIME, RowDigests, mantissas, row_digests


def _py_weights(n: int, salt: int, limit: int) -> list[list[int]]:
    out = []
    for lane in range(LANES):
        row = []
        for i in range(n):
            x = (i * 0x9E3779B1 + lane * 0x85EBCA77 + salt * 0xC2B2AE3D) % PRIME
            for mult in (0x27D4EB2F, 0x165667B1):
                x = (x ^ (x >> 15)) * mult % PRIME
            row.append(x % (limit - 1) + 1)
        out.append(row)
    return out


def _py_digest(x: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The digest from its definition, in Python integers: each element's bytes as signed little-endian 16-bit words,
    a row's lane `sum(c * u) mod p`, a sequence's `sum(w[r] * row) mod p` over its active rows."""
    B, T = mask.shape
    flat = x.reshape(B, T, -1)
    out = []
    for b in range(B):
        lanes, ordinal = [0] * LANES, 0
        for t in range(T):
            if not mask[b, t]:
                continue
            raw = flat[b, t].contiguous().view(torch.uint8).tolist()
            words = list(struct.unpack(f"<{len(raw) // 2}h", bytes(raw)))
            cols, rows = _py_weights(len(words), 1, 1 << 15), _py_weights(T, 2, PRIME)
            for lane in range(LANES):
                h = sum(c * u for c, u in zip(cols[lane], words)) % PRIME
                lanes[lane] = (lanes[lane] + h * rows[lane][ordinal]) % PRIME
            ordinal += 1
        out.append(lanes)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_row_digests_match_their_definition(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 7, generator=g) * 100).to(dtype)
    mask = torch.rand(3, 5, generator=g) < 0.7
    mask[2] = False  # a sequence without an active row: all lanes 0
    assert row_digests(x, mask).tolist() == _py_digest(x, mask)
    assert row_digests(x, mask)[2].tolist() == [0] * LANES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_word_of_an_active_row_moves_every_lane(dtype, monkeypatch):
    x = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(3)).to(dtype)
    mask = torch.tensor([[True, False, True, True], [False, True, True, False]])
    want = row_digests(x, mask)
    words = x.view(torch.int16)
    for b in range(2):
        for t in range(4):
            for j in range(words.shape[2]):
                for flip in (1, -32768):  # the word's lowest bit, its top bit
                    w = words.clone()
                    w[b, t, j] ^= flip
                    moved = row_digests(w.view(dtype), mask) != want
                    assert moved[b].all() == bool(mask[b, t]) and not moved[1 - b].any(), (b, t, j, flip)
    monkeypatch.setattr(digest, "_CHUNK", 7)  # one row a step: the steps change nothing
    assert torch.equal(row_digests(x, mask), want)


def test_padding_and_position_never_enter_and_order_does():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 16, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.6
    mask[:, 0] = True
    base = row_digests(x, mask)
    y = torch.where(mask[..., None], x, torch.randn(4, 6, 16, generator=g))  # other values under the padding
    assert torch.equal(row_digests(y, mask), base)
    perm = torch.tensor([2, 0, 3, 1])  # the sequences reordered
    assert torch.equal(row_digests(x[perm], mask[perm]), base[perm])
    padded, pmask = torch.nn.functional.pad(x, (0, 0, 3, 0)), torch.nn.functional.pad(mask, (3, 0))
    assert torch.equal(row_digests(padded, pmask), base)  # padded on the left
    z = x.clone()
    rows = mask[0].nonzero().flatten()[:2]
    z[0, rows] = x[0, rows.flip(0)]  # two rows of a sequence swapped
    assert (row_digests(z, mask)[0] != base[0]).all()
    zero = torch.zeros(1, 1, 4)
    assert (row_digests(-zero, torch.ones(1, 1)) != row_digests(zero, torch.ones(1, 1))).all()  # -0.0 is not +0.0
    assert torch.equal(row_digests(torch.zeros(2, 3, 0), torch.ones(2, 3)), torch.zeros(2, 4, dtype=torch.int64))
    for b, t in ((0, 5), (2, 0)):  # no row at all (a rank without sequences): the digests of no rows
        assert torch.equal(row_digests(torch.zeros(b, t, 7), torch.ones(b, t)), torch.zeros(b, 4, dtype=torch.int64))


@pytest.mark.parametrize("chunk", [1 << 24, 40])
def test_tensors_digested_together_give_each_ones_digest(chunk, monkeypatch):
    """`RowDigests(mask)(a, b, c)`, one matmul of the three side by side (other widths, dtypes, a 4-d one), gives the
    digests each gives alone and their definition's; also in steps of a few rows."""
    monkeypatch.setattr(digest, "_CHUNK", chunk)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(3, 5, generator=g) < 0.7
    xs = [torch.randn(3, 5, 6, generator=g).bfloat16(), torch.randn(3, 5, generator=g)[..., None].double(),
          torch.randn(3, 5, 2, 3, generator=g)]
    words = []  # the 16-bit words put side by side: a step's rows at a time, never the whole tensors
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts, *a: words.extend(t.numel() for t in ts if t.dtype == torch.int16) or
                        cat(ts, *a))
    together = RowDigests(mask, torch.device("cpu"))(*xs)
    assert [d.tolist() for d in together] == [_py_digest(x, mask) for x in xs]
    assert words and max(words) <= chunk


def test_row_digests_refuse_what_they_cannot_read():
    with pytest.raises(Exception, match=r"x: expected \[B, T, ...\] with \[B, T\] = \[2, 3\]"):
        row_digests(torch.zeros(2, 4, 5), torch.ones(2, 3))
    with pytest.raises(Exception, match="x: expected a dtype of 2, 4 or 8 bytes, got torch.uint8"):
        row_digests(torch.zeros(2, 3, 5, dtype=torch.uint8), torch.ones(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mantissas_are_blind_to_a_power_of_two_and_nothing_else(dtype):
    x = torch.randn(64, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(mantissas(x), mantissas(x * 4)) and torch.equal(mantissas(x), mantissas(x / 2))
    assert not torch.equal(mantissas(x), mantissas(x * 3)) and not torch.equal(mantissas(x), mantissas(-x))
