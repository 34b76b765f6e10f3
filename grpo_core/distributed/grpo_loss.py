"""Distributed GRPO loss over vocab-parallel TP x DP: the same bits at every TP x DP layout, on every machine and
device, because every number is the canonical math of `canonical.py` and every sum has a shape fixed by the
contract:
- vocabulary: fixed-width tiles merged in global tile order (`vocab_parallel_logprob.py`);
- tokens: each sequence's token sum is a `pair_sum` over the fixed `padded_seq_len` extent, computed by the DP
  rank that owns the whole sequence;
- sequences: per-sequence totals travel by `all_gather` in DP-rank order and are summed in global sequence order;
- counts travel as integers; advantages are computed on every rank from the gathered global reward vector.
No float is ever `all_reduce`d. The gradient is analytic (`canonical.token_coef`), written chunk by chunk: the
extra memory is one gradient in the logits' dtype plus `O(tokens * vocab / tile_width)`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import canonical
from ..contract import GRPOLossContract, LossContractError, check_inputs
from ..result import GRPOLossResult, provenance
from .preflight import check_logprobs_everywhere, preflight, replicated_digest
from .vocab_parallel_logprob import vocab_parallel_lse, write_grad

BACKEND_ID = "distributed/2"


def gather_sequences(local: torch.Tensor, contract: GRPOLossContract, dp_group: Any) -> torch.Tensor:
    """Concatenates every DP rank's `[n_rank, ...]` rows in DP-rank order (exact copies); uneven shards allowed."""
    bounds = contract.sharding.sequence_shard_bounds
    if len(bounds) == 1:
        return local
    sizes = [hi - lo for lo, hi in bounds]
    padded = F.pad(local, (0, 0) * (local.dim() - 1) + (0, max(sizes) - local.shape[0]))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=dp_group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class _Loss(torch.autograd.Function):
    """Forward: the loss computed outside autograd. Backward: `grad_output * coef * (onehot - softmax)` on this
    rank's active rows, zeros elsewhere; no communication (every rank holds the replicated loss)."""

    @staticmethod
    def forward(ctx, logits, loss, rows, local_ids, lse, coef, tile_width):
        ctx.save_for_backward(logits, rows, local_ids, lse, coef)
        ctx.tile_width = tile_width
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, rows, local_ids, lse, coef = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.zeros(flat.shape, dtype=logits.dtype, device=logits.device)
        write_grad(grad, flat, rows, local_ids, lse, coef * grad_loss.to(torch.float32), ctx.tile_width)
        return grad.view(logits.shape), None, None, None, None, None, None


class DistributedGRPOLossOp:
    """`result = op.apply(policy_local_logits, action_ids, old_logps, rewards, contract=..., completion_mask=...,
    ref_local_logits=..., tp_group=..., dp_group=...)`.

    Local tensors: `policy_local_logits` / `ref_local_logits` `[n_local, padded_seq_len, local_vocab]` (this rank's
    sequences and vocab shard), `action_ids` (global ids), `old_logps`, `completion_mask` `[n_local,
    padded_seq_len]`, `rewards` `[n_local]`. The result's scalars and per-sequence vectors cover the whole batch
    and are identical on every rank; the gradient flows into this rank's shard of the policy logits only (never
    into `old_logps`, `rewards` or the reference logits). Every bad input, on any rank, raises the same
    `LossContractError` on every rank (`preflight.py` says what can and cannot be guaranteed).
    """

    backend = "distributed"

    def supports(self, contract: GRPOLossContract) -> list[str]:
        s = contract.sharding
        if (s.tp_world_size > 1 or s.dp_world_size > 1) and not dist.is_available():
            return ["torch.distributed is not available in this build of torch"]
        return []

    @staticmethod
    def _token_sum(terms: torch.Tensor) -> torch.Tensor:
        """Each sequence's token sum (a fixed tree over `padded_seq_len`)."""
        return canonical.pair_sum(terms)

    def apply(self, policy_local_logits: torch.Tensor, action_ids: torch.Tensor, old_logps: torch.Tensor,
              rewards: torch.Tensor, *, contract: GRPOLossContract, completion_mask: torch.Tensor,
              ref_local_logits: torch.Tensor | None = None, tp_group: Any = None, dp_group: Any = None
              ) -> GRPOLossResult:
        tensors = {"policy_local_logits": policy_local_logits, "ref_local_logits": ref_local_logits,
                   "action_ids": action_ids, "old_logps": old_logps, "rewards": rewards,
                   "completion_mask": completion_mask}

        def local_checks() -> torch.Tensor:  # runs inside the preflight: whatever it raises reaches every rank
            s = contract.sharding
            (seq_lo, seq_hi), (v_lo, v_hi) = s.sequence_bounds, s.vocab_bounds
            check_inputs(policy_local_logits, ref_local_logits, action_ids, old_logps, rewards, completion_mask,
                         beta=contract.beta, values=False, rewards_required=True)  # types before the shape
            expected = (seq_hi - seq_lo, contract.padded_seq_len, v_hi - v_lo)
            if tuple(policy_local_logits.shape) != expected:
                raise LossContractError(
                    f"policy_local_logits: expected [owned sequences, padded_seq_len, local vocab] = {list(expected)}"
                    f" from the contract (sequences {seq_lo}:{seq_hi}, vocab {v_lo}:{v_hi}), got "
                    f"{list(policy_local_logits.shape)}")
            return check_inputs(policy_local_logits, ref_local_logits, action_ids, old_logps, rewards, completion_mask,
                                beta=contract.beta, vocab_size=contract.vocab_size, num_rewards=seq_hi - seq_lo,
                                rewards_required=True)

        mask = preflight(contract, BACKEND_ID, tensors, local_checks,
                         lambda: replicated_digest(completion_mask, torch.where(completion_mask.bool(), action_ids, 0),
                                                   torch.where(completion_mask.bool(), old_logps, 0), rewards),
                         tp_group, dp_group)
        old_logps, rewards = old_logps.detach(), rewards.detach()  # the gradient flows into the policy logits only
        s = contract.sharding
        (seq_lo, seq_hi), (v_lo, v_hi) = s.sequence_bounds, s.vocab_bounds
        n_local, T = seq_hi - seq_lo, contract.padded_seq_len
        lp = contract.logprob_contract
        rows = mask.reshape(-1).nonzero().squeeze(1)
        ids = action_ids.reshape(-1)[rows].long()
        x = policy_local_logits.detach()

        def logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            lse, selected = vocab_parallel_lse(logits.reshape(n_local * T, -1), rows, ids, lp, tp_group)
            full = torch.zeros(n_local * T, dtype=torch.float32, device=x.device)
            return full.index_put((rows,), selected - lse).view(n_local, T), lse, selected - lse

        logp, lse, logp_rows = logprobs(x)
        bad = ~torch.isfinite(logp_rows)
        logp_ref = None
        if ref_local_logits is not None:
            logp_ref, _, ref_rows = logprobs(ref_local_logits.detach())
            bad |= ~torch.isfinite(ref_rows)

        advantages = canonical.group_advantages(gather_sequences(rewards.to(torch.float32), contract, dp_group),
                                                contract.groups, contract.advantage_std)
        adv = advantages[seq_lo:seq_hi]
        lo, hi = canonical.clip_bounds(contract.clip_eps, contract.clip_eps_high, logp)
        ratio, kl_tok = canonical.ratio_and_kl(logp, logp_ref, old_logps, mask)
        policy_tok = canonical.clipped_surrogate(ratio, adv, mask, lo, hi)
        bad_seq = torch.zeros(n_local * T, dtype=torch.int64, device=x.device).index_put((rows,), bad.long())
        counts_bad = gather_sequences(torch.stack([mask.sum(-1), bad_seq.view(n_local, T).sum(-1)], -1), contract,
                                      dp_group)
        counts = counts_bad[:, 0]
        if bool(counts_bad[:, 1].any()):  # every rank holds the gathered flags: all raise together, same words
            check_logprobs_everywhere(logp, logp_ref, mask, lambda t: gather_sequences(t, contract, dp_group))
        per_seq_policy = gather_sequences(self._token_sum(policy_tok), contract, dp_group)
        per_seq_kl = gather_sequences(self._token_sum(kl_tok), contract, dp_group)
        loss, policy_loss, kl = canonical.combine(per_seq_policy, per_seq_kl, counts, contract.beta,
                                                  contract.normalizer, contract.normalizer_constant)
        if policy_local_logits.requires_grad and torch.is_grad_enabled():
            weights = canonical.token_weights(counts, contract.normalizer, contract.normalizer_constant)
            coef = canonical.token_coef(ratio, logp, logp_ref, adv, weights[seq_lo:seq_hi], mask, lo, hi,
                                        contract.beta)
            loss = _Loss.apply(policy_local_logits, loss, rows, ids - v_lo, lse, coef.reshape(-1)[rows],
                               lp.tile_width)
        return GRPOLossResult(
            loss=loss, policy_loss=policy_loss, kl=kl, per_sequence_policy=per_seq_policy,
            per_sequence_kl=per_seq_kl, advantages=advantages, per_sequence_active_tokens=counts,
            provenance=provenance(self.backend, policy_local_logits, backend_id=BACKEND_ID,
                                  fingerprint=contract.fingerprint(), tile_width=lp.tile_width,
                                  tp_world_size=s.tp_world_size, dp_world_size=s.dp_world_size,
                                  determinism_scope=contract.determinism_scope.value))
