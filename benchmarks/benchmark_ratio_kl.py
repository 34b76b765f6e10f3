"""Per-token ratio / KL forward and forward+backward against the floors measured in the same run.

    python benchmarks/benchmark_ratio_kl.py --configs "4,8,256,32768" --dtype bf16

Floors: forward 2aE/BW; forward+backward (two passes: `ratio.sum().backward()`) (3a+1)E/BW.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth, make_inputs, parse_configs, provenance, report, timed  # noqa: E402
from grpo_core import kernel_registry  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="4,8,256,32768;4,8,256,131072")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--active", type=float, default=0.9)
    p.add_argument("--out", default="ratio_kl")
    args = p.parse_args()
    prov, rows = provenance(), []
    ops = {"triton": kernel_registry.get_op("ratio_kl", backend="triton"),
           "native": kernel_registry.get_op("ratio_kl", backend="native")}
    ops["torch_compile"] = torch.compile(ops["native"])
    for P, S, L, V in parse_configs(args.configs):
        inp = make_inputs(P * S, L, V, DTYPES[args.dtype], args.active)
        E = inp["policy_logits"].numel() * inp["policy_logits"].element_size()
        a = inp["completion_mask"].float().mean().item()
        bw = copy_bandwidth(E)
        floors = {"fwd": 2 * a * E / bw * 1e3, "fwd_bwd": (3 * a + 1) * E / bw * 1e3}
        for name, op in ops.items():
            for mode in ("fwd", "fwd_bwd"):
                x = inp["policy_logits"].detach().requires_grad_(mode == "fwd_bwd")
                args_ = (x, inp["ref_logits"], inp["action_ids"], inp["completion_mask"], inp["old_logps"])

                def run(args_=args_, op=op, mode=mode):
                    if mode == "fwd":
                        with torch.no_grad():
                            op(*args_)
                    else:
                        op(*args_)[0].sum().backward()
                p50, p20, p80, peak = timed(run, grad_to_none=[x] if mode == "fwd_bwd" else None)
                floor = floors[mode]
                rows.append(dict(op="ratio_kl", backend=name, mode=mode, config=f"{P},{S},{L},{V}", B=P * S, T=L, V=V,
                                 dtype=args.dtype, active=a, p50_ms=p50, p20_ms=p20, p80_ms=p80, peak_extra_mib=peak,
                                 floor_ms=floor, ratio_to_floor=p50 / floor, copy_bw_tbps=bw / 1e12,
                                 bw_tbps=(2 * a * E if mode == "fwd" else (3 * a + 1) * E) / (p50 * 1e-3) / 1e12,
                                 logits_gib=E / 2**30, **prov))
                print(f"{name:14s} {mode:8s} V={V:6d} p50 {p50:8.3f} ms  floor {floor:7.3f}  x{p50 / floor:5.2f}",
                      flush=True)
        del inp
        torch.cuda.empty_cache()
    report(rows, args.out)


if __name__ == "__main__":
    main()
