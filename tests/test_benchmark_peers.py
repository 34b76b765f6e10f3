"""The fused linear benchmark's peers compute what ours computes (CPU, float32): TRL 1.16's head and token loss
(`trl_head`, `trl_logprobs`) and Liger's fused GRPO loss where it imports, against `linear_grpo_loss` and
`linear_logprobs` on the same inputs: the loss, both gradients and the log-probs within float32 rounding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchmark_linear_grpo_loss import backends, logprob_backends  # noqa: E402

g = torch.Generator().manual_seed(0)
B, T, H, V = 3, 7, 16, 40
INPUTS = dict(hidden=torch.randn(B, T, H, generator=g), weight=torch.randn(V, H, generator=g) * 0.5,
              ids=torch.randint(0, V, (B, T), generator=g), mask=torch.rand(B, T, generator=g) < 0.8,
              old=-torch.rand(B, T, generator=g) * 2 - 3, ref=-torch.rand(B, T, generator=g) * 2 - 3,
              adv=torch.randn(B, generator=g))


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_fused_peers_match_ours(beta):
    fns, got = backends(beta), {}
    for name in ("linear", "trl_head", "liger"):
        if name not in fns:
            continue
        h, w = (INPUTS[k].clone().requires_grad_(True) for k in ("hidden", "weight"))
        loss = fns[name](INPUTS, h, w)
        loss.backward()
        got[name] = (loss.detach(), h.grad, w.grad)
    assert "trl_head" in got
    want = got.pop("linear")
    for name, values in got.items():
        for what, a, b in zip(("loss", "hidden gradient", "weight gradient"), values, want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), f"{name}: {what}"
    ratio = torch.exp(torch.log_softmax(INPUTS["hidden"] @ INPUTS["weight"].T, -1).gather(
        -1, INPUTS["ids"][..., None])[..., 0] - INPUTS["old"])[INPUTS["mask"]]
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()  # both sides of the clip


def test_logprob_peers_match_ours():
    fns = logprob_backends()
    assert "trl_logprobs" in fns
    want = fns["logprobs"](INPUTS, INPUTS["hidden"], INPUTS["weight"])
    got = fns["trl_logprobs"](INPUTS, INPUTS["hidden"], INPUTS["weight"])
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-5) and (want[INPUTS["mask"]] != 0).all()
