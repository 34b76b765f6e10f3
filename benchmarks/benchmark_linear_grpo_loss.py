"""The fused linear GRPO loss (hidden states + lm_head weight) against the three-matmul floor of the same run.

    python benchmarks/benchmark_linear_grpo_loss.py --configs "8x1024,3584,151936;32x2048,3584,151936"

Floors: the bf16 matmul rate R measured here (`torch.mm` of 8192^3), `3 * 2NHV / R` for forward+backward with
gradients for the hidden states and the weight (logits, dH, dW), `2NHV / R` for the log-prob forward (and once
more per reference forward: `ref_hidden`); and cuBLAS at the op's own GEMM shapes (`own_floor`: `torch.mm` on each
chunk's three products, `floor_own_ms`). Backends: `linear` (ours: `grpo_core.linear`, Triton kernels, the
contract path at 1x1), `matmul_then_triton` (`h @ W.T` in torch, then our fast Triton op on the materialized
logits), `native` (`h @ W.T`, then the native op), and Liger's `LigerFusedLinearGRPOLoss` (what TRL's
`use_liger_kernel=True` runs) when it imports. beta 0 is TRL's default; beta 0.04 takes `ref_logps`. `*_gspo`:
the same with GSPO's `importance_sampling_level="sequence"` (ours computes the logits twice: its floor stays three
matmuls). `linear_entropy`: with the token entropies (`entropy=True`, a third row statistic), as `GRPOCoreTrainer`
runs it. `trl_head`: TRL 1.16's default path when `trl` imports, what `GRPOTrainer` runs: its fused LM head
(`add_fused_lm_head`'s `_ChunkedLogProbFunction` on the active rows, `outputs=("log_probs", "entropy")`, tiles of
`_CHUNKED_LOGPROB_CHUNK_SIZE` columns), then its token loss as `_compute_loss` (dapo, epsilon 0.2 both sides, the
k3 KL without `use_bias_correction_kl`, as ours runs here; TRL's metrics and their host syncs left out). The
log-prob forward: ours (`logprobs`, `linear_logprobs`) and TRL's head without gradients (`trl_logprobs`,
`outputs=("log_probs",)`: TRL's reference forward; its old log-probs come with the entropies too).
Peak memory is the peak allocated over what was allocated before the call, gradients included.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import provenance, report, timed  # noqa: E402
from grpo_core import kernel_registry  # noqa: E402
from grpo_core.linear import TRITON_CHUNK, linear_grpo_loss, linear_logprobs  # noqa: E402
from grpo_core.triton import matmul as mm  # noqa: E402


def parse(text: str) -> list[tuple[int, int, int, int]]:
    """`"BxT,H,V;..."`."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            bt, H, V = part.split(",")
            B, T = bt.split("x")
            out.append((int(B), int(T), int(H), int(V)))
        except ValueError:
            raise SystemExit(f"--configs: expected 'BxT,H,V' groups, got {part!r}") from None
    return out


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of `torch.mm` on `n`^3 (median)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def own_floor(N: int, H: int, V: int, chunk: int = TRITON_CHUNK) -> tuple[float, float]:
    """cuBLAS (`torch.mm`, bf16 out, median) at the fused loss's own GEMM shapes, summed over its chunks of `chunk`
    of the `N` tokens: per chunk of `c` tokens the logits `[c, H] @ [H, V]` (`h @ W.T`), dH `[c, V] @ [V, H]`
    (`dz @ W`) and dW `[V, c] @ [c, H]` (`dz.T @ h`). `(log-prob forward ms, forward+backward ms)`: the chunks'
    logits products, and all three."""
    sizes = [chunk] * (N // chunk) + [N % chunk] * (N % chunk > 0)
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
    ms = {}
    for c in set(sizes):
        h = torch.randn(c, H, device="cuda", dtype=torch.bfloat16)
        dz = torch.randn(c, V, device="cuda", dtype=torch.bfloat16)
        ms[c] = [do_bench(f, warmup=10, rep=100, return_mode="median")
                 for f in (lambda: h @ w.T, lambda: dz @ w, lambda: dz.T @ h)]
    return sum(ms[c][0] for c in sizes), sum(sum(ms[c]) for c in sizes)


def inputs(B: int, T: int, H: int, V: int, active: float, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
    ids = torch.randint(0, V, (B, T), device="cuda", generator=g)
    mask = torch.rand(B, T, device="cuda", generator=g) < active
    old = -torch.rand(B, T, device="cuda", generator=g) * 2 - 10
    ref = -torch.rand(B, T, device="cuda", generator=g) * 2 - 10
    adv = torch.randn(B, device="cuda", generator=g)
    return dict(hidden=hidden, weight=weight, ids=ids, mask=mask, old=old, ref=ref, adv=adv)


def backends(beta: float) -> dict:
    triton_op = kernel_registry.get_op("grpo_loss", backend="triton")
    native = kernel_registry.get_op("grpo_loss", backend="native")

    def ref_of(i):
        return i["ref"] if beta > 0 else None

    out = {f"linear{suffix}": lambda i, h, w, level=level: linear_grpo_loss(
        h, w, i["ids"], i["old"], completion_mask=i["mask"], advantages=i["adv"], ref_logps=ref_of(i), beta=beta,
        loss_type="dapo", importance_sampling_level=level).loss for suffix, level in (("", "token"),
                                                                                      ("_gspo", "sequence"))}
    out["linear_entropy"] = lambda i, h, w: linear_grpo_loss(  # what GRPOCoreTrainer runs: the entropies logged
        h, w, i["ids"], i["old"], completion_mask=i["mask"], advantages=i["adv"], ref_logps=ref_of(i), beta=beta,
        loss_type="dapo", entropy=True).loss

    def materialized(op):
        def run(i, h, w):
            logits = h @ w.T
            # the reference log-probs are given: the logits ops take reference logits, so beta > 0 is run with
            # beta = 0 here and the reference term's cost (one [N] elementwise op) left out
            return op(logits, None, i["ids"], i["old"], None, i["mask"], advantages=i["adv"], beta=0.0,
                      loss_type="dapo")[0]
        return run

    head = trl_head(("log_probs", "entropy"))
    if head is not None:
        def trl_loss(i, h, w):
            m = i["mask"]
            logp, ent = head(i, h, w)
            ent.detach().sum()  # the logged entropy
            ratio = torch.exp(logp - i["old"])
            adv = i["adv"][:, None]
            per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
            if beta > 0:
                d = i["ref"] - logp
                per_token = per_token + beta * (torch.exp(d) - d - 1)
            return (per_token * m).sum() / m.sum().clamp(min=1.0)
        out["trl_head"] = trl_loss
    out["matmul_then_triton"] = materialized(triton_op)
    out["native"] = materialized(native)
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        for suffix, level in (("", "token"), ("_gspo", "sequence")):
            liger = LigerFusedLinearGRPOLoss(beta=beta, loss_type="dapo", use_ref_model=beta > 0,
                                             importance_sampling_level=level)
            out[f"liger{suffix}"] = lambda i, h, w, liger=liger: liger(
                h, w, i["ids"], i["mask"].long(), i["adv"], ref_per_token_logps=ref_of(i),
                old_per_token_logps=i["old"])[0]
    except ImportError:
        pass
    return out


def trl_head(outputs: tuple[str, ...]):
    """TRL 1.16's fused LM head as `add_fused_lm_head` runs it: `_ChunkedLogProbFunction` on the active rows, its
    `outputs` scattered back to `[B, T]` (log-probs, entropies or None); None when `trl` does not import."""
    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, _ChunkedLogProbFunction
    except ImportError:
        return None

    def run(i, h, w):
        m = i["mask"]
        per_token = _ChunkedLogProbFunction.apply(h[m], w, None, i["ids"][m], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                                  None, 1.0, outputs)[:2]
        return [None if x is None else x.new_zeros(m.shape).masked_scatter(m, x) for x in per_token]
    return run


def logprob_backends() -> dict:
    """The log-prob forwards (no gradients): ours and, when `trl` imports, TRL's head as it runs for the reference
    log-probs."""
    out = {"logprobs": lambda i, h, w: linear_logprobs(h, w, i["ids"], i["mask"])}
    head = trl_head(("log_probs",))
    if head is not None:
        def trl_logprobs(i, h, w):
            with torch.no_grad():
                return head(i, h, w)[0]
        out["trl_logprobs"] = trl_logprobs
    return out


def profile(B: int, T: int, H: int, V: int, betas: list[float], active: float, steps: int = 3) -> None:
    """`torch.profiler` over `steps` forward+backward steps of the `linear` backend: GPU time per kernel against
    the steps' wall time (the difference: the GPU idle between launches)."""
    i = inputs(B, T, H, V, active)
    h, w = i["hidden"].detach().requires_grad_(True), i["weight"].detach().requires_grad_(True)
    for beta in betas:
        fn = backends(beta)["linear"]

        def step():
            fn(i, h, w).backward()
            h.grad = w.grad = None
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / steps * 1e3
        print(f"{B}x{T},{H},{V} beta={beta}: {wall:.1f} ms wall a step (under the profiler), GPU time a step:")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
            print(f"  {e.device_time_total / steps / 1e3:8.2f} ms  {e.count // steps:4d} launches  {e.key[:70]}")
        total = sum(e.self_device_time_total for e in prof.key_averages()) / steps / 1e3
        print(f"  {total:8.2f} ms  all kernels", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="8x1024,3584,151936;32x2048,3584,151936;8x1024,4096,128256;"
                                        "32x2048,4096,128256")
    p.add_argument("--betas", default="0,0.04")
    p.add_argument("--active", type=float, default=1.0, help="fraction of active tokens (TRL masks padding only)")
    p.add_argument("--skip", default="", help="comma-separated backends to skip (e.g. native,liger); "
                                           "BACKEND@BxT skips one at that size only (liger@32x2048)")
    p.add_argument("--out", default="linear_grpo_loss")
    p.add_argument("--profile", action="store_true", help="profile the first config's `linear` steps instead of "
                                                          "timing (nothing appended)")
    args = p.parse_args()
    if args.profile:
        return profile(*parse(args.configs)[0], [float(b) for b in args.betas.split(",")], args.active)
    skip, prov = set(filter(None, args.skip.split(","))), provenance()
    rate = matmul_rate()
    print(f"bf16 matmul rate {rate / 1e12:.1f} TFLOP/s", flush=True)
    for B, T, H, V in parse(args.configs):
        rows = []
        i = inputs(B, T, H, V, args.active)
        N = int(i["mask"].sum())
        flops = 2 * N * H * V
        own = dict(zip(("logprob_fwd", "fwd_bwd"), own_floor(N, H, V)))
        print(f"{B}x{T},{H},{V}: cuBLAS at the op's shapes: logits {own['logprob_fwd']:.2f} ms, all three "
              f"{own['fwd_bwd']:.2f} ms ({3 * flops / own['fwd_bwd'] / 1e9:.1f} TFLOP/s)", flush=True)
        for beta in (float(b) for b in args.betas.split(",")):
            runs = {**backends(beta), **(logprob_backends() if beta == 0 else {})}  # log-probs: once per config
            for name, fn in runs.items():
                if name in skip or f"{name}@{B}x{T}" in skip:
                    continue
                forward_only = name.endswith("logprobs")
                h = i["hidden"].detach().requires_grad_(not forward_only)
                w = i["weight"].detach().requires_grad_(not forward_only)

                def run(h=h, w=w, fn=fn, forward_only=forward_only, i=i):
                    out = fn(i, h, w)
                    if not forward_only:
                        out.backward()
                mode, floor = ("logprob_fwd", 1) if forward_only else ("fwd_bwd", 3)
                floor = floor * flops / rate * 1e3  # matmuls of 2NHV each
                try:
                    p50, p20, p80, peak = timed(run, grad_to_none=None if forward_only else [h, w])
                except torch.OutOfMemoryError:
                    print(f"{name} {mode} {B}x{T},{H},{V} beta={beta}: out of memory", file=sys.stderr, flush=True)
                    torch.cuda.empty_cache()
                    continue
                rows.append(dict(op="linear_grpo_loss", backend=name, mode=mode, config=f"{B}x{T},{H},{V}",
                                 beta=beta, B=B, T=T, H=H, V=V, dtype="bf16", active=N / (B * T), p50_ms=p50,
                                 p20_ms=p20, p80_ms=p80, peak_extra_mib=peak, floor_ms=floor,
                                 ratio_to_floor=p50 / floor, floor_own_ms=own[mode], ratio_to_own=p50 / own[mode],
                                 matmul_tflops=rate / 1e12, chunk_tokens=TRITON_CHUNK,
                                 block=f"{mm.BLOCK_M}x{mm.BLOCK_N}x{mm.BLOCK_K}/{mm.NUM_WARPS}w/{mm.NUM_STAGES}s",
                                 **prov))
                print(f"{name:20s} {mode:11s} {B}x{T},{H},{V} beta={beta:<5} p50 {p50:9.2f} ms  floor {floor:8.2f}"
                      f"  x{p50 / floor:5.2f}  own {own[mode]:8.2f} x{p50 / own[mode]:5.2f}"
                      f"  peak {peak / 1024:7.2f} GiB", flush=True)
                h.grad = w.grad = None
        del i
        torch.cuda.empty_cache()
        report(rows, args.out, ["config", "beta", "backend", "mode", "p50_ms", "floor_ms", "ratio_to_floor",
                                "ratio_to_own", "peak_extra_mib"])  # per config: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
