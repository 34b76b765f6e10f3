"""The input checks every backend shares, so that one bad input gives the same `LossContractError`, word for word,
on every backend: an argument of the wrong type, a tensor of the wrong shape, dtype or device, a non-finite reward
(after the cast to float32), old log-prob, given advantage, given reference log-prob or selected log-prob at an active
token, a loss that overflows float32. Masked tokens are never checked: they may hold anything. `loss_options` is the
one place that turns a plain call's arguments into resolved options (`LossOptions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .contract import (AdvantagesInput, AdvantageStd, GRPOLossContract, ImportanceSamplingLevel, LossContractError,
                       Surrogate, TokenNormalizer, check_groups, check_max_length_product, check_no_groups,
                       VESPO_GAMMA, check_options, normalizer_value, sequence_clip, surrogate_of)

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHOWN = 8  # how many bad positions an error lists


def _type_name(value: Any) -> str:
    if value is None:
        return "None"
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def check_tensor(name: str, value: Any, *, optional: bool = False) -> None:
    """`value` must be a dense `torch.Tensor` with data (None too when `optional`) whose values are its storage's;
    checked before anything reads it."""
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        hint = "; convert it with torch.from_numpy(...)" if type(value).__module__ == "numpy" else ""
        raise LossContractError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, got "
                                f"{_type_name(value)}{hint}")
    if value.device.type == "meta":
        raise LossContractError(f"{name}: expected a tensor with data (on the CPU or a GPU), got a meta-device "
                                f"tensor of shape {list(value.shape)}")
    if value.layout != torch.strided:
        raise LossContractError(f"{name}: expected a dense (strided) tensor, got layout {value.layout}; convert it "
                                f"with .to_dense()")
    # The kernels read the storage, not a lazy view over it (inside a compiled graph dynamo cannot trace the query)
    if not torch.compiler.is_compiling() and (value.is_neg() or value.is_conj()):
        raise LossContractError(f"{name}: expected a tensor without a lazy negation or conjugation bit, got one; "
                                f"materialize it with .resolve_neg() / .resolve_conj()")


def _tokens(bad: torch.Tensor) -> str:
    """The first few `(b, t)` positions where `bad` `[B, T]` is set, and how many there are in all."""
    where = torch.nonzero(bad)
    shown = [tuple(p) for p in where[:_SHOWN].tolist()]
    return f"{shown}" + (f" ({where.shape[0]} in all)" if where.shape[0] > _SHOWN else "")


def _shape(name: str, t: Any, expected: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != expected:
        raise LossContractError(f"{name}: expected shape {what} = {list(expected)}, got {list(t.shape)}")


def check_one_source(rewards: Any, advantages: Any) -> None:
    """A loss takes exactly one of `rewards` (normalized per group by the op) and `advantages` (given)."""
    if rewards is None and advantages is None:
        raise LossContractError("rewards: expected a torch.Tensor, got None, and advantages is None too: pass exactly "
                                "one of rewards / advantages (advantages computed elsewhere, [B] or [B, T])")
    if rewards is not None and advantages is not None:
        raise LossContractError("rewards / advantages: expected exactly one of them, got both; pass rewards (the op "
                                "normalizes them per group) or advantages (used as given)")


def advantages_kind(advantages: torch.Tensor | None) -> AdvantagesInput:
    """Which input a (shape-checked) call gives: rewards (no advantages), or advantages per sequence / token."""
    if advantages is None:
        return AdvantagesInput.REWARDS
    return AdvantagesInput.TOKEN if advantages.dim() == 2 else AdvantagesInput.SEQUENCE


_SOURCE_WORDS = {AdvantagesInput.REWARDS: "rewards", AdvantagesInput.SEQUENCE: "advantages [B] (one per sequence)",
                 AdvantagesInput.TOKEN: "advantages [B, T] (one per token)"}


def stand_in(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor with this shape, dtype and device and no storage to speak of (one element, expanded): what
    `check_inputs` reads of the logits when a check runs after the call."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def check_inputs(policy_logits: Any, ref_logits: Any, action_ids: Any, old_logps: Any, rewards: Any,
                 completion_mask: Any, *, beta: float, vocab_size: int | None = None,
                 num_rewards: int | None = None, values: bool = True, rewards_required: bool = False,
                 advantages: Any = None, advantages_input: AdvantagesInput | None = None,
                 ref_logps: Any = None, importance_sampling_ratio: Any = None,
                 sampling_logps: Any = None) -> torch.Tensor:
    """Checks the loss inputs against each other and returns the completion mask as bool `[B, T]`.

    Types first: every argument must be a tensor with data (`ref_logits` may be None, and so may `ref_logps`, the
    reference's log-probs `[B, T]` given in its place: at most one of the two, and one when beta > 0; `rewards` and
    `advantages` too, but a loss, `rewards_required`, takes exactly one of them). `policy_logits` is
    `[B, T, V_local]`; `vocab_size` is the global vocabulary that `action_ids` index (default: `V_local`).
    `num_rewards` (default `B`) is the number of sequences that `rewards` `[n]` and `advantages` `[n]` or `[n, T]`
    cover. `advantages_input` (the contract path): the input the contract declares. Values: rewards must be
    finite once cast to float32 (the loss's precision), ids in range and `old_logps` and advantages finite (in
    float32) at active tokens (a sequence's advantage where it has one), and so must given `ref_logps`; masked
    positions may hold anything (padding ids, NaN). `importance_sampling_ratio` (optional): the rollout engine's
    importance weights, `[B, T]` or `[B, 1]` (one per sequence), finite and >= 0 where an active token reads them.
    `sampling_logps` (optional, `[B, T]`): the sampler's log-probs for the off-policy mask, not +-inf at active
    tokens (NaN: a token the sampler did not score). `values=False` checks types, shapes, dtypes and devices only
    (no device sync): the caller then owes `check_inputs(..., values=True)` when its kernels flag bad values.
    """
    for name, t, optional in (("policy_logits", policy_logits, False), ("ref_logits", ref_logits, True),
                              ("ref_logps", ref_logps, True),
                              ("importance_sampling_ratio", importance_sampling_ratio, True),
                              ("sampling_logps", sampling_logps, True), ("action_ids", action_ids, False),
                              ("old_logps", old_logps, False),
                              ("rewards", rewards, None), ("advantages", advantages, None),
                              ("completion_mask", completion_mask, False)):
        if optional is not None or t is not None:  # rewards / advantages: None is `check_one_source`'s matter
            check_tensor(name, t, optional=bool(optional))
    if rewards_required:
        check_one_source(rewards, advantages)
    if policy_logits.dim() != 3:
        raise LossContractError(f"policy_logits: expected a 3-D tensor [B, T, V], got {list(policy_logits.shape)}")
    B, T, V = policy_logits.shape
    vocab_size = V if vocab_size is None else vocab_size
    for name, t in (("policy_logits", policy_logits), ("ref_logits", ref_logits)):
        if t is not None and t.dtype not in _LOGIT_DTYPES:
            raise LossContractError(f"{name}: expected dtype float32, float16 or bfloat16, got {t.dtype}")
    if ref_logits is not None and ref_logps is not None:
        raise LossContractError("ref_logits / ref_logps: expected at most one reference, got both (the reference "
                                "model's logits, or its log-probs of the action ids)")
    if ref_logits is None and ref_logps is None:
        if beta != 0.0:
            raise LossContractError(f"ref_logits: required when beta > 0 (beta={beta}); pass the reference "
                                    f"model's logits, or its log-probs as ref_logps, or set beta=0")
    elif ref_logits is not None:
        _shape("ref_logits", ref_logits, (B, T, V), "[B, T, V] like policy_logits")
    else:
        _shape("ref_logps", ref_logps, (B, T), "[B, T]")
        if not ref_logps.is_floating_point():
            raise LossContractError(f"ref_logps: expected a floating dtype, got {ref_logps.dtype}")
    weights = importance_sampling_ratio
    if weights is not None:
        if tuple(weights.shape) not in ((B, T), (B, 1)):
            raise LossContractError(f"importance_sampling_ratio: expected shape [B, T] = [{B}, {T}] (one per token) or "
                                    f"[B, 1] = [{B}, 1] (one per sequence), got {list(weights.shape)}")
        if not weights.is_floating_point():
            raise LossContractError(f"importance_sampling_ratio: expected a floating dtype, got {weights.dtype}")
    if sampling_logps is not None:
        _shape("sampling_logps", sampling_logps, (B, T), "[B, T]")
        if not sampling_logps.is_floating_point():
            raise LossContractError(f"sampling_logps: expected a floating dtype, got {sampling_logps.dtype}")
    if completion_mask.dim() != 2:
        raise LossContractError(f"completion_mask: expected a 2-D tensor [B, T], got {list(completion_mask.shape)}")
    _shape("completion_mask", completion_mask, (B, T), "[B, T]")
    _shape("action_ids", action_ids, (B, T), "[B, T]")
    _shape("old_logps", old_logps, (B, T), "[B, T]")
    n = B if num_rewards is None else num_rewards
    if rewards is not None:
        _shape("rewards", rewards, (n,), "[B]")
        if not (rewards.is_floating_point() or rewards.dtype in (torch.int64, torch.int32)):
            raise LossContractError(f"rewards: expected a floating or integer dtype, got {rewards.dtype}")
    if advantages is not None:
        if tuple(advantages.shape) not in ((n,), (n, T)):
            raise LossContractError(f"advantages: expected shape [B] = [{n}] (one per sequence) or [B, T] = [{n}, {T}] "
                                    f"(one per token), got {list(advantages.shape)}")
        if not advantages.is_floating_point():
            raise LossContractError(f"advantages: expected a floating dtype, got {advantages.dtype}")
    if advantages_input is not None and (rewards is not None or advantages is not None):
        given = advantages_kind(advantages)
        if given is not advantages_input:
            raise LossContractError(f"{'rewards' if advantages is None else 'advantages'}: the contract takes "
                                    f"{_SOURCE_WORDS[advantages_input]} (advantages_input={advantages_input.value!r}), "
                                    f"got {_SOURCE_WORDS[given]}")
    if action_ids.dtype not in (torch.int64, torch.int32):
        raise LossContractError(f"action_ids: expected dtype int64 or int32, got {action_ids.dtype}")
    if not old_logps.is_floating_point():
        raise LossContractError(f"old_logps: expected a floating dtype, got {old_logps.dtype}")
    for name, t in (("ref_logits", ref_logits), ("ref_logps", ref_logps), ("importance_sampling_ratio", weights),
                    ("sampling_logps", sampling_logps), ("action_ids", action_ids),
                    ("old_logps", old_logps), ("rewards", rewards), ("advantages", advantages),
                    ("completion_mask", completion_mask)):
        if t is not None and t.device != policy_logits.device:
            raise LossContractError(f"{name}: expected device {policy_logits.device} like policy_logits, "
                                    f"got {t.device}")
    if rewards is not None and values:
        finite = torch.isfinite(rewards.to(torch.float32))  # after the cast: 1e300 in float64 is inf in float32
        if not bool(finite.all()):
            bad = torch.nonzero(~finite).flatten()[:_SHOWN].tolist()
            raise LossContractError(f"rewards: expected finite values, got non-finite at sequences {bad} (checked "
                                    f"in float32, the precision the loss computes in: got "
                                    f"{rewards[bad].tolist()} as {rewards.dtype})")
    if completion_mask.dtype == torch.bool:
        mask = completion_mask
    else:
        mask = completion_mask != 0
        if values and bool((completion_mask[mask] != 1).any()):
            raise LossContractError(f"completion_mask: expected bool or 0/1 values, got other values "
                                    f"(dtype {completion_mask.dtype})")
    if not values:
        return mask
    active_ids = action_ids[mask]
    out_of_range = (active_ids < 0) | (active_ids >= vocab_size)
    if bool(out_of_range.any()):
        bad = active_ids[out_of_range][:_SHOWN].tolist()
        raise LossContractError(f"action_ids: expected ids in [0, {vocab_size}) at active tokens, got {bad}")
    bad_old = mask & ~torch.isfinite(old_logps.to(torch.float32))
    if bool(bad_old.any()):
        raise LossContractError(f"old_logps: expected finite values at active tokens, got non-finite at (b, t) "
                                f"{_tokens(bad_old)}")
    if ref_logps is not None:
        bad_ref = mask & ~torch.isfinite(ref_logps.to(torch.float32))
        if bool(bad_ref.any()):
            raise LossContractError(f"ref_logps: expected finite values at active tokens, got non-finite at (b, t) "
                                    f"{_tokens(bad_ref)} (checked in float32)")
    if weights is not None:
        w32 = weights.to(torch.float32)
        bad_w = mask & ~((w32 >= 0.0) & (w32 < math.inf))  # NaN fails both
        if bool(bad_w.any()):
            raise LossContractError(f"importance_sampling_ratio: expected finite values >= 0 at active tokens, got "
                                    f"others at (b, t) {_tokens(bad_w)} (checked in float32)")
    if sampling_logps is not None:
        bad_s = mask & torch.isinf(sampling_logps.to(torch.float32))
        if bool(bad_s.any()):
            raise LossContractError(f"sampling_logps: expected finite values (or NaN: not scored) at active tokens, "
                                    f"got +-inf at (b, t) {_tokens(bad_s)} (checked in float32)")
    if advantages is not None:
        finite = torch.isfinite(advantages.to(torch.float32))  # after the cast, like rewards
        if advantages.dim() == 2:
            bad_adv = mask & ~finite
            if bool(bad_adv.any()):
                raise LossContractError(f"advantages: expected finite values at active tokens, got non-finite at "
                                        f"(b, t) {_tokens(bad_adv)} (checked in float32)")
        else:
            bad_seq = torch.nonzero(mask.any(-1) & ~finite).flatten()
            if bad_seq.numel():
                raise LossContractError(f"advantages: expected finite values for sequences with an active token, got "
                                        f"non-finite at sequences {bad_seq[:_SHOWN].tolist()} (checked in float32)")
    return mask


def check_logprobs(logp: torch.Tensor, logp_ref: torch.Tensor | None, mask: torch.Tensor,
                   names: tuple[str, str] = ("policy_logits", "ref_logits")) -> None:
    """Every backend's check of its selected log-probs (fp32 `[B, T]` each, `logp_ref` None without a
    reference; `mask` bool `[B, T]`): at active tokens they must be finite, else the same `LossContractError`
    on every backend, naming `policy_logits` (checked first) or `ref_logits` and the `(b, t)` tokens (`names`: the
    arguments the logits come from, e.g. the hidden states and the weight of the fused linear loss).

    NaN means the token's row holds a NaN or +inf logit (or no finite logit at all); -inf means the action's
    probability is 0 (its logit is -inf, or so far below the row's others that its probability underflows).
    -inf logits elsewhere in a row are legal (vocabulary masking) and give finite log-probabilities."""
    for name, lp in zip(names, (logp, logp_ref)):
        if lp is None:
            continue
        nan, neg = mask & ~torch.isfinite(lp) & (lp != -math.inf), mask & (lp == -math.inf)
        if bool((nan | neg).any()):
            causes = []
            if bool(nan.any()):
                causes.append(f"NaN at (b, t) {_tokens(nan)}: the row holds a NaN or +inf logit (or no finite one)")
            if bool(neg.any()):
                causes.append(f"-inf at (b, t) {_tokens(neg)}: the action's logit is -inf (probability 0)")
            raise LossContractError(f"{name}: expected finite log-probabilities at active tokens, got "
                                    + "; ".join(causes))


def check_derived_advantages(advantages: torch.Tensor, rewards: torch.Tensor, groups: tuple[int, ...]) -> None:
    """Raises where the advantages computed from the whole batch's fp32 `rewards` (CSR `groups`) are not finite in a
    group of finite rewards: its sum or variance overflowed fp32 (`canonical.group_advantages` gives NaN there).
    Every backend runs it after its log-prob check. (A non-finite reward is `check_inputs`'s to name, on the rank
    that holds it.)"""
    bad = ~torch.isfinite(advantages)
    if not bool(bad.any()):
        return
    finite = torch.isfinite(rewards)
    seqs = [i for lo, hi in zip(groups, groups[1:]) if bool(finite[lo:hi].all()) for i in range(lo, hi) if bad[i]]
    if seqs:
        raise LossContractError(
            f"rewards: the advantages of sequences {seqs[:8]} are not finite: the sum or the variance of their "
            f"group's rewards overflows float32 (|reward| up to {float(rewards[seqs].abs().max()):.3g}); scale the "
            f"rewards down")


def check_loss(loss: torch.Tensor, per_sequence_kl: torch.Tensor | None = None, reference: str = "") -> None:
    """Raises where the loss of inputs that passed every other check is not finite: a per-token term (an advantage
    times a ratio, a KL term) or a sum of them overflowed fp32, e.g. a given advantage of 3e38. Every backend runs it
    last, on the loss every rank holds. With `per_sequence_kl` (the fused linear loss, whose logits are its own) a
    KL term that overflows is named as such, `reference` being the argument the reference log-probs come from."""
    if bool(torch.isfinite(loss)):
        return
    if per_sequence_kl is not None and not bool(torch.isfinite(per_sequence_kl).all()):
        raise LossContractError(f"{reference}: expected reference log-probs within float32 reach of the policy's, got "
                                f"a KL term that overflows float32: at an active token the reference's log-prob "
                                f"exceeds the policy's by more than about 88 (its exp overflows); check the scale of "
                                f"hidden / weight and of {reference}")
    raise LossContractError("loss: expected a finite float32 loss from finite inputs, got a non-finite one: an "
                            "advantage times a ratio, a KL term, or a sum of them overflows float32; scale the "
                            "rewards or advantages down")


def check_option_inputs(sampling_logps: Any, is_ratio: Any, threshold: float | None, surrogate: Surrogate,
                        padded_seq_len: int) -> None:
    """What only some options read: the sampler's log-probs, read by the off-policy mask only (given without it,
    they would be ignored); and the importance sampling ratio, which vespo reads per token (it sums their logs over
    the sequence; TRL's vespo takes no sequence-level ratio, and Liger's adds one log per sequence)."""
    if sampling_logps is not None and threshold is None:
        raise LossContractError("sampling_logps: only read by the off-policy mask, but off_policy_mask_threshold is "
                                "None; leave it None or set the threshold")
    if (surrogate is Surrogate.VESPO and isinstance(is_ratio, torch.Tensor) and is_ratio.dim() == 2
            and is_ratio.shape[1] == 1 < padded_seq_len):
        raise LossContractError(f"importance_sampling_ratio: expected one per token [B, T] with loss_type='vespo' (its "
                                f"gamma weight sums their logs, as TRL's token_truncate / token_mask modes give "
                                f"them), got {list(is_ratio.shape)}")


@dataclass(frozen=True)
class LossOptions:
    """The options a loss runs with, validated: from the plain call (`loss_options`) or from a contract
    (`LossOptions.of`)."""

    mask: torch.Tensor
    clip_eps: float
    clip_eps_high: float
    beta: float
    groups: tuple[int, ...] | None  # None: the advantages are given
    std: AdvantageStd | None  # None: the advantages are given
    normalizer: TokenNormalizer
    constant: float | None  # what `canonical.normalize` takes (`normalizer_value`)
    temperature: float = 1.0
    advantages_input: AdvantagesInput = AdvantagesInput.REWARDS
    delta: float | None = None  # None: no upper clamp of the unclipped ratio
    bias_kl: bool = False  # the KL term times the ratio (TRL's use_bias_correction_kl)
    surrogate: Surrogate = Surrogate.CLIPPED
    taus: tuple[float, float] | None = None  # SAPO's temperatures (positive, negative advantages)
    level: ImportanceSamplingLevel = ImportanceSamplingLevel.TOKEN  # the token's own ratio, or its sequence's (GSPO)
    off_policy: float | None = None  # the off-policy mask's threshold (None: off)
    gamma: tuple[float, float, float, float] | None = None  # vespo's (k_pos, lambda_pos, k_neg, lambda_neg)
    entropy: bool = False  # the token entropies are computed (the two below read them)
    entropy_coef: float = 0.0  # TRL's entropy bonus coefficient
    top_entropy: float = 1.0  # TRL's top_entropy_quantile

    @property
    def sequence_level(self) -> bool:
        return self.level is ImportanceSamplingLevel.SEQUENCE

    @property
    def sequence_clip(self) -> bool:
        return sequence_clip(self.level, self.advantages_input)

    @classmethod
    def of(cls, contract: GRPOLossContract, mask: torch.Tensor) -> LossOptions:
        return cls(mask, contract.clip_eps, contract.clip_eps_high, contract.beta, contract.groups,
                   contract.advantage_std, contract.normalizer, contract.normalizer_value, contract.temperature,
                   contract.advantages_input, contract.delta, contract.use_bias_correction_kl, contract.surrogate,
                   contract.sapo_temperatures, contract.importance_sampling_level,
                   contract.off_policy_mask_threshold, contract.vespo_gamma, contract.entropy,
                   contract.entropy_coef, contract.top_entropy_quantile)


def loss_options(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, clip_eps, beta,
                 samples_per_prompt, group_boundaries, clip_eps_high, normalizer, normalizer_constant, advantage_std,
                 values: bool = True, *, temperature: Any = 1.0, advantages: Any = None, loss_type: Any = None,
                 max_completion_length: Any = None, ref_logps: Any = None, delta: Any = None,
                 use_bias_correction_kl: Any = False, importance_sampling_ratio: Any = None,
                 sapo_temperature_pos: Any = None, sapo_temperature_neg: Any = None,
                 importance_sampling_level: Any = "token", off_policy_mask_threshold: Any = None,
                 sampling_logps: Any = None, entropy_coef: Any = 0.0, top_entropy_quantile: Any = 1.0,
                 **vespo: Any) -> LossOptions:
    """Validates the keyword options and the tensors of the plain-call API (shared by every backend); `vespo`:
    `contract.VESPO_GAMMA`'s names."""
    o = check_options(clip_eps=clip_eps, clip_eps_high=clip_eps_high, beta=beta, normalizer=normalizer,
                      normalizer_constant=normalizer_constant, advantage_std=advantage_std, temperature=temperature,
                      loss_type=loss_type, max_completion_length=max_completion_length,
                      rewards_input=advantages is None, delta=delta, use_bias_correction_kl=use_bias_correction_kl,
                      sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                      importance_sampling_level=importance_sampling_level,
                      off_policy_mask_threshold=off_policy_mask_threshold, entropy_coef=entropy_coef,
                      top_entropy_quantile=top_entropy_quantile, **vespo)
    surrogate = surrogate_of(loss_type)
    if isinstance(policy_logits, torch.Tensor) and policy_logits.dim() == 3:
        check_option_inputs(sampling_logps, importance_sampling_ratio, o["off_policy_mask_threshold"], surrogate,
                            policy_logits.shape[1])
    mask = check_inputs(policy_logits, ref_logits, action_ids, old_logps, rewards, completion_mask, beta=o["beta"],
                        values=values, rewards_required=True, advantages=advantages, ref_logps=ref_logps,
                        importance_sampling_ratio=importance_sampling_ratio, sampling_logps=sampling_logps)
    B, T = mask.shape
    if B == 0:
        raise LossContractError("policy_logits: expected at least one sequence (B >= 1), got B = 0")
    check_max_length_product(o["normalizer"], o["max_completion_length"], B)
    if advantages is None:
        groups = check_groups(B, samples_per_prompt, group_boundaries, o["advantage_std"])
    else:
        check_no_groups(samples_per_prompt, group_boundaries)
        groups = None
    return LossOptions(mask, o["clip_eps"], o["clip_eps_high"], o["beta"], groups, o["advantage_std"],
                       o["normalizer"], normalizer_value(o["normalizer"], o["normalizer_constant"],
                                                         o["max_completion_length"], T),
                       o["temperature"], advantages_kind(advantages), o["delta"], o["use_bias_correction_kl"],
                       surrogate,
                       None if o["sapo_temperature_pos"] is None else (o["sapo_temperature_pos"],
                                                                       o["sapo_temperature_neg"]),
                       o["importance_sampling_level"], o["off_policy_mask_threshold"],
                       None if o["vespo_k_pos"] is None else tuple(o[name] for name in VESPO_GAMMA), o["entropy"],
                       o["entropy_coef"], o["top_entropy_quantile"])
