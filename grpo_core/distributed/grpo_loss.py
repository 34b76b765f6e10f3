"""Distributed GRPO loss over vocab-parallel TP x DP, bit-identical at every TP x DP degree.

Only sums can change bits, so every sum has a shape fixed by the contract:
- vocabulary: fixed-width tiles merged in global tile order (`vocab_parallel_logprob.py`);
- tokens: each sequence's token sum is a `tree_sum` over the fixed `padded_seq_len` extent, computed by the DP
  rank that owns the whole sequence;
- sequences: per-sequence totals travel by `all_gather` in DP-rank order and are summed in global sequence order;
- counts travel as integers; advantages are computed on every rank from the gathered global reward vector.
No float is ever `all_reduce`d. The elementwise math is the native op's own (`native/ratio_kl.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..advantages import group_advantages
from ..contract import GRPOLossContract, LossContractError, check_inputs
from ..native.grpo_loss import combine, grpo_terms, provenance
from ..result import GRPOLossResult
from .preflight import preflight, replicated_digest
from .vocab_parallel_logprob import VocabParallelLogprobOp

BACKEND_ID = "distributed/1"


def _gather_sequences(local: torch.Tensor, contract: GRPOLossContract, dp_group: Any) -> torch.Tensor:
    """Concatenates every DP rank's `[n_rank, ...]` rows in DP-rank order (exact copies); uneven shards allowed."""
    bounds = contract.sharding.sequence_shard_bounds
    if len(bounds) == 1:
        return local
    sizes = [hi - lo for lo, hi in bounds]
    padded = F.pad(local, (0, 0) * (local.dim() - 1) + (0, max(sizes) - local.shape[0]))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=dp_group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class _GatherSequences(torch.autograd.Function):
    """Forward: the global `[num_sequences]` vector. Backward: this rank's slice of its gradient.

    Every rank evaluates the same replicated loss from the gathered vector, so the gradient of its own
    sequences is just its slice: no communication, no float reduction.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, contract: GRPOLossContract, dp_group: Any) -> torch.Tensor:
        ctx.bounds = contract.sharding.sequence_bounds
        return _gather_sequences(local, contract, dp_group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo, hi = ctx.bounds
        return grad[lo:hi], None, None


class DistributedGRPOLossOp:
    """`result = op.apply(policy_local_logits, action_ids, old_logps, rewards, contract=..., completion_mask=...,
    ref_local_logits=..., tp_group=..., dp_group=...)`.

    Local tensors: `policy_local_logits` / `ref_local_logits` `[n_local, padded_seq_len, local_vocab]` (this rank's
    sequences and vocab shard), `action_ids` (global ids), `old_logps`, `completion_mask` `[n_local,
    padded_seq_len]`, `rewards` `[n_local]`. The result's scalars and per-sequence vectors cover the whole batch
    and are identical on every rank; the gradient flows into this rank's shard.
    """

    backend = "distributed"
    # The per-sequence token reduction (tree sums over padded_seq_len); a hook so that the harness can plant a
    # deliberately regrouped variant and prove its diff catches it.
    token_terms = staticmethod(grpo_terms)

    def __init__(self) -> None:
        self._logprob = VocabParallelLogprobOp()

    def supports(self, contract: GRPOLossContract) -> list[str]:
        s = contract.sharding
        if (s.tp_world_size > 1 or s.dp_world_size > 1) and not dist.is_available():
            return ["torch.distributed is not available in this build of torch"]
        return []

    def apply(self, policy_local_logits: torch.Tensor, action_ids: torch.Tensor, old_logps: torch.Tensor,
              rewards: torch.Tensor, *, contract: GRPOLossContract, completion_mask: torch.Tensor,
              ref_local_logits: torch.Tensor | None = None, tp_group: Any = None, dp_group: Any = None
              ) -> GRPOLossResult:
        if not isinstance(contract, GRPOLossContract):
            raise LossContractError(f"contract: expected a GRPOLossContract, got {type(contract).__name__}")
        s = contract.sharding
        (seq_lo, seq_hi), (v_lo, v_hi) = s.sequence_bounds, s.vocab_bounds
        n_local, T = seq_hi - seq_lo, contract.padded_seq_len

        def local_checks() -> torch.Tensor:
            expected = (n_local, T, v_hi - v_lo)
            if isinstance(policy_local_logits, torch.Tensor) and tuple(policy_local_logits.shape) != expected:
                raise LossContractError(
                    f"policy_local_logits: expected [owned sequences, padded_seq_len, local vocab] = {list(expected)}"
                    f" from the contract (sequences {seq_lo}:{seq_hi}, vocab {v_lo}:{v_hi}), got "
                    f"{list(policy_local_logits.shape)}")
            return check_inputs(policy_local_logits, ref_local_logits, action_ids, old_logps, rewards, completion_mask,
                                beta=contract.beta, vocab_size=contract.vocab_size, num_rewards=n_local)

        mask = preflight(contract, BACKEND_ID, local_checks, tp_group, dp_group,
                         lambda: replicated_digest(completion_mask, torch.where(completion_mask.bool(), action_ids, 0),
                                                   torch.where(completion_mask.bool(), old_logps, 0), rewards))

        lp = contract.logprob_contract
        flat_mask = mask.reshape(-1)
        flat_ids = action_ids.reshape(-1)
        logp, _ = self._logprob(policy_local_logits.reshape(n_local * T, -1), flat_ids, contract=lp,
                                tp_group=tp_group, mask=flat_mask)
        logp_ref = None
        if ref_local_logits is not None:
            with torch.no_grad():
                logp_ref, _ = self._logprob(ref_local_logits.reshape(n_local * T, -1), flat_ids, contract=lp,
                                            tp_group=tp_group, mask=flat_mask)
            logp_ref = logp_ref.view(n_local, T)

        advantages = group_advantages(_gather_sequences(rewards.to(torch.float32), contract, dp_group),
                                      contract.groups, contract.advantage_std)
        local_policy, local_kl, local_counts = self.token_terms(logp.view(n_local, T), logp_ref, old_logps, mask,
                                                               advantages[seq_lo:seq_hi], contract.clip_eps,
                                                               contract.clip_eps_high)
        per_seq_policy = _GatherSequences.apply(local_policy, contract, dp_group)
        per_seq_kl = _GatherSequences.apply(local_kl, contract, dp_group)
        counts = _gather_sequences(local_counts, contract, dp_group)
        loss, policy_loss, kl = combine(per_seq_policy, per_seq_kl, counts, contract.beta, contract.normalizer,
                                        contract.normalizer_constant)
        return GRPOLossResult(
            loss=loss, policy_loss=policy_loss, kl=kl, per_sequence_policy=per_seq_policy.detach(),
            per_sequence_kl=per_seq_kl.detach(), advantages=advantages, per_sequence_active_tokens=counts,
            provenance=provenance(self.backend, policy_local_logits, backend_id=BACKEND_ID,
                                  fingerprint=contract.fingerprint(), tile_width=lp.tile_width,
                                  tp_world_size=s.tp_world_size, dp_world_size=s.dp_world_size,
                                  determinism_scope=contract.determinism_scope.value))
