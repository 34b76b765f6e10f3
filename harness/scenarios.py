"""Named, seeded scenarios. Inputs come from a CPU generator and are then moved to the device, so every
platform sees the same input bits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_core import GRPOLossContract, ShardingSpec
from grpo_core.distributed import DistributedGRPOLossOp, VocabParallelLogprobOp


@dataclass(frozen=True)
class Scenario:
    name: str
    vocab: int
    seed: int
    num_sequences: int = 8
    seq_len: int = 32
    groups: dict = field(default_factory=lambda: {"samples_per_prompt": 4})
    normalizer: str = "global_active_tokens"
    normalizer_constant: float | None = None
    beta: float = 0.04
    clip: tuple[float, float] = (0.2, 0.2)
    advantage_std: str = "population"
    dtype: str = "float32"
    wide: bool = False  # logits over many binary exponents: the vacuity guard
    empty: tuple[int, ...] = ()  # sequences without an active token
    identity: bool = False  # reference == policy, old_logps == the policy's own log-probs

    def contract(self, tp: int = 1, dp: int = 1, tp_rank: int = 0, dp_rank: int = 0) -> GRPOLossContract:
        sharding = ShardingSpec.uniform(vocab_size=self.vocab, num_sequences=self.num_sequences, tp_world_size=tp,
                                        dp_world_size=dp, tp_rank=tp_rank, dp_rank=dp_rank)
        return GRPOLossContract(
            num_sequences=self.num_sequences, padded_seq_len=self.seq_len, vocab_size=self.vocab,
            clip_eps=self.clip[0], clip_eps_high=self.clip[1], beta=self.beta, normalizer=self.normalizer,
            normalizer_constant=self.normalizer_constant, advantage_std=self.advantage_std, sharding=sharding,
            determinism_scope="topology_invariant", **self.groups)

    def inputs(self) -> dict[str, torch.Tensor | None]:
        """Global inputs on the CPU (the same bits on every platform)."""
        S, T, V = self.num_sequences, self.seq_len, self.vocab
        g = torch.Generator().manual_seed(self.seed)
        policy = 2.0 * torch.randn(S, T, V, generator=g)
        if self.wide:
            policy = policy * torch.exp2(torch.randint(-12, 3, (S, T, V), generator=g).float())
        ref = policy + 0.3 * torch.randn(S, T, V, generator=g)
        ids = torch.randint(0, V, (S, T), generator=g)
        mask = torch.rand(S, T, generator=g) < 0.85
        mask[:, 0] = True
        mask[list(self.empty)] = False
        dtype = getattr(torch, self.dtype)
        policy, ref = policy.to(dtype), ref.to(dtype)
        true = torch.log_softmax(policy.double(), -1).gather(-1, ids[..., None])[..., 0]
        old = (true + 0.25 * torch.randn(S, T, generator=g, dtype=torch.float64)).float()
        if self.identity:
            ref = policy
            lp = self.contract().logprob_contract
            old, _ = VocabParallelLogprobOp()(policy.reshape(S * T, V), ids.reshape(-1), contract=lp,
                                              mask=mask.reshape(-1))
            old = old.view(S, T)
        return dict(policy_logits=policy, ref_logits=ref if self.beta > 0 else None, action_ids=ids, old_logps=old,
                    rewards=torch.randn(S, generator=g), completion_mask=mask)


SCENARIOS = {s.name: s for s in [
    Scenario("uniform_v1000", vocab=1000, seed=1),
    Scenario("csr_straddle_odd_v1031", vocab=1031, seed=2, groups={"group_boundaries": (0, 3, 5, 8)}),
    Scenario("per_sequence_mean", vocab=1024, seed=3, normalizer="per_sequence_then_mean", empty=(2,)),
    Scenario("fixed_constant_beta0", vocab=1000, seed=4, normalizer="fixed_constant", normalizer_constant=128.0,
             beta=0.0),
    Scenario("asymmetric_clip_unbiased", vocab=1031, seed=5, clip=(0.2, 0.28), advantage_std="unbiased",
             groups={"group_boundaries": (0, 2, 5, 8)}),
    Scenario("empty_sequences", vocab=1000, seed=6, empty=(0, 3, 4, 7)),
    Scenario("singleton_groups_no_std", vocab=1000, seed=7, groups={"samples_per_prompt": 1}, advantage_std="none"),
    Scenario("bf16_logits", vocab=1031, seed=8, dtype="bfloat16"),
    Scenario("wide_exponent", vocab=4099, seed=9, wide=True, groups={"group_boundaries": (0, 3, 5, 8)}),
    Scenario("identity", vocab=1000, seed=10, identity=True),
]}


class RegroupedTokenSumOp(DistributedGRPOLossOp):
    """A planted drift: the per-sequence token sum is regrouped (left to right instead of the fixed tree)."""

    @staticmethod
    def _token_sum(terms: torch.Tensor) -> torch.Tensor:
        total = terms[..., 0] + 0.0  # fp32 adds, left to right (torch.cumsum accumulates in double on the CPU)
        for t in range(1, terms.shape[-1]):
            total = total + terms[..., t]
        return total
