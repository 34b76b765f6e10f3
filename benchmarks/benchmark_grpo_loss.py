"""GRPO loss forward and forward+backward against the memory-bandwidth floors measured in the same run.

    python benchmarks/benchmark_grpo_loss.py --configs "4,8,256,32768;2,8,1024,151936" --dtype bf16

Floors (E = bytes of one logits tensor, a = active-token fraction, BW = measured copy bandwidth):
forward 2aE/BW; forward+backward single-pass (2a+1)E/BW (`ratio_to_floor` always uses this one); two-pass
(3a+1)E/BW (recorded as `two_pass_floor_ms`).
Baselines: native eager, torch.compile of the native op, Liger-Kernel's triton_grpo_loss when importable.
The deterministic path (`topology_invariant`, the Triton kernels of the canonical math): `deterministic` at 1x1,
and `deterministic_tp2` / `deterministic_tp4`: the kernels one rank of a 2- / 4-way vocabulary split runs (its
shard's tile statistics, the merge of all ranks' statistics, the token sums, its shard's gradient), on one GPU,
without the all_gather of the statistics (`[tokens, vocab / tile]` floats). `deterministic_torch` is the torch
reference of the same bits. Backends named `*_ref_logps` take the reference as given log-probs (`ref_logps`,
computed before the timing) instead of its logits: their floors count one logits tensor, not two (forward aE/BW,
forward+backward (a+1)E/BW, two-pass (2a+1)E/BW). `*_gspo`: GSPO's `importance_sampling_level="sequence"`;
`*_vespo`: `loss_type="vespo"`; `*_entropy`: TRL's entropy bonus (`entropy_coef=0.01`: the token entropies, a third
row statistic); `triton_two_pass_top_entropy`: and `top_entropy_quantile=0.2` (one more read of the rows for the
canonical entropies). The fast op runs these two-pass only.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth, make_inputs, parse_configs, provenance, report, timed  # noqa: E402
from grpo_core import (AdvantageStd, GRPOLossContract, ShardingSpec, TokenNormalizer,  # noqa: E402
                       kernel_registry)
from grpo_core.distributed import DistributedGRPOLossOp  # noqa: E402
from grpo_core.triton import canonical as kernels  # noqa: E402
from grpo_core.triton.ratio_kl import BLOCK_V, NUM_STAGES, NUM_WARPS, token_logprobs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def deterministic(spp: int, kernels_name: str, level: str = "token", **options):
    """The `topology_invariant` path at 1x1. The contract is built once per shape, as a trainer builds it: a new
    one per call re-derives what the contract keeps (its fingerprint, its logprob contract), about 0.15 ms a call on
    the H200's host."""
    op = DistributedGRPOLossOp(kernels=kernels_name)

    @functools.cache
    def contract(B: int, T: int, V: int) -> GRPOLossContract:
        return GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, samples_per_prompt=spp, beta=0.04,
                                determinism_scope="topology_invariant", importance_sampling_level=level, **options)

    def run(inp):
        c = contract(*inp["policy_logits"].shape)
        return op.apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], inp["rewards"], contract=c,
                        completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"],
                        ref_logps=inp.get("ref_logps")).loss
    return run


class _OneTPRank(torch.autograd.Function):
    """Rank 0's kernels of a `tp`-way vocabulary split (the statistics of the other ranks: copies of its own)."""

    @staticmethod
    def forward(ctx, x, inp, tp, spp):
        B, T, V = inp["full_vocab"]
        W = 128
        lo = ShardingSpec.uniform(vocab_size=V, num_sequences=B, tp_world_size=tp).vocab_bounds[0]
        mask, ids = inp["completion_mask"], inp["action_ids"]
        sel, stats = kernels.row_stats(x, inp["ref_logits"], ids, mask, lo, W)
        lse = kernels.merge_lse(torch.cat([stats] * tp, -1), mask)
        logp, logp_ref = torch.where(mask.reshape(-1), sel - lse, 0.0).view(2, B, T)
        adv = kernels.group_advantages(inp["rewards"], tuple(range(0, B + 1, spp)), AdvantageStd.POPULATION)
        sums, ints = kernels.sequence_sums(logp, logp_ref, inp["old_logps"], mask, ids, adv, inp["rewards"], V, 0.8,
                                           1.2)
        scalars, w, _ = kernels.finish(sums, ints, 0.04, TokenNormalizer.GLOBAL_ACTIVE_TOKENS, None)
        loss = scalars[0]
        ctx.save_for_backward(x, ids, mask, logp, logp_ref, inp["old_logps"], adv, w, lse[0])
        ctx.lo = lo
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, ids, mask, logp, logp_ref, old, adv, w, lse = ctx.saved_tensors
        return kernels.grad(x, ids, mask, logp, logp_ref, old, adv, w, lse, grad_loss, ctx.lo, 0.8, 1.2,
                            0.04), None, None, None


def one_tp_rank(spp: int, tp: int):
    return lambda inp: _OneTPRank.apply(inp["policy_logits"], inp, tp, spp)


def backends(spp: int, skip: set[str]) -> dict:
    triton_op = kernel_registry.get_op("grpo_loss", backend="triton")
    native = kernel_registry.get_op("grpo_loss", backend="native")
    out = {}
    for mode, single in (("two_pass", False), ("single_pass", True)):
        for suffix, check in (("", "deferred"), ("_unchecked", "assert")):  # the default, and no host-side check
            out[f"triton_{mode}{suffix}"] = (lambda inp, single=single, check=check: triton_op(
                **inp, samples_per_prompt=spp, single_pass=single, check_values=check)[0])
    out["triton_two_pass_ref_logps"] = lambda inp: triton_op(**inp, samples_per_prompt=spp)[0]
    out["triton_single_pass_ref_logps"] = lambda inp: triton_op(**inp, samples_per_prompt=spp, single_pass=True)[0]
    out["triton_two_pass_gspo"] = lambda inp: triton_op(**inp, samples_per_prompt=spp,
                                                        importance_sampling_level="sequence")[0]
    out["deterministic"] = deterministic(spp, "triton")
    out["deterministic_gspo"] = deterministic(spp, "triton", "sequence")
    out["triton_two_pass_vespo"] = lambda inp: triton_op(**inp, samples_per_prompt=spp, loss_type="vespo")[0]
    out["deterministic_vespo"] = deterministic(spp, "triton", loss_type="vespo")
    out["triton_two_pass_entropy"] = lambda inp: triton_op(**inp, samples_per_prompt=spp, entropy_coef=0.01)[0]
    out["triton_two_pass_top_entropy"] = lambda inp: triton_op(**inp, samples_per_prompt=spp, entropy_coef=0.01,
                                                               top_entropy_quantile=0.2)[0]
    out["deterministic_entropy"] = deterministic(spp, "triton", entropy=True, entropy_coef=0.01)
    out["deterministic_ref_logps"] = deterministic(spp, "triton")
    out["deterministic_tp2"] = one_tp_rank(spp, 2)
    out["deterministic_tp4"] = one_tp_rank(spp, 4)
    out["deterministic_torch"] = deterministic(spp, "torch")
    out["native"] = lambda inp: native(**inp, samples_per_prompt=spp)[0]
    if "compile" not in skip:
        compiled = torch.compile(lambda inp: native(**inp, samples_per_prompt=spp)[0])
        out["torch_compile"] = compiled
    try:
        from liger_kernel.ops.grpo_loss import fused_selective_log_softmax
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def liger(inp):
            # Liger takes [B, T+1, V] logits (shifted by one) and the reference log-probs from a second kernel.
            ref_logp = fused_selective_log_softmax(inp["liger_ref"], inp["action_ids"], 1.0, inp["completion_mask"])
            B = inp["rewards"].shape[0]
            r = inp["rewards"].view(-1, spp)
            adv = ((r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True).clamp(min=1e-6)).view(B)
            loss, _ = triton_grpo_loss(inp["liger_policy"], inp["old_logps"], ref_logp, inp["action_ids"], adv,
                                       inp["completion_mask"].float(), temperature=1.0, beta=0.04, eps_low=0.2,
                                       eps_high=0.2, inplace=False, loss_type="bnpo", reduce=True)
            return loss
        out["liger"] = liger
    except ImportError:
        pass
    return {k: v for k, v in out.items() if k not in skip}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="4,8,256,32768;4,8,256,50257;4,8,256,131072;2,8,1024,151936")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--active", type=float, default=0.9)
    p.add_argument("--skip", default="", help="comma-separated backends to skip (e.g. compile,native)")
    p.add_argument("--only", default="", help="comma-separated backends to run, the others skipped")
    p.add_argument("--out", default="grpo_loss")
    args = p.parse_args()
    skip, only = set(filter(None, args.skip.split(","))), set(filter(None, args.only.split(",")))
    if only:  # the other backends (torch.compile's is skipped as "compile")
        known = set(backends(1, {"compile"})) | {"torch_compile"}
        if only - known:
            raise SystemExit(f"--only: expected backends among {sorted(known)}, got {sorted(only - known)}")
        skip |= known - only - {"torch_compile"} | ({"compile"} if "torch_compile" not in only else set())
    dtype, prov = DTYPES[args.dtype], provenance()
    for P, S, L, V in parse_configs(args.configs):
        B, T, rows = P * S, L, []
        inp = make_inputs(B, T, V, dtype, args.active)
        E = inp["policy_logits"].numel() * inp["policy_logits"].element_size()
        a = inp["completion_mask"].float().mean().item()
        bw = copy_bandwidth(E)
        given = {**inp, "ref_logits": None,  # the reference's log-probs, as its own no-grad pass would hand them
                 "ref_logps": token_logprobs(inp["ref_logits"], None, inp["action_ids"],
                                             inp["completion_mask"])[0][0].view(B, T)}
        for name, fn in backends(S, skip).items():
            streams = 1 if name.endswith("_ref_logps") else 2  # logits tensors read in the forward
            floors = {"fwd": streams * a * E / bw * 1e3, "fwd_bwd": (streams * a + 1) * E / bw * 1e3,
                      "fwd_bwd_two_pass": ((streams + 1) * a + 1) * E / bw * 1e3}
            if name == "liger":
                inp["liger_policy"] = torch.cat([inp["policy_logits"], inp["policy_logits"][:, :1]], 1)
                inp["liger_ref"] = torch.cat([inp["ref_logits"], inp["ref_logits"][:, :1]], 1)
            shard = None
            if name.startswith("deterministic_tp"):  # this rank's own (contiguous) shards of both tensors
                tp = int(name.removeprefix("deterministic_tp"))
                lo, hi = ShardingSpec.uniform(vocab_size=V, num_sequences=B, tp_world_size=tp).vocab_bounds
                shard = {**inp, "full_vocab": (B, T, V), "policy_logits": inp["policy_logits"][..., lo:hi].contiguous(),
                         "ref_logits": inp["ref_logits"][..., lo:hi].contiguous()}
            for mode in ("fwd", "fwd_bwd"):
                base = shard or (given if streams == 1 else inp)
                x = (base["liger_policy"] if name == "liger" else base["policy_logits"]).detach()
                x.requires_grad_(mode == "fwd_bwd")
                key = "liger_policy" if name == "liger" else "policy_logits"
                call = {**base, key: x}
                if mode == "fwd":
                    def run(call=call, fn=fn):
                        with torch.no_grad():
                            fn(call)
                else:
                    def run(call=call, fn=fn):
                        fn(call).backward()
                try:
                    p50, p20, p80, peak = timed(run, grad_to_none=[x] if mode == "fwd_bwd" else None)
                except torch.OutOfMemoryError:
                    print(f"{name} {mode} V={V}: out of memory", file=sys.stderr)
                    continue
                share = (hi - lo) / V if shard else 1.0  # a TP rank reads and writes its shard only
                floor = floors["fwd" if mode == "fwd" else "fwd_bwd"] * share
                rows.append(dict(op="grpo_loss", backend=name, mode=mode, config=f"{P},{S},{L},{V}", B=B, T=T, V=V,
                                 dtype=args.dtype, active=a, p50_ms=p50, p20_ms=p20, p80_ms=p80, peak_extra_mib=peak,
                                 floor_ms=floor, ratio_to_floor=p50 / floor,
                                 two_pass_floor_ms=floors["fwd_bwd_two_pass"] * share, copy_bw_tbps=bw / 1e12,
                                 bw_tbps=floor * bw / (p50 * 1e12),
                                 logits_gib=E / 2**30, triton_block_v=BLOCK_V, triton_num_warps=NUM_WARPS,
                                 triton_num_stages=NUM_STAGES, **prov))
                print(f"{name:16s} {mode:8s} V={V:6d} p50 {p50:8.3f} ms  floor {floor:7.3f}  x{p50 / floor:5.2f}  "
                      f"peak {peak:9.1f} MiB", flush=True)
            inp.pop("liger_policy", None), inp.pop("liger_ref", None)
            del shard
        del inp, given
        torch.cuda.empty_cache()
        report(rows, args.out)  # per config: a run cut short (a config that does not fit) keeps what it measured


if __name__ == "__main__":
    main()
