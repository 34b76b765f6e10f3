"""What a loss op returns on its contract path."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass(frozen=True, slots=True)
class GRPOLossResult:
    """Unpacks as `loss, policy_loss, kl`; per-sequence vectors cover the whole batch (`[num_sequences]`).

    `per_sequence_policy` / `per_sequence_kl` are each sequence's token sums over its active tokens (before the
    token normalizer); `per_sequence_active_tokens` are exact int64 counts.
    """

    loss: torch.Tensor  # fp32 scalar, differentiable
    policy_loss: torch.Tensor  # fp32 scalar, detached
    kl: torch.Tensor  # fp32 scalar, detached
    per_sequence_policy: torch.Tensor
    per_sequence_kl: torch.Tensor
    advantages: torch.Tensor
    per_sequence_active_tokens: torch.Tensor
    provenance: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.loss, self.policy_loss, self.kl))


def provenance(backend: str, logits: torch.Tensor, **extra: Any) -> dict[str, Any]:
    """What ran: backend, versions, device and dtype, plus `extra` (the contract fingerprint, ...)."""
    return {"backend": backend, "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(logits.device) if logits.is_cuda else platform.machine(),
            "dtype": str(logits.dtype).removeprefix("torch."), **extra}
