"""What a loss op returns on its contract path."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from . import canonical


@dataclass(frozen=True, slots=True)
class GRPOLossResult:
    """Unpacks as `loss, policy_loss, kl`; per-sequence vectors cover the whole batch (`[num_sequences]`).

    `per_sequence_policy` / `per_sequence_kl` are each sequence's token sums over its active tokens (before the
    token normalizer); `per_sequence_active_tokens` are exact int64 counts. `advantages` are the ones used: the
    group-normalized rewards `[S]`, or the given advantages cast to fp32 (`[S]` or `[S, T]`, as given).

    What a trainer logs (detached fp32 scalars over the batch's active tokens; 0 when there is none):
    `clip_fraction` (TRL's clip ratio: tokens with ratio < 1 - clip_eps and A < 0, or ratio > 1 + clip_eps_high
    and A > 0), `mean_ratio`, `kl_token_mean` (the k3 KL's mean per active token, TRL's logged `kl`). `policy_loss`
    is the surrogate alone; TRL's reported loss also holds `beta * kl`: that is `loss` here. `vespo_phi` (loss_type
    'vespo', else None): each sequence's gamma weight `[S]` (`canonical.vespo_phi`; with advantages per token, each
    token's `[S, T]`, 0.0 on masked tokens), detached; TRL logs its mean over the sequences (`vespo/phi_seq_mean`).
    """

    loss: torch.Tensor  # fp32 scalar, differentiable
    policy_loss: torch.Tensor  # fp32 scalar, detached
    kl: torch.Tensor  # fp32 scalar, detached
    per_sequence_policy: torch.Tensor
    per_sequence_kl: torch.Tensor
    advantages: torch.Tensor
    per_sequence_active_tokens: torch.Tensor
    clip_fraction: torch.Tensor  # fp32 scalar, detached
    mean_ratio: torch.Tensor  # fp32 scalar, detached
    kl_token_mean: torch.Tensor  # fp32 scalar, detached
    vespo_phi: torch.Tensor | None = None
    token_entropy: torch.Tensor | None = None  # contract.entropy: each active token's `[S, T]` (0.0 on masked ones)
    per_sequence_entropy: torch.Tensor | None = None  # its token sums `[S]`
    entropy_token_mean: torch.Tensor | None = None  # fp32 scalar: the mean over the active tokens (TRL's `entropy`)
    per_sequence_kept_entropy: torch.Tensor | None = None  # the token sums over the kept tokens `[S]` (top_entropy)
    per_sequence_kept_tokens: torch.Tensor | None = None  # the kept tokens per sequence, int64 `[S]`
    provenance: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.loss, self.policy_loss, self.kl))


def entropy_fields(token_entropy: torch.Tensor, per_sequence: torch.Tensor, counts: torch.Tensor,
                   kept: torch.Tensor, kept_counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """The result's entropy fields from the token entropies `[S, T]` (0.0 on masked tokens), their sums per sequence,
    the active tokens per sequence, and the sums and counts over the tokens `canonical.entropy_keep` keeps (those whose
    policy terms and entropy bonus count)."""
    return dict(token_entropy=token_entropy, per_sequence_entropy=per_sequence,
                entropy_token_mean=canonical.token_mean(per_sequence, counts), per_sequence_kept_entropy=kept,
                per_sequence_kept_tokens=kept_counts)


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()


def provenance(backend: str, logits: torch.Tensor, **extra: Any) -> dict[str, Any]:
    """What ran: backend, versions, device and dtype, plus `extra` (the contract fingerprint, ...)."""
    return {"backend": backend, "torch": torch.__version__, "python": platform.python_version(),
            "device": _device_name(logits.device), "dtype": str(logits.dtype).removeprefix("torch."), **extra}
