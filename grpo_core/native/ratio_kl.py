"""Reference per-token math: selected log-probs, the masked ratio and the k3 KL, and the clipped surrogate.

Plain PyTorch in fp32 whatever the logits dtype. Only active rows are read: masked rows never touch the
log-softmax, so whatever they hold (padding, inf, NaN) leaves the outputs and the gradient untouched.
"""

from __future__ import annotations

import torch

from ..contract import check_inputs


def selected_logprobs(logits: torch.Tensor, action_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)[action]` in fp32 at active tokens, exactly 0.0 elsewhere; `[B, T]`."""
    rows = logits[mask].float()
    picked = torch.log_softmax(rows, dim=-1).gather(-1, action_ids[mask].long().unsqueeze(-1)).squeeze(-1)
    return torch.zeros(mask.shape, dtype=torch.float32, device=logits.device).masked_scatter(mask, picked)


def ratio_and_kl(logp: torch.Tensor, logp_ref: torch.Tensor | None, old_logps: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ratio = exp(masked(logp - old))` (mask before exp: 1.0 on masked tokens) and `kl = exp(d) - d - 1`
    with `d = masked(logp_ref - logp)` (exactly 0.0 on masked tokens; all zeros without a reference)."""
    zero = torch.zeros_like(logp)
    ratio = torch.exp(torch.where(mask, logp - old_logps.float(), zero))
    if logp_ref is None:
        return ratio, zero
    d = torch.where(mask, logp_ref - logp, zero)
    return ratio, torch.exp(d) - d - 1.0


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
                      clip_eps_high: float) -> torch.Tensor:
    """Per-token `-min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A)`, exactly 0.0 on masked tokens."""
    adv = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    policy = -torch.minimum(ratio * adv, clipped * adv)
    return torch.where(mask, policy, torch.zeros_like(policy))


class NativeRatioKLOp:
    """`ratio, kl = op(policy_logits, ref_logits, action_ids, completion_mask, old_logps)`, each fp32 `[B, T]`."""

    backend = "native"

    def __call__(self, policy_logits: torch.Tensor, ref_logits: torch.Tensor, action_ids: torch.Tensor,
                 completion_mask: torch.Tensor, old_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = check_inputs(policy_logits, ref_logits, action_ids, old_logps, None, completion_mask, beta=1.0)
        logp = selected_logprobs(policy_logits, action_ids, mask)
        with torch.no_grad():
            logp_ref = selected_logprobs(ref_logits, action_ids, mask)
        return ratio_and_kl(logp, logp_ref, old_logps, mask)
