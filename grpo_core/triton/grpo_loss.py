"""TritonGRPOLossOp: the GRPO loss from one streaming pass over each active row.

Single-pass mode (the default when `policy_logits` requires grad): the advantages and the normalizer weights are
known before the pass, so the kernel computes each token's `d loss / d logp` right after its log-sum-exp and
writes the gradient `g * (onehot - softmax)` in the same program. Forward + backward then reads every active
policy and reference row once from HBM (the gradient loop re-reads the policy row from L2) and writes the
gradient once; the backward only applies `grad_output`. Memory: the gradient (logits dtype, `B*T*V`) is
allocated during the forward and held until the backward, where the two-pass mode allocates it in the
backward; both hold one gradient at the peak. `inplace=True` writes it into `policy_logits`' own storage
(eager only; the logits are overwritten). Two-pass mode (`single_pass=False`): the forward streams the rows once
for the log-probs and the backward streams the policy rows again to write the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.library import triton_op, wrap_triton

from ..contract import AdvantageStd, TokenNormalizer
from ..native.grpo_loss import combine, grpo_terms, loss_options
from ..reduction import token_weights
from .group_norm import group_advantages
from .ratio_kl import NUM_WARPS, _block, _logprob_fwd_kernel, _rows, check_values_after, token_logprobs


def _launch_single_pass(launch, policy, ref, ids, mask, old, adv, weight, grad, clip_low, clip_high, beta):
    x = _rows(policy)
    r = _rows(ref) if ref is not None else x
    g = grad.view(x.shape)
    N, V = x.shape
    out = torch.empty(3, N, dtype=torch.float32, device=x.device)
    err = torch.zeros(1, dtype=torch.int32, device=x.device)
    launch(_logprob_fwd_kernel)[(N,)](
        x, r, ids.contiguous().view(-1), mask.contiguous().view(-1), out, err, old.contiguous().view(-1), adv,
        weight, g, N, policy.shape[1], V,
        x.stride(0), r.stride(0), g.stride(0), clip_low, clip_high, beta, HAS_REF=ref is not None, SINGLE_PASS=True,
        BLOCK=_block(V), num_warps=NUM_WARPS)
    return out, err


@triton_op("grpo_core::grpo_single_pass", mutates_args={})
def grpo_single_pass(policy: torch.Tensor, ref: torch.Tensor | None, ids: torch.Tensor, mask: torch.Tensor,
                     old: torch.Tensor, adv: torch.Tensor, weight: torch.Tensor, clip_low: float, clip_high: float,
                     beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out [3, N] = logp, logp_ref, lse, err [1], grad [B, T, V])` with `grad = d loss / d policy`."""
    grad = torch.empty(policy.shape, dtype=policy.dtype, device=policy.device)
    out, err = _launch_single_pass(wrap_triton, policy, ref, ids, mask, old, adv, weight, grad, clip_low, clip_high,
                                   beta)
    return out, err, grad


class _AttachGradient(torch.autograd.Function):
    """Returns the precomputed loss; its backward is the precomputed gradient times `grad_output`."""

    @staticmethod
    def forward(ctx, policy: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if not torch.compiler.is_compiling() and bool(grad_loss == 1.0):  # the usual loss.backward(): no extra pass
            return grad, None, None
        return grad * grad_loss.to(grad.dtype), None, None


class TritonGRPOLossOp:
    """Same call as the native op (`NativeGRPOLossOp.__call__`), plus `single_pass` (default: when the policy
    logits require grad) and `inplace` (single-pass only: the gradient overwrites `policy_logits`)."""

    backend = "triton"

    def __call__(self, policy_logits: torch.Tensor, ref_logits: torch.Tensor | None, action_ids: torch.Tensor,
                 old_logps: torch.Tensor, rewards: torch.Tensor, completion_mask: torch.Tensor,
                 clip_eps: float = 0.2, beta: float = 0.04, samples_per_prompt: int | None = None,
                 group_boundaries: Any = None, *, clip_eps_high: float | None = None,
                 normalizer: TokenNormalizer | str = TokenNormalizer.GLOBAL_ACTIVE_TOKENS,
                 normalizer_constant: float | None = None, advantage_std: AdvantageStd | str = AdvantageStd.POPULATION,
                 single_pass: bool | None = None, inplace: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        o = loss_options(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, clip_eps, beta,
                         samples_per_prompt, group_boundaries, clip_eps_high, normalizer, normalizer_constant,
                         advantage_std, values=False)
        wants_grad = policy_logits.requires_grad and torch.is_grad_enabled()
        single = wants_grad if single_pass is None else bool(single_pass) and wants_grad
        if inplace and not single:
            raise ValueError("inplace: only the single-pass mode can write the gradient into policy_logits "
                             "(it needs policy_logits.requires_grad and single_pass not False)")
        B, T, _ = policy_logits.shape
        mask8 = o.mask.view(torch.int8)
        old = old_logps.float()
        adv = group_advantages(rewards, o.groups, o.std)
        if single:
            weight = token_weights(o.mask.sum(-1), o.normalizer, o.constant)
            if inplace:
                grad = policy_logits.detach()
                out, err = _launch_single_pass(lambda k: k, grad, ref_logits, action_ids, mask8, old, adv, weight,
                                               grad, o.clip_eps, o.clip_eps_high, o.beta)
            else:
                out, err, grad = grpo_single_pass(policy_logits.detach(), ref_logits, action_ids, mask8, old, adv,
                                                  weight, o.clip_eps, o.clip_eps_high, o.beta)
        else:
            out, err = token_logprobs(policy_logits, ref_logits, action_ids, mask8)
        logp = out[0].view(B, T)
        logp_ref = out[1].view(B, T).detach() if ref_logits is not None else None
        per_seq_policy, per_seq_kl, counts = grpo_terms(logp, logp_ref, old, o.mask, adv, o.clip_eps, o.clip_eps_high)
        loss, policy_loss, kl = combine(per_seq_policy, per_seq_kl, counts, o.beta, o.normalizer, o.constant)
        check_values_after(err, policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, o.beta)
        if single:
            loss = _AttachGradient.apply(policy_logits, loss.detach(), grad)
        return loss, policy_loss, kl
