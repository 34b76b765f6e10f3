"""Fused Triton backend: one streaming pass over the vocabulary per active token, analytic backward."""

from .grpo_loss import TritonGRPOLossOp
from .ratio_kl import TritonRatioKLOp

__all__ = ["TritonGRPOLossOp", "TritonRatioKLOp"]
