"""Our fused linear GRPO loss (`grpo_core.linear.linear_grpo_loss`) behind TRL's and Liger's interfaces.

`GRPOLinearLoss` is a drop-in for Liger's `LigerFusedLinearGRPOLoss` (liger-kernel 0.8.5, the module TRL's
`GRPOTrainer` built for `use_liger_kernel=True` in earlier releases): the same constructor, the same
`forward(_input, lin_weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
old_per_token_logps, ref_input, ref_weight, ref_bias, vllm_is_ratio, num_items_in_batch)` with `_input` the last
hidden states `[B, T, H]`, and the same return `(loss, metrics)`: `metrics = (kl, clip_ratio)` when `beta != 0`,
`(clip_ratio,)` otherwise, each a mean over the active tokens (cispo's clip ratio: the tokens with ratio >
epsilon_high and A > 0; sapo's and vespo's: 0; with `importance_sampling_level="sequence"` the clip ratio is a mean
over the sequences, as TRL logs it). It needs torch only.

`GRPOCoreTrainer` (needs the `trl` extra: trl 1.16) is TRL's `GRPOTrainer` training on our loss. TRL 1.16 builds no
Liger GRPO loss any more: its `_compute_loss` scores the completion tokens with its own chunked LM head
(`add_fused_lm_head`) and applies the loss to the `[B, T]` log-probabilities. The subclass overrides `_compute_loss` and
TRL's log-prob pass: it runs the backbone for the hidden states of the completion positions and hands them, with the LM
head's weight and bias, to `GRPOLinearLoss`, routed through the DDP / FSDP wrapper's forward as TRL's distillation
trainer does. TRL's old and reference log-probabilities come from the loss's own kernels (`linear_logprobs` on the same
backbone call), so on policy every ratio is exactly 1.0 and the KL against an identical reference exactly 0.0;
generation, rewards and advantages stay TRL's. On CUDA in one process the loss checks its inputs' values without a
device sync (its `check_values="deferred"`) and the trainer reads those checks before each optimizer step, so a bad
value raises before its gradients reach the weights; on more than one process each loss call checks them itself
(`"sync"`: a process must raise before DDP averages its gradients into the others'). `record_dir=` records every
micro-batch's per-sequence numbers and digests (`grpo_core.recorder`; `python -m harness diff` compares two runs). It
logs what TRL logs of the loss: `kl` (beta != 0), `entropy` (the loss's token entropies, `contract.entropy`), the clip
ratio of the loss type (`clip_ratio/region_mean`; cispo's `cispo_clip_ratio`; none for sapo and vespo, which clip
nothing), vespo's `vespo/phi_seq_mean`, and with an entropy bonus `policy_loss` and `entropy_coef`; not the low / high
clip ratios, which the loss does not compute. TRL's entropy options run as in TRL: `entropy_coef` (the bonus, a mean
over the kept tokens divided by the accumulation alone), `top_entropy_quantile` (the policy terms of the tokens below
the quantile dropped: one process only, TRL's quantile spans the processes) and `use_adaptive_entropy` (TRL's controller
and its state, checkpointed by TRL).

Loss types (TRL's semantics; each is the op's `loss_type`): grpo, bnpo, dr_grpo and dapo (the clipped surrogate
under their token normalizers); cispo (`-sg(min(ratio, epsilon_high)) * A * logp`, the ratio clamped at
`epsilon_high` itself, normalized as dapo: TRL's `num_items_in_batch`); sapo (`-sigmoid(tau * (ratio - 1)) * 4 / tau
* A`, tau `sapo_temperature_pos` where A > 0 else `sapo_temperature_neg`, normalized as grpo); luspo (the clipped
surrogate, each sequence's token sum averaged over the sequences); vespo (`-phi * A * logp`, phi the detached gamma
weight of the sequence's summed log-ratio with `vespo_k_pos` / `_lambda_pos` / `_k_neg` / `_lambda_neg`, the
importance sampling ratio in its log, normalized as dapo). As in TRL, the trainer divides the loss by the accumulation
steps except for dapo, cispo and vespo, whose normalizer holds them.

TRL's (and Liger's) loss options reach the loss: `delta` (two-sided clipping, the clipped surrogate's only: the
unclipped ratio clamped above at delta; below 1 + epsilon_high, the logged `clip_ratio/region_mean` counts the ratio
and TRL's the clamped ratio), `use_bias_correction_kl` (the k3 KL times the ratio; TRL 1.16's default) and the
vLLM importance sampling correction (Liger's `vllm_is_ratio`, TRL's `inputs["importance_sampling_ratio"]`, `[B, T]`
or `[B, 1]`, multiplied into the policy term and not into the KL; vespo takes `[B, T]` only, in its gamma weight).
The trainer takes them, and the SAPO temperatures and VESPO parameters, from its config, the ratio exactly when TRL
applies it (`use_vllm` and `vllm_importance_sampling_correction`; vespo: whenever the inputs hold it, as TRL).

`importance_sampling_level='sequence'` (GSPO: every token reads its sequence's ratio) reaches the loss too; the clip
ratio it logs is then TRL's mean over the sequences. So does `off_policy_mask_threshold` (DeepSeek-V3.2's off-policy
sequence mask, with TRL's `inputs["sampling_per_token_logps"]` when vLLM gives them, else the old log-probs).

The whole run (`grpo_core.integrations.trl_run`, `grpo_core.rollouts`, README "Verify your training run"): with
`record_dir` each generation's rollout (ids, rewards, the start of each completion's text) goes beside the step files,
and every file carries the run's description (the configuration that changes numbers, the model's config and weights
at step 0, the tokenizer, the prompts, the versions). `reproducible=True` sets what two runs of one command need to be
identical on one machine (`grpo_core.reproducible`; `full_determinism=True` too). `replay_from=` trains on a recorded
run's completions and rewards instead of sampling. `record_layers=True` digests the embedding's, each decoder layer's
and the final norm's output rows per sequence. `record_sampler=True` records the sampler's log-prob of each sampled
token beside the trainer's under the sampling weights. `exact_on_policy=True` (`grpo_core.exact`) samples and trains
under the mode in which the sampler's log-probs are the trainer's bit for bit, the sampler keyed by (generation step,
place in the generation batch) and seeded by `GRPOConfig.seed`; it refuses vLLM, continuous batching, `rollout_func`
and sampling settings that change the distribution (top-k, top-p, ...). Recording and replay refuse tools,
`rollout_func` and environments; replay refuses vLLM; `record_sampler` refuses transformers' continuous batching.

Not supported, refused with a `ValueError` naming the argument: `delta` with cispo, sapo or vespo (TRL ignores it
there: leave it None). The trainer also refuses a loss term of its own (a MoE router loss), `top_entropy_quantile`
below 1 on more than one process, logits that the model soft-caps or scales, and vision inputs.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import torch

from ..digest import module_digests
from ..exact import ExactOnPolicy, check_generation
from ..linear import linear_grpo_loss, linear_logprobs
from ..pending import raise_pending
from ..recorder import TrainingRecorder, key_of
from ..reproducible import make_reproducible
from ..result import GRPOLossResult
from ..rollouts import rng_states, set_rng_states
from . import trl_run

__all__ = ["GRPOCoreTrainer", "GRPOLinearLoss"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
BY_NUM_ITEMS = ("dapo", "cispo", "vespo")  # TRL divides them by `num_items_in_batch`, which holds the accumulation
CLIP_RATIO_KEYS = {"cispo": "cispo_clip_ratio", "sapo": None, "vespo": None}  # TRL's (default: the region's)


class GRPOLinearLoss(torch.nn.Module):
    """Liger's `LigerFusedLinearGRPOLoss` interface on `linear_grpo_loss`. `compiled` and `chunk_size` are accepted
    and ignored (the op chunks the tokens itself); the SAPO temperatures reach the loss with loss_type='sapo' only,
    the VESPO parameters with 'vespo' only. `use_ref_model=False` makes the KL term zero (Liger then compares the
    policy with itself). `result(...)` takes `forward`'s arguments and returns the op's whole `GRPOLossResult`.
    `check_values`: the op's (with the Triton kernels, "deferred" or "sync": `linear_grpo_loss`)."""

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: int | None = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: float | None = None, use_bias_correction_kl: bool = False,
                 off_policy_mask_threshold: float | None = None, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
                 entropy: bool = False, entropy_coef: float = 0.0, top_entropy_quantile: float = 1.0,
                 check_values: str = "deferred"):
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type: expected one of {', '.join(map(repr, LOSS_TYPES))}, got {loss_type!r}")
        if importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level: expected 'token' or 'sequence', got "
                             f"{importance_sampling_level!r}")
        if loss_type == "dr_grpo" and max_completion_length is None:
            raise ValueError("max_completion_length: expected an int with loss_type='dr_grpo', got None")
        if delta is not None and loss_type in ("cispo", "sapo", "vespo"):
            raise ValueError(f"delta: expected None with loss_type={loss_type!r}, got {delta!r} (two-sided clipping "
                             f"belongs to the clipped surrogate; TRL ignores it there): leave it None")
        self.beta, self.use_ref_model, self.loss_type = beta, use_ref_model, loss_type
        self.epsilon_low, self.epsilon_high, self.temperature = epsilon_low, epsilon_high, temperature
        self.max_completion_length = max_completion_length
        self.delta, self.use_bias_correction_kl = delta, use_bias_correction_kl
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.importance_sampling_level = importance_sampling_level
        self.off_policy_mask_threshold = off_policy_mask_threshold
        self.vespo_gamma = {"vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos,
                            "vespo_k_neg": vespo_k_neg, "vespo_lambda_neg": vespo_lambda_neg}
        self.entropy, self.entropy_coef, self.top_entropy_quantile = entropy, entropy_coef, top_entropy_quantile
        self.check_values = check_values

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Liger's `(loss, metrics)` of `result(...)`: `metrics = (kl, clip_ratio)` when `beta != 0`, else
        `(clip_ratio,)`."""
        result = self.result(*args, **kwargs)
        if self.beta == 0.0:
            return result.loss, (result.clip_fraction,)
        return result.loss, (result.kl_token_mean, result.clip_fraction)

    def result(self, _input: torch.Tensor, lin_weight: torch.Tensor, selected_token_ids: torch.Tensor,
                attention_mask: torch.Tensor, advantages: torch.Tensor, bias: torch.Tensor | None = None,
                ref_per_token_logps: torch.Tensor | None = None, old_per_token_logps: torch.Tensor | None = None,
                ref_input: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None,
                ref_bias: torch.Tensor | None = None, vllm_is_ratio: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | float | None = None,
                sampling_per_token_logps: torch.Tensor | None = None, entropy_coef: float | None = None
                ) -> GRPOLossResult:
        """`_input [B, T, H]`, `lin_weight [V, H]`, `selected_token_ids`, `attention_mask [B, T]`, `advantages [B]`.
        `num_items_in_batch` (dapo and cispo): the active tokens of the whole generation batch, over all processes;
        the loss is divided by it over the world size, as in TRL and Liger (without it: by the active tokens of this
        batch, summed over the processes, over the world size). `vllm_is_ratio` `[B, T]` or `[B, 1]`: vLLM's
        importance sampling ratio, multiplied into each token's policy term (not into the KL term); `[B]`, one per
        sequence, is taken as `[B, 1]`, as Liger does. `sampling_per_token_logps` (TRL's, vLLM's log-probs; default the
        old ones): read by the off-policy mask (`off_policy_mask_threshold`, TRL's; not Liger's)."""
        if isinstance(vllm_is_ratio, torch.Tensor) and vllm_is_ratio.dim() == 1:
            vllm_is_ratio = vllm_is_ratio.unsqueeze(-1)
        use_ref = self.use_ref_model and self.beta != 0.0
        if use_ref and ref_per_token_logps is None and ref_input is None:
            raise ValueError("ref_per_token_logps / ref_input: expected one of them with use_ref_model=True and "
                             "beta != 0, got neither")
        if use_ref and ref_per_token_logps is not None:
            ref_input = ref_weight = ref_bias = None  # Liger, too, uses the given log-probabilities
        return linear_grpo_loss(
            _input, lin_weight, selected_token_ids, old_per_token_logps, None, attention_mask, bias=bias,
            advantages=advantages, ref_logps=ref_per_token_logps if use_ref else None,
            ref_hidden=ref_input if use_ref else None, ref_weight=ref_weight if use_ref else None,
            ref_bias=ref_bias if use_ref else None, clip_eps=self.epsilon_low, clip_eps_high=self.epsilon_high,
            beta=self.beta if use_ref else 0.0, temperature=self.temperature, delta=self.delta,
            use_bias_correction_kl=self.use_bias_correction_kl, importance_sampling_ratio=vllm_is_ratio,
            importance_sampling_level=self.importance_sampling_level,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            sampling_logps=None if self.off_policy_mask_threshold is None else sampling_per_token_logps,
            entropy=self.entropy, top_entropy_quantile=self.top_entropy_quantile,
            entropy_coef=self.entropy_coef if entropy_coef is None else entropy_coef, check_values=self.check_values,
            **self._term_options(), **self._normalizer(attention_mask, num_items_in_batch))

    def _term_options(self) -> dict[str, float]:
        """The op refuses the SAPO temperatures and the VESPO parameters with another loss type."""
        if self.loss_type == "sapo":
            return {"sapo_temperature_pos": self.sapo_temperature_pos,
                    "sapo_temperature_neg": self.sapo_temperature_neg}
        return self.vespo_gamma if self.loss_type == "vespo" else {}

    def _normalizer(self, mask: torch.Tensor, num_items_in_batch: Any) -> dict[str, Any]:
        """The op's loss type and normalizer arguments. Only the normalizer of dapo, cispo and vespo can differ from
        this batch's own: TRL divides them by the generation batch's active tokens over the processes
        (`num_items_in_batch / world`), given to the op as a fixed constant; cispo's and vespo's `loss_type` still
        names their per-token term (dapo's, the clipped surrogate, is the op's default)."""
        if self.loss_type == "dr_grpo":
            return {"loss_type": "dr_grpo", "max_completion_length": self.max_completion_length}
        if self.loss_type not in BY_NUM_ITEMS:
            return {"loss_type": self.loss_type}
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if num_items_in_batch is None:
            if world == 1:
                return {"loss_type": self.loss_type}
            count = mask.sum().to(torch.float32)
            dist.all_reduce(count)
            num_items_in_batch = count
        count = float(num_items_in_batch)
        if not 0.0 <= count < float("inf"):  # NaN fails too
            raise ValueError(f"num_items_in_batch: expected a finite token count >= 0, got {count!r}")
        constant = (count if count > 0.0 else 1.0) / world  # TRL's clamp of a zero count (no active token: loss 0)
        term = {} if self.loss_type == "dapo" else {"loss_type": self.loss_type}
        return {**term, "normalizer": "fixed_constant", "normalizer_constant": constant}


def __getattr__(name: str) -> Any:
    """`GRPOCoreTrainer` is built on first use, so that `GRPOLinearLoss` imports without TRL."""
    if name == "GRPOCoreTrainer":
        globals()[name] = cls = _grpo_core_trainer()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _grpo_core_trainer() -> type:
    try:
        from accelerate.utils import is_peft_model
        from trl import GRPOTrainer
        from trl.models.utils import _ForwardRedirection
        from transformers import TrainerCallback
    except ImportError as exc:
        raise ImportError(f"GRPOCoreTrainer needs TRL: pip install 'grpo-core[trl]' ({exc})") from exc

    class _FlushRecorder(TrainerCallback):
        """Writes the recorder's step once its optimizer step is taken (its backward passes have run), and what is
        left when training ends."""

        def __init__(self, recorder: TrainingRecorder):
            self.recorder = recorder

        def on_step_end(self, args, state, control, **kwargs):
            self.recorder.flush(wait=False)

        def on_train_end(self, args, state, control, **kwargs):
            self.recorder.close()

    class _CheckValues(TrainerCallback):
        """Reads the loss's deferred value checks (`grpo_core.raise_pending`) before each optimizer step: a bad input
        value of any micro-batch raises before its gradients reach the weights."""

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            raise_pending()

    class GRPOCoreTrainer(GRPOTrainer):
        """TRL's `GRPOTrainer` with grpo-core's fused linear GRPO loss: same arguments, same training loop, same
        logged `loss`, `kl` and clip ratio (`clip_ratio/region_mean`, cispo's `cispo_clip_ratio`, none for sapo; with
        `delta` below 1 + epsilon_high TRL counts the clamped ratio, ours the ratio). See the module docstring for what
        it refuses."""

        def __init__(self, *args: Any, record_dir: str | None = None, reproducible: bool = False,
                     replay_from: str | None = None, record_layers: bool = False, record_sampler: bool = False,
                     exact_on_policy: bool = False, **kwargs: Any):
            for name, value in (("reproducible", reproducible), ("record_layers", record_layers),
                                ("record_sampler", record_sampler), ("exact_on_policy", exact_on_policy)):
                if not isinstance(value, bool):
                    raise ValueError(f"{name}: expected True or False, got {value!r}")
            for name, value in (("record_layers", record_layers), ("record_sampler", record_sampler)):
                if value and record_dir is None:
                    raise ValueError(f"{name}: expected record_dir= beside it (it records into the run's folder), "
                                     f"got record_dir=None")
            if reproducible:  # before the trainer's first CUDA work (the cuBLAS workspace is set once per process)
                make_reproducible()
            super().__init__(*args, **kwargs)
            a = self.args
            self.grpo_core_reproducible = reproducible or a.full_determinism
            if a.full_determinism:  # transformers' own switch leaves cuDNN's attention on: turn it off as ours does
                make_reproducible()
            if self.top_entropy_quantile < 1.0 and self.accelerator.num_processes > 1:
                raise ValueError(f"top_entropy_quantile: expected 1.0 with GRPOCoreTrainer on more than one process, "
                                 f"got {self.top_entropy_quantile!r} (TRL's quantile spans the processes' tokens, the "
                                 f"loss's its own batch)")
            if self.aux_loss_enabled:
                raise ValueError(f"router_aux_loss_coef: expected 0.0 with GRPOCoreTrainer for a MoE model, got "
                                 f"{self.router_aux_loss_coef!r} (the loss has no router term)")
            config = self.model.config.get_text_config()
            for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                         "logits_scaling"):
                if getattr(config, name, None) not in (None, 1.0):
                    raise ValueError(f"{name}: the model's config sets {getattr(config, name)!r}; GRPOCoreTrainer "
                                     f"supports plain logits hidden @ lm_head.weight.T + bias only")
            self.grpo_core_loss = GRPOLinearLoss(
                beta=self.beta, use_ref_model=self.beta != 0.0, epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high, loss_type=self.loss_type,
                max_completion_length=self.max_completion_length,
                importance_sampling_level=self.importance_sampling_level, temperature=self.temperature,
                delta=a.delta, use_bias_correction_kl=a.use_bias_correction_kl,
                off_policy_mask_threshold=a.off_policy_mask_threshold,
                sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg,
                vespo_k_pos=a.vespo_k_pos, vespo_lambda_pos=a.vespo_lambda_pos, vespo_k_neg=a.vespo_k_neg,
                vespo_lambda_neg=a.vespo_lambda_neg, entropy=True, top_entropy_quantile=self.top_entropy_quantile,
                check_values="deferred" if self.accelerator.num_processes == 1 else "sync")
            self.grpo_core_redirection = _ForwardRedirection()
            self.add_callback(_CheckValues())
            self.grpo_core_recorder = self.grpo_core_replay = None
            self.grpo_core_record_sampler = record_sampler
            self.grpo_core_layers = None
            self._grpo_core_generation: dict[str, Any] = {}  # what the generation in progress gave
            self.grpo_core_exact = None
            if exact_on_policy:
                if (self.use_vllm or self.use_transformers_continuous_batching or self.rollout_func is not None
                        or self.tools or self.environment_factories is not None):
                    raise ValueError("exact_on_policy: expected one sampling turn by the model's own generate (no "
                                     "vLLM, continuous batching, rollout_func, tools or environments)")
                unwrapped = self.accelerator.unwrap_model(self.model)
                if is_peft_model(unwrapped):
                    raise ValueError("exact_on_policy: expected a model without PEFT adapters (the mode covers plain "
                                     "linear layers), got a PEFT model")
                self.grpo_core_exact = ExactOnPolicy(unwrapped, seed=a.seed, fp32_head=a.cast_lm_head_to_fp32)
                check_generation(self.generation_config)
                self.grpo_core_exact.install()
                if self.ref_model is not None:  # the reference's log-probs by the same arithmetic as the policy's
                    ExactOnPolicy(self.accelerator.unwrap_model(self.ref_model), seed=a.seed,
                                  fp32_head=a.cast_lm_head_to_fp32).install()
            if record_dir is None and replay_from is None:
                return
            if replay_from is not None and not isinstance(replay_from, (str, os.PathLike)):
                raise ValueError(f"replay_from: expected the folder of a recorded run, got {replay_from!r}")
            if self.tools or self.rollout_func is not None or self.environment_factories is not None:
                raise ValueError("record_dir / replay_from: expected a trainer that samples with its model (no tools, "
                                 "rollout_func or environments: their completions are not the sampler's alone)")
            if record_sampler and self.use_transformers_continuous_batching:
                raise ValueError("record_sampler: expected generate's own batches, got use_transformers_continuous_"
                                 "batching=True (its paged batches do not keep a sequence's row from step to step)")
            description = trl_run.run_description(self, self.grpo_core_reproducible)
            if replay_from is not None:
                if self.use_vllm:
                    raise ValueError("replay_from: expected use_vllm=False (a replay samples nothing), got True")
                steps = None if a.max_steps <= 0 else trl_run.generation_steps(
                    a.max_steps, a.gradient_accumulation_steps, a.steps_per_generation * self.num_iterations)
                self.grpo_core_replay = trl_run.Replay(replay_from, description, steps)
                description["replay_from"] = str(replay_from)
            if record_dir is not None:
                if record_layers:
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    self.grpo_core_layers = trl_run.layer_modules(
                        unwrapped.base_model.model if is_peft_model(unwrapped) else unwrapped)
                self.grpo_core_recorder = TrainingRecorder(record_dir, rank=self.accelerator.process_index,
                                                           metadata=description)
                self.add_callback(_FlushRecorder(self.grpo_core_recorder))

        def _compute_loss(self, model, inputs):
            if inputs.get("pixel_values") is not None:
                raise ValueError("pixel_values: GRPOCoreTrainer supports text-only models")
            mode = "train" if self.model.training else "eval"
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
            num_items = inputs["num_items_in_batch"]
            if mode == "train":  # TRL's dapo normalizer spans one accumulation window of the generation batch
                num_items = num_items * accumulation / self.args.steps_per_generation
            # TRL's entropy bonus: its coefficient from the end of the last optimizer step (adaptive: only while the
            # entropy is at most the target), on the mean over the kept tokens, divided by the accumulation alone
            coef = 0.0
            if self._entropy_bonus_enabled and (not self.use_adaptive_entropy
                                                or self._last_world_entropy <= self.args.entropy_target):
                coef = self.entropy_coef / (accumulation if self.loss_type in BY_NUM_ITEMS else 1)
            unwrapped = self.accelerator.unwrap_model(model)
            loss, m = self.grpo_core_redirection(model, unwrapped, self._grpo_core_loss, unwrapped, inputs, num_items,
                                                 coef)
            if self.loss_type not in BY_NUM_ITEMS:  # their normalizer already holds the accumulation (as in TRL)
                loss = loss / accumulation
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            count = mask.sum().to(torch.float32)
            sequences = torch.tensor(float(mask.shape[0]), device=count.device)
            if self._entropy_bonus_enabled:
                self._metrics[mode]["policy_loss"].append(self.accelerator.gather(m["policy_loss"]).nanmean().item())
                if self.use_adaptive_entropy and mode == "train":
                    self._adapt_entropy_coef(m["kept_entropy"], m["kept_tokens"])
                if mode == "train" and self.accelerator.sync_gradients:
                    self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
            kl, clip, phi = m["kl"], m["clip"], m["phi"]
            logged = [("kl", kl, count)] if self.beta != 0.0 else []
            logged.append(("entropy", m["entropy_mean"], count))
            clip_key = CLIP_RATIO_KEYS.get(self.loss_type, "clip_ratio/region_mean")
            if clip_key is not None:  # TRL's sequence-level clip ratio is a mean over the sequences (the loss's too)
                logged.append((clip_key, clip, sequences if self.importance_sampling_level == "sequence" else count))
            if phi is not None:  # a mean over the sequences, as TRL's
                logged.append(("vespo/phi_seq_mean", phi.mean(), sequences))
            for key, value, weight in logged:
                total, n = self.accelerator.reduce(torch.stack([value * weight, weight]), reduction="sum")
                self._metrics[mode][key].append((total / n.clamp(min=1.0)).item())
            return loss

        def _adapt_entropy_coef(self, kept_entropy: torch.Tensor, kept_tokens: torch.Tensor) -> None:
            """TRL's adaptive entropy controller: the window's entropy sum and count over the kept tokens (the loss's
            per-sequence sums and counts) accumulate over the micro-batches; at the optimizer step, reduced over the
            processes, they move the coefficient by `entropy_coef_delta` toward more bonus below `entropy_target` and
            less above it."""
            stats = torch.stack([kept_entropy.sum(), kept_tokens.sum().to(kept_entropy.dtype)])
            self._entropy_window_stats = stats if self._entropy_window_stats is None else (
                self._entropy_window_stats + stats)
            if self.accelerator.sync_gradients:
                a = self.args
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (total[0] / total[1].clamp(min=1.0)).item()
                self.entropy_coef = (min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
                                     if world <= a.entropy_target else
                                     max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min))
                self._last_world_entropy, self._entropy_window_stats = world, None

        def _hidden_and_head(self, unwrapped, input_ids, attention_mask, logits_to_keep):
            """The backbone's last hidden states at the positions that predict the last `logits_to_keep` tokens
            (position t predicts token t + 1), and the LM head's weight and bias: `(hidden, weight, bias)`, cast to
            fp32 with `cast_lm_head_to_fp32` (the gradient flows back through the casts)."""
            if is_peft_model(unwrapped):
                unwrapped = unwrapped.base_model.model
            with self.accelerator.autocast():
                hidden = unwrapped.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                              use_cache=False).last_hidden_state
            hidden = hidden[:, -logits_to_keep - 1:-1]
            head = unwrapped.get_output_embeddings()
            weight, bias = head.weight, head.bias
            if self.args.cast_lm_head_to_fp32:
                hidden, weight, bias = hidden.float(), weight.float(), None if bias is None else bias.float()
            return hidden, weight, bias

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            """TRL's old and reference log-probs, computed by the loss's own kernels (`linear_logprobs`) from the
            same backbone call as the loss's: the very bits the loss computes for the policy, so that on policy
            every ratio is exactly 1.0 and the KL against an identical reference exactly 0.0. TRL's own way for
            what the loss does not take (entropies, a router loss, vision inputs)."""
            if compute_entropy or compute_aux_loss or any(v is not None for v in multimodal.values()):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                    **multimodal)
            unwrapped = self.accelerator.unwrap_model(model)
            batch_size = batch_size or input_ids.size(0)
            out = []
            for start in range(0, input_ids.size(0), batch_size):
                ids, att = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
                hidden, weight, bias = self._hidden_and_head(unwrapped, ids, att, logits_to_keep)
                out.append(linear_logprobs(hidden, weight, ids[:, -logits_to_keep:], att[:, -logits_to_keep:],
                                           bias=bias, temperature=self.temperature,
                                           check_values=self.grpo_core_loss.check_values))
            return torch.cat(out), None, None

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
            """TRL's sampling; with `replay_from`, the recorded run's completions at this batch's places instead (its
            generators restored to their state after that generation); with `record_sampler`, the sampler's
            log-probs of what `generate` sampled."""
            step, device = self.state.global_step + 1, self.accelerator.device
            lo = self.accelerator.process_index * len(prompt_ids)  # this process's first place in the batch
            if self.grpo_core_exact is not None:  # keyed by (generation step, training or not, place in the batch)
                high = (step << 1 | (not self.model.training)) << 31
                self.grpo_core_exact.keys = torch.arange(lo, lo + len(prompt_ids), device=device) + high
            if not self.model.training or (self.grpo_core_recorder is None and self.grpo_core_replay is None):
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args,
                                                     **kwargs)
            if self.grpo_core_replay is not None:
                rows = self.grpo_core_replay.rows(step, list(range(lo, lo + len(prompt_ids))), prompt_ids)
                rng = self.grpo_core_replay.rng(step, self.accelerator.process_index, self.accelerator.num_processes)
                if rng is not None:
                    set_rng_states(rng, device)
                completion_ids = [r["completion_ids"] for r in rows]
                self._grpo_core_generation = {"sampler_logps": (
                    None if rows[0]["sampler_logps"] is None else [r["sampler_logps"] for r in rows]),
                    "rng": rng_states(device), "ids": ([list(p) for p in prompt_ids], completion_ids)}
                return completion_ids, None
            sampler = None
            if self.grpo_core_record_sampler and not self.use_vllm and self.grpo_core_exact is None:
                unwrapped = self.accelerator.unwrap_model(self.model)
                sampler = trl_run.SamplerLogps(unwrapped.base_model.model if is_peft_model(unwrapped) else unwrapped,
                                               self.temperature)
            with sampler.capture() if sampler is not None else contextlib.nullcontext():
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                         num_generations, *args, **kwargs)
            if logprobs is not None:  # vLLM's
                got = [np.asarray([np.nan if x is None else x for x in lp], dtype=np.float32) for lp in logprobs]
            elif self.grpo_core_exact is not None and self.grpo_core_record_sampler:
                table = self.grpo_core_exact.logps.cpu().numpy()
                got = [row[:len(c)] for row, c in zip(table, completion_ids)]
            else:
                got = None if sampler is None else sampler.of(completion_ids)
            self._grpo_core_generation = {"sampler_logps": got, "rng": rng_states(device),
                                          "ids": ([list(p) for p in prompt_ids], completion_ids)}
            return completion_ids, logprobs

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            """TRL's rewards of all processes' completions `[generation batch, reward functions]`; with
            `replay_from`, the recorded ones (the reward functions are not called)."""
            if self.grpo_core_replay is None or not self.model.training:
                rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            else:
                rewards = torch.from_numpy(self.grpo_core_replay.rewards(self.state.global_step + 1)).to(
                    self.accelerator.device)
            self._grpo_core_generation["rewards"] = rewards
            return rewards

        def _generate_and_score_completions(self, inputs):
            """TRL's; while recording, the generation's rollout (ids, rewards, the sampler's and with
            `record_sampler` the trainer's log-probs) goes to the recorder."""
            self._grpo_core_generation = {}
            out = super()._generate_and_score_completions(inputs)
            if self.grpo_core_recorder is None or not self.model.training:
                return out
            g = self._grpo_core_generation
            # keyed by the ids the loss sees (a truncated completion masked out has none); the generated ids kept
            prompt_mask, completion_mask = out["prompt_mask"].bool().cpu(), out["completion_mask"].bool().cpu()
            masked = [(p[m].tolist(), c[mc].tolist()) for p, m, c, mc in
                      zip(out["prompt_ids"].cpu(), prompt_mask, out["completion_ids"].cpu(), completion_mask)]
            prompts, completions = g.get("ids") or ([p for p, _ in masked], [c for _, c in masked])
            lo = self.accelerator.process_index * len(completions)
            trainer = None
            if self.grpo_core_record_sampler:
                trainer_logps = out.get("old_per_token_logps")
                if trainer_logps is None:  # TRL computed none: the trainer's log-probs under the sampling weights
                    with torch.no_grad():
                        trainer_logps, _, _ = self._get_per_token_logps_and_entropies(
                            self.model, torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
                            torch.cat([out["prompt_mask"], out["completion_mask"]], 1),
                            out["completion_ids"].size(1), self.args.per_device_train_batch_size)
                trainer = [t[:len(c)].numpy() for t, c in zip(trainer_logps.float().cpu(), completions)]
                self._log_sampler_difference(g.get("sampler_logps"), trainer)
            self.grpo_core_recorder.record_rollout(
                step=self.state.global_step + 1, positions=list(range(lo, lo + len(completions))), prompt_ids=prompts,
                completion_ids=completions, keys=[key_of(p, c) for p, c in masked],
                rewards=g["rewards"][lo:lo + len(completions)].float().cpu().numpy(),
                sampler_logps=g.get("sampler_logps"), trainer_logps=trainer,
                texts=self._tokenizer.batch_decode(completions, skip_special_tokens=True),
                meta={"reward_functions": list(self.reward_func_names),
                      "rng": g.get("rng") or rng_states(self.accelerator.device)})
            return out

        def _log_sampler_difference(self, sampler: list | None, trainer: list) -> None:
            """TRL's `sampling/sampling_logp_difference/{mean,max}` (|trainer - sampler| over the completion tokens
            of all processes)."""
            if sampler is None or (self.use_vllm and self.vllm_importance_sampling_correction):  # TRL logs it then
                return
            d = np.abs(np.concatenate(trainer or [np.zeros(0)]).astype(np.float64)
                       - np.concatenate(sampler or [np.zeros(0)]).astype(np.float64))
            d = d[~np.isnan(d)]
            stats = torch.tensor([d.sum(), d.size, d.max(initial=0.0)], dtype=torch.float64,
                                 device=self.accelerator.device)
            total = self.accelerator.gather(stats[None]).view(-1, 3)
            self._metrics["train"]["sampling/sampling_logp_difference/mean"].append(
                (total[:, 0].sum() / total[:, 1].sum().clamp(min=1)).item())
            self._metrics["train"]["sampling/sampling_logp_difference/max"].append(total[:, 2].max().item())

        def _grpo_core_loss(self, unwrapped, inputs, num_items, entropy_coef):
            """Backbone, then the fused linear loss on the completion positions (inside the wrapper's forward):
            `(loss, what the trainer logs)`."""
            completion_ids = inputs["completion_ids"]
            input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            recording = self.grpo_core_recorder is not None and self.model.training
            layers = (module_digests(self.grpo_core_layers, attention_mask)
                      if recording and self.grpo_core_layers is not None else contextlib.nullcontext(None))
            with layers as layer_digests:
                hidden, weight, bias = self._hidden_and_head(unwrapped, input_ids, attention_mask,
                                                             completion_ids.size(1))
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            applies = self.use_vllm and self.vllm_importance_sampling_correction  # as TRL (vespo: whenever given)
            is_ratio = inputs.get("importance_sampling_ratio") if applies or self.loss_type == "vespo" else None
            r = self.grpo_core_loss.result(hidden, weight, completion_ids, mask, inputs["advantages"],
                                           bias=bias, ref_per_token_logps=inputs.get("ref_per_token_logps"),
                                           old_per_token_logps=inputs.get("old_per_token_logps"),
                                           vllm_is_ratio=is_ratio, num_items_in_batch=num_items,
                                           sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
                                           entropy_coef=entropy_coef)
            if recording:
                accumulation = self.current_gradient_accumulation_steps
                self.grpo_core_recorder.record(
                    r, step=self.state.global_step + 1, input=hidden, completion_ids=completion_ids,
                    completion_mask=mask, prompt_ids=inputs["prompt_ids"], prompt_mask=inputs["prompt_mask"],
                    old_logps=inputs.get("old_per_token_logps"), ref_logps=inputs.get("ref_per_token_logps"),
                    importance_sampling_ratio=is_ratio, micro_batch=self._step % accumulation,
                    generation=self._step // (self.args.steps_per_generation * self.num_iterations),
                    layers=layer_digests)
            return r.loss, {"kl": r.kl_token_mean, "clip": r.clip_fraction, "phi": r.vespo_phi,
                            "entropy_mean": r.entropy_token_mean,
                            "kept_entropy": r.per_sequence_kept_entropy, "kept_tokens": r.per_sequence_kept_tokens,
                            "policy_loss": r.policy_loss + r.kl * self.beta}

    GRPOCoreTrainer.__module__, GRPOCoreTrainer.__qualname__ = __name__, "GRPOCoreTrainer"
    return GRPOCoreTrainer
