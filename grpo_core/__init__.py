"""grpo-core: the GRPO loss (clipped surrogate + k3 KL) straight from logits, with a determinism contract."""

from .contract import (AdvantageStd, DeterminismScope, GRPOLossContract, LogprobContract, LossContractError,
                       ShardingSpec, TokenNormalizer)
from .pending import raise_pending
from .registry import BackendUnavailableError, kernel_registry
from .result import GRPOLossResult

__version__ = "0.1.0"
__all__ = ["AdvantageStd", "BackendUnavailableError", "DeterminismScope", "GRPOLossContract", "GRPOLossResult",
           "LogprobContract", "LossContractError", "ShardingSpec", "TokenNormalizer", "kernel_registry",
           "raise_pending"]
