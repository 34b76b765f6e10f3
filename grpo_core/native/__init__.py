from .grpo_loss import NativeGRPOLossOp
from .ratio_kl import NativeRatioKLOp

__all__ = ["NativeGRPOLossOp", "NativeRatioKLOp"]
