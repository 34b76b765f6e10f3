"""Accuracy of the canonical exp, log, sqrt and sigmoid over every fp32 input of each range, against float64, and of
VESPO's gamma weight (`canonical.vespo_phi`, their composition) over every fp32 log w (`--only phi` runs it alone).

Subnormal inputs and results are outside the ranges: the canonical functions flush them to 0.

    python3 benchmarks/canonical_accuracy.py            # every input: ~2**31 per function, minutes on 2 cores
    python3 benchmarks/canonical_accuracy.py --step 97  # every 97th bit pattern, seconds

Prints, per function and range: how many inputs were checked, the largest error in ULPs of the exact result
(the fp32 ULP of the float64 value's binade) and where it occurs, and the share of results that are not the
correctly rounded one. sqrt is also compared bit for bit with IEEE's correctly rounded fp32 sqrt.
"""

from __future__ import annotations

import argparse
import struct
import time

import numpy as np
import torch

from grpo_core import canonical


def bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


def inputs(lo: float, hi: float, step: int, chunk: int = 1 << 24):
    """Every `step`-th fp32 in [lo, hi] by bit pattern (lo < 0 < hi is walked as two monotone ranges)."""
    spans = [(0 if hi > 0 and lo <= 0 else bits(lo), bits(hi), 1)] if hi > 0 else []
    if lo < 0:
        spans.append((0 if hi >= 0 else bits(-hi), bits(-lo), -1))
    for first, last, sign in spans:
        for start in range(first, last + 1, chunk * step):
            pattern = torch.arange(start, min(start + chunk * step, last + 1), step, dtype=torch.int64)
            yield pattern.to(torch.int32).view(torch.float32) * sign


def ulp_error(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in ULPs of fp32 at `exact` (float64); exact results below 2**-126 use the normal ULP."""
    _, e = torch.frexp(exact.abs().clamp(min=canonical.TINY))
    return (got.double() - exact).abs() / torch.ldexp(torch.ones_like(exact), e - 24)


def scan(name: str, fn, ref, lo: float, hi: float, step: int) -> dict:
    t0 = time.monotonic()
    count, worst, worst_x, not_rounded = 0, 0.0, None, 0
    for x in inputs(lo, hi, step):
        exact = ref(x.double())
        got = fn(x)
        err = ulp_error(got, exact)
        rounded = exact.float()
        not_rounded += int((got.view(torch.int32) != rounded.view(torch.int32)).sum())
        count += x.numel()
        i = int(err.argmax())
        if float(err[i]) > worst:
            worst, worst_x = float(err[i]), float(x[i])
    row = dict(function=name, range=f"[{lo:.9g}, {hi:.9g}]", inputs=count, max_ulp=worst, at=worst_x,
               not_correctly_rounded=not_rounded / max(count, 1), seconds=time.monotonic() - t0)
    print(f"{name:5s} {row['range']:32s} inputs {count:>11,d}  max {worst:.4f} ULP at {worst_x!r:>16}  "
          f"not correctly rounded {row['not_correctly_rounded']:.2%}  ({row['seconds']:.0f} s)", flush=True)
    return row


def gamma(k: float, lam: float):
    """`(canonical.vespo_phi of one token whose log-ratio is log w, its float64 value, the largest log w whose phi is a
    normal float)` for `(k, lam)` at both advantage signs."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        return canonical.vespo_phi(x.view(n, 1), torch.zeros(n, 1), torch.zeros(n), torch.ones(n, 1, dtype=torch.bool),
                                   None, (k, lam, k, lam)).view(-1)

    def ref(x: torch.Tensor) -> torch.Tensor:
        return torch.exp((lam + k * x) - lam * torch.exp(x))

    lo, hi = 0.0, canonical.VESPO_LOG_W[1]  # phi falls past its mode log(k / lam) < log w: bisect for 2**-126
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(ref(torch.tensor(mid, dtype=torch.float64))) >= canonical.TINY else (lo, mid)
    return fn, ref, struct.unpack("<f", struct.pack("<f", lo))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", type=int, default=1, help="check every STEP-th bit pattern (1: every input)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["phi"], help="only VESPO's gamma weight")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.only == "phi":
        # TRL's defaults (k, lambda) for A >= 0 and A < 0, over log w in [fp32(log 1e-8), the last normal phi]
        for k, lam in ((2.0, 3.0), (3.0, 2.0)):
            fn, ref, hi = gamma(k, lam)
            scan(f"phi{k:g}/{lam:g}", fn, ref, canonical.VESPO_LOG_W[0], hi, a.step)
            scan(f"trl{k:g}/{lam:g}", lambda x: torch.exp(lam + k * x - lam * torch.exp(x)), ref,  # TRL's fp32 torch
                 canonical.VESPO_LOG_W[0], hi, a.step)
        return
    big = struct.unpack("<f", struct.pack("<i", 0x7F7FFFFF))[0]
    # exp: every input whose result is a normal float; log and sqrt: every positive normal float.
    scan("exp", canonical.exp, torch.exp, -87.33654, 88.72283, a.step)
    scan("log", canonical.log, torch.log, canonical.TINY, big, a.step)
    scan("sqrt", canonical.sqrt, torch.sqrt, canonical.TINY, big, a.step)
    # sigmoid: every input whose result is a normal float below 1 - 2**-25 (above it the exact value rounds to 1)
    scan("sigm", canonical.sigmoid, torch.sigmoid, -87.33654, 17.32868, a.step)
    # Edges: below the normal range exp is 0, above it inf; exp(0) is exactly 1.
    edge = torch.tensor([float("-inf"), -1e4, -87.34, 0.0, -0.0, 88.73, 1e4, float("inf")])
    print("exp edges", dict(zip(edge.tolist(), canonical.exp(edge).tolist())))
    v = torch.tensor([0.0, canonical.TINY, 1.0, 2.0, big])
    print("sqrt edges equal IEEE:", bool((canonical.sqrt(v) == torch.from_numpy(np.sqrt(v.numpy()))).all()),
          "| subnormals give 0:", canonical.sqrt(torch.tensor([1e-45, 1e-39])).tolist())


if __name__ == "__main__":
    main()
