"""Where the time goes: GPU kernel time (torch.profiler) against the wall time of one call.

    python benchmarks/profile_grpo_loss.py --configs "4,8,256,32768;4,8,256,131072" --paths fast,deterministic

Prints, per config, path and mode, the median wall time, the median time until the Python call returns (from an
idle GPU; without `check_values` that is the host cost of the launches), the summed CUDA kernel time of one call,
the host share, the achieved bandwidth of the row kernels (bytes they must move / their own time) and the four
longest kernels. `fast`: the Triton op (two-pass and single-pass, with and without the deferred value check);
`deterministic`: the `topology_invariant` path at 1x1 (`benchmark_grpo_loss.py`'s). `--host N`: the N Python
functions with the most time of their own over 30 calls (cProfile), per variant.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchmark_grpo_loss import DTYPES, deterministic  # noqa: E402
from benchmarks.common import copy_bandwidth, make_inputs, parse_configs  # noqa: E402
from grpo_core import kernel_registry  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="4,8,256,32768;4,8,256,131072")
    p.add_argument("--paths", default="fast", help="comma-separated: fast, deterministic")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--host", type=int, default=0, help="print the N Python functions with the most own time")
    args = p.parse_args()
    paths = args.paths.split(",")
    if not set(paths) <= {"fast", "deterministic"}:
        raise SystemExit(f"--paths: expected fast and/or deterministic, got {args.paths!r}")
    op = kernel_registry.get_op("grpo_loss", backend="triton")
    for P, S, L, V in parse_configs(args.configs):
        inp = make_inputs(P * S, L, V, DTYPES[args.dtype], 0.9)
        E = inp["policy_logits"].numel() * inp["policy_logits"].element_size()
        a = inp["completion_mask"].float().mean().item()
        bw = copy_bandwidth(E)
        variants = [("fast", mode, single, check) for mode, single in (("fwd", False), ("fwd_bwd", True),
                                                                        ("fwd_bwd", False))
                    for check in ("deferred", "assert") if "fast" in paths]
        variants += [("deterministic", mode, False, "deferred") for mode in ("fwd", "fwd_bwd")
                     if "deterministic" in paths]
        det = deterministic(S, "triton")
        for path, mode, single, check in variants:
            x = inp["policy_logits"].detach().requires_grad_(mode == "fwd_bwd")

            def run(x=x, single=single, mode=mode, check=check, path=path):
                call = {**inp, "policy_logits": x}
                loss = (lambda **kw: (det(call),)) if path == "deterministic" else (
                    lambda **kw: op(**call, samples_per_prompt=S, check_values=check, **kw))
                if mode == "fwd":
                    with torch.no_grad():
                        loss()
                else:
                    loss(single_pass=single)[0].backward()
                    x.grad = None
            wall = do_bench(run, warmup=10, rep=100, return_mode="median")
            calls = []  # host time until the call returns (with check_values, that includes the device sync)
            for _ in range(30):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                calls.append((time.perf_counter() - t0) * 1e3)
            call = statistics.median(calls)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            total = sum(e.device_time_total for e in kernels) / 1e3
            rows = [e for e in kernels if "logprob" in e.key or "_row_kernel" in e.key or "_grad_kernel" in e.key]
            row_ms = sum(e.device_time_total for e in rows) / 1e3
            moved = 2 * a * E if mode == "fwd" else ((2 * a + 1) * E if single else (3 * a + 1) * E)
            label = path + " " + (mode if mode == "fwd" else f"{mode} {'single' if single else 'two-pass'}")
            label += "" if check == "deferred" else " unchecked"
            print(f"V={V:6d} {label:28s} wall {wall:7.3f} ms  call returns {call:7.3f} ms  kernels {total:7.3f} ms  "
                  f"host share {max(0.0, 1 - total / wall):5.1%}  row kernels {row_ms:7.3f} ms = "
                  f"{moved / row_ms / 1e9:6.2f} TB/s (copy {bw / 1e12:.2f} TB/s)", flush=True)
            for e in sorted(kernels, key=lambda e: -e.device_time_total)[:4]:
                print(f"      {e.device_time_total / 1e3:8.3f} ms  x{e.count:<3d} {e.key[:70]}")
            if args.host:
                torch.cuda.synchronize()
                prof = cProfile.Profile()
                prof.runcall(lambda: [run() for _ in range(30)])
                torch.cuda.synchronize()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.host)
                lines = out.getvalue().splitlines()
                header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
                print("\n".join(line for line in lines[header + 1:] if line.strip()))


if __name__ == "__main__":
    main()
