from .grpo_loss import DistributedGRPOLossOp
from .vocab_parallel_logprob import VocabParallelLogprobOp

__all__ = ["DistributedGRPOLossOp", "VocabParallelLogprobOp"]
