"""Named, seeded scenarios whose inputs have the same bits on every machine, torch version and CPU code path.

Scenarios with `hidden > 0` run the fused linear loss (`grpo_core.linear`) from hidden states and an lm_head weight.

torch's own samplers are not portable (`torch.randn` takes another code path under `ATEN_CPU_CAPABILITY=default`
and goes through vector exp / log / cos), so the inputs are built from integers only: NumPy's legacy
`RandomState` stream (frozen by NumPy's policy), turned into floats by exact operations. `old_logps` are the
canonical log-probs plus noise. The inputs are made on the CPU and then moved to the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from grpo_core import GRPOLossContract, ShardingSpec
from grpo_core.contract import VESPO_GAMMA
from grpo_core.distributed import DistributedGRPOLossOp, VocabParallelLogprobOp
from grpo_core.distributed.grpo_loss import _TorchKernels
from grpo_core.linear import LinearGRPOLossOp, linear_logprobs


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
    hidden: int = 0  # > 0: the fused linear loss, from hidden states [S, T, hidden] and a weight [vocab, hidden]
    reference: str = "model"  # the reference model's input ('model': its logits, or its hidden states for a linear
    #                            scenario) or its log-probs as given ('logps': canonical, of the same input)
    temperature: float = 1.0
    delta: float | None = None
    bias_kl: bool = False  # the KL term times the ratio (use_bias_correction_kl)
    is_ratio: str = ""  # importance sampling weights: "token" [S, T], "sequence" [S, 1], or "" (none)
    loss_type: str | None = None  # 'cispo', 'sapo', 'luspo', 'vespo': as TRL's (with the normalizer they name)
    taus: tuple[float, float] | None = None  # SAPO's temperatures (None: TRL's defaults)
    gamma: tuple[float, float, float, float] | None = None  # VESPO's (k_pos, lambda_pos, k_neg, lambda_neg)
    level: str = "token"  # importance_sampling_level: "sequence" is GSPO's ratio
    off_policy: float | None = None  # off_policy_mask_threshold
    sampling: bool = False  # the off-policy mask reads sampler log-probs (the old ones plus noise), not the old ones
    entropy: tuple[float, float] | None = None  # (entropy_coef, top_entropy_quantile): TRL's bonus and mask

    @property
    def linear(self) -> bool:
        return self.hidden > 0

    def op(self, kernels: str, planted: bool = False):
        """The loss op of this scenario (`planted`: the regrouped token sum, the gate's drift control)."""
        if self.linear:
            return RegroupedLinearOp(kernels) if planted else LinearGRPOLossOp(kernels)
        return RegroupedTokenSumOp() if planted else DistributedGRPOLossOp(kernels)

    def contract(self, tp: int = 1, dp: int = 1, tp_rank: int = 0, dp_rank: int = 0) -> GRPOLossContract:
        sharding = ShardingSpec.uniform(vocab_size=self.vocab, num_sequences=self.num_sequences, tp_world_size=tp,
                                        dp_world_size=dp, tp_rank=tp_rank, dp_rank=dp_rank)
        return GRPOLossContract(
            num_sequences=self.num_sequences, padded_seq_len=self.seq_len, vocab_size=self.vocab,
            clip_eps=self.clip[0], clip_eps_high=self.clip[1], beta=self.beta, normalizer=self.normalizer,
            normalizer_constant=self.normalizer_constant, advantage_std=self.advantage_std, sharding=sharding,
            temperature=self.temperature, determinism_scope="topology_invariant", delta=self.delta,
            use_bias_correction_kl=self.bias_kl, loss_type=self.loss_type, importance_sampling_level=self.level,
            off_policy_mask_threshold=self.off_policy,
            **({} if self.taus is None else dict(zip(("sapo_temperature_pos", "sapo_temperature_neg"), self.taus))),
            **({} if self.gamma is None else dict(zip(VESPO_GAMMA, self.gamma))),
            **({} if self.entropy is None else dict(entropy_coef=self.entropy[0],
                                                    top_entropy_quantile=self.entropy[1])),
            **self.groups)

    def inputs(self) -> dict[str, torch.Tensor | None]:
        """Global inputs on the CPU (the same bits on every platform)."""
        if self.linear:
            return self._linear_inputs()
        S, T, V = self.num_sequences, self.seq_len, self.vocab
        rng = np.random.RandomState(self.seed)
        policy = 2.0 * normalish(rng, (S, T, V))
        if self.wide:
            policy = policy * torch.exp2(torch.from_numpy(rng.randint(-12, 3, (S, T, V))).float())
        ref = policy + 0.3 * normalish(rng, (S, T, V))
        ids = torch.from_numpy(rng.randint(0, V, (S, T))).long()
        mask = uniform(rng, (S, T)) < 0.85
        mask[:, 0] = True
        mask[list(self.empty)] = False
        dtype = getattr(torch, self.dtype)
        policy, ref = policy.to(dtype), ref.to(dtype)
        own, _ = VocabParallelLogprobOp()(policy.reshape(S * T, V), ids.reshape(-1),
                                          contract=self.contract().logprob_contract, mask=mask.reshape(-1))
        old = own.view(S, T) + 0.25 * normalish(rng, (S, T))
        if self.identity:
            ref, old = policy, own.view(S, T)
        out = dict(policy_logits=policy, ref_logits=ref if self.beta > 0 else None, action_ids=ids, old_logps=old,
                   rewards=normalish(rng, (S,)), completion_mask=mask, ref_logps=None)
        if self.beta > 0 and self.reference == "logps":
            if self.temperature != 1.0:
                raise ValueError(f"{self.name}: reference='logps' of logits is written for temperature 1.0")
            ref_logps, _ = VocabParallelLogprobOp()(ref.reshape(S * T, V), ids.reshape(-1),
                                                    contract=self.contract().logprob_contract, mask=mask.reshape(-1))
            out["ref_logits"], out["ref_logps"] = None, ref_logps.view(S, T)
        return self._weights(rng, out)


    def _linear_inputs(self) -> dict[str, torch.Tensor | None]:
        """Hidden states, a weight and a bias; `old_logps` are the canonical (torch kernels') log-probs plus noise;
        the reference as hidden states or as their log-probs (`reference='logps'`)."""
        S, T, V, H = self.num_sequences, self.seq_len, self.vocab, self.hidden
        rng = np.random.RandomState(self.seed)
        dtype = getattr(torch, self.dtype)
        hidden = normalish(rng, (S, T, H))
        if self.wide:
            hidden = hidden * torch.exp2(torch.from_numpy(rng.randint(-8, 3, (S, T, H))).float())
        weight = (0.25 * normalish(rng, (V, H))).to(dtype)
        bias = normalish(rng, (V,)).to(dtype)
        ref_hidden = (hidden + 0.1 * normalish(rng, (S, T, H))).to(dtype)
        hidden = hidden.to(dtype)
        ids = torch.from_numpy(rng.randint(0, V, (S, T))).long()
        mask = uniform(rng, (S, T)) < 0.85
        mask[:, 0] = True
        mask[list(self.empty)] = False
        own = linear_logprobs(hidden, weight, ids, mask, bias=bias, temperature=self.temperature, kernels="torch")
        out = dict(hidden=hidden, weight=weight, bias=bias, action_ids=ids,
                   old_logps=own + 0.25 * normalish(rng, (S, T)), rewards=normalish(rng, (S,)), completion_mask=mask,
                   ref_hidden=None, ref_logps=None)
        if self.beta > 0:
            ref_logps = linear_logprobs(ref_hidden, weight, ids, mask, bias=bias, temperature=self.temperature,
                                        kernels="torch")
            out["ref_logps" if self.reference == "logps" else "ref_hidden"] = (
                ref_logps if self.reference == "logps" else ref_hidden)
        return self._weights(rng, out)

    def _weights(self, rng: np.random.RandomState, out: dict) -> dict:
        """The importance sampling weights in [0.5, 1.5), then the sampler's log-probs, drawn last (the other inputs
        keep their bits)."""
        S, T = self.num_sequences, self.seq_len
        out["importance_sampling_ratio"] = (0.5 + uniform(rng, (S, T if self.is_ratio == "token" else 1))
                                            if self.is_ratio else None)
        out["sampling_logps"] = out["old_logps"] + 0.1 * normalish(rng, (S, T)) if self.sampling else None
        return out


def uniform(rng: np.random.RandomState, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 in [0, 1) on a 2**-24 grid, from 24-bit integers (exact)."""
    return torch.from_numpy(rng.randint(0, 1 << 24, shape).astype(np.float64) * 2.0**-24).float()


def normalish(rng: np.random.RandomState, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 with mean 0 and variance 1, bell-shaped: the sum of four uniforms, centered and scaled (IEEE `+ - *`
    on float64, then one rounding to fp32)."""
    total = sum(rng.randint(0, 1 << 24, shape).astype(np.float64) * 2.0**-24 for _ in range(4))
    return torch.from_numpy((total - 2.0) * 3.0**0.5).float()


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
    Scenario("ref_logps_bf16_csr", vocab=1031, seed=14, dtype="bfloat16", reference="logps", clip=(0.2, 0.28),
             advantage_std="unbiased_eps", groups={"group_boundaries": (0, 2, 5, 8)}),
    Scenario("token_options_bf16", vocab=1031, seed=15, dtype="bfloat16", clip=(0.2, 0.28), delta=1.1, bias_kl=True,
             is_ratio="token"),
    Scenario("cispo_bf16", vocab=1031, seed=17, dtype="bfloat16", loss_type="cispo", clip=(0.2, 1.1),
             is_ratio="sequence"),
    Scenario("sapo_csr", vocab=1000, seed=18, loss_type="sapo", normalizer="per_sequence_then_batch_mean",
             taus=(0.8, 1.6), bias_kl=True, groups={"group_boundaries": (0, 3, 5, 8)}, empty=(4,)),
    Scenario("luspo_empty", vocab=520, seed=19, loss_type="luspo", normalizer="sequence_sums_then_batch_mean",
             empty=(1, 6)),
    Scenario("gspo_bf16", vocab=1031, seed=20, dtype="bfloat16", level="sequence", clip=(0.02, 0.03), bias_kl=True,
             is_ratio="token", empty=(5,), groups={"group_boundaries": (0, 3, 5, 8)}),
    Scenario("off_policy_bf16", vocab=1031, seed=22, dtype="bfloat16", off_policy=0.01, sampling=True,
             is_ratio="token", bias_kl=True, clip=(0.2, 0.28)),
    Scenario("vespo_bf16", vocab=1031, seed=23, dtype="bfloat16", loss_type="vespo", gamma=(1.5, 2.0, 4.0, 1.0),
             is_ratio="token", bias_kl=True, empty=(3,)),
    Scenario("entropy_bf16", vocab=1031, seed=25, dtype="bfloat16", entropy=(0.01, 0.6), temperature=0.8,
             empty=(2,)),
    Scenario("linear_bf16", vocab=1031, seed=11, hidden=64, dtype="bfloat16"),
    Scenario("linear_wide_ref_logps_dr_grpo", vocab=1000, seed=12, hidden=48, wide=True, reference="logps",
             normalizer="sequences_times_max_length", temperature=0.7, groups={"group_boundaries": (0, 3, 5, 8)}),
    Scenario("linear_beta0_per_sequence", vocab=1024, seed=13, hidden=32, beta=0.0, empty=(2,),
             normalizer="per_sequence_then_batch_mean", clip=(0.2, 0.28)),
    Scenario("linear_token_options", vocab=1000, seed=16, hidden=32, reference="logps", delta=1.3, bias_kl=True,
             is_ratio="sequence", normalizer="per_sequence_then_batch_mean"),
    Scenario("linear_gspo_luspo", vocab=1000, seed=21, hidden=32, reference="logps", level="sequence",
             loss_type="luspo", normalizer="sequence_sums_then_batch_mean", clip=(0.02, 0.03), empty=(6,)),
    Scenario("linear_vespo_off_policy", vocab=1000, seed=24, hidden=32, reference="logps", loss_type="vespo",
             is_ratio="token", off_policy=0.01, sampling=True),
    Scenario("linear_entropy", vocab=1000, seed=26, hidden=32, reference="logps", entropy=(0.02, 0.5),
             level="sequence", clip=(0.02, 0.03)),
]}


class RegroupedTokenSumOp(DistributedGRPOLossOp):
    """A planted drift: the per-sequence token sum is regrouped (left to right instead of the fixed tree). It runs
    the torch kernels, whose token sum it replaces."""

    def __init__(self) -> None:
        super().__init__(kernels="torch")

    @staticmethod
    def _token_sum(terms: torch.Tensor) -> torch.Tensor:
        total = terms[..., 0] + 0.0  # fp32 adds, left to right (torch.cumsum accumulates in double on the CPU)
        for t in range(1, terms.shape[-1]):
            total = total + terms[..., t]
        return total


class RegroupedLinearOp(LinearGRPOLossOp):
    """The same planted drift for the fused linear loss. Its stages are the torch kernels, whose token sum it
    replaces, with either kernel set for the log-probs."""

    _token_sum = staticmethod(RegroupedTokenSumOp._token_sum)

    def _stages(self, k):
        return _TorchKernels(self._token_sum)
