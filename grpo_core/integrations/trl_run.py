"""What `GRPOCoreTrainer` records of a whole run beyond the loss, and how it replays one: the run's description (the
configuration that changes numbers, the model's config and a digest of its weights at step 0, the tokenizer, the
prompts, the library versions), the sampler's log-probs of `generate`, the modules whose outputs are digested per
layer, and a recorded run's completions served again in place of sampling (`Replay`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..rollouts import read_rollouts

# GRPOConfig fields that change no number (where and how a run reports, saves and evaluates): left out of the run's
# description, so that two runs differ in it only by what can move a bit.
_NOT_NUMERIC = ("output_dir", "logging_", "log_", "report_to", "run_name", "save_", "hub_", "push_to_hub",
                "disable_tqdm", "eval_", "per_device_eval_batch_size", "num_completions_to_print", "wandb_",
                "trackio_", "project", "overwrite_output_dir", "resume_from_checkpoint", "dataloader_num_workers",
                "dataloader_persistent_workers", "dataloader_prefetch_factor", "do_eval", "do_predict", "do_train",
                "prediction_loss_only", "metric_for_best_model", "load_best_model_at_end", "greater_is_better",
                "skip_memory_metrics", "include_num_input_tokens_seen", "print_", "num_generations_eval", "deepspeed",
                "vllm_server_")
# What a replayed run must share with the recorded one (the run's description's keys), and what each is called.
REPLAY_MUST_MATCH = {"tokenizer_digest": "tokenizer", "model_config": "model", "weights_digest": "weights at step 0",
                     "prompts_digest": "prompt set", "generation_batch_size": "generation batch (all processes)",
                     "num_generations": "completions per prompt", "reward_functions": "reward functions"}
VERSIONS = ("torch", "triton", "transformers", "trl", "accelerate", "datasets", "tokenizers")


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str, sort_keys=True))


def _blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def weights_digest(model: torch.nn.Module) -> str:
    """BLAKE2b-128 of every parameter's name, dtype, shape and bytes, in `named_parameters` order (one at a time on
    the host)."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():
        t = p.detach().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def versions() -> dict[str, str | None]:
    out = {}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def generation_steps(max_steps: int, grad_accum: int, generate_every: int) -> list[int]:
    """The optimizer steps at which TRL generates in a run of `max_steps` (its micro-step k generates when
    k % generate_every == 0, and belongs to step k // grad_accum + 1)."""
    return sorted({k // grad_accum + 1 for k in range(0, max_steps * grad_accum, generate_every)})


def run_description(trainer, reproducible: bool) -> dict[str, Any]:
    """The run as the recorder stores it in every file (`metadata`): its layout, the GRPOConfig fields that change
    numbers, the model's config and weights at step 0, the tokenizer, the prompts, the versions. No path: two runs
    that differ only in where they read or write are the same run."""
    a, acc = trainer.args, trainer.accelerator
    unwrapped = acc.unwrap_model(trainer.model)
    config = {k: v for k, v in a.to_dict().items() if not k.startswith(_NOT_NUMERIC)}
    model_config = unwrapped.config.to_dict()
    for k in ("_name_or_path", "transformers_version"):
        model_config.pop(k, None)
    tokenizer = trainer._tokenizer
    vocab = sorted(tokenizer.get_vocab().items())
    prompts = None
    dataset = trainer.train_dataset
    if dataset is not None and hasattr(dataset, "column_names") and "prompt" in (dataset.column_names or ()):
        prompts = _blake(json.dumps(list(dataset["prompt"]), default=str, sort_keys=True).encode())
    return _jsonable({
        "trainer": "GRPOCoreTrainer", "world_size": acc.num_processes,
        "gradient_accumulation_steps": a.gradient_accumulation_steps,
        "per_device_train_batch_size": a.per_device_train_batch_size, "steps_per_generation": a.steps_per_generation,
        "num_iterations": trainer.num_iterations, "num_generations": trainer.num_generations,
        "generation_batch_size": a.per_device_train_batch_size * a.steps_per_generation * acc.num_processes,
        "loss_type": trainer.loss_type, "beta": trainer.beta, "seed": a.seed, "reproducible": reproducible,
        "reward_functions": list(trainer.reward_func_names), "config": config, "model_config": model_config,
        "weights_digest": weights_digest(unwrapped),
        "tokenizer_digest": _blake(json.dumps([vocab, tokenizer.all_special_ids]).encode()),
        "prompts_digest": prompts, "versions": versions()})


def layer_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules whose outputs `record_layers` digests, in the order they run: the input embedding, each decoder
    layer (the model's one ModuleList of `num_hidden_layers` modules) and the final norm when there is one, named as
    in `model.named_modules()`."""
    names = {id(m): n for n, m in model.named_modules()}
    count = model.config.get_text_config().num_hidden_layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if len(lists) != 1:
        raise ValueError(f"record_layers: expected a model with one ModuleList of its {count} decoder layers, got "
                         f"{len(lists)} such lists in {type(model).__name__}")
    out = {names[id(model.get_input_embeddings())]: model.get_input_embeddings()}
    out.update({names[id(m)]: m for m in lists[0]})
    norm = getattr(model.base_model, "norm", None)
    if isinstance(norm, torch.nn.Module):
        out[names[id(norm)]] = norm
    return out


class SamplerLogps:
    """The sampler's log-prob of each token `generate` samples: hooks on the model (its forward's `input_ids` are the
    tokens sampled at the step before) and on its output embeddings (the last position's logits, whose log-softmax at
    `temperature` is kept for one step). The log-probs are those of the whole temperature-scaled distribution, the one
    the trainer scores: the rest of what `generate` applies to the logits (top-k, top-p and min-p truncation, which
    renormalize over the kept tokens; a repetition penalty) is not applied to them."""

    def __init__(self, model: torch.nn.Module, temperature: float):
        self.model, self.temperature = model, float(temperature)
        self.picked: list[torch.Tensor] = []
        self.pending: torch.Tensor | None = None

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.pending is not None and ids is not None:
            self.picked.append(self.pending.gather(1, ids[:, -1:].to(self.pending.device))[:, 0])
            self.pending = None

    def _head(self, module, args, output):
        self.pending = torch.log_softmax(output[:, -1].float() / self.temperature, dim=-1)

    @contextlib.contextmanager
    def capture(self) -> Iterator[SamplerLogps]:
        handles = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                   self.model.get_output_embeddings().register_forward_hook(self._head)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def of(self, completion_ids: list[list[int]]) -> list[np.ndarray]:
        """Each completion's log-probs, float32. The last sampled token's come from the distribution still pending
        (a row that ended earlier gathers its own last token there, a pick its length cuts off)."""
        if self.pending is not None and completion_ids:
            last = torch.tensor([c[-1] for c in completion_ids], device=self.pending.device)
            self.picked.append(self.pending.gather(1, last[:, None])[:, 0])
        table = torch.stack(self.picked, 1).cpu().numpy() if self.picked else np.zeros((len(completion_ids), 0))
        self.picked, self.pending = [], None
        return [row[:len(c)].astype(np.float32) for row, c in zip(table, completion_ids)]


class Replay:
    """A recorded run's generations, served in place of sampling. Checked before training starts against this run's
    description (`REPLAY_MUST_MATCH`) and the optimizer steps it will generate at; each served prompt is checked
    against the recorded one at its place in the generation batch."""

    def __init__(self, folder: str, description: dict[str, Any], steps: list[int] | None):
        if not Path(folder).is_dir():
            raise ValueError(f"replay_from: expected the folder of a run recorded with GRPOCoreTrainer(record_dir=), "
                             f"got {folder}, which does not exist")
        try:
            self.steps = read_rollouts(folder)
        except ValueError as exc:
            raise ValueError(f"replay_from: {exc}") from None
        if not self.steps:
            raise ValueError(f"replay_from: expected a run recorded with GRPOCoreTrainer(record_dir=) (its "
                             f"rank-*/rollout-*.parquet files), got {folder}, which has none")
        self.folder = folder
        recorded = next(iter(self.steps.values()))[0]["meta"]["metadata"]
        differ = []
        for key, what in REPLAY_MUST_MATCH.items():
            mine, theirs = description.get(key), recorded.get(key)
            if mine != theirs:
                if isinstance(mine, dict) and isinstance(theirs, dict):
                    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                    differ.append(f"{what} ({', '.join(f'{k}: {theirs.get(k)!r} recorded, {mine.get(k)!r} here' for k in keys[:4])})")
                elif key.endswith("_digest"):
                    differ.append(f"{what} (digest {theirs} recorded, {mine} here)")
                else:
                    differ.append(f"{what} ({theirs!r} recorded, {mine!r} here)")
        if differ:
            raise ValueError(f"replay_from: expected a run with this one's {', '.join(REPLAY_MUST_MATCH.values())}, "
                             f"got {folder}, which differs in: " + "; ".join(differ))
        size = description["generation_batch_size"]
        for step, rows in self.steps.items():
            if [r["position"] for r in rows] != list(range(size)):
                raise ValueError(f"replay_from: expected positions 0..{size - 1} of step {step}'s generation batch in "
                                 f"{folder}, got {len(rows)} rows (a rank's rollout-{step:07d}.parquet is missing?)")
        missing = sorted(set(steps or ()) - set(self.steps))
        if missing:
            raise ValueError(f"replay_from: expected a rollout for every step this run generates at ({_few(steps)}), "
                             f"got {folder} without step {_few(missing)} (it holds {_few(sorted(self.steps))})")

    def rows(self, step: int, positions: list[int], prompt_ids: list[list[int]]) -> list[dict[str, Any]]:
        """The recorded rows at `positions` of `step`'s generation, their prompts checked against `prompt_ids`."""
        if step not in self.steps:
            raise ValueError(f"replay_from: expected a rollout of step {step} in {self.folder}, got steps "
                             f"{_few(sorted(self.steps))}")
        rows = [self.steps[step][p] for p in positions]
        for row, prompt in zip(rows, prompt_ids):
            if row["prompt_ids"] != list(prompt):
                raise ValueError(f"replay_from: expected step {step}'s prompt at position {row['position']} to be the "
                                 f"recorded one ({len(row['prompt_ids'])} tokens), got another ({len(prompt)} tokens): "
                                 f"the prompts come in another order")
        return rows

    def rewards(self, step: int) -> np.ndarray:
        """`[generation batch, reward functions]` float32: the recorded rewards of `step`'s generation, all ranks."""
        return np.stack([r["rewards"] for r in self.steps[step]])

    def rng(self, step: int, rank: int, world: int) -> dict[str, str] | None:
        """The generators' states that rank `rank` had after `step`'s generation, when the recorded run had this
        world size (other layouts draw other numbers anyway)."""
        rows = [r for r in self.steps[step] if r["rank"] == rank]
        if not rows or rows[0]["meta"]["metadata"].get("world_size") != world:
            return None
        return rows[0]["meta"].get("rng")


def _few(items: list) -> str:
    return ", ".join(map(str, items[:8])) + (f" ... ({len(items)} in all)" if len(items) > 8 else "")
