"""GRPO from scratch on a toy task: continue a prompt of digits with the same digits sorted.

    .nox/determinism/bin/python examples/grpo_toy.py --steps 150 --plot runs/toy/reward.png   # CPU, native
    python examples/grpo_toy.py --device cuda --backend triton    # GPU (an interpreter with torch and triton)
    .nox/determinism/bin/python examples/grpo_toy.py --contract   # the contract path (get_loss_op)

`.nox/determinism/bin/python` is the interpreter `nox -s determinism` makes (the README's "Which Python"); any
interpreter with grpo-core and torch installed runs it too. `--plot` makes the file's folder when it is missing.

Threads: one by default (`--threads`); the model is tiny, and on a shared 2-core CPU torch's default (one per core)
made each step 3-12x slower. The final line names the threads and the machine next to the step time.

A small GRU language model (plain PyTorch, random init, no downloads) samples `samples_per_prompt` completions
per prompt; each completion may stop early at EOS (a ragged completion mask). The reward is the fraction of
positions that match the sorted prompt. `old_logps` are cached at rollout, a frozen copy of the initial model is
the reference, and several optimizer steps per rollout move the ratio off 1 so that clipping engages.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

try:
    import torch
    import torch.nn as nn
except ModuleNotFoundError as exc:  # the system python3, say: one line and exit code 2, not a traceback
    print(f"grpo_toy.py: error: {exc.name}: expected an interpreter with grpo-core installed (torch), got "
          f"{sys.executable}, which lacks it; use .nox/determinism/bin/python (README, Which Python)", file=sys.stderr)
    sys.exit(2)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo_core import GRPOLossContract, kernel_registry  # noqa: E402

DIGITS, LENGTH = 5, 4
EOS, SEP = DIGITS, DIGITS + 1
VOCAB = DIGITS + 2


class TinyLM(nn.Module):
    def __init__(self, hidden: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


def completion_logits(model: nn.Module, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """Logits `[B, LENGTH, V]` that predicted each completion token (teacher forcing)."""
    seq = torch.cat([prompts, torch.full_like(prompts[:, :1], SEP), completions[:, :-1]], 1)
    return model(seq)[:, prompts.shape[1]:]


@torch.no_grad()
def rollout(model: nn.Module, prompts: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples completions token by token; after EOS the mask is off."""
    B = prompts.shape[0]
    seq = torch.cat([prompts, torch.full((B, 1), SEP, device=prompts.device)], 1)
    done = torch.zeros(B, dtype=torch.bool, device=prompts.device)
    out, mask = [], []
    for _ in range(LENGTH):
        probs = torch.softmax(model(seq)[:, -1].float(), -1)
        tok = torch.multinomial(probs.cpu(), 1, generator=g).to(prompts.device).squeeze(1)
        tok = torch.where(done, torch.full_like(tok, EOS), tok)
        mask.append(~done)
        done = done | (tok == EOS)
        out.append(tok)
        seq = torch.cat([seq, tok[:, None]], 1)
    return torch.stack(out, 1), torch.stack(mask, 1)


def rewards_for(prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    return (completions == prompts.sort(1).values).float().mean(1)


def train(*, steps: int = 150, prompts_per_step: int = 16, samples_per_prompt: int = 8, inner_steps: int = 2,
          lr: float = 3e-3, clip_eps: float = 0.2, beta: float = 0.02, normalizer: str = "global_active_tokens",
          backend: str | None = None, device: str = "cpu", seed: int = 0, contract: bool = False,
          progress: bool = True) -> list[dict]:
    """Runs GRPO and returns one record per step (reward, KL, clip fraction, seconds)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = TinyLM().to(device)
    ref_model = TinyLM().to(device)
    ref_model.load_state_dict(model.state_dict())
    ref_model.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_op = kernel_registry.get_op("grpo_loss", backend=backend)
    B = prompts_per_step * samples_per_prompt
    spec = GRPOLossContract(num_sequences=B, padded_seq_len=LENGTH, vocab_size=VOCAB, clip_eps=clip_eps, beta=beta,
                            samples_per_prompt=samples_per_prompt, normalizer=normalizer)
    dispatched = kernel_registry.get_loss_op(spec) if contract else None
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        prompts = torch.randint(0, DIGITS, (prompts_per_step, LENGTH), generator=g).to(device)
        prompts = prompts.repeat_interleave(samples_per_prompt, 0)
        completions, mask = rollout(model, prompts, g)
        rewards = rewards_for(prompts, completions)
        with torch.no_grad():
            old_logps = torch.log_softmax(completion_logits(model, prompts, completions).float(), -1).gather(
                -1, completions[..., None])[..., 0]
            ref_logits = completion_logits(ref_model, prompts, completions)
        clipped = kl_value = 0.0
        for _ in range(inner_steps):
            logits = completion_logits(model, prompts, completions)
            if dispatched is not None:
                loss, _, kl = dispatched.op.apply(logits, completions, old_logps, rewards, contract=spec,
                                                  completion_mask=mask, ref_local_logits=ref_logits)
            else:
                loss, _, kl = loss_op(logits, ref_logits, completions, old_logps, rewards, mask, clip_eps=clip_eps,
                                      beta=beta, samples_per_prompt=samples_per_prompt, normalizer=normalizer)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                logp = torch.log_softmax(logits.float(), -1).gather(-1, completions[..., None])[..., 0]
                ratio = torch.exp(logp - old_logps)[mask]
                clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).float().mean().item()
            kl_value = kl.item()
        history.append(dict(step=step, reward=rewards.mean().item(), kl=kl_value, clip_fraction=clipped,
                            seconds=time.perf_counter() - t0))
        if progress and (sys.stderr.isatty() or (step + 1) % max(1, steps // 10) == 0):
            done = (step + 1) * 30 // steps
            print(f"\r[{'#' * done:<30}] step {step + 1}/{steps} reward {history[-1]['reward']:.3f} kl {kl_value:.4f} "
                  f"clip {clipped:.3f}", end="" if sys.stderr.isatty() else "\n", file=sys.stderr, flush=True)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return history


def machine(device: str) -> str:
    """Where a step time was measured: the device, or the CPU model with its cores and torch's threads."""
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    threads = torch.get_num_threads()
    return (f"{model}, {os.cpu_count()} cores, {threads} thread{'s' if threads != 1 else ''}, "
            f"torch {torch.__version__}")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every mistake in the arguments is one line naming the argument (exit code 2), before anything runs."""
    if args.steps < 1:
        p.error(f"--steps: expected an integer >= 1, got {args.steps}")
    if args.threads < 0:
        p.error(f"--threads: expected an integer >= 0, got {args.threads}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device: expected cpu or cuda[:index], got {args.device}")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        n = torch.cuda.device_count()
        p.error(f"--device: expected cpu{f' or cuda:0 to cuda:{n - 1}' if n else ''} (torch {torch.__version__} sees "
                f"{n} CUDA device{'' if n == 1 else 's'} here), got {args.device}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu or cuda[:index], got {args.device}")
    if args.backend == "triton":
        if importlib.util.find_spec("triton") is None:
            p.error("--backend: expected native or nothing (triton is not installed here), got triton")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--backend: expected native or nothing with --device cpu (the Triton kernels need CUDA, or "
                    "TRITON_INTERPRET=1 for the CPU interpreter), got triton")
    if args.plot is not None:
        folder = Path(args.plot).resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            p.error(f"--plot: expected a file in a folder that exists or can be made, got {args.plot} (cannot make "
                    f"{folder}: {err.strerror})")
        if Path(args.plot).is_dir():
            p.error(f"--plot: expected a file, got {args.plot}, which is a folder")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2 (argparse prints its whole usage block first)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main() -> None:
    p = Parser(prog="grpo_toy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps of rollouts (default 150)")
    p.add_argument("--backend", choices=["native", "triton"], default=None, help="default: automatic")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:index] (default cpu)")
    p.add_argument("--normalizer", default="global_active_tokens",
                   choices=["global_active_tokens", "per_sequence_then_mean"], help="default global_active_tokens")
    p.add_argument("--beta", type=float, default=0.02, help="KL coefficient (default 0.02)")
    p.add_argument("--clip", type=float, default=0.2, help="clip_eps (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1; 0: torch's default, one "
                                                          "per core)")
    p.add_argument("--contract", action="store_true", help="use get_loss_op(contract) instead of get_op")
    p.add_argument("--plot", default=None, help="write the reward curve to this PNG (its folder is made if missing)")
    args = p.parse_args()
    check_args(p, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    hist = train(steps=args.steps, backend=args.backend, device=args.device, normalizer=args.normalizer,
                 beta=args.beta, clip_eps=args.clip, seed=args.seed, contract=args.contract)
    n = min(10, max(1, len(hist) // 2))  # the first and last n steps, apart when there are 2 or more
    first = sum(h["reward"] for h in hist[:n]) / n
    last = sum(h["reward"] for h in hist[-n:]) / n
    ms = 1e3 * sorted(h["seconds"] for h in hist)[len(hist) // 2]
    steps = "step" if n == 1 else f"{n} steps"
    print(f"mean reward: first {steps} {first:.3f}, last {steps} {last:.3f}; median step {ms:.1f} ms "
          f"({machine(args.device)})")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot([h["reward"] for h in hist])
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
