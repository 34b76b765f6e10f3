"""Where the time goes: GPU kernel time (torch.profiler) against the wall time of one call.

    python benchmarks/profile_grpo_loss.py --configs "4,8,256,32768;4,8,256,131072"

Prints, per config and mode, the median wall time, the median time until the Python call returns (from an idle
GPU; without `check_values` that is the host cost of the launches), the summed CUDA kernel time of one call, the
host share, and the achieved bandwidth of the row kernels (bytes they must move / their own time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth, make_inputs, parse_configs  # noqa: E402
from grpo_core import kernel_registry  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="4,8,256,32768;4,8,256,131072")
    args = p.parse_args()
    op = kernel_registry.get_op("grpo_loss", backend="triton")
    for P, S, L, V in parse_configs(args.configs):
        inp = make_inputs(P * S, L, V, torch.bfloat16, 0.9)
        E = inp["policy_logits"].numel() * 2
        a = inp["completion_mask"].float().mean().item()
        bw = copy_bandwidth(E)
        variants = [(mode, single, check) for mode, single in (("fwd", False), ("fwd_bwd", True), ("fwd_bwd", False))
                    for check in ("deferred", "assert")]
        for mode, single, check in variants:
            x = inp["policy_logits"].detach().requires_grad_(mode == "fwd_bwd")

            def run(x=x, single=single, mode=mode, check=check):
                call = {**inp, "policy_logits": x}
                if mode == "fwd":
                    with torch.no_grad():
                        op(**call, samples_per_prompt=S, check_values=check)
                else:
                    op(**call, samples_per_prompt=S, single_pass=single, check_values=check)[0].backward()
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
            rows = [e for e in kernels if "logprob" in e.key]
            row_ms = sum(e.device_time_total for e in rows) / 1e3
            moved = 2 * a * E if mode == "fwd" else ((2 * a + 1) * E if single else (3 * a + 1) * E)
            label = mode if mode == "fwd" else f"{mode} {'single' if single else 'two-pass'}"
            label += "" if check == "deferred" else " unchecked"
            print(f"V={V:6d} {label:28s} wall {wall:7.3f} ms  call returns {call:7.3f} ms  kernels {total:7.3f} ms  "
                  f"host share {max(0.0, 1 - total / wall):5.1%}  row kernels {row_ms:7.3f} ms = "
                  f"{moved / row_ms / 1e9:6.2f} TB/s (copy {bw / 1e12:.2f} TB/s)", flush=True)
            for e in sorted(kernels, key=lambda e: -e.device_time_total)[:4]:
                print(f"      {e.device_time_total / 1e3:8.3f} ms  x{e.count:<3d} {e.key[:70]}")


if __name__ == "__main__":
    main()
