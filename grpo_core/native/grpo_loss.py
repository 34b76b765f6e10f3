"""Reference GRPO loss: plain PyTorch autograd over the token formulas of `canonical.py`.

The advantages, the per-sequence token sums, the normalizers and the metrics are the canonical ones (fixed
pairwise trees, portable bits); the log-softmax and the exp of the ratio and the KL are torch's own, so this op
agrees with the deterministic path to fp32 rounding, not to the bit. A temperature multiplies the fp32 logits by
`fp32(1 / temperature)` (as the deterministic path does) before the log-softmax; at 1.0 nothing is multiplied.

Only `policy_logits` receives a gradient: `ref_logits` (or `ref_logps`), `old_logps`, `rewards` and given
`advantages` are detached, whatever their `requires_grad`, as on every backend. A non-finite selected
log-probability at an active token raises (`checks.check_logprobs`), as on every backend.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import canonical
from ..checks import (LossOptions, check_derived_advantages, check_inputs, check_logprobs, check_loss,
                      check_option_inputs, check_tensor, loss_options)
from ..contract import (AdvantageStd, AdvantagesInput, DeterminismScope, GRPOLossContract, LossContractError,
                        TokenNormalizer, inverse_temperature)
from ..result import GRPOLossResult, entropy_fields, provenance
from .ratio_kl import selected_logprobs


class NativeGRPOLossOp:
    """The reference op: `loss, policy_loss, kl = op(policy_logits, ref_logits, action_ids, old_logps, rewards,
    completion_mask, clip_eps=0.2, beta=0.04, samples_per_prompt=8)`, or with `rewards=None, advantages=...`
    (computed elsewhere, `[B]` or `[B, T]`; no group options then); `op.apply(..., contract=...)` is the contract
    path for a single process (TP = DP = 1). The gradient flows into `policy_logits` only."""

    backend = "native"

    def __call__(self, policy_logits: torch.Tensor, ref_logits: torch.Tensor | None, action_ids: torch.Tensor,
                 old_logps: torch.Tensor, rewards: torch.Tensor | None, completion_mask: torch.Tensor,
                 clip_eps: float = 0.2, beta: float = 0.04, samples_per_prompt: int | None = None,
                 group_boundaries: Any = None, *, clip_eps_high: float | None = None,
                 normalizer: TokenNormalizer | str | None = None, normalizer_constant: float | None = None,
                 advantage_std: AdvantageStd | str | None = None, temperature: float = 1.0,
                 advantages: torch.Tensor | None = None, loss_type: str | None = None,
                 max_completion_length: int | None = None, ref_logps: torch.Tensor | None = None,
                 delta: float | None = None, use_bias_correction_kl: bool = False,
                 importance_sampling_ratio: torch.Tensor | None = None, sapo_temperature_pos: float | None = None,
                 sapo_temperature_neg: float | None = None, importance_sampling_level: str = "token",
                 off_policy_mask_threshold: float | None = None, sampling_logps: torch.Tensor | None = None,
                 vespo_k_pos: float | None = None, vespo_lambda_pos: float | None = None,
                 vespo_k_neg: float | None = None, vespo_lambda_neg: float | None = None,
                 entropy_coef: float = 0.0, top_entropy_quantile: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`normalizer` (default global_active_tokens) or TRL's / Liger's `loss_type` ('grpo', 'bnpo',
        'dr_grpo' with `max_completion_length`, default T, or 'dapo'); `advantage_std` (default population) only
        with rewards; `ref_logps` `[B, T]`: the reference's log-probs of the action ids, given in place of
        `ref_logits` (pass `ref_logits=None`). TRL's `delta` (an upper clamp of the unclipped ratio) and
        `use_bias_correction_kl` (the KL term times the ratio); `importance_sampling_ratio` `[B, T]` or `[B, 1]`:
        the rollout engine's importance weights (TRL's `importance_sampling_ratio`, Liger's `vllm_is_ratio`),
        multiplied into each token's surrogate term. `loss_type` 'cispo', 'sapo' (with its temperatures) and 'vespo'
        (with its gamma parameters `vespo_*`, TRL's; the importance sampling ratio enters its gamma weight,
        `canonical.vespo_phi`) change the per-token term (`contract.Surrogate`). `importance_sampling_level="sequence"`
        (GSPO): every token reads its sequence's ratio, the exp of its mean log-ratio (`canonical.sequence_log_ratio`).
        `off_policy_mask_threshold` (DeepSeek-V3.2's off-policy sequence mask, TRL's): a sequence's policy terms are
        dropped where its advantage is negative and its mean of `sampling_logps - logp` (default `old_logps`) exceeds
        the threshold (`canonical.off_policy_weights`). `entropy_coef` (TRL's entropy bonus: the loss minus
        `entropy_coef` times the mean entropy of the policy over the kept active tokens, with its gradient) and
        `top_entropy_quantile` (TRL's: the policy terms kept on the active tokens whose entropy is at least the batch's
        `1 - top_entropy_quantile` quantile, `canonical.entropy_keep`; the KL term on every active token)."""
        o = loss_options(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, clip_eps, beta,
                         samples_per_prompt, group_boundaries, clip_eps_high, normalizer, normalizer_constant,
                         advantage_std, temperature=temperature, advantages=advantages, loss_type=loss_type,
                         max_completion_length=max_completion_length, ref_logps=ref_logps, delta=delta,
                         use_bias_correction_kl=use_bias_correction_kl,
                         importance_sampling_ratio=importance_sampling_ratio,
                         sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                         importance_sampling_level=importance_sampling_level,
                         off_policy_mask_threshold=off_policy_mask_threshold, sampling_logps=sampling_logps,
                         vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                         vespo_lambda_neg=vespo_lambda_neg, entropy_coef=entropy_coef,
                         top_entropy_quantile=top_entropy_quantile)
        return tuple(self._run(policy_logits, ref_logits, ref_logps, action_ids, old_logps, rewards, advantages, o, {},
                               importance_sampling_ratio, sampling_logps))

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
              rewards: torch.Tensor | None = None, *, contract: GRPOLossContract, completion_mask: torch.Tensor,
              ref_local_logits: torch.Tensor | None = None, tp_group: Any = None, dp_group: Any = None,
              advantages: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
              importance_sampling_ratio: torch.Tensor | None = None, sampling_logps: torch.Tensor | None = None
              ) -> GRPOLossResult:
        """`rewards` or `advantages`: the one `contract.advantages_input` declares."""
        reasons = self.supports(contract)
        if reasons:
            raise LossContractError("contract: the native op cannot serve it: " + "; ".join(reasons))
        kind = contract.advantages_input
        check_tensor("policy_logits", policy_local_logits)  # its type, then the contract's shape, then the rest
        expected = (contract.num_sequences, contract.padded_seq_len, contract.vocab_size)
        if tuple(policy_local_logits.shape) != expected:
            raise LossContractError(f"policy_local_logits: expected [num_sequences, padded_seq_len, vocab_size] = "
                                    f"{list(expected)} from the contract, got {list(policy_local_logits.shape)}")
        check_option_inputs(sampling_logps, importance_sampling_ratio, contract.off_policy_mask_threshold,
                            contract.surrogate, contract.padded_seq_len)
        mask = check_inputs(policy_local_logits, ref_local_logits, action_ids, old_logps, rewards, completion_mask,
                            beta=contract.beta, rewards_required=True, advantages=advantages, advantages_input=kind,
                            ref_logps=ref_logps, importance_sampling_ratio=importance_sampling_ratio,
                            sampling_logps=sampling_logps)
        return self._run(policy_local_logits, ref_local_logits, ref_logps, action_ids, old_logps, rewards, advantages,
                         LossOptions.of(contract, mask), {"fingerprint": contract.fingerprint()},
                         importance_sampling_ratio, sampling_logps)

    def _run(self, policy_logits, ref_logits, ref_logps, action_ids, old_logps, rewards, advantages, o: LossOptions,
             extra, is_ratio=None, sampling_logps=None) -> GRPOLossResult:
        mask, old_logps = o.mask, old_logps.detach()  # the gradient flows into policy_logits only
        if o.advantages_input is AdvantagesInput.REWARDS:
            advantages = adv = canonical.group_advantages(rewards.detach(), o.groups, o.std)
        else:
            advantages = advantages.detach().to(torch.float32, copy=True)  # reported as given
            adv = canonical.used_advantages(advantages, mask)
        inv = inverse_temperature(o.temperature)
        logp, ent = (selected_logprobs(policy_logits, action_ids, mask, inv, entropy=True) if o.entropy else
                     (selected_logprobs(policy_logits, action_ids, mask, inv), None))
        logp_ref = None if ref_logps is None else canonical.given_logprobs(ref_logps, mask)
        if ref_logits is not None:
            with torch.no_grad():
                logp_ref = selected_logprobs(ref_logits, action_ids, mask, inv)
        check_logprobs(logp.detach(), logp_ref, mask)
        if o.advantages_input is AdvantagesInput.REWARDS:  # a group whose sum or variance overflowed: NaN
            check_derived_advantages(adv, rewards.detach().to(torch.float32), o.groups)
        ratio, kl_tok = canonical.ratio_and_kl(logp, logp_ref, old_logps, mask, exp=torch.exp, bias_kl=o.bias_kl,
                                               sequence=o.sequence_level)
        lo, hi = canonical.clip_bounds(o.clip_eps, o.clip_eps_high, logp, o.surrogate)
        is_ratio = None if is_ratio is None else canonical.given_logprobs(is_ratio, mask)
        keep = None if ent is None else canonical.entropy_keep(ent.detach(), mask, o.top_entropy)
        is_ratio, phi = canonical.importance_weights(logp, old_logps, adv, mask, is_ratio, o.off_policy, sampling_logps,
                                                     o.gamma, keep=keep)
        policy_tok = canonical.clipped_surrogate(ratio, adv, mask, lo, hi, o.delta, is_ratio, o.surrogate, logp,
                                                 o.taus, sigmoid=torch.sigmoid)
        per_seq_policy, per_seq_kl, counts = (canonical.pair_sum(policy_tok), canonical.pair_sum(kl_tok),
                                              mask.sum(dim=-1))
        loss, policy_loss, kl = canonical.combine(per_seq_policy, per_seq_kl, counts, o.beta, o.normalizer,
                                                  o.constant)
        kept = None if ent is None else (canonical.pair_sum(torch.where(keep, ent, 0.0)), keep.sum(-1))
        if ent is not None and o.entropy_coef != 0.0:
            loss = loss - canonical.entropy_bonus(*kept, o.entropy_coef)[0]
        check_loss(loss.detach())
        ratio_sums, clipped = canonical.sequence_metrics(ratio.detach(), adv, mask, lo, hi)
        clip_fraction, mean_ratio, kl_token_mean = canonical.batch_metrics(ratio_sums, per_seq_kl.detach(), clipped,
                                                                           counts, o.sequence_clip)
        return GRPOLossResult(loss=loss, policy_loss=policy_loss, kl=kl, per_sequence_policy=per_seq_policy.detach(),
                              per_sequence_kl=per_seq_kl.detach(), advantages=advantages,
                              per_sequence_active_tokens=counts, clip_fraction=clip_fraction, mean_ratio=mean_ratio,
                              kl_token_mean=kl_token_mean, vespo_phi=phi,
                              **({} if ent is None else entropy_fields(ent.detach(), canonical.pair_sum(ent.detach()),
                                                                       counts, kept[0].detach(), kept[1])),
                              provenance=provenance(self.backend, policy_logits, **extra))
