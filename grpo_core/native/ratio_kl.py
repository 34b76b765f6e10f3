"""Selected log-probs from torch's own log-softmax, and the ratio / k3 KL op built on them.

Plain PyTorch in fp32 whatever the logits dtype. Only active rows are read: masked rows never touch the
log-softmax, so whatever they hold (padding, inf, NaN) leaves the outputs and the gradient untouched. At active
tokens, a non-finite selected log-probability raises (`checks.check_logprobs`), as in the loss.
"""

from __future__ import annotations

import torch

from .. import canonical
from ..checks import check_inputs, check_logprobs


def selected_logprobs(logits: torch.Tensor, action_ids: torch.Tensor, mask: torch.Tensor,
                      inv_temperature: float = 1.0, entropy: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`log_softmax(logits * inv_temperature)[action]` in fp32 at active tokens, exactly 0.0 elsewhere; `[B, T]`.
    `inv_temperature` is an fp32 value (`contract.inverse_temperature`); at 1.0 nothing is multiplied. `entropy`:
    also each active token's entropy `-sum(p * log p)` (0.0 elsewhere), with its gradient."""
    rows = logits[mask].float()
    if inv_temperature != 1.0:
        rows = rows * canonical.fp32(inv_temperature, rows)
    logp = torch.log_softmax(rows, dim=-1)
    picked = logp.gather(-1, action_ids[mask].long().unsqueeze(-1)).squeeze(-1)
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    if not entropy:
        return zeros.masked_scatter(mask, picked)
    finite = torch.where(torch.isneginf(logp), 0.0, logp)  # p log p is 0 at a -inf logit (0 * -inf: NaN)
    return zeros.masked_scatter(mask, picked), zeros.masked_scatter(mask, -(logp.exp() * finite).sum(-1))


class NativeRatioKLOp:
    """`ratio, kl = op(policy_logits, ref_logits, action_ids, completion_mask, old_logps)`, each fp32 `[B, T]`."""

    backend = "native"

    def __call__(self, policy_logits: torch.Tensor, ref_logits: torch.Tensor, action_ids: torch.Tensor,
                 completion_mask: torch.Tensor, old_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = check_inputs(policy_logits, ref_logits, action_ids, old_logps, None, completion_mask, beta=1.0)
        logp = selected_logprobs(policy_logits, action_ids, mask)
        with torch.no_grad():
            logp_ref = selected_logprobs(ref_logits, action_ids, mask)
        check_logprobs(logp.detach(), logp_ref, mask)
        return canonical.ratio_and_kl(logp, logp_ref, old_logps.detach(), mask, exp=torch.exp)
