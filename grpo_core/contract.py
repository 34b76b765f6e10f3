"""The loss contract: every choice that changes the numbers, validated once, hashed into a fingerprint.

A contract is frozen and validated on construction. Two ranks of one job build equal contracts up to their
rank indices; `fingerprint()` hashes everything else, so ranks (and runs, and processes) can prove they
agree before any float is exchanged.

The checks of the options (`check_options` and those it calls) live here, where the contract's own validation
needs them; the checks of the tensors, and `loss_options`, which turns a plain call's arguments into resolved
options, are in `checks.py`.

Options added for users of other GRPO implementations (`temperature`, given `advantages`, `loss_type`,
`advantage_std="unbiased_eps"`, `delta`, `use_bias_correction_kl`, `importance_sampling_level`,
`off_policy_mask_threshold`) enter the fingerprint only when they differ from their defaults, so that the fingerprint
of a contract that does not use them, and every golden recorded with one, stays what it was.
Every backend computes all of them (the fast Triton op and the distributed op in their kernels).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any


__all__ = [
    "AdvantageStd",
    "AdvantagesInput",
    "DeterminismScope",
    "GRPOLossContract",
    "ImportanceSamplingLevel",
    "LogprobContract",
    "LossContractError",
    "ShardingSpec",
    "Surrogate",
    "TokenNormalizer",
]

# Bumped whenever the arithmetic behind a fingerprint changes, so old goldens stop matching loudly.
# 2: the canonical math (portable exp / log / sqrt, adjacent-pair trees); 3: its exp by fused multiply-adds
MATH_VERSION = "grpo-core-math-3"
DEFAULT_VOCAB_TILE = 128
FP32_MAX = float.fromhex("0x1.fffffep+127")
FP32_TINY = float.fromhex("0x1p-126")  # the smallest normal float32


class LossContractError(ValueError):
    """A contract, a tensor or a process layout does not satisfy the loss contract."""


class TokenNormalizer(str, enum.Enum):
    GLOBAL_ACTIVE_TOKENS = "global_active_tokens"  # sum / active tokens of the batch (TRL and Liger: bnpo, dapo)
    PER_SEQUENCE_THEN_MEAN = "per_sequence_then_mean"  # mean of the per-sequence means of non-empty sequences
    FIXED_CONSTANT = "fixed_constant"  # sum / normalizer_constant
    PER_SEQUENCE_THEN_BATCH_MEAN = "per_sequence_then_batch_mean"  # the same means over every sequence (TRL: grpo)
    SEQUENCES_TIMES_MAX_LENGTH = "sequences_times_max_length"  # sum / (sequences * max length) (TRL: dr_grpo)
    SEQUENCE_SUMS_THEN_BATCH_MEAN = "sequence_sums_then_batch_mean"  # sum / sequences (TRL: luspo)


class Surrogate(str, enum.Enum):
    """The per-token policy term, by TRL's and Liger's `loss_type`."""

    CLIPPED = "clipped"  # -min(r A, clamp(r, 1 - clip_eps, 1 + clip_eps_high) A): grpo, bnpo, dr_grpo, dapo
    CISPO = "cispo"  # -sg(min(r, clip_eps_high)) A logp: the ratio clamped at clip_eps_high itself, as TRL and Liger
    SAPO = "sapo"  # -sigmoid(tau (r - 1)) (4 / tau) A, tau = sapo_temperature_pos if A > 0 else sapo_temperature_neg
    VESPO = "vespo"  # -phi A logp, phi: the detached gamma weight of the sequence's summed log-ratio (vespo_phi)


class ImportanceSamplingLevel(str, enum.Enum):
    """Which ratio each token's terms read (TRL's `importance_sampling_level`)."""

    TOKEN = "token"  # its own: exp(logp - old)
    SEQUENCE = "sequence"  # its sequence's (GSPO): exp of the mean of logp - old over the sequence's active tokens


# TRL's and Liger's `loss_type` names: the token normalizer, and the per-token term where it is not the clipped
# surrogate. (TRL's `luspo` is the clipped surrogate under the luspo normalizer, with the ratio of
# `importance_sampling_level`.)
LOSS_TYPES = {"grpo": TokenNormalizer.PER_SEQUENCE_THEN_BATCH_MEAN, "bnpo": TokenNormalizer.GLOBAL_ACTIVE_TOKENS,
              "dr_grpo": TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH, "dapo": TokenNormalizer.GLOBAL_ACTIVE_TOKENS,
              "cispo": TokenNormalizer.GLOBAL_ACTIVE_TOKENS, "sapo": TokenNormalizer.PER_SEQUENCE_THEN_BATCH_MEAN,
              "luspo": TokenNormalizer.SEQUENCE_SUMS_THEN_BATCH_MEAN, "vespo": TokenNormalizer.GLOBAL_ACTIVE_TOKENS}
SAPO_TEMPERATURES = (1.0, 1.05)  # TRL's and Liger's defaults (positive, negative advantages)
VESPO_GAMMA = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}  # TRL's


def sequence_clip(level: ImportanceSamplingLevel, kind: AdvantagesInput) -> bool:
    """Whether the clip fraction counts sequences: GSPO with an advantage per sequence (TRL's `[B, 1]` terms; with
    advantages per token TRL's terms are `[B, T]` and it counts tokens)."""
    return level is ImportanceSamplingLevel.SEQUENCE and kind is not AdvantagesInput.TOKEN


def surrogate_of(loss_type: str | None) -> Surrogate:
    member = Surrogate._value2member_map_.get(loss_type)
    return Surrogate.CLIPPED if member is None else member


class AdvantageStd(str, enum.Enum):
    POPULATION = "population"  # (r - mean) / max(population std, 1e-6)
    UNBIASED = "unbiased"  # (r - mean) / max(Bessel std, 1e-6)
    NONE = "none"  # r - mean
    UNBIASED_EPS = "unbiased_eps"  # (r - mean) / (Bessel std + 1e-4), as TRL computes it


class AdvantagesInput(str, enum.Enum):
    """Which input the loss takes: rewards (the op normalizes them per group) or advantages computed elsewhere."""

    REWARDS = "rewards"  # rewards [B]
    SEQUENCE = "sequence"  # advantages [B], one per sequence
    TOKEN = "token"  # advantages [B, T], one per token


class DeterminismScope(str, enum.Enum):
    # Same bits for the same inputs, layout and build; nothing promised across layouts.
    RUN_TO_RUN = "run_to_run"
    # Same bits at every TP x DP layout of one build and device type (fixed vocab tiles, fixed trees).
    TOPOLOGY_INVARIANT = "topology_invariant"


def check_enum(cls: type[enum.Enum], name: str, value: Any) -> enum.Enum:
    """A member of `cls`, given as itself or as its value (a lookup, not `cls(value)`, which torch.compile cannot
    trace)."""
    if isinstance(value, cls):
        return value
    member = cls._value2member_map_.get(value) if isinstance(value, str) else None
    if member is None:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise LossContractError(f"{name}: expected one of {allowed}, got {value!r}")
    return member


def check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LossContractError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise LossContractError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _float(name: str, value: int | float) -> float:
    """`float(value)`, or the contract's error for an int too large for a float (`float(10**400)` raises
    OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        raise LossContractError(f"{name}: expected a finite float, got an int of {value.bit_length()} bits, which "
                                f"overflows a float") from None


def check_float(name: str, value: Any, *, minimum: float, maximum: float = math.inf, open_max: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossContractError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    value = _float(name, value)
    if not math.isfinite(value) or value < minimum or value > maximum or (open_max and value == maximum):
        lower = "" if minimum == -math.inf else f" >= {minimum}"
        upper = "" if maximum == math.inf else f" and < {maximum}" if open_max else f" and <= {maximum}"
        raise LossContractError(f"{name}: expected a finite float{lower}{upper}, got {value!r}")
    return value


def to_fp32(value: float) -> float:
    """`value` rounded to the nearest float32 (as `torch.tensor(value, dtype=torch.float32)` would), +-inf when
    it overflows."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_fp32(name: str, value: Any, *, minimum: float, maximum: float = math.inf, open_max: bool = False) -> float:
    """`check_float`, and the value must stay finite once rounded to float32, the precision every backend
    computes in. Returns the Python float, unrounded (the fingerprint keeps every bit given)."""
    value = check_float(name, value, minimum=minimum, maximum=maximum, open_max=open_max)
    if not math.isfinite(to_fp32(value)):
        raise LossContractError(f"{name}: expected a float that is finite in float32 (at most {FP32_MAX!r}), got "
                                f"{value!r}, which overflows to inf in float32")
    return value


def check_delta(value: Any) -> float | None:
    """TRL's `delta`: None, or a float > 0 that is a finite normal float32 once rounded (the unclipped ratio is
    clamped at it; devices that flush subnormals would disagree). Returns the Python float, unrounded."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossContractError(f"delta: expected a float or None, got {type(value).__name__} {value!r}")
    if not FP32_TINY <= to_fp32(_float("delta", value)) <= FP32_MAX:  # NaN fails too
        raise LossContractError(f"delta: expected a float > 0 that is a finite normal float32 (about 1.18e-38 to "
                                f"3.40e+38; the unclipped ratio is clamped at it), got {value!r}")
    return float(value)


def check_temperature(value: Any) -> float:
    """`temperature` must be a float > 0 whose reciprocal, rounded once to float32, is a finite normal float32
    (the logits are multiplied by it): about 2.94e-39 to 8.51e37. Returns the Python float, unrounded."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossContractError(f"temperature: expected a float, got {type(value).__name__} {value!r}")
    t = _float("temperature", value)
    if math.isfinite(t) and not math.isfinite(to_fp32(t)):
        raise LossContractError(f"temperature: expected a float that is finite in float32 (at most {FP32_MAX!r}), "
                                f"got {value!r}, which overflows to inf in float32")
    inv = to_fp32(1.0 / t) if t > 0.0 and math.isfinite(t) else 0.0
    if not FP32_TINY <= inv < math.inf:
        raise LossContractError(f"temperature: expected a finite float > 0 whose reciprocal is a finite normal "
                                f"float32 (about 2.94e-39 to 8.51e+37), got {value!r}")
    return t


def inverse_temperature(temperature: float) -> float:
    """`fp32(1 / temperature)`: computed in Python (double) and rounded once; the logits are multiplied by it."""
    return to_fp32(1.0 / temperature)


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _shard_bounds(name: str, bounds: Any, world_size: int) -> tuple[tuple[int, int], ...]:
    """Normalizes `[(lo, hi), ...]` per rank and checks the shards are contiguous, in rank order, from 0."""
    try:
        pairs = tuple((int(lo), int(hi)) for lo, hi in bounds)
        if any(isinstance(v, bool) or int(v) != v for pair in bounds for v in pair):
            raise TypeError
    except (TypeError, ValueError):
        raise LossContractError(f"{name}: expected one (lo, hi) int pair per rank, got {bounds!r}") from None
    if len(pairs) != world_size:
        raise LossContractError(f"{name}: expected {world_size} (lo, hi) pairs (one per rank), got {len(pairs)}")
    expected_lo = 0
    for rank, (lo, hi) in enumerate(pairs):
        if lo != expected_lo:
            kind = "a gap" if lo > expected_lo else "an overlap"
            raise LossContractError(
                f"{name}: shards must be contiguous and in rank order; rank {rank} starts at {lo} but the "
                f"previous shard ends at {expected_lo} ({kind}); got {pairs}"
            )
        if hi <= lo:
            raise LossContractError(f"{name}: rank {rank} has an empty or reversed shard ({lo}, {hi}); got {pairs}")
        expected_lo = hi
    return pairs


def _even_bounds(total_units: int, parts: int, unit: int, total: int) -> tuple[tuple[int, int], ...]:
    """Splits `total_units` units of width `unit` over `parts` ranks as evenly as possible (last clipped)."""
    cuts = [min(total, (total_units * r // parts) * unit) for r in range(parts + 1)]
    return tuple(zip(cuts[:-1], cuts[1:]))


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingSpec:
    """Where this rank sits in the TP x DP (x CP) layout and which vocab / sequence slice it owns."""

    vocab_shard_bounds: tuple[tuple[int, int], ...]
    sequence_shard_bounds: tuple[tuple[int, int], ...]
    tp_rank: int = 0
    tp_world_size: int = 1
    dp_rank: int = 0
    dp_world_size: int = 1
    cp_rank: int = 0
    cp_world_size: int = 1

    def __post_init__(self) -> None:
        for axis in ("tp", "dp", "cp"):
            world = check_int(f"sharding.{axis}_world_size", getattr(self, f"{axis}_world_size"), minimum=1)
            rank = check_int(f"sharding.{axis}_rank", getattr(self, f"{axis}_rank"), minimum=0)
            if rank >= world:
                raise LossContractError(f"sharding.{axis}_rank: expected < {axis}_world_size={world}, got {rank}")
        if self.cp_world_size != 1:
            raise LossContractError(
                f"sharding.cp_world_size: context parallelism is not supported (expected 1, got "
                f"{self.cp_world_size}); gather the sequence dimension before the loss"
            )
        _set(self, "vocab_shard_bounds", _shard_bounds("sharding.vocab_shard_bounds", self.vocab_shard_bounds,
                                                       self.tp_world_size))
        _set(self, "sequence_shard_bounds", _shard_bounds("sharding.sequence_shard_bounds",
                                                          self.sequence_shard_bounds, self.dp_world_size))

    @classmethod
    def uniform(cls, *, vocab_size: int, num_sequences: int, tp_world_size: int = 1, dp_world_size: int = 1,
                tp_rank: int = 0, dp_rank: int = 0, vocab_tile: int = DEFAULT_VOCAB_TILE) -> ShardingSpec:
        """Even shards: whole vocab tiles per TP rank, whole sequences per DP rank."""
        check_int("vocab_size", vocab_size, minimum=1)
        check_int("num_sequences", num_sequences, minimum=1)
        check_int("vocab_tile", vocab_tile, minimum=1)
        num_tiles = -(-vocab_size // vocab_tile)
        if check_int("tp_world_size", tp_world_size, minimum=1) > num_tiles:
            raise LossContractError(f"tp_world_size: expected <= {num_tiles} (vocab_size={vocab_size} holds "
                                    f"{num_tiles} tiles of {vocab_tile}), got {tp_world_size}")
        if check_int("dp_world_size", dp_world_size, minimum=1) > num_sequences:
            raise LossContractError(f"dp_world_size: expected <= num_sequences={num_sequences}, got {dp_world_size}")
        return cls(
            vocab_shard_bounds=_even_bounds(num_tiles, tp_world_size, vocab_tile, vocab_size),
            sequence_shard_bounds=_even_bounds(num_sequences, dp_world_size, 1, num_sequences),
            tp_rank=tp_rank, tp_world_size=tp_world_size, dp_rank=dp_rank, dp_world_size=dp_world_size,
        )

    @property
    def vocab_bounds(self) -> tuple[int, int]:
        return self.vocab_shard_bounds[self.tp_rank]

    @property
    def sequence_bounds(self) -> tuple[int, int]:
        return self.sequence_shard_bounds[self.dp_rank]


@dataclass(frozen=True, kw_only=True, slots=True)
class LogprobContract:
    """The vocab-parallel log-prob computation: tiles of `tile_width` columns, sharded by `vocab_shard_bounds`."""

    vocab_size: int
    tile_width: int = DEFAULT_VOCAB_TILE
    vocab_shard_bounds: tuple[tuple[int, int], ...] | None = None  # None: one shard
    tp_rank: int = 0
    num_tokens: int
    determinism_scope: DeterminismScope = DeterminismScope.RUN_TO_RUN

    def __post_init__(self) -> None:
        check_int("logprob.vocab_size", self.vocab_size, minimum=1)
        width = check_int("logprob.tile_width", self.tile_width, minimum=1)
        if width & (width - 1):
            raise LossContractError(f"logprob.tile_width: expected a power of two, got {width}")
        check_int("logprob.num_tokens", self.num_tokens, minimum=0)
        bounds = self.vocab_shard_bounds or ((0, self.vocab_size),)
        bounds = _shard_bounds("logprob.vocab_shard_bounds", bounds, len(bounds))
        if bounds[-1][1] != self.vocab_size:
            raise LossContractError(f"logprob.vocab_shard_bounds: shards must cover [0, vocab_size={self.vocab_size}),"
                                    f" got {bounds}")
        misaligned = [lo for lo, _ in bounds if lo % width]
        if misaligned:
            raise LossContractError(f"logprob.vocab_shard_bounds: every shard must start on a tile boundary "
                                    f"(multiple of tile_width={width}); {misaligned} do not, in {bounds}")
        _set(self, "vocab_shard_bounds", bounds)
        if not 0 <= check_int("logprob.tp_rank", self.tp_rank, minimum=0) < len(bounds):
            raise LossContractError(f"logprob.tp_rank: expected < {len(bounds)} shards, got {self.tp_rank}")
        _set(self, "determinism_scope", check_enum(DeterminismScope, "logprob.determinism_scope",
                                              self.determinism_scope))

    @property
    def num_tiles(self) -> int:
        return -(-self.vocab_size // self.tile_width)

    @property
    def local_bounds(self) -> tuple[int, int]:
        return self.vocab_shard_bounds[self.tp_rank]


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOLossContract:
    """Everything that determines the GRPO loss numbers of one job. Keyword-only, frozen, validated."""

    num_sequences: int
    padded_seq_len: int
    vocab_size: int
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: symmetric, equal to clip_eps
    beta: float = 0.04
    samples_per_prompt: int | None = None
    group_boundaries: tuple[int, ...] | None = None
    normalizer: TokenNormalizer | None = None  # None: global_active_tokens, or what loss_type says
    normalizer_constant: float | None = None
    advantage_std: AdvantageStd | None = None  # None: population (rewards); must stay None with given advantages
    temperature: float = 1.0  # the logits are multiplied by fp32(1 / temperature) before the log-softmax
    advantages_input: AdvantagesInput = AdvantagesInput.REWARDS
    loss_type: str | None = None  # TRL / Liger name of the normalizer: 'grpo', 'bnpo', 'dr_grpo' or 'dapo'
    max_completion_length: int | None = None  # dr_grpo's length (None: padded_seq_len)
    delta: float | None = None  # TRL's two-sided clipping: the unclipped ratio is clamped above at fp32(delta)
    use_bias_correction_kl: bool = False  # TRL's: each token's k3 KL term is multiplied by its ratio
    sapo_temperature_pos: float | None = None  # loss_type 'sapo' only (None: 1.0)
    sapo_temperature_neg: float | None = None  # loss_type 'sapo' only (None: 1.05)
    vespo_k_pos: float | None = None  # loss_type 'vespo' only (None: 2.0); the gamma weight's shape where A >= 0
    vespo_lambda_pos: float | None = None  # loss_type 'vespo' only (None: 3.0); its rate where A >= 0
    vespo_k_neg: float | None = None  # loss_type 'vespo' only (None: 3.0); the shape where A < 0
    vespo_lambda_neg: float | None = None  # loss_type 'vespo' only (None: 2.0); the rate where A < 0
    importance_sampling_level: ImportanceSamplingLevel = ImportanceSamplingLevel.TOKEN
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's off-policy sequence mask (None: off)
    entropy: bool = False  # the result carries the policy's token entropies (True whenever the two below use them)
    entropy_coef: float = 0.0  # TRL's entropy bonus: loss - entropy_coef * mean entropy of the kept active tokens
    top_entropy_quantile: float = 1.0  # TRL's: policy terms kept on the tokens of this top fraction of entropies
    sharding: ShardingSpec | None = None  # None: a single process
    determinism_scope: DeterminismScope = DeterminismScope.RUN_TO_RUN
    vocab_tile: int = DEFAULT_VOCAB_TILE
    logprob: LogprobContract | None = None  # None: derived from the fields above (see logprob_contract)
    # computed once (a loss call reads them several times): the derived logprob contract, the fingerprint
    _derived: LogprobContract | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _fingerprint: str | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __reduce__(self):
        """Pickled as its constructor's arguments: unpickling validates again and computes the cached fields anew
        (a fingerprint pickled by another version of the math is not carried over)."""
        return functools.partial(type(self), **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                                 if f.init}), ()

    def __post_init__(self) -> None:
        check_int("num_sequences", self.num_sequences, minimum=1)
        check_int("padded_seq_len", self.padded_seq_len, minimum=1)
        check_int("vocab_size", self.vocab_size, minimum=1)
        kind = check_enum(AdvantagesInput, "advantages_input", self.advantages_input)
        _set(self, "advantages_input", kind)
        options = check_options(clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high, beta=self.beta,
                                normalizer=self.normalizer, normalizer_constant=self.normalizer_constant,
                                advantage_std=self.advantage_std, temperature=self.temperature,
                                loss_type=self.loss_type, max_completion_length=self.max_completion_length,
                                rewards_input=kind is AdvantagesInput.REWARDS, delta=self.delta,
                                use_bias_correction_kl=self.use_bias_correction_kl,
                                sapo_temperature_pos=self.sapo_temperature_pos,
                                sapo_temperature_neg=self.sapo_temperature_neg,
                                **{name: getattr(self, name) for name in VESPO_GAMMA},
                                importance_sampling_level=self.importance_sampling_level,
                                off_policy_mask_threshold=self.off_policy_mask_threshold, entropy=self.entropy,
                                entropy_coef=self.entropy_coef, top_entropy_quantile=self.top_entropy_quantile)
        for name, value in options.items():
            _set(self, name, value)
        _set(self, "determinism_scope", check_enum(DeterminismScope, "determinism_scope", self.determinism_scope))
        if kind is AdvantagesInput.REWARDS:
            groups = check_groups(self.num_sequences, self.samples_per_prompt, self.group_boundaries,
                                  self.advantage_std)
            if self.group_boundaries is not None:
                _set(self, "group_boundaries", groups)
        else:
            check_no_groups(self.samples_per_prompt, self.group_boundaries)
        check_max_length_product(self.normalizer, self.max_completion_length, self.num_sequences)
        check_int("vocab_tile", self.vocab_tile, minimum=1)

        sharding = self.sharding
        if sharding is None:
            sharding = ShardingSpec(vocab_shard_bounds=((0, self.vocab_size),),
                                    sequence_shard_bounds=((0, self.num_sequences),))
        elif not isinstance(sharding, ShardingSpec):
            raise LossContractError(f"sharding: expected a ShardingSpec, got {type(sharding).__name__}")
        for name, bounds, total in (("vocab_shard_bounds", sharding.vocab_shard_bounds, self.vocab_size),
                                    ("sequence_shard_bounds", sharding.sequence_shard_bounds, self.num_sequences)):
            if bounds[-1][1] != total:
                raise LossContractError(f"sharding.{name}: shards must cover [0, {total}) exactly, but they end at "
                                        f"{bounds[-1][1]}: {bounds}")
        _set(self, "sharding", sharding)

        derived = self._derived_logprob()  # validates the tile width against the vocab shards
        _set(self, "_derived", derived)
        if self.logprob is not None:
            if not isinstance(self.logprob, LogprobContract):
                raise LossContractError(f"logprob: expected a LogprobContract, got {type(self.logprob).__name__}")
            for field in dataclasses.fields(LogprobContract):
                mine, want = getattr(self.logprob, field.name), getattr(derived, field.name)
                if mine != want:
                    raise LossContractError(
                        f"logprob.{field.name}: the nested logprob contract disagrees with the loss contract "
                        f"(expected {want!r} from this rank's sharding and fields, got {mine!r})"
                    )

    def _derived_logprob(self) -> LogprobContract:
        lo, hi = self.sharding.sequence_bounds
        return LogprobContract(vocab_size=self.vocab_size, tile_width=self.vocab_tile,
                               vocab_shard_bounds=self.sharding.vocab_shard_bounds, tp_rank=self.sharding.tp_rank,
                               num_tokens=(hi - lo) * self.padded_seq_len, determinism_scope=self.determinism_scope)

    @property
    def logprob_contract(self) -> LogprobContract:
        """The nested logprob contract: the one given, checked against this contract, or the derived one."""
        return self.logprob if self.logprob is not None else self._derived

    @property
    def groups(self) -> tuple[int, ...] | None:
        """CSR group boundaries, whichever way the groups were declared (None when the advantages are given)."""
        if self.group_boundaries is not None:
            return self.group_boundaries
        if self.samples_per_prompt is None:
            return None
        return tuple(range(0, self.num_sequences + 1, self.samples_per_prompt))

    @property
    def surrogate(self) -> Surrogate:
        """The per-token policy term `loss_type` names (the clipped surrogate unless 'cispo', 'sapo' or 'vespo')."""
        return surrogate_of(self.loss_type)

    @property
    def sequence_clip(self) -> bool:
        return sequence_clip(self.importance_sampling_level, self.advantages_input)

    @property
    def sapo_temperatures(self) -> tuple[float, float] | None:
        """`(sapo_temperature_pos, sapo_temperature_neg)` with loss_type 'sapo' (defaults filled in), else None."""
        return None if self.sapo_temperature_pos is None else (self.sapo_temperature_pos, self.sapo_temperature_neg)

    @property
    def vespo_gamma(self) -> tuple[float, float, float, float] | None:
        """`(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)` with loss_type 'vespo', else None."""
        return None if self.vespo_k_pos is None else tuple(getattr(self, name) for name in VESPO_GAMMA)

    @property
    def normalizer_value(self) -> float | None:
        """The constant of the normalizer (`canonical.normalize`'s `constant`): `normalizer_constant` for
        fixed_constant, the max completion length for sequences_times_max_length, else None."""
        return normalizer_value(self.normalizer, self.normalizer_constant, self.max_completion_length,
                                self.padded_seq_len)

    def numeric_fields(self) -> dict[str, Any]:
        """The fields that change the numbers, rank indices left out, floats as exact hex strings. The options
        added for migration appear only when they differ from their defaults (old fingerprints stay valid)."""
        s = self.sharding
        groups = self.groups
        extra: dict[str, Any] = {}
        if self.temperature != 1.0:
            extra["temperature"] = self.temperature.hex()
        if self.advantages_input is not AdvantagesInput.REWARDS:
            extra["advantages_input"] = self.advantages_input.value
        if self.normalizer is TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH:
            extra["max_completion_length"] = int(self.normalizer_value)
        if self.delta is not None:
            extra["delta"] = self.delta.hex()
        if self.use_bias_correction_kl:
            extra["use_bias_correction_kl"] = True
        if self.surrogate is not Surrogate.CLIPPED:
            extra["surrogate"] = self.surrogate.value
        if self.importance_sampling_level is not ImportanceSamplingLevel.TOKEN:
            extra["importance_sampling_level"] = self.importance_sampling_level.value
        if self.off_policy_mask_threshold is not None:
            extra["off_policy_mask_threshold"] = self.off_policy_mask_threshold.hex()
        if self.surrogate is Surrogate.SAPO:
            extra["sapo_temperatures"] = [self.sapo_temperature_pos.hex(), self.sapo_temperature_neg.hex()]
        if self.surrogate is Surrogate.VESPO:
            extra["vespo_gamma"] = [value.hex() for value in self.vespo_gamma]
        if self.entropy:  # what every rank computes and gathers (ranks must agree)
            extra["entropy"] = True
        if self.entropy_coef != 0.0:
            extra["entropy_coef"] = self.entropy_coef.hex()
        if self.top_entropy_quantile != 1.0:
            extra["top_entropy_quantile"] = self.top_entropy_quantile.hex()
        return {**extra,
            "math_version": MATH_VERSION,
            "num_sequences": self.num_sequences,
            "padded_seq_len": self.padded_seq_len,
            "vocab_size": self.vocab_size,
            "clip_eps": self.clip_eps.hex(),
            "clip_eps_high": self.clip_eps_high.hex(),
            "beta": self.beta.hex(),
            "group_boundaries": None if groups is None else list(groups),
            "normalizer": self.normalizer.value,
            "normalizer_constant": None if self.normalizer_constant is None else self.normalizer_constant.hex(),
            "advantage_std": None if self.advantage_std is None else self.advantage_std.value,
            "determinism_scope": self.determinism_scope.value,
            "vocab_tile": self.vocab_tile,
            "tp_world_size": s.tp_world_size,
            "dp_world_size": s.dp_world_size,
            "cp_world_size": s.cp_world_size,
            "vocab_shard_bounds": [list(b) for b in s.vocab_shard_bounds],
            "sequence_shard_bounds": [list(b) for b in s.sequence_shard_bounds],
        }

    def fingerprint(self) -> str:
        """A stable hex digest of `numeric_fields()`: equal on every rank of one job, across processes and runs."""
        if self._fingerprint is None:
            blob = json.dumps(self.numeric_fields(), sort_keys=True, separators=(",", ":"))
            _set(self, "_fingerprint", hashlib.sha256(blob.encode()).hexdigest()[:32])
        return self._fingerprint


def check_groups(num_sequences: int, samples_per_prompt: Any, group_boundaries: Any,
                 advantage_std: AdvantageStd | str) -> tuple[int, ...]:
    """Validates exactly one group spec and returns CSR boundaries (shared by the contract and the ops)."""
    if (samples_per_prompt is None) == (group_boundaries is None):
        given = "both" if samples_per_prompt is not None else "neither"
        raise LossContractError(f"samples_per_prompt / group_boundaries: expected exactly one of them, got {given}")
    std = check_enum(AdvantageStd, "advantage_std", advantage_std)
    if samples_per_prompt is not None:
        size = check_int("samples_per_prompt", samples_per_prompt, minimum=1)
        if size == 1 and std is not AdvantageStd.NONE:
            raise LossContractError(f"samples_per_prompt: expected >= 2 under advantage_std={std.value!r} (the std "
                                    f"of a group holding a single sequence is undefined), got 1; use "
                                    f"advantage_std='none' or larger groups")
        if num_sequences % size:
            raise LossContractError(f"samples_per_prompt: expected a divisor of the number of sequences "
                                    f"{num_sequences}, got {size}")
        bounds = tuple(range(0, num_sequences + 1, size))
    else:
        try:
            bounds = tuple(group_boundaries.tolist() if hasattr(group_boundaries, "tolist") else group_boundaries)
        except TypeError:
            raise LossContractError(f"group_boundaries: expected a sequence of ints, got {group_boundaries!r}"
                                    ) from None
        if any(isinstance(b, bool) or not isinstance(b, int) for b in bounds):
            raise LossContractError(f"group_boundaries: expected ints, got {bounds!r}")
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_sequences:
            raise LossContractError(f"group_boundaries: expected CSR offsets starting at 0 and ending at the number "
                                    f"of sequences {num_sequences}, got {bounds}")
        if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
            raise LossContractError(f"group_boundaries: expected strictly increasing offsets, got {bounds}")
    if std is not AdvantageStd.NONE:
        singles = [g for g, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b - a == 1]
        if singles:
            raise LossContractError(f"group_boundaries: groups {singles[:8]} hold a single sequence, whose std is "
                                    f"undefined under advantage_std={std.value!r}; use advantage_std='none' or "
                                    f"larger groups")
    return bounds


def check_no_groups(samples_per_prompt: Any, group_boundaries: Any) -> None:
    """With given advantages nothing is normalized per group: a group option would be ignored, so it is refused."""
    for name, value in (("samples_per_prompt", samples_per_prompt), ("group_boundaries", group_boundaries)):
        if value is not None:
            raise LossContractError(f"{name}: only used to normalize rewards per group, but the advantages are given; "
                                    f"leave it None, got {value!r}")


def resolve_normalizer(loss_type: Any, normalizer: Any) -> TokenNormalizer:
    """The token normalizer named by `normalizer` or by TRL's / Liger's `loss_type` (two spellings of one choice:
    give one, or both when they agree); neither: global_active_tokens. 'cispo', 'sapo' and 'vespo' also name a
    per-token term: with them a `normalizer` given replaces the one they name (TRL divides cispo and vespo by the
    generation batch's tokens, `normalizer='fixed_constant'` across micro-batches)."""
    if loss_type is None:
        if normalizer is None:
            return TokenNormalizer.GLOBAL_ACTIVE_TOKENS
        return check_enum(TokenNormalizer, "normalizer", normalizer)
    if not isinstance(loss_type, str) or loss_type not in LOSS_TYPES:
        allowed = ", ".join(repr(name) for name in LOSS_TYPES)
        raise LossContractError(f"loss_type: expected one of {allowed}, got {loss_type!r}")
    named = LOSS_TYPES[loss_type]
    if normalizer is not None and surrogate_of(loss_type) is not Surrogate.CLIPPED:
        return check_enum(TokenNormalizer, "normalizer", normalizer)
    if normalizer is not None and check_enum(TokenNormalizer, "normalizer", normalizer) is not named:
        raise LossContractError(f"loss_type / normalizer: loss_type={loss_type!r} is normalizer={named.value!r}, but "
                                f"normalizer={TokenNormalizer(normalizer).value!r} was given too; pass one of them")
    return named


def check_max_completion_length(normalizer: TokenNormalizer, value: Any) -> int | None:
    if normalizer is TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH:
        return None if value is None else check_int("max_completion_length", value, minimum=1)
    if value is not None:
        raise LossContractError(f"max_completion_length: only used with loss_type='dr_grpo' (normalizer="
                                f"'sequences_times_max_length'), got {value!r} with normalizer={normalizer.value!r}")
    return None


def check_max_length_product(normalizer: TokenNormalizer, max_completion_length: int | None,
                             num_sequences: int) -> None:
    """dr_grpo divides by `fp32(num_sequences * max_completion_length)`, the integer product rounded once: it must
    be finite in float32, on every backend."""
    if normalizer is not TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH or max_completion_length is None:
        return
    product = num_sequences * max_completion_length
    if product.bit_length() > 129 or not math.isfinite(to_fp32(float(product))):
        n = max_completion_length
        shown = str(n) if n < 10**15 else f"about {float(n):.3g}" if n.bit_length() <= 1024 else (
            f"an int of {n.bit_length()} bits")
        raise LossContractError(f"max_completion_length: expected an int whose product with the number of sequences "
                                f"({num_sequences}) is finite in float32 (at most {FP32_MAX!r}; the loss divides by "
                                f"it), got {shown}")


def normalizer_value(normalizer: TokenNormalizer, constant: float | None, max_completion_length: int | None,
                     padded_seq_len: int) -> float | None:
    """The one constant a normalizer takes: the fixed constant, or dr_grpo's max completion length (default: the
    padded sequence length)."""
    if normalizer is TokenNormalizer.FIXED_CONSTANT:
        return constant
    if normalizer is TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH:
        return float(padded_seq_len if max_completion_length is None else max_completion_length)
    return None


def check_advantage_std(value: Any, rewards_input: bool) -> AdvantageStd | None:
    """Default population; with given advantages there is nothing to normalize, so it must stay None."""
    if not rewards_input:
        if value is not None:
            raise LossContractError(f"advantage_std: only used to normalize rewards, but the advantages are given; "
                                    f"leave it None, got {value!r}")
        return None
    return AdvantageStd.POPULATION if value is None else check_enum(AdvantageStd, "advantage_std", value)


def check_normalizer_constant(normalizer: TokenNormalizer, constant: Any) -> float | None:
    if normalizer is TokenNormalizer.FIXED_CONSTANT:
        if constant is None:
            raise LossContractError("normalizer_constant: expected a positive float with normalizer='fixed_constant', "
                                    "got None")
        value = check_fp32("normalizer_constant", constant, minimum=0.0)
        if value == 0.0:
            raise LossContractError("normalizer_constant: expected a positive float, got 0.0")
        if to_fp32(value) < FP32_TINY:  # the loss divides by it; devices that flush subnormals would disagree
            raise LossContractError(f"normalizer_constant: expected a normal float32 (>= 2**-126 = {FP32_TINY!r}), "
                                    f"got {value!r}, which is {to_fp32(value)!r} in float32")
        return value
    if constant is not None:
        raise LossContractError(f"normalizer_constant: only used with normalizer='fixed_constant', got {constant!r} "
                                f"with normalizer={normalizer.value!r}")
    return None


def check_options(*, clip_eps: Any, clip_eps_high: Any, beta: Any, normalizer: Any, normalizer_constant: Any,
                  advantage_std: Any, temperature: Any = 1.0, loss_type: Any = None, max_completion_length: Any = None,
                  rewards_input: bool = True, delta: Any = None, use_bias_correction_kl: Any = False,
                  sapo_temperature_pos: Any = None, sapo_temperature_neg: Any = None,
                  importance_sampling_level: Any = ImportanceSamplingLevel.TOKEN,
                  off_policy_mask_threshold: Any = None, entropy: Any = False, entropy_coef: Any = 0.0,
                  top_entropy_quantile: Any = 1.0, **vespo: Any) -> dict[str, Any]:
    """Validates the scalar options once, for the contract and for the plain call alike; returns them by field
    name (`clip_eps_high=None` becomes `clip_eps`; `normalizer` is resolved with `loss_type`; `advantage_std`
    None becomes population when the op takes rewards, `rewards_input`; `delta` None: no upper clamp). Every float
    must be finite once rounded to float32, the precision every backend computes in; the normalizer constant and
    `delta` must be normal float32 values. `vespo`: `VESPO_GAMMA`'s names (loss_type 'vespo' only; None: TRL's
    defaults): finite floats, the rates >= 0 (below 1e-4 they count as 1e-4, as in TRL: `canonical.vespo_phi`).
    `entropy` becomes True with an `entropy_coef` other than 0 or a `top_entropy_quantile` below 1 (they read the
    entropies); the quantile lies in [0, 1] (0: the tokens of the largest entropy only, as TRL's)."""
    clip_eps = check_fp32("clip_eps", clip_eps, minimum=0.0, maximum=1.0, open_max=True)
    clip_eps_high = check_fp32("clip_eps_high", clip_eps if clip_eps_high is None else clip_eps_high, minimum=0.0)
    beta = check_fp32("beta", beta, minimum=0.0)
    temperature = check_temperature(temperature)
    normalizer = resolve_normalizer(loss_type, normalizer)
    surrogate = surrogate_of(loss_type)
    if delta is not None and surrogate is not Surrogate.CLIPPED:
        raise LossContractError(f"delta: only used with the clipped surrogate, got delta={delta!r} with "
                                f"loss_type={loss_type!r} (TRL and Liger ignore it there)")
    taus = []
    for name, value, default in (("sapo_temperature_pos", sapo_temperature_pos, SAPO_TEMPERATURES[0]),
                                 ("sapo_temperature_neg", sapo_temperature_neg, SAPO_TEMPERATURES[1])):
        if surrogate is not Surrogate.SAPO:
            if value is not None:
                raise LossContractError(f"{name}: only used with loss_type='sapo', got {value!r} with "
                                        f"loss_type={loss_type!r}")
            taus.append(None)
            continue
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                FP32_TINY <= to_fp32(_float(name, value)) <= FP32_MAX):
            raise LossContractError(f"{name}: expected a float > 0 that is a finite normal float32, got {value!r}")
        taus.append(float(value))
    gamma = {}
    for name, default in VESPO_GAMMA.items():
        value = vespo.pop(name, None)
        if surrogate is not Surrogate.VESPO:
            if value is not None:
                raise LossContractError(f"{name}: only used with loss_type='vespo', got {value!r} with "
                                        f"loss_type={loss_type!r}")
            gamma[name] = None
            continue
        gamma[name] = check_fp32(name, default if value is None else value,
                                 minimum=0.0 if "lambda" in name else -math.inf)
    if vespo:
        raise TypeError(f"check_options: unexpected keyword arguments {sorted(vespo)}")
    if not isinstance(use_bias_correction_kl, bool):
        raise LossContractError(f"use_bias_correction_kl: expected a bool, got {type(use_bias_correction_kl).__name__}"
                                f" {use_bias_correction_kl!r}")
    level = check_enum(ImportanceSamplingLevel, "importance_sampling_level", importance_sampling_level)
    threshold = off_policy_mask_threshold
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(
                to_fp32(_float("off_policy_mask_threshold", threshold))):
            raise LossContractError(f"off_policy_mask_threshold: expected None or a float that is finite in float32 "
                                    f"(a sequence's mean log-ratio of the sampler to the policy), got {threshold!r}")
        threshold = float(threshold)
    if not isinstance(entropy, bool):
        raise LossContractError(f"entropy: expected a bool, got {type(entropy).__name__} {entropy!r}")
    entropy_coef = check_fp32("entropy_coef", entropy_coef, minimum=-math.inf)
    top = check_float("top_entropy_quantile", top_entropy_quantile, minimum=0.0, maximum=1.0)
    return dict(delta=check_delta(delta), use_bias_correction_kl=use_bias_correction_kl,
                importance_sampling_level=level, off_policy_mask_threshold=threshold, entropy_coef=entropy_coef,
                entropy=entropy or entropy_coef != 0.0 or top < 1.0, top_entropy_quantile=top,
                sapo_temperature_pos=taus[0], sapo_temperature_neg=taus[1], **gamma,
                clip_eps=clip_eps, clip_eps_high=clip_eps_high, beta=beta, normalizer=normalizer,
                normalizer_constant=check_normalizer_constant(normalizer, normalizer_constant),
                max_completion_length=check_max_completion_length(normalizer, max_completion_length),
                advantage_std=check_advantage_std(advantage_std, rewards_input), temperature=temperature)
