"""Reference GRPO loss: plain PyTorch autograd over the per-token math of `ratio_kl.py`.

Per-sequence token sums, the normalizers and the advantages use the same fixed-order trees as every other
backend (`reduction.py`, `advantages.py`); the log-softmax is torch's own, so this op agrees with the others
to fp32 rounding, not to the bit.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

import torch

from ..advantages import group_advantages
from ..contract import (AdvantageStd, DeterminismScope, GRPOLossContract, LossContractError, TokenNormalizer,
                        check_enum, check_groups, check_inputs, check_normalizer_constant, check_float)
from ..reduction import normalize, tree_sum
from ..result import GRPOLossResult
from .ratio_kl import clipped_surrogate, ratio_and_kl, selected_logprobs


def grpo_terms(logp: torch.Tensor, logp_ref: torch.Tensor | None, old_logps: torch.Tensor, mask: torch.Tensor,
               advantages: torch.Tensor, clip_eps: float, clip_eps_high: float, token_sum=tree_sum
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence token sums `[B]` of the clipped surrogate and of the k3 KL, and the active counts `[B]`."""
    ratio, kl = ratio_and_kl(logp, logp_ref, old_logps, mask)
    policy = clipped_surrogate(ratio, advantages, mask, clip_eps, clip_eps_high)
    return token_sum(policy), token_sum(kl), mask.sum(dim=-1)


def combine(per_seq_policy: torch.Tensor, per_seq_kl: torch.Tensor, counts: torch.Tensor, beta: float,
            normalizer: TokenNormalizer, constant: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`loss = N(policy) + beta * N(kl)`; returns `(loss, policy_loss, kl)` with the last two detached."""
    policy_loss = normalize(per_seq_policy, counts, normalizer, constant)
    kl = normalize(per_seq_kl, counts, normalizer, constant)
    loss = policy_loss + torch.full((), beta, dtype=torch.float32, device=kl.device) * kl
    return loss, policy_loss.detach(), kl.detach()


@dataclass(frozen=True)
class LossOptions:
    mask: torch.Tensor
    clip_eps: float
    clip_eps_high: float
    beta: float
    groups: tuple[int, ...]
    std: AdvantageStd
    normalizer: TokenNormalizer
    constant: float | None


def loss_options(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, clip_eps, beta,
                 samples_per_prompt, group_boundaries, clip_eps_high, normalizer, normalizer_constant, advantage_std,
                 values: bool = True) -> LossOptions:
    """Validates the keyword options and the tensors of the plain-call API (shared by every backend)."""
    clip_eps = check_float("clip_eps", clip_eps, minimum=0.0, maximum=1.0, open_max=True)
    clip_eps_high = check_float("clip_eps_high", clip_eps if clip_eps_high is None else clip_eps_high, minimum=0.0)
    beta = check_float("beta", beta, minimum=0.0)
    normalizer = check_enum(TokenNormalizer, "normalizer", normalizer)
    std = check_enum(AdvantageStd, "advantage_std", advantage_std)
    constant = check_normalizer_constant(normalizer, normalizer_constant)
    mask = check_inputs(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, beta=beta,
                        values=values)
    if policy_logits.shape[0] == 0:
        raise LossContractError("policy_logits: expected at least one sequence (B >= 1), got B = 0")
    groups = check_groups(policy_logits.shape[0], samples_per_prompt, group_boundaries, std)
    return LossOptions(mask, clip_eps, clip_eps_high, beta, groups, std, normalizer, constant)


def provenance(backend: str, logits: torch.Tensor, **extra: Any) -> dict[str, Any]:
    return {"backend": backend, "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(logits.device) if logits.is_cuda else platform.machine(),
            "dtype": str(logits.dtype).removeprefix("torch."), **extra}


class NativeGRPOLossOp:
    """The reference op: `loss, policy_loss, kl = op(policy_logits, ref_logits, action_ids, old_logps, rewards,
    completion_mask, clip_eps=0.2, beta=0.04, samples_per_prompt=8)`; `op.apply(..., contract=...)` is the
    contract path for a single process (TP = DP = 1)."""

    backend = "native"

    def __call__(self, policy_logits: torch.Tensor, ref_logits: torch.Tensor | None, action_ids: torch.Tensor,
                 old_logps: torch.Tensor, rewards: torch.Tensor, completion_mask: torch.Tensor,
                 clip_eps: float = 0.2, beta: float = 0.04, samples_per_prompt: int | None = None,
                 group_boundaries: Any = None, *, clip_eps_high: float | None = None,
                 normalizer: TokenNormalizer | str = TokenNormalizer.GLOBAL_ACTIVE_TOKENS,
                 normalizer_constant: float | None = None, advantage_std: AdvantageStd | str = AdvantageStd.POPULATION
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        o = loss_options(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, clip_eps, beta,
                         samples_per_prompt, group_boundaries, clip_eps_high, normalizer, normalizer_constant,
                         advantage_std)
        return tuple(self._run(policy_logits, ref_logits, action_ids, old_logps, rewards, o.mask, o.clip_eps,
                               o.clip_eps_high, o.beta, o.groups, o.std, o.normalizer, o.constant, {}))

    def supports(self, contract: GRPOLossContract) -> list[str]:
        """Reasons this op cannot serve `contract` (empty when it can)."""
        reasons = []
        s = contract.sharding
        if s.tp_world_size != 1 or s.dp_world_size != 1:
            reasons.append(f"native runs in a single process; the contract has tp_world_size={s.tp_world_size}, "
                           f"dp_world_size={s.dp_world_size}")
        if contract.determinism_scope is not DeterminismScope.RUN_TO_RUN:
            reasons.append(f"native does not promise determinism_scope={contract.determinism_scope.value!r} "
                           f"(its log-softmax is not tiled like the distributed backend's)")
        return reasons

    def apply(self, policy_local_logits: torch.Tensor, action_ids: torch.Tensor, old_logps: torch.Tensor,
              rewards: torch.Tensor, *, contract: GRPOLossContract, completion_mask: torch.Tensor,
              ref_local_logits: torch.Tensor | None = None, tp_group: Any = None, dp_group: Any = None
              ) -> GRPOLossResult:
        reasons = self.supports(contract)
        if reasons:
            raise LossContractError("contract: the native op cannot serve it: " + "; ".join(reasons))
        expected = (contract.num_sequences, contract.padded_seq_len, contract.vocab_size)
        if isinstance(policy_local_logits, torch.Tensor) and tuple(policy_local_logits.shape) != expected:
            raise LossContractError(f"policy_local_logits: expected [num_sequences, padded_seq_len, vocab_size] = "
                                    f"{list(expected)} from the contract, got {list(policy_local_logits.shape)}")
        mask = check_inputs(policy_local_logits, ref_local_logits, action_ids, old_logps, rewards, completion_mask,
                            beta=contract.beta)
        return self._run(policy_local_logits, ref_local_logits, action_ids, old_logps, rewards, mask,
                         contract.clip_eps, contract.clip_eps_high, contract.beta, contract.groups,
                         contract.advantage_std, contract.normalizer, contract.normalizer_constant,
                         {"fingerprint": contract.fingerprint()})

    def _run(self, policy_logits, ref_logits, action_ids, old_logps, rewards, mask, clip_eps, clip_eps_high, beta,
             groups, std, normalizer, constant, extra) -> GRPOLossResult:
        advantages = group_advantages(rewards, groups, std)
        logp = selected_logprobs(policy_logits, action_ids, mask)
        logp_ref = None
        if ref_logits is not None:
            with torch.no_grad():
                logp_ref = selected_logprobs(ref_logits, action_ids, mask)
        per_seq_policy, per_seq_kl, counts = grpo_terms(logp, logp_ref, old_logps, mask, advantages, clip_eps,
                                                        clip_eps_high)
        loss, policy_loss, kl = combine(per_seq_policy, per_seq_kl, counts, beta, normalizer, constant)
        return GRPOLossResult(loss=loss, policy_loss=policy_loss, kl=kl, per_sequence_policy=per_seq_policy.detach(),
                              per_sequence_kl=per_seq_kl.detach(), advantages=advantages,
                              per_sequence_active_tokens=counts,
                              provenance=provenance(self.backend, policy_logits, **extra))
