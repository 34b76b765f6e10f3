"""The recorder's cost at a trainer's micro-batch: `TrainingRecorder.record` after the fused linear loss, the gradient
hook it adds to the backward, and the step's `flush` as the trainer calls it (`wait=False`: the copy off the device
queued, the Parquet file written by a background thread), against the loss op and the backward without it.

    python benchmarks/benchmark_recorder.py    # Qwen2.5-0.5B's micro-batch: 8 x 512 tokens, H 896, V 151936
    python benchmarks/benchmark_recorder.py --device cpu --tiny
    python benchmarks/benchmark_recorder.py --layers 0.5b  # record_layers: the per-layer digests' cost

Each step runs the loss twice, once without the recorder (`op`, `bwd`) and once with it (`record`, `bwd_recorded`),
each region between device synchronizations; `record_host` is `record`'s return without one. Then `flush` hands the
step (one recorded call) to the writer without one, and `write` is the time until its file is written (the background
thread's, off the step's path). Medians over the steps after the first two, in ms; `--profile` adds torch.profiler's
table of one recorded call and its backward.

`--layers MODEL`: `record_layers`' digests instead (`digest.module_digests` on the embedding, every decoder layer and
the final norm of benchmark_trl_step.py's MODEL shape, random bf16 weights): the backbone's forward and backward on a
micro-batch of 8 x 256 tokens (128 of prompt and 128 of completion, the whole-run checks' shape), alternately without
(`plain`) and with the digests (`digests`), and the digests' kernels alone on the same outputs (`digest_only`)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import torch

from grpo_core.linear import linear_grpo_loss
from grpo_core.recorder import TrainingRecorder


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 x 16 tokens, H 32, V 100")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--layers", metavar="MODEL", help="time record_layers' digests at a benchmark_trl_step.py shape")
    args = p.parse_args()
    if args.layers:
        return layers(args)
    B, T, H, V, P = (2, 16, 32, 100, 4) if args.tiny else (8, 512, 896, 151936, 128)
    dev = torch.device(args.device)

    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # bf16: TRL's default on the GPU
    weight = (torch.randn(V, H, device=dev, generator=g) * H**-0.5).to(dtype).requires_grad_(True)
    ids, prompt = (torch.randint(0, V, (B, n), device=dev, generator=g) for n in (T, P))
    mask = torch.ones(B, T, dtype=torch.long, device=dev)
    old, ref = (-torch.rand(B, T, device=dev, generator=g) - 11 for _ in range(2))
    adv = torch.randn(B, device=dev, generator=g)
    rec = TrainingRecorder(tempfile.mkdtemp(), rank=0)

    def loss(h):
        return linear_grpo_loss(h, weight, ids, old, None, mask, advantages=adv, ref_logps=ref, beta=0.04,
                                entropy=True)

    def record(r, h, step, micro_batch):
        rec.record(r, step=step, input=h, completion_ids=ids, completion_mask=mask, prompt_ids=prompt,
                   old_logps=old, ref_logps=ref, micro_batch=micro_batch)

    ms = {k: [] for k in ("op", "bwd", "record_host", "record", "bwd_recorded", "flush", "write")}
    for step in range(1, args.steps + 1):
        for micro_batch, recorded in enumerate((False, True)):
            h = torch.randn(B, T, H, device=dev, generator=g).to(dtype).requires_grad_(True)
            _sync(dev)
            t0 = time.perf_counter()
            r = loss(h)
            _sync(dev)
            t1 = time.perf_counter()
            if recorded:
                record(r, h, step, micro_batch)
                t_host = time.perf_counter()
                _sync(dev)
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            r.loss.backward()
            _sync(dev)
            t4 = time.perf_counter()
            if step > 2:
                ms["bwd_recorded" if recorded else "bwd"].append(t4 - t3)
                if recorded:
                    ms["record_host"].append(t_host - t1)
                    ms["record"].append(t2 - t1)
                else:
                    ms["op"].append(t1 - t0)
            weight.grad = None
        t5 = time.perf_counter()
        rec.flush(wait=False)
        t6 = time.perf_counter()
        rec.flush()  # nothing left to hand off: waits for the background write
        if step > 2:
            ms["flush"].append(t6 - t5)
            ms["write"].append(time.perf_counter() - t5)
    med = {k: statistics.median(v) * 1e3 for k, v in ms.items()}
    print(f"{B} x {T} tokens, H {H}, V {V}, {dtype}, {dev}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
          + " ms (medians)")
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        h = torch.randn(B, T, H, device=dev, generator=g).to(dtype).requires_grad_(True)
        r = loss(h)
        _sync(dev)
        with torch.profiler.profile(activities=activities) as prof:
            record(r, h, args.steps + 1, 0)
            r.loss.backward()
            _sync(dev)
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=50))


def layers(args) -> None:
    from benchmark_trl_step import MODELS
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_core.digest import RowDigests, module_digests
    from grpo_core.integrations.trl_run import layer_modules

    if args.layers not in MODELS:
        raise SystemExit(f"--layers: expected one of {', '.join(MODELS)}, got {args.layers!r}")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with dev:
        model = Qwen2ForCausalLM(Qwen2Config(**MODELS[args.layers], use_sliding_window=False)).to(dtype)
    B, T = (8, 256) if not args.tiny else (2, 16)
    ids = torch.randint(3, model.config.vocab_size, (B, T), device=dev)
    mask = torch.ones(B, T, dtype=torch.long, device=dev)
    mask[::2, -40:] = 0  # completions that ended early
    modules = layer_modules(model)

    def step(digested: bool) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        with module_digests(modules, mask) if digested else contextlib.nullcontext():
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden.float().square().mean().backward()
        _sync(dev)
        return time.perf_counter() - t0

    outs = []
    handles = [m.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
               for m in modules.values()]
    with torch.no_grad():
        model.model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    ms = {k: [] for k in ("plain", "digests", "digest_only")}
    for i in range(args.steps + 2):
        for digested in (False, True) if i % 2 else (True, False):
            t = step(digested)
            if i >= 2:
                ms["digests" if digested else "plain"].append(t)
        model.zero_grad(set_to_none=True)
        _sync(dev)
        t0 = time.perf_counter()
        rows = RowDigests(mask, dev)
        for o in outs:
            rows(o)
        _sync(dev)
        if i >= 2:
            ms["digest_only"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in ms.items()}
    print(f"{args.layers} backbone, {B} x {T} tokens, {len(modules)} modules digested, {dtype}, {dev}: "
          + ", ".join(f"{k} {v:.3f}" for k, v in med.items()) + f" ms (medians of {args.steps}); digests - plain "
          f"{med['digests'] - med['plain']:.3f} ms")


if __name__ == "__main__":
    main()
