"""Distributed GRPO loss over vocab-parallel TP x DP: the same bits at every TP x DP layout, on every machine and
device, because every number is the canonical math of `canonical.py` and every sum has a shape fixed by the
contract:
- vocabulary: fixed-width tiles merged in global tile order (`vocab_parallel_logprob.py`);
- tokens: each sequence's token sum is a `pair_sum` over the fixed `padded_seq_len` extent, computed by the DP
  rank that owns the whole sequence;
- sequences: per-sequence totals travel by `all_gather` in DP-rank order and are summed in global sequence order;
- counts travel as integers; advantages are computed on every rank from the gathered global reward vector (given
  advantages are used as they are, and gathered for the result).
No float is ever `all_reduce`d. The gradient is analytic (`canonical.token_coef`), written chunk by chunk: the
extra memory is one gradient in the logits' dtype plus `O(tokens * vocab / tile_width)`.

A temperature multiplies the fp32 logits by `inv = fp32(1 / temperature)` (one multiply per element, policy and
reference) before the tiles; the gradient is `((coef * grad_output) * inv) * (onehot - softmax(z))`. At 1.0 nothing
is multiplied (the bits of the default math). The Triton kernels (`triton/canonical.py`) and the torch ones compute
the same operations for every option, the advantages, the loss types, the std and the metrics included. At 1x1
on CUDA the Triton forward launches five kernels (four with given advantages) and a few small torch ops, with no
device sync, and the backward one kernel; at TP > 1 the preflight's digest and the gather of the statistics
synchronize.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import canonical, pending
from ..checks import (check_derived_advantages, check_inputs, check_logprobs, check_loss, check_option_inputs,
                      check_tensor, stand_in)
from ..contract import (AdvantagesInput, GRPOLossContract, ImportanceSamplingLevel, LossContractError,
                        inverse_temperature)
from ..result import GRPOLossResult, entropy_fields, provenance
from .preflight import check_logprobs_everywhere, preflight, replicated_digest
from .vocab_parallel_logprob import gather_tile_stats, vocab_parallel_lse, write_grad

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


def replicated_inputs(completion_mask: torch.Tensor, action_ids: torch.Tensor, old_logps: torch.Tensor | None,
                      rewards: torch.Tensor | None, advantages: torch.Tensor | None, ref_logps: torch.Tensor | None,
                      importance_sampling_ratio: torch.Tensor | None, sampling_logps: torch.Tensor | None,
                      **more: torch.Tensor | None) -> dict[str, str | None]:
    """`replicated_digest` of the per-token inputs TP peers must share, each read at active tokens only (masked
    tokens may hold anything), and of `more` as given."""
    active = completion_mask.bool()

    def at_active(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.where(active, t, 0)

    given = None
    if advantages is not None:  # only what active tokens read must agree
        given = torch.where(active if advantages.dim() == 2 else active.any(-1), advantages, 0)
    return replicated_digest(completion_mask=completion_mask, action_ids=at_active(action_ids),
                             old_logps=at_active(old_logps), rewards=rewards, advantages=given,
                             ref_logps=at_active(ref_logps),
                             importance_sampling_ratio=at_active(importance_sampling_ratio),
                             sampling_logps=at_active(sampling_logps), **more)


def gathered_entropy_keep(entropy: torch.Tensor, mask: torch.Tensor, contract: GRPOLossContract,
                          dp_group: Any) -> torch.Tensor:
    """This rank's `[n_local, T]` of `canonical.entropy_keep` over the whole batch's entropies and mask (gathered:
    every rank computes the same quantile): the active tokens whose policy terms are kept (`mask` itself at
    top_entropy_quantile = 1)."""
    top = contract.top_entropy_quantile
    if top == 1.0:
        return mask
    lo, hi = contract.sharding.sequence_bounds
    every = gather_sequences(mask.to(torch.uint8), contract, dp_group).bool()
    return canonical.entropy_keep(gather_sequences(entropy, contract, dp_group), every, top)[lo:hi]


# The stages both contract-path ops (this one and `linear.LinearGRPOLossOp`) walk, in their order: the preflight
# (`preflight.py`), the advantages, the log-probs (each op's own), the token terms and their sums per sequence, the
# gathers over DP (`LossCall.gather`), the finish (the scalars), the checks, the gradient's coefficients, the result.

def advantages_stage(c: LossCall, rewards: torch.Tensor | None, advantages: torch.Tensor | None, k: Any = None):
    """`(advantages of the whole batch, this rank's as the token terms read them, this rank's fp32 rewards, the whole
    batch's)`, the rewards None when the contract takes advantages: from the gathered rewards, normalized per group
    on every rank (`k.group_advantages`, the torch kernels' by default), or as given (gathered for the result)."""
    k = k or _TorchKernels
    if c.contract.advantages_input is AdvantagesInput.REWARDS:
        seq_lo, seq_hi = c.contract.sharding.sequence_bounds
        rewards_local = rewards.detach().to(torch.float32)
        rewards_all = c.gather(rewards_local)
        advantages_all = k.group_advantages(rewards_all, c.contract)
        return advantages_all, advantages_all[seq_lo:seq_hi], rewards_local, rewards_all
    given = advantages.detach().to(torch.float32, copy=True)
    return c.gather(given), k.token_advantages(given, c.mask), None, None


def token_terms(c: LossCall, logp: torch.Tensor, logp_ref: torch.Tensor | None, adv: torch.Tensor,
                ent: torch.Tensor | None, exp: Callable[[torch.Tensor], torch.Tensor],
                token_sum: Callable[[torch.Tensor], torch.Tensor]):
    """The token terms of this rank's sequences (fp32 `[n, T]` log-probs, `ent` the entropies or None) and their
    sums: `(sums [surrogate, KL, ratio (, entropy, kept entropy)] fp32 [n] each, ints [clipped tokens (, kept
    tokens)] int64 [n] each, vespo's phi or None, (ratio, importance weights, kept tokens))`."""
    o = c.contract
    lo_t, hi_t = canonical.fp32(c.clip[0], c.old), canonical.fp32(c.clip[1], c.old)
    ratio, kl_tok = canonical.ratio_and_kl(logp, logp_ref, c.old, c.mask, bias_kl=o.use_bias_correction_kl,
                                           sequence=c.sequence)
    local_ratio, local_clipped = canonical.sequence_metrics(ratio, adv, c.mask, lo_t, hi_t)
    keep = None if ent is None else gathered_entropy_keep(ent, c.mask, o, c.dp_group)
    w_is, phi = c.weights(logp, adv, exp, keep)
    policy = canonical.clipped_surrogate(ratio, adv, c.mask, lo_t, hi_t, o.delta, w_is, o.surrogate, logp,
                                         o.sapo_temperatures)
    sums, ints = [token_sum(policy), token_sum(kl_tok), local_ratio], [local_clipped]
    if ent is not None:  # the entropy's sums over the active tokens and over the kept ones, and the kept tokens
        sums += [token_sum(ent), token_sum(torch.where(keep, ent, 0.0))]
        ints.append(keep.sum(-1))
    return sums, ints, phi, (ratio, w_is, keep)


def finish_stage(sums: torch.Tensor, ints: torch.Tensor, contract: GRPOLossContract):
    """`((loss, policy_loss, kl, clip_fraction, mean_ratio, kl_token_mean), token weights [S])` of the whole batch's
    per-sequence vectors: `sums` as `token_terms` gives them, `ints` [active tokens, non-finite log-probs, clipped
    tokens (, kept tokens)]."""
    counts, _, clipped = ints[:3]
    loss, policy_loss, kl = canonical.combine(sums[0], sums[1], counts, contract.beta, contract.normalizer,
                                              contract.normalizer_value)
    if contract.entropy_coef != 0.0:
        loss = loss - canonical.entropy_bonus(sums[4], ints[3], contract.entropy_coef)[0]
    metrics = canonical.batch_metrics(sums[2], sums[1], clipped, counts)
    return (loss, policy_loss, kl, *metrics), canonical.token_weights(counts, contract.normalizer,
                                                                       contract.normalizer_value)


LOGITS = ("policy_logits", "ref_logits")  # the arguments the log-probs come from, for the messages


def check_everywhere(c: LossCall, flags: torch.Tensor, loss: torch.Tensor, logp: torch.Tensor,
                     logp_ref: torch.Tensor | None, derived: tuple | None, names: tuple[str, str] = LOGITS,
                     kl: torch.Tensor | None = None) -> None:
    """Raises now, on every rank together: every rank holds the gathered `flags` (non-finite log-probs per
    sequence), `derived` (the whole batch's `(advantages, rewards, groups)`, or None) and the loss. `names`: the
    arguments the log-probs come from; `kl`: the per-sequence KL sums, for `check_loss`'s words (`names[1]`)."""
    if bool(flags.any()):
        check_logprobs_everywhere(logp, logp_ref, c.mask, c.gather, names)
    if derived is not None:
        check_derived_advantages(*derived)
    check_loss(loss, kl, names[1])


def loss_coef(c: LossCall, ratio: torch.Tensor, logp: torch.Tensor, logp_ref: torch.Tensor | None, adv: torch.Tensor,
              w: torch.Tensor, w_is: torch.Tensor | None) -> torch.Tensor:
    """Each token's `d loss / d logp` fp32 `[n, T]` (`w`: this rank's sequences' token weights, `finish_stage`)."""
    o = c.contract
    lo_t, hi_t = canonical.fp32(c.clip[0], c.old), canonical.fp32(c.clip[1], c.old)
    return (canonical.sequence_coef if c.sequence else canonical.token_coef)(
        ratio, logp, logp_ref, adv, w, c.mask, lo_t, hi_t, o.beta, o.delta, w_is, o.use_bias_correction_kl,
        o.surrogate, o.sapo_temperatures)


def result_stage(c: LossCall, loss: torch.Tensor, scalars: tuple, sums: torch.Tensor, ints: torch.Tensor,
                 advantages_all: torch.Tensor, phi: torch.Tensor | None, ent: torch.Tensor | None,
                 ran: dict[str, Any]) -> GRPOLossResult:
    """The result from the finished call (`ran`: `provenance` of the op and its kernels, completed here)."""
    o, s = c.contract, c.contract.sharding
    _, policy_loss, kl, clip_fraction, mean_ratio, kl_token_mean = scalars
    if o.sequence_clip:
        clip_fraction = canonical.sequence_clip_fraction(ints[2])
    return GRPOLossResult(
        loss=loss, policy_loss=policy_loss, kl=kl, per_sequence_policy=sums[0], per_sequence_kl=sums[1],
        advantages=advantages_all, per_sequence_active_tokens=ints[0], clip_fraction=clip_fraction,
        mean_ratio=mean_ratio, kl_token_mean=kl_token_mean, vespo_phi=None if phi is None else c.gather(phi),
        **({} if ent is None else entropy_fields(c.gather(ent), sums[3], ints[0], sums[4], ints[3])),
        provenance={**ran, "fingerprint": o.fingerprint(), "tile_width": o.logprob_contract.tile_width,
                    "tp_world_size": s.tp_world_size, "dp_world_size": s.dp_world_size,
                    "determinism_scope": o.determinism_scope.value})


class _Loss(torch.autograd.Function):
    """Forward: the loss computed outside autograd. Backward: `grad_output * coef * (onehot - softmax)` on this
    rank's active rows (with an entropy bonus, plus its term `coef_h * p * (log p + H)`), zeros elsewhere; no
    communication (every rank holds the replicated loss)."""

    @staticmethod
    def forward(ctx, logits, loss, backward):
        ctx.backward_fn = backward
        ctx.save_for_backward(logits)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        return ctx.backward_fn(ctx.saved_tensors[0], grad_loss.to(torch.float32)), None, None


class DistributedGRPOLossOp:
    """`result = op.apply(policy_local_logits, action_ids, old_logps, rewards, contract=..., completion_mask=...,
    ref_local_logits=..., tp_group=..., dp_group=...)`.

    Local tensors: `policy_local_logits` / `ref_local_logits` `[n_local, padded_seq_len, local_vocab]` (this rank's
    sequences and vocab shard), `action_ids` (global ids), `old_logps`, `completion_mask` `[n_local,
    padded_seq_len]`, and `rewards` `[n_local]` or, as `contract.advantages_input` declares, `advantages=`
    `[n_local]` / `[n_local, padded_seq_len]` (TP peers hold the same ones). The result's scalars and
    per-sequence vectors cover the whole batch and are identical on every rank; the gradient flows into this
    rank's shard of the policy logits only (never into `old_logps`, `rewards`, `advantages` or the reference
    logits). Every bad input, on any rank, raises the same `LossContractError` on every rank (`preflight.py` says
    what can and cannot be guaranteed).

    `kernels`: "triton" (the fused kernels of `triton/canonical.py`), "torch" (the reference: torch ops, any device)
    or "auto" (Triton for CUDA tensors when Triton imports, else torch). Both give the same bits.
    """

    backend = "distributed"

    def __init__(self, kernels: str = "auto") -> None:
        if kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels: expected 'auto', 'triton' or 'torch', got {kernels!r}")
        self.kernels = kernels

    def supports(self, contract: GRPOLossContract) -> list[str]:
        s = contract.sharding
        if (s.tp_world_size > 1 or s.dp_world_size > 1) and not dist.is_available():
            return ["torch.distributed is not available in this build of torch"]
        return []

    def _triton_runs(self, logits: torch.Tensor, tile_width: int) -> bool:
        if self.kernels == "torch" or (self.kernels == "auto" and not (
                logits.is_cuda and importlib.util.find_spec("triton") is not None)):
            return False
        if self.kernels == "triton" and not logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise LossContractError(f"kernels: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
                                    f"interpreter), got policy_local_logits on {logits.device}; use kernels='torch'")
        from ..triton.canonical import MAX_TILE
        if tile_width > MAX_TILE:
            if self.kernels == "auto":
                return False
            raise LossContractError(f"vocab_tile: the Triton kernels take tiles of at most {MAX_TILE} columns, got "
                                    f"{tile_width}; use kernels='torch'")
        plane = logits.shape[0] * logits.shape[1] * -(-logits.shape[-1] // tile_width)
        if 1 << 30 <= plane < 1 << 31:  # a 32-bit kernel argument that the row kernel doubles
            if self.kernels == "auto":
                return False
            raise LossContractError(f"vocab_tile: the Triton kernels cannot address the tile statistics of {plane} "
                                    f"(tokens x tiles) tiles, between 2**30 and 2**31; use another vocab_tile or "
                                    f"kernels='torch'")
        return True

    @staticmethod
    def _token_sum(terms: torch.Tensor) -> torch.Tensor:
        """Each sequence's token sum (a fixed tree over `padded_seq_len`)."""
        return canonical.pair_sum(terms)

    def apply(self, policy_local_logits: torch.Tensor, action_ids: torch.Tensor, old_logps: torch.Tensor,
              rewards: torch.Tensor | None = None, *, contract: GRPOLossContract, completion_mask: torch.Tensor,
              ref_local_logits: torch.Tensor | None = None, tp_group: Any = None, dp_group: Any = None,
              check_values: str = "deferred", advantages: torch.Tensor | None = None,
              ref_logps: torch.Tensor | None = None, importance_sampling_ratio: torch.Tensor | None = None,
              sampling_logps: torch.Tensor | None = None) -> GRPOLossResult:
        """`check_values` (the Triton kernels; the torch ones check in the call): "deferred" checks the values
        without a device sync and raises at a later call (at the latest `pending.AHEAD` calls later) or at
        `grpo_core.raise_pending()`, "sync" in this call (`pending.py`). `ref_logps` `[n_local, padded_seq_len]`:
        the reference's log-probs of the action ids, given in place of `ref_local_logits` (the same on TP
        siblings); `importance_sampling_ratio` `[n_local, padded_seq_len]` or `[n_local, 1]`: the rollout's importance
        weights, multiplied into each token's surrogate term (the same on TP siblings); `sampling_logps`
        `[n_local, padded_seq_len]`: the sampler's log-probs for `contract.off_policy_mask_threshold` (default
        `old_logps`; the same on TP siblings)."""
        pending.poll((tp_group, dp_group))  # this op's collective checks: every rank raises at the same call
        triton_runs = False
        tensors = {"policy_local_logits": policy_local_logits, "ref_local_logits": ref_local_logits,
                   "ref_logps": ref_logps, "importance_sampling_ratio": importance_sampling_ratio,
                   "sampling_logps": sampling_logps, "action_ids": action_ids, "old_logps": old_logps,
                   "rewards": rewards, "advantages": advantages, "completion_mask": completion_mask}

        def local_checks() -> torch.Tensor:  # runs inside the preflight: whatever it raises reaches every rank
            nonlocal triton_runs
            pending.poll()  # this process's local checks: what one rank raises here, every rank raises
            pending.check_mode(check_values)
            s = contract.sharding
            (seq_lo, seq_hi), (v_lo, v_hi) = s.sequence_bounds, s.vocab_bounds
            check_tensor("policy_logits", policy_local_logits)  # its type, then the contract's shape, then the rest
            expected = (seq_hi - seq_lo, contract.padded_seq_len, v_hi - v_lo)
            if tuple(policy_local_logits.shape) != expected:
                raise LossContractError(
                    f"policy_local_logits: expected [owned sequences, padded_seq_len, local vocab] = {list(expected)}"
                    f" from the contract (sequences {seq_lo}:{seq_hi}, vocab {v_lo}:{v_hi}), got "
                    f"{list(policy_local_logits.shape)}")
            triton_runs = self._triton_runs(policy_local_logits, contract.vocab_tile)
            check_option_inputs(sampling_logps, importance_sampling_ratio, contract.off_policy_mask_threshold,
                                contract.surrogate, contract.padded_seq_len)
            return check_inputs(policy_local_logits, ref_local_logits, action_ids, old_logps, rewards, completion_mask,
                                beta=contract.beta, vocab_size=contract.vocab_size, num_rewards=seq_hi - seq_lo,
                                rewards_required=True, values=not triton_runs, advantages=advantages,
                                advantages_input=contract.advantages_input, ref_logps=ref_logps,
                                importance_sampling_ratio=importance_sampling_ratio,
                                sampling_logps=sampling_logps)  # Triton: flags, no sync

        def replicated() -> dict[str, str | None]:  # compared on the TP axis only
            if contract.sharding.tp_world_size == 1:
                return {}
            return replicated_inputs(completion_mask, action_ids, old_logps, rewards, advantages, ref_logps,
                                     importance_sampling_ratio, sampling_logps)

        mask = preflight(contract, BACKEND_ID, tensors, local_checks, replicated, tp_group, dp_group,
                         lambda: {"kernels": "triton" if triton_runs else "torch", "check_values": check_values})
        k = _TritonKernels() if triton_runs else _TorchKernels(self._token_sum)
        c = LossCall.of(contract, mask, action_ids, completion_mask, old_logps, importance_sampling_ratio,
                        sampling_logps, tp_group, dp_group, check_values)
        seq_lo, seq_hi = contract.sharding.sequence_bounds
        advantages_all, adv, rewards_local, rewards_all = advantages_stage(c, rewards, advantages, k)
        given_ref = None if ref_logps is None else canonical.given_logprobs(ref_logps, mask)
        ref = None if ref_local_logits is None else ref_local_logits.detach()
        logp, logp_ref, sums, ints, phi, ent, state = k.forward(c, policy_local_logits.detach(), ref, given_ref, adv,
                                                                rewards_local)
        # Every rank holds the whole batch's per-sequence vectors, gathered in DP-rank order.
        ints, sums = c.gather(ints.T).T.contiguous(), c.gather(sums.T).T.contiguous()
        scalars, w, flag = k.finish(sums, ints, contract)
        loss = scalars[0]
        k.settle(c, (policy_local_logits, ref_local_logits, ref_logps, old_logps, rewards, advantages,
                     importance_sampling_ratio, sampling_logps), flag, ints[1],
                 loss, logp, logp_ref, None if rewards_all is None else (advantages_all, rewards_all, contract.groups))
        if policy_local_logits.requires_grad and torch.is_grad_enabled():
            w = w[seq_lo:seq_hi]
            ent_w = None if ent is None else canonical.entropy_bonus(sums[4], ints[3], contract.entropy_coef)[1]
            loss = _Loss.apply(policy_local_logits, loss,
                               lambda logits, grad_loss: k.grad(c, state, logp, logp_ref, w, logits, grad_loss, ent_w))
        return result_stage(c, loss, scalars, sums, ints, advantages_all, phi, ent,
                            provenance(self.backend, policy_local_logits, backend_id=BACKEND_ID, kernels=k.name))


@dataclass(frozen=True)
class LossCall:
    """What the kernel sets read of one call, and the options they take. The inputs that only a deferred check
    re-reads go to `settle` alone: the gradient's closure keeps this, and must not keep the logits alive."""

    contract: GRPOLossContract
    mask: torch.Tensor  # bool [n_local, T]
    action_ids: torch.Tensor
    completion_mask: torch.Tensor  # as given (the Triton kernels check its values)
    old: torch.Tensor  # fp32, detached: the gradient flows into the policy logits only
    inv: float  # fp32(1 / temperature)
    clip: tuple[float, float]  # the ratio's bounds (`canonical.bounds`)
    tp_group: Any
    dp_group: Any
    check_values: str
    is_ratio: torch.Tensor | None  # fp32 [n_local, T], 0.0 on masked tokens (`canonical.given_logprobs`)
    sequence: bool  # GSPO: every token reads its sequence's ratio (`canonical.sequence_coef` for the gradient)
    sampling: torch.Tensor | None  # fp32 [n_local, T]: the off-policy mask's sampler log-probs (None: `old`)

    @classmethod
    def of(cls, contract: GRPOLossContract, mask: torch.Tensor, action_ids: torch.Tensor,
           completion_mask: torch.Tensor, old_logps: torch.Tensor | None,
           importance_sampling_ratio: torch.Tensor | None, sampling_logps: torch.Tensor | None, tp_group: Any,
           dp_group: Any, check_values: str = "sync") -> LossCall:
        """The call's inputs as the stages read them (`old_logps` None: `old` None until the op's own log-probs
        take its place)."""
        def fp32(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(torch.float32)

        return cls(contract, mask, action_ids, completion_mask, fp32(old_logps),
                   inverse_temperature(contract.temperature),
                   canonical.bounds(contract.clip_eps, contract.clip_eps_high, contract.surrogate), tp_group, dp_group,
                   check_values, None if importance_sampling_ratio is None else
                   canonical.given_logprobs(importance_sampling_ratio, mask),
                   contract.importance_sampling_level is ImportanceSamplingLevel.SEQUENCE, fp32(sampling_logps))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return gather_sequences(local, self.contract, self.dp_group)

    def weights(self, logp: torch.Tensor, adv: torch.Tensor, exp: Callable[[torch.Tensor], torch.Tensor],
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`(weights, phi)`: the importance weights the token terms read (`is_ratio`, or vespo's gamma weight, with the
        off-policy mask and the entropy mask `keep` folded in when the contract sets them) and vespo's phi of this
        rank's sequences (`canonical.importance_weights`, from this rank's whole sequences)."""
        o = self.contract
        return canonical.importance_weights(logp, self.old, adv, self.mask, self.is_ratio,
                                            o.off_policy_mask_threshold, self.sampling, o.vespo_gamma, exp, keep)


class _TorchKernels:
    """The reference kernels, torch ops on any device. The preflight reads the values (a device sync); a non-finite
    log-prob, derived advantage or loss raises in the call, on every rank (every rank holds what it is read from)."""

    name = "torch"

    def __init__(self, token_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.token_sum = token_sum  # each sequence's token sum (the harness plants a drift here)

    @staticmethod
    def group_advantages(rewards: torch.Tensor, contract: GRPOLossContract) -> torch.Tensor:
        return canonical.group_advantages(rewards, contract.groups, contract.advantage_std)

    @staticmethod
    def token_advantages(given: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return canonical.used_advantages(given, mask)

    def forward(self, c: LossCall, x, ref, given_ref, adv, rewards):
        """`(logp, logp_ref, per-sequence sums fp32 [3, n] (surrogate, KL, ratio), ints int64 [3, n] (active tokens,
        non-finite log-probs, clipped tokens), vespo's phi (or None), what the gradient needs)`. (`rewards`: the
        Triton kernels' use.)"""
        n, T = c.mask.shape
        lp = c.contract.logprob_contract
        rows = c.mask.reshape(-1).nonzero().squeeze(1)
        ids = c.action_ids.reshape(-1)[rows].long()

        def logprobs(logits: torch.Tensor, entropy: bool = False):
            lse, selected, *h = vocab_parallel_lse(logits.reshape(n * T, -1), rows, ids, lp, c.tp_group, c.inv,
                                                   entropy)
            full = torch.zeros(n * T, dtype=torch.float32, device=x.device)
            ent = [full.index_put((rows,), h[0]).view(n, T)] if h else []
            return full.index_put((rows,), selected - lse).view(n, T), lse, *ent

        logp, lse, *ent = logprobs(x, c.contract.entropy)
        ent = ent[0] if ent else None
        logp_ref = given_ref if ref is None else logprobs(ref)[0]
        sums, ints, phi, (ratio, w_is, keep) = self.terms(c, logp, logp_ref, adv, ent, rewards)
        return logp, logp_ref, sums, ints, phi, ent, (rows, ids, lse, ratio, adv, w_is, keep, ent)

    def terms(self, c: LossCall, logp, logp_ref, adv, ent, rewards):
        """From this rank's fp32 `[n, T]` log-probs (`ent`: the entropies, or None): `(per-sequence sums fp32 [3, n]
        (surrogate, KL, ratio (, entropy, kept entropy)), ints int64 [3, n] (active tokens, non-finite log-probs
        (the preflight checked the inputs' values), clipped tokens (, kept tokens)), vespo's phi (or None), (ratio,
        importance weights, kept tokens))` (`token_terms`). (`rewards`: the Triton kernels' use.)"""
        sums, ints, phi, state = token_terms(c, logp, logp_ref, adv, ent, canonical.exp, self.token_sum)
        finite = torch.isfinite(logp) if logp_ref is None else torch.isfinite(logp) & torch.isfinite(logp_ref)
        return torch.stack(sums), torch.stack([c.mask.sum(-1), (c.mask & ~finite).sum(-1), *ints]), phi, state

    @staticmethod
    def finish(sums: torch.Tensor, ints: torch.Tensor, contract: GRPOLossContract):
        """`finish_stage`, and no flag."""
        return (*finish_stage(sums, ints, contract), None)

    @staticmethod
    def settle(c: LossCall, inputs, flag, flags, loss, logp, logp_ref, derived, names=LOGITS, kl=None,
               label=None) -> None:
        """Raises now (`check_everywhere`, `names` and `kl` as there). (`inputs`, `flag` (None here) and `label`: the
        Triton kernels' use.)"""
        check_everywhere(c, flags, loss, logp, logp_ref, derived, names, kl)

    @staticmethod
    def grad(c: LossCall, state, logp, logp_ref, w, logits, grad_loss, entropy_weight=None) -> torch.Tensor:
        """`d loss / d logits` times `grad_loss`; `entropy_weight` (fp32 0-d): each kept token's weight in the entropy
        bonus (`canonical.entropy_bonus`)."""
        rows, ids, lse, ratio, adv, w_is, keep, ent = state
        o = c.contract
        coef = loss_coef(c, ratio, logp, logp_ref, adv, w, w_is)
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.zeros(flat.shape, dtype=logits.dtype, device=logits.device)
        scaled = coef.reshape(-1)[rows] * grad_loss
        if c.inv != 1.0:
            scaled = scaled * canonical.fp32(c.inv, scaled)
        entropy = None
        if o.entropy_coef != 0.0:  # each kept token's weight in the bonus, times grad_output and 1 / temperature
            coef_h = torch.where(keep, entropy_weight, 0.0).reshape(-1)[rows] * grad_loss
            if c.inv != 1.0:
                coef_h = coef_h * canonical.fp32(c.inv, coef_h)
            entropy = (coef_h, ent.reshape(-1)[rows])
        write_grad(grad, flat, rows, ids - c.contract.sharding.vocab_bounds[0], lse, scaled,
                   c.contract.logprob_contract.tile_width, c.inv, entropy)
        return grad.view(logits.shape)


class _TritonKernels:
    """The fused kernels of `triton/canonical.py` (CUDA, or the interpreter). They flag bad values per sequence,
    which `pending` reads without a device sync ("deferred") or with one ("sync")."""

    name = "triton"

    @staticmethod
    def group_advantages(rewards: torch.Tensor, contract: GRPOLossContract) -> torch.Tensor:
        from ..triton import canonical as kernels
        return kernels.group_advantages(rewards, contract.groups, contract.advantage_std)

    @staticmethod
    def token_advantages(given: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return given  # the kernels read what active tokens read

    @staticmethod
    def forward(c: LossCall, x, ref, given_ref, adv, rewards):
        """As `_TorchKernels.forward`; the flags also cover the inputs' values (`kernels.sequence_sums`), and
        `rewards` (fp32, this rank's, or None) are checked."""
        from ..triton import canonical as kernels
        n, T = c.mask.shape
        lp = c.contract.logprob_contract
        o = c.contract
        sel, stats = kernels.row_stats(x, ref, c.action_ids, c.mask, lp.local_bounds[0], lp.tile_width, c.inv,
                                       o.entropy)
        stats, sel = stats[:1 + (ref is not None)], sel[:1 + (ref is not None)]
        if len(lp.vocab_shard_bounds) > 1:  # every rank's tiles, in global order (the policy's entropy sums too)
            ids = c.action_ids.reshape(-1).long()
            gathered = [gather_tile_stats(st[0], st[1], z, ids, lp, c.tp_group, *st[2:3 - k])
                        for k, (st, z) in enumerate(zip(stats, sel))]
            stats = torch.stack([torch.stack([g[0], g[1], *g[3:], *[torch.zeros_like(g[0])] * (o.entropy and k > 0)])
                                 for k, g in enumerate(gathered)])
            sel = torch.stack([g[2] for g in gathered])
        sel = sel.contiguous()  # replaced by the log-probs
        lse, *ent = (kernels.merge_lse(stats, c.mask, True, sel) if o.entropy else
                     (kernels.merge_lse(stats, c.mask, selected=sel),))
        ent = ent[0].view(n, T) if ent else None
        logp = sel.view(-1, n, T)
        logp_ref = logp[1] if ref is not None else given_ref
        sums, ints, phi, (ratio, w_is, keep) = _TritonKernels.terms(c, logp[0], logp_ref, adv, ent, rewards)
        return logp[0], logp_ref, sums, ints, phi, ent, (lse[0], adv, ratio, w_is, keep, ent)

    @staticmethod
    def terms(c: LossCall, logp, logp_ref, adv, ent, rewards):
        """As `_TorchKernels.terms`, the token terms and their sums in one kernel (`kernels.sequence_sums`), whose
        flags also cover the inputs' values (`rewards`: fp32, this rank's, or None, are checked). The ratio: GSPO's
        sequence ratios, else None (the kernel's alone)."""
        from ..triton import canonical as kernels
        o = c.contract
        ratio = None  # GSPO: the sequence ratios of `canonical`, read by the kernels and the gradient
        if c.sequence:
            ratio = canonical.ratio_and_kl(logp, None, c.old, c.mask, kernels.exp_of, sequence=True)[0]
        keep = None if ent is None else gathered_entropy_keep(ent, c.mask, c.contract, c.dp_group)
        used = o.vespo_gamma is not None or o.off_policy_mask_threshold is not None  # what reads the advantages
        w_is, phi = c.weights(logp, canonical.used_advantages(adv, c.mask) if used else adv, kernels.exp_of, keep)
        sums, ints = kernels.sequence_sums(logp, logp_ref, c.old, c.completion_mask, c.action_ids, adv, rewards,
                                           o.vocab_size, *c.clip, o.delta, w_is, o.use_bias_correction_kl,
                                           o.surrogate, o.sapo_temperatures, ratio)
        if c.sampling is not None:  # a +-inf sampler log-prob at an active token: the sequence's bad-value flag
            ints[1] |= (c.mask & torch.isinf(c.sampling)).any(-1)
        if c.is_ratio is not None and w_is is not c.is_ratio:  # the kernels read the computed weights: the given
            ints[1] |= (c.mask & ~((c.is_ratio >= 0.0) & (c.is_ratio < math.inf))).any(-1)  # ones here
        if ent is not None:  # the entropy's sums over the active tokens and over the kept ones, the kept tokens
            sums = torch.cat([sums, torch.stack([canonical.pair_sum(ent), canonical.pair_sum(torch.where(keep, ent,
                                                                                                       0.0))])])
            ints = torch.cat([ints, keep.sum(-1)[None]])
        return sums, ints, phi, (ratio, w_is, keep)

    @staticmethod
    def finish(sums: torch.Tensor, ints: torch.Tensor, contract: GRPOLossContract):
        """As `_TorchKernels.finish`, in one kernel, and the flag: the largest of the gathered per-sequence flags,
        or 1 where the loss is not finite."""
        from ..triton import canonical as kernels
        scalars, w, flag = kernels.finish(sums, ints, contract.beta, contract.normalizer, contract.normalizer_value)
        scalars = tuple(scalars)
        if contract.entropy_coef != 0.0:  # the flag covers the loss with its bonus
            scalars = (scalars[0] - canonical.entropy_bonus(sums[4], ints[3], contract.entropy_coef)[0], *scalars[1:])
            flag = torch.maximum(flag, (~torch.isfinite(scalars[0])).to(flag.dtype))
        return scalars, w, flag

    @staticmethod
    def settle(c: LossCall, inputs, flag, flags, loss, logp, logp_ref, derived, names=LOGITS, kl=None,
               label="grpo_loss (distributed, triton kernels)") -> None:
        """Hands `flag` to `pending` with this rank's `inputs` (policy and reference logits (or what has their shape,
        dtype and device), `ref_logps`, `old_logps`, rewards, advantages, as given) by `c.check_values`; the precise
        error comes from the rank that holds the bad value, the others name the sequences; every rank of the world
        raises at the same call (the world's groups are the key of its deferred checks). `names`, `kl`: as in
        `check_everywhere`; `label`: the op, in a deferred error."""
        s, contract = c.contract.sharding, c.contract
        seq_lo, seq_hi = s.sequence_bounds
        policy, ref, ref_logps, old_logps, rewards, advantages, is_ratio, sampling = inputs
        kept = [None if t is None else t.detach() for t in (c.action_ids, old_logps, rewards, c.completion_mask,
                                                            advantages, ref_logps, is_ratio, sampling)]
        logits = [None if t is None else (t.shape, t.dtype, t.device) for t in (policy, ref)]  # not kept alive

        def recheck() -> None:
            mask = check_inputs(*(None if t is None else stand_in(*t) for t in logits), *kept[:4], beta=contract.beta,
                                vocab_size=contract.vocab_size, num_rewards=seq_hi - seq_lo, rewards_required=True,
                                advantages=kept[4], advantages_input=contract.advantages_input, ref_logps=kept[5],
                                importance_sampling_ratio=kept[6], sampling_logps=kept[7])
            check_logprobs(logp, logp_ref, mask, names)
            if derived is not None:
                check_derived_advantages(*derived)
            if not bool(flags.any()):  # no input flagged on any rank: the loss itself (`_finish_kernel`'s flag)
                check_loss(loss, kl, names[1])
            if s.tp_world_size * s.dp_world_size == 1:  # no other rank: `pending` says the inputs changed since
                return
            seqs = flags.nonzero().flatten()[:8].tolist()
            raise LossContractError(f"sequences {seqs} hold a bad input value (an id, mask value, reward, advantage, "
                                    f"old, reference or sampling log-prob, importance sampling ratio, or a non-finite "
                                    f"log-prob) on another rank, which names it")

        if c.check_values == "sync":
            pending.raise_now(flag, recheck)
        else:
            pending.defer(flag, recheck, label,
                          group=(c.tp_group, c.dp_group) if s.tp_world_size * s.dp_world_size > 1 else None)

    @staticmethod
    def grad(c: LossCall, state, logp, logp_ref, w, logits, grad_loss, entropy_weight=None) -> torch.Tensor:
        from ..triton import canonical as kernels
        lse, adv, ratio, w_is, keep, ent = state
        o = c.contract
        coef = None
        if ratio is not None:
            lo_t, hi_t = canonical.fp32(c.clip[0], c.old), canonical.fp32(c.clip[1], c.old)
            coef = canonical.sequence_coef(ratio, logp, logp_ref, canonical.used_advantages(adv, c.mask), w, c.mask,
                                           lo_t, hi_t, o.beta, o.delta, w_is, o.use_bias_correction_kl,
                                           o.surrogate, o.sapo_temperatures, kernels.exp_of, kernels.sigmoid_of)
        return kernels.grad(logits, c.action_ids, c.mask, logp, logp_ref, c.old, adv, w, lse, grad_loss,
                            o.sharding.vocab_bounds[0], *c.clip, o.beta, c.inv, delta=o.delta, is_ratio=w_is,
                            bias_kl=o.use_bias_correction_kl, surrogate=o.surrogate, taus=o.sapo_temperatures,
                            coef=coef, entropy=None if o.entropy_coef == 0.0 else (
                                torch.where(keep, entropy_weight, 0.0).reshape(-1) * grad_loss, ent.reshape(-1)))
