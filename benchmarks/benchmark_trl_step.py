"""TRL's `GRPOTrainer` (its own loss) against `GRPOCoreTrainer` on Qwen2-shaped models: the optimizer step's time,
the loss stage's time, peak memory and the logged curves, step by step.

    python benchmarks/benchmark_trl_step.py                          # Qwen2.5-0.5B and 1.5B shapes, both trainers
    python benchmarks/benchmark_trl_step.py --trainers ours,ours_rec --record-dir /tmp/rec   # the recorder's cost
    python benchmarks/benchmark_trl_step.py --tiny                   # a 2-layer model on the CPU, end to end
    python benchmarks/benchmark_trl_step.py --models 0.5b --steps 4 --profile-dir /tmp/prof   # where the time goes

Nothing is downloaded: each model is a `Qwen2ForCausalLM` built from its config with random weights (seeded), saved
in bf16 with a WordLevel tokenizer (3 specials, the letters, fillers up to the vocabulary) to a temporary folder that
both trainers load, the reference model too. Prompts are random letters, one token each, `--prompt-length` long. A
random model's next token is near uniform over the vocabulary, so EOS (one token in 151936) is rare and completions
run to `--completion-length`. Reward: the mean of `id % 7` over the completion (it varies within a group). Both
trainers get the same seed and `GRPOConfig` (TRL's defaults otherwise: AdamW, lr 1e-6, gradient checkpointing on,
sampling at temperature 1), so they see the same completions (checked: a digest of each generation's ids).

One generation batch is `--prompts` x `--num-generations` completions; TRL splits it into micro-batches of
`--per-device` (`steps_per_generation` = prompts x generations / per-device) and passes over it `--num-iterations`
times; `--grad-accum` micro-batches make an optimizer step. The defaults (8 x 8, 8, 2, 5) make 20 steps of one
generation; with `num_iterations` > 1 TRL computes the old log-probs, so ratios move off 1 and tokens get clipped.

Measured per optimizer step (a `TrainerCallback`, synchronized at its begin and end):
- `step_ms`: wall time of the step (its micro-batches' forward and backward, the gradient clipping, the optimizer
  step) minus the time inside `_generate_and_score_completions`. That time is split into `sample_ms` (`_generate`:
  tokenizing and `model.generate`) and `score_ms` (the rest: the old and reference log-prob forwards, the rewards,
  the advantages); the method is synchronized before and after, and it runs inside the step that needs a generation.
- CUDA events, summed over the step's micro-batches:
  - `loss_fwd_ms`: from the backbone's return inside `_compute_loss` (a forward hook on `model.base_model`) to
    `_compute_loss`'s return. TRL: the slicing and masking of the hidden states, its chunked LM head
    (`_ChunkedLogProbFunction`: the log-probs and entropies) and its GRPO loss, with the metrics it logs there (their
    `.item()` syncs). Ours: the slicing, `GRPOLinearLoss.result` (the fused LM head and the GRPO loss), the
    metrics it logs. The same region in both.
  - `loss_op_ms`: the op alone: TRL's `_ChunkedLogProbFunction.apply` (the LM head's log-probs and entropies,
    no GRPO term), ours `GRPOLinearLoss.result` (LM head and GRPO loss).
  - `loss_bwd_ms`: from the gradient of `_compute_loss`'s result (a tensor hook) to the gradient of the backbone's
    last hidden states (a tensor hook): the backward of the loss stage (the LM head's dH and dW included).
- `peak_mib`: `torch.cuda.max_memory_allocated`, reset at the step's begin (models, optimizer states, activations;
  a step with a generation includes the generation's).
- the logged `loss`, `kl`, `entropy`, clip ratio, `grad_norm` and (steps with a generation) `reward`.

`--profile-dir`: step `--profile-step` of each trainer runs under torch.profiler (its Chrome trace written there), and
the loss stage's forward is summarized per micro-batch: the host's time in it, the device's span from its first
kernel to its last, the time no kernel ran in that span, and the kernels that took the most. That step's row is
slower than the others (the profiler's own cost): profile in a run of its own.

Rows (one per model x trainer x step, with the configuration, the torch settings and the provenance) append to
`--out` (default `results/trl_step.parquet`). The summary prints medians over the steps without a generation, past
the first step (compilation), and the largest difference of each logged value against the first trainer listed:
the trainers agree to bf16 rounding, not bitwise (reported, not asserted).

Trainers: `trl`, `ours` (`GRPOCoreTrainer`), `ours_rec` (`GRPOCoreTrainer(record_dir=<--record-dir>/<model>)`, the
recorder's per-step run tables: `python -m harness diff A/<model> B/<model>` compares two runs).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.metadata
import inspect
import os
import random
import statistics
import string
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")  # read when huggingface_hub is imported: never reach the hub
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore", category=FutureWarning)  # TRL 1.16 calls transformers 5.24's deprecated names

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, append, markdown, provenance  # noqa: E402

MODELS = {  # Qwen2.5's shapes (tied embeddings); `tiny` for the CPU
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
DEFAULTS = dict(models="0.5b,1.5b", steps=20, completion_length=512, prompt_length=128, prompts=8,
                num_generations=8, per_device=8, grad_accum=2, num_iterations=5,
                out=str(RESULTS / "trl_step.parquet"))
TINY = dict(models="tiny", steps=4, completion_length=16, prompt_length=8, prompts=4, num_generations=4,
            per_device=4, grad_accum=2, num_iterations=1,  # 2 generations of 2 steps
            out=str(Path(tempfile.gettempdir()) / "trl_step_tiny.parquet"))
TRAINERS = ("trl", "ours", "ours_rec")
LOGGED = ("loss", "kl", "entropy", "clip_ratio/region_mean", "grad_norm", "reward")
PAD, EOS = 0, 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (hidden 64, vocabulary 512), 4 steps of "
                                                       "short completions: the whole script on the CPU")
    p.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default {DEFAULTS['models']})")
    p.add_argument("--trainers", default="trl,ours", help=f"comma-separated, of {', '.join(TRAINERS)}")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {DEFAULTS['steps']})")
    p.add_argument("--completion-length", type=int, help=f"default {DEFAULTS['completion_length']}")
    p.add_argument("--prompt-length", type=int, help=f"tokens (default {DEFAULTS['prompt_length']})")
    p.add_argument("--prompts", type=int, help=f"prompts per generation (default {DEFAULTS['prompts']})")
    p.add_argument("--num-generations", type=int, help=f"completions per prompt (default "
                                                        f"{DEFAULTS['num_generations']})")
    p.add_argument("--per-device", type=int, help=f"per_device_train_batch_size (default {DEFAULTS['per_device']})")
    p.add_argument("--grad-accum", type=int, help=f"gradient_accumulation_steps (default {DEFAULTS['grad_accum']})")
    p.add_argument("--num-iterations", type=int, help=f"passes over each generation (default "
                                                       f"{DEFAULTS['num_iterations']})")
    p.add_argument("--loss-type", default=None, help="GRPOConfig's loss_type (default TRL's: dapo)")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-gradient-checkpointing", action="store_true", help="TRL's default is on")
    p.add_argument("--deterministic", choices=("off", "warn", "on"), default="off",
                   help="torch.use_deterministic_algorithms (warn: warn_only=True), with CUBLAS_WORKSPACE_CONFIG")
    p.add_argument("--record-dir", help="the `ours_rec` trainer's record_dir (a folder per model under it)")
    p.add_argument("--reproducible", action="store_true", help="GRPOCoreTrainer(reproducible=True) for ours and "
                                                               "ours_rec (process-wide: trainers after it run so too)")
    p.add_argument("--record-layers", action="store_true", help="ours_rec with record_layers=True")
    p.add_argument("--record-sampler", action="store_true", help="ours_rec with record_sampler=True")
    p.add_argument("--exact-on-policy", action="store_true", help="GRPOCoreTrainer(exact_on_policy=True) for ours and "
                                                                  "ours_rec")
    p.add_argument("--replay-from", help="ours and ours_rec replay this recorded run (a folder per model under it)")
    p.add_argument("--profile-dir", help="profile one optimizer step of each trainer (torch.profiler): a Chrome trace "
                   "per model and trainer in this folder, and the loss stage's GPU time printed")
    p.add_argument("--profile-step", type=int, help="the optimizer step --profile-dir profiles (default 3)")
    p.add_argument("--out", help=f"Parquet table the rows append to (default {DEFAULTS['out']}; --tiny: "
                                 f"{TINY['out']})")
    args = p.parse_args()
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.models = [m for m in args.models.split(",") if m]
    args.trainers = [t for t in args.trainers.split(",") if t]
    if not args.models or set(args.models) - set(MODELS):
        p.error(f"--models: expected names of {', '.join(MODELS)}, got {','.join(args.models)!r}")
    if not args.trainers or set(args.trainers) - set(TRAINERS) or len(set(args.trainers)) < len(args.trainers):
        p.error(f"--trainers: expected distinct names of {', '.join(TRAINERS)}, got {','.join(args.trainers)!r}")
    if ("ours_rec" in args.trainers) != (args.record_dir is not None):
        p.error(f"--record-dir: expected with --trainers including ours_rec and only then, got "
                f"{args.record_dir!r} with --trainers {','.join(args.trainers)}")
    if (args.record_layers or args.record_sampler) and "ours_rec" not in args.trainers:
        p.error("--record-layers / --record-sampler: expected --trainers including ours_rec, got "
                f"{','.join(args.trainers)}")
    if args.replay_from is not None and "trl" in args.trainers:
        p.error(f"--replay-from: expected --trainers without trl (TRL's trainer does not replay), got "
                f"{','.join(args.trainers)}")
    for name in ("steps", "completion_length", "prompt_length", "prompts", "num_generations", "per_device",
                 "grad_accum", "num_iterations"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.profile_step is not None and args.profile_dir is None:
        p.error(f"--profile-step: expected with --profile-dir only, got {args.profile_step} without it")
    args.profile_step = 3 if args.profile_step is None else args.profile_step
    if args.profile_dir is not None and not 1 <= args.profile_step <= args.steps:
        p.error(f"--profile-step: expected a step from 1 to --steps ({args.steps}), got {args.profile_step}")
    batch = args.prompts * args.num_generations
    if batch % args.per_device:
        p.error(f"--per-device: expected a divisor of prompts x num_generations ({batch}), got {args.per_device}")
    args.steps_per_generation = batch // args.per_device
    return args


def torch_settings(mode: str) -> dict:
    """TF32 off for matmuls and cuDNN; deterministic algorithms per `mode`. Returns what is in force."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if mode != "off":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before the first cuBLAS handle (no CUDA call yet)
        torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    return {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "deterministic": mode, "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
            "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}


def build_model(name: str, path: Path, seed: int, device: str) -> None:
    """A random-weight Qwen2 of `MODELS[name]`'s shape in bf16 and a one-token-per-letter tokenizer, saved to `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    shape = MODELS[name]
    words = ["<pad>", "<eos>", "<unk>", *string.ascii_letters]
    words += [f"<t{i}>" for i in range(shape["vocab_size"] - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    config = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, use_sliding_window=False, pad_token_id=PAD, eos_token_id=EOS,
                         bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    del model


def reward(completions, completion_ids, **kwargs) -> list[float]:
    return [sum(i % 7 for i in ids) / max(len(ids), 1) for ids in completion_ids]


class Probe:
    """Timing marks (CUDA events, or `perf_counter` on the CPU) and one row per optimizer step."""

    def __init__(self, cuda: bool):
        self.cuda, self.in_loss, self.rows, self.digests = cuda, False, [], []
        self.profiler = self.region = None
        self.marks: dict[str, list] = defaultdict(list)
        self.wall_ms: dict[str, float] = defaultdict(float)

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name].append(event)
        else:
            self.marks[name].append(time.perf_counter())

    def hook(self, name: str):
        return lambda grad: self.mark(name)  # returns None: the gradient is unchanged

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def wall(self, name: str):
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.wall_ms[name] += (time.perf_counter() - start) * 1e3

    def span_ms(self, name: str) -> float:
        starts, ends = self.marks[f"{name}_start"], self.marks[f"{name}_end"]
        if len(starts) != len(ends):
            raise RuntimeError(f"{name}: {len(starts)} start marks against {len(ends)} end marks in one step")
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in zip(starts, ends))
        return sum(e - s for s, e in zip(starts, ends)) * 1e3

    def begin_step(self) -> None:
        self.sync()
        self.marks.clear()
        self.wall_ms.clear()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def end_step(self, step: int) -> None:
        self.sync()
        wall = (time.perf_counter() - self.t0) * 1e3
        generation, sample = self.wall_ms["generation"], self.wall_ms["sample"]
        self.rows.append(dict(
            step=step, generation=generation > 0, micro_batches=len(self.marks["loss_fwd_end"]),
            step_ms=wall - generation, sample_ms=sample, score_ms=generation - sample,
            loss_fwd_ms=self.span_ms("loss_fwd"), loss_op_ms=self.span_ms("loss_op"),
            loss_bwd_ms=self.span_ms("loss_bwd"),
            peak_mib=torch.cuda.max_memory_allocated() / 2**20 if self.cuda else float("nan")))


def probed(base: type) -> type:
    """`base` with its generation timed and its loss stage marked (see the module docstring)."""

    class Probed(base):
        def _generate(self, prompts):
            with self.probe.wall("sample"):
                return super()._generate(prompts)

        def _generate_and_score_completions(self, inputs):
            with self.probe.wall("generation"):
                out = super()._generate_and_score_completions(inputs)
            ids = (out["completion_ids"] * out["completion_mask"]).cpu().numpy()
            self.probe.digests.append(hashlib.sha256(ids.tobytes()).hexdigest()[:16])
            return out

        def _compute_loss(self, model, inputs):
            self.probe.in_loss = True
            try:
                loss = super()._compute_loss(model, inputs)
            finally:
                self.probe.in_loss = False
            self.probe.mark("loss_fwd_end")
            if self.probe.region is not None:
                self.probe.region.__exit__(None, None, None)
                self.probe.region = None
            loss.register_hook(self.probe.hook("loss_bwd_start"))
            return loss

    Probed.__name__ = Probed.__qualname__ = f"Probed{base.__name__}"
    return Probed


@contextmanager
def instrumented(trainer, probe: Probe, profile: tuple[int, str] | None = None):
    """The backbone's forward hook (loss stage start, and the hidden states' gradient hook), the op marks, the step
    callback; `profile`: `(step, trace path)`, that step under torch.profiler with the loss stage's forward marked."""
    import trl.trainer.utils as trl_utils
    from transformers import TrainerCallback

    def backbone_done(module, args, output):
        if probe.in_loss:
            probe.mark("loss_fwd_start")
            if probe.profiler is not None:
                probe.region = torch.profiler.record_function("loss_fwd")
                probe.region.__enter__()
            output.last_hidden_state.register_hook(probe.hook("loss_bwd_end"))

    def timed(fn):
        def run(*args, **kwargs):
            if not probe.in_loss:
                return fn(*args, **kwargs)
            probe.mark("loss_op_start")
            out = fn(*args, **kwargs)
            probe.mark("loss_op_end")
            return out
        return run

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if profile is not None and state.global_step + 1 == profile[0]:
                activities = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if probe.cuda else [])
                probe.profiler = torch.profiler.profile(activities=activities)
                probe.profiler.__enter__()
            probe.begin_step()

        def on_step_end(self, args, state, control, **kwargs):
            probe.end_step(state.global_step)
            if probe.profiler is not None:
                probe.profiler.__exit__(None, None, None)
                probe.profiler.export_chrome_trace(profile[1])
                print(profile_text(profile[1]), flush=True)
                probe.profiler = None

    handle = trainer.accelerator.unwrap_model(trainer.model).base_model.register_forward_hook(backbone_done)
    head = trl_utils._ChunkedLogProbFunction  # TRL's fused LM head, looked up at each call of the patched forward
    trl_utils._ChunkedLogProbFunction = type("TimedHead", (), {"apply": staticmethod(timed(head.apply))})
    if hasattr(trainer, "grpo_core_loss"):
        trainer.grpo_core_loss.result = timed(trainer.grpo_core_loss.result)
    trainer.add_callback(Steps())
    try:
        yield
    finally:
        handle.remove()
        trl_utils._ChunkedLogProbFunction = head


def run(kind: str, model: str, path: Path, args, cuda: bool) -> tuple[list[dict], list[str]]:
    """Trains `args.steps` optimizer steps with one trainer; returns its step rows and generation digests."""
    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, PrinterCallback

    from grpo_core.integrations.trl import GRPOCoreTrainer

    base = trl.GRPOTrainer if kind == "trl" else GRPOCoreTrainer
    extra = {}
    if kind == "ours_rec":
        extra = {"record_dir": str(Path(args.record_dir) / model), "record_layers": args.record_layers,
                 "record_sampler": args.record_sampler}
    if kind != "trl":
        extra["reproducible"] = args.reproducible
        extra["exact_on_policy"] = args.exact_on_policy
        if args.replay_from is not None:
            extra["replay_from"] = str(Path(args.replay_from) / model)
    rng = random.Random(args.seed)
    generations = -(-args.steps * args.grad_accum // (args.steps_per_generation * args.num_iterations))
    prompts = ["".join(rng.choices(string.ascii_lowercase, k=args.prompt_length))
               for _ in range(args.prompts * generations)]
    options = {} if args.loss_type is None else {"loss_type": args.loss_type}
    with tempfile.TemporaryDirectory() as out_dir:
        config = trl.GRPOConfig(
            output_dir=out_dir, use_cpu=not cuda, bf16=True, seed=args.seed, report_to="none", save_strategy="no",
            disable_tqdm=True, logging_steps=1, max_steps=args.steps, per_device_train_batch_size=args.per_device,
            gradient_accumulation_steps=args.grad_accum, steps_per_generation=args.steps_per_generation,
            num_generations=args.num_generations, num_iterations=args.num_iterations,
            max_completion_length=args.completion_length, beta=args.beta,
            gradient_checkpointing=not args.no_gradient_checkpointing,
            model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa"}, **options)
        trainer = probed(base)(model=str(path), reward_funcs=reward, args=config,
                               train_dataset=Dataset.from_dict({"prompt": prompts}),
                               processing_class=PreTrainedTokenizerFast.from_pretrained(path), **extra)
        trainer.probe = probe = Probe(cuda)
        trainer.remove_callback(PrinterCallback)  # the log lines: the rows hold them
        profile = None
        if args.profile_dir is not None:
            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
            profile = (args.profile_step, str(Path(args.profile_dir) / f"{model}_{kind}.json"))
        with instrumented(trainer, probe, profile):
            trainer.train()
        logs = {r["step"]: r for r in trainer.state.log_history if "loss" in r}
        resolved = dict(loss_type=trainer.loss_type, lr=config.learning_rate, optim=str(config.optim),
                        use_bias_correction_kl=config.use_bias_correction_kl, temperature=config.temperature)
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    for row in probe.rows:
        row.update(model=model, trainer=kind, **resolved,
                   **{key: float(logs.get(row["step"], {}).get(key, float("nan"))) for key in LOGGED})
    return probe.rows, probe.digests


def profile_text(path: str) -> str:
    """The profiled step's loss stage forward (its `loss_fwd` ranges, one a micro-batch) from its Chrome trace: per
    range, the device's span from the first kernel launched in it to the last one's end, and the time no kernel ran
    in that span; the host syncs in the ranges, and the kernels that took the most time."""
    import json

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "user_annotation"
                    and e.get("name") == "loss_fwd")
    where = lambda e: next((i for i, (a, b) in enumerate(ranges) if a <= e["ts"] <= b), None)  # noqa: E731
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and where(e) is not None]
    launched = {e["args"]["correlation"]: where(e) for e in runtime if "correlation" in e.get("args", {})}
    syncs = sum(1 for e in runtime if "Synchronize" in e["name"] or e["name"].startswith("cudaMemcpy"))
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                      and e.get("args", {}).get("correlation") in launched), key=lambda e: e["ts"])
    span = busy = 0.0
    by: dict = defaultdict(lambda: [0, 0.0])
    for i in range(len(ranges)):
        mine = [e for e in kernels if launched[e["args"]["correlation"]] == i]
        end = float("-inf")
        for e in mine:
            busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
            end = max(end, e["ts"] + e["dur"])
            by[e["name"][:100]][0] += 1
            by[e["name"][:100]][1] += e["dur"]
        span += end - mine[0]["ts"] if mine else 0.0
    host = sum(b - a for a, b in ranges)
    lines = [f"profile {path}: the loss stage's forward, {len(ranges)} ranges: host {host / 1e3:.2f} ms; device span "
             f"{span / 1e3:.2f} ms, kernels {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms; {len(kernels)} "
             f"kernels, {syncs} host syncs or copies"]
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:15]
    lines += [f"  {us / 1e3:8.3f} ms {n:5d} x {name}" for name, (n, us) in top]
    return "\n".join(lines)


def median(rows: list[dict], key: str) -> float:
    steady = [r[key] for r in rows if not r["generation"] and r["step"] > 1] or [r[key] for r in rows]
    return statistics.median(steady)


def summarize(rows: list[dict], digests: dict, trainers: list[str]) -> None:
    summary, agreement = [], []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {t: [r for r in rows if r["model"] == model and r["trainer"] == t] for t in trainers}
        first = by[trainers[0]]
        for t in trainers:
            r = by[t]
            summary.append(dict(
                model=model, trainer=t, steps=len(r), step_ms=median(r, "step_ms"),
                vs_first=median(r, "step_ms") / median(first, "step_ms"), loss_fwd_ms=median(r, "loss_fwd_ms"),
                loss_bwd_ms=median(r, "loss_bwd_ms"), loss_op_ms=median(r, "loss_op_ms"),
                peak_gib=max((x["peak_mib"] for x in r if not x["generation"]), default=float("nan")) / 1024,
                peak_gen_gib=max(x["peak_mib"] for x in r) / 1024,
                sample_s=sum(x["sample_ms"] for x in r) / 1e3, score_s=sum(x["score_ms"] for x in r) / 1e3))
            if t == trainers[0]:
                continue
            same = digests[(model, t)] == digests[(model, trainers[0])]
            for key in LOGGED:
                pairs = [(a[key], b[key], a["step"]) for a, b in zip(first, r) if a[key] == a[key] and b[key] == b[key]]
                if not pairs:
                    continue
                diff, a, b, step = max((abs(a - b), a, b, s) for a, b, s in pairs)
                agreement.append(dict(model=model, trainers=f"{trainers[0]} vs {t}", key=key,
                                      max_abs_diff=f"{diff:.3e}", at_step=step, first=f"{a:.6e}", other=f"{b:.6e}",
                                      max_abs_value=f"{max(abs(a) for a, _, _ in pairs):.3e}",
                                      same_completions="yes" if same else "NO"))
    print(markdown(summary, ["model", "trainer", "steps", "step_ms", "vs_first", "loss_fwd_ms", "loss_bwd_ms",
                             "loss_op_ms", "peak_gib", "peak_gen_gib", "sample_s", "score_s"]))
    if agreement:
        print()
        print(markdown(agreement, ["model", "trainers", "key", "max_abs_diff", "at_step", "first", "other",
                                   "max_abs_value", "same_completions"]))


def print_sampler(folder: Path) -> None:
    """The sampler's log-probs against the trainer's, per step, of a run recorded with record_sampler."""
    from grpo_core.rollouts import read_rollouts
    from harness.training import sampler_mismatch, sampler_text

    m = sampler_mismatch(read_rollouts(folder))
    print(sampler_text("this run", m))
    if m is not None:
        for name in ("steps", "sequences", "tokens"):
            print(m[name].to_string(index=False, float_format=lambda v: f"{v:.4g}"), flush=True)


def versions() -> dict:
    out = {}
    for name in ("trl", "transformers", "accelerate", "datasets", "tokenizers", "huggingface_hub", "pyarrow",
                 "fsspec", "peft"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def check_record_dir() -> None:
    """`ours_rec` needs a GRPOCoreTrainer with a `record_dir` argument: refused before any model is built."""
    from grpo_core.integrations.trl import GRPOCoreTrainer

    signature = inspect.signature(GRPOCoreTrainer.__init__)
    if "record_dir" not in signature.parameters:
        raise SystemExit(f"--record-dir: expected a GRPOCoreTrainer that takes record_dir=, got one with the "
                         f"signature {signature} (grpo_core from {sys.modules['grpo_core'].__file__})")


def main() -> None:
    args = parse_args()
    if "ours_rec" in args.trainers:
        check_record_dir()
    settings = torch_settings(args.deterministic)
    cuda = torch.cuda.is_available()
    prov = {**provenance(), **versions()}
    print(f"device {prov['device']}; torch {prov['torch']}, triton {prov['triton']}, trl {prov['trl']}, "
          f"transformers {prov['transformers']}, accelerate {prov['accelerate']}, datasets {prov['datasets']}, "
          f"tokenizers {prov['tokenizers']}, huggingface_hub {prov['huggingface_hub']}, pyarrow {prov['pyarrow']}, "
          f"fsspec {prov['fsspec']}, peft {prov['peft']}; commit {prov['git_commit']}", flush=True)
    print("torch settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), flush=True)
    run_config = dict(prompts=args.prompts, num_generations=args.num_generations, per_device=args.per_device,
                      grad_accum=args.grad_accum, steps_per_generation=args.steps_per_generation,
                      num_iterations=args.num_iterations, completion_length=args.completion_length,
                      prompt_length=args.prompt_length, beta=args.beta, seed=args.seed, dtype="bf16",
                      gradient_checkpointing=not args.no_gradient_checkpointing, recorded="",
                      reproducible=args.reproducible, record_layers=args.record_layers,
                      record_sampler=args.record_sampler, replay_from=args.replay_from or "",
                      exact_on_policy=args.exact_on_policy)
    print(f"each run: {args.steps} optimizer steps of {args.grad_accum} x {args.per_device} completions; a generation "
          f"of {args.prompts} x {args.num_generations} completions of {args.completion_length} tokens (prompts of "
          f"{args.prompt_length}) every {args.steps_per_generation * args.num_iterations // args.grad_accum} steps",
          flush=True)
    rows, digests = [], {}
    for model in args.models:
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            build_model(model, Path(folder), args.seed, "cuda" if cuda else "cpu")
            print(f"{model}: built and saved in {time.perf_counter() - start:.1f} s", flush=True)
            model_rows = []
            for kind in args.trainers:
                start = time.perf_counter()
                out, digests[(model, kind)] = run(kind, model, Path(folder), args, cuda)
                recorded = str(Path(args.record_dir) / model) if kind == "ours_rec" else ""
                model_rows += [{**r, **run_config, "recorded": recorded, **settings, **prov} for r in out]
                print(f"{model} {kind}: {len(out)} steps in {time.perf_counter() - start:.1f} s, generations "
                      f"{digests[(model, kind)]}", flush=True)
                if kind == "ours_rec" and args.record_sampler:
                    print_sampler(Path(recorded))
        path = append(model_rows, args.out)  # per model: a run cut short keeps what it measured
        print(f"appended {len(model_rows)} rows to {path}", flush=True)
        rows += model_rows
    summarize(rows, digests, args.trainers)


if __name__ == "__main__":
    main()
