"""Contract validation (every loud failure), fingerprint stability and sensitivity, ShardingSpec.uniform."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from grpo_core import (AdvantageStd, DeterminismScope, GRPOLossContract, LogprobContract, LossContractError,
                       ShardingSpec, TokenNormalizer)

BASE = dict(num_sequences=8, padded_seq_len=32, vocab_size=1000, samples_per_prompt=4)


def make(**over) -> GRPOLossContract:
    return GRPOLossContract(**{**BASE, **over})


def test_defaults_and_string_enums():
    c = make(normalizer="per_sequence_then_mean", advantage_std="unbiased")
    assert c.normalizer is TokenNormalizer.PER_SEQUENCE_THEN_MEAN and c.advantage_std is AdvantageStd.UNBIASED
    assert c.clip_eps_high == c.clip_eps == 0.2
    assert c.groups == (0, 4, 8)
    assert c.sharding.tp_world_size == c.sharding.dp_world_size == 1
    assert c.logprob_contract.num_tokens == 8 * 32 and c.logprob_contract.tile_width == 128
    assert [m.value for m in TokenNormalizer] == ["global_active_tokens", "per_sequence_then_mean", "fixed_constant",
                                                  "per_sequence_then_batch_mean", "sequences_times_max_length",
                                                  "sequence_sums_then_batch_mean"]
    assert c.temperature == 1.0 and c.advantages_input.value == "rewards" and c.loss_type is None
    assert make().normalizer is TokenNormalizer.GLOBAL_ACTIVE_TOKENS and make().advantage_std is AdvantageStd.POPULATION
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.beta = 1.0
    with pytest.raises(TypeError):
        GRPOLossContract(8, 32, 1000)  # keyword-only


@pytest.mark.parametrize("over,match", [
    (dict(num_sequences=0), "num_sequences: expected an int >= 1"),
    (dict(num_sequences=8.0), "num_sequences: expected an int"),
    (dict(padded_seq_len=True), "padded_seq_len: expected an int"),
    (dict(vocab_size=-3), "vocab_size: expected an int >= 1"),
    (dict(clip_eps=1.0), "clip_eps: expected a finite float"),
    (dict(clip_eps=-0.1), "clip_eps: expected a finite float"),
    (dict(clip_eps="0.2"), "clip_eps: expected a float"),
    (dict(clip_eps_high=float("inf")), "clip_eps_high: expected a finite float"),
    (dict(beta=float("nan")), "beta: expected a finite float"),
    (dict(samples_per_prompt=3), "samples_per_prompt: expected a divisor"),
    (dict(samples_per_prompt=0), "samples_per_prompt: expected an int >= 1"),
    (dict(group_boundaries=(0, 4, 8)), "got both"),
    (dict(samples_per_prompt=None), "got neither"),
    (dict(samples_per_prompt=None, group_boundaries=(0, 4, 7)), "group_boundaries: expected CSR offsets"),
    (dict(samples_per_prompt=None, group_boundaries=(1, 4, 8)), "group_boundaries: expected CSR offsets"),
    (dict(samples_per_prompt=None, group_boundaries=(0, 4, 4, 8)), "strictly increasing"),
    (dict(samples_per_prompt=None, group_boundaries=(0, 7, 8)), "hold a single sequence"),
    (dict(samples_per_prompt=None, group_boundaries=(0, 7, 8), advantage_std="unbiased"), "single sequence"),
    (dict(samples_per_prompt=1), "samples_per_prompt: expected >= 2 under advantage_std='population' .*single "
                                 "sequence"),
    (dict(samples_per_prompt=1, advantage_std="unbiased"), "samples_per_prompt: expected >= 2 under "
                                                           "advantage_std='unbiased'"),
    (dict(beta=1e39), "beta: expected a float that is finite in float32"),
    (dict(clip_eps_high=1e39), "clip_eps_high: expected a float that is finite in float32"),
    (dict(normalizer="fixed_constant", normalizer_constant=1e39), "normalizer_constant: expected a float that is "
                                                                  "finite in float32"),
    (dict(normalizer="fixed_constant", normalizer_constant=1e-46), "normalizer_constant: expected a normal float32"),
    (dict(normalizer="fixed_constant", normalizer_constant=1e-39), "normalizer_constant: expected a normal float32"),
    (dict(normalizer="mean"), "normalizer: expected one of"),
    (dict(normalizer=TokenNormalizer.FIXED_CONSTANT), "normalizer_constant: expected a positive float"),
    (dict(normalizer=TokenNormalizer.FIXED_CONSTANT, normalizer_constant=0.0), "normalizer_constant: expected a pos"),
    (dict(normalizer=TokenNormalizer.FIXED_CONSTANT, normalizer_constant=-2.0), "normalizer_constant"),
    (dict(normalizer_constant=5.0), "normalizer_constant: only used with"),
    (dict(advantage_std="std"), "advantage_std: expected one of"),
    (dict(determinism_scope="bitwise"), "determinism_scope: expected one of"),
    (dict(vocab_tile=100), "tile_width: expected a power of two"),
    (dict(vocab_tile=0), "vocab_tile: expected an int >= 1"),
    (dict(sharding="tp2"), "sharding: expected a ShardingSpec"),
    (dict(logprob="x"), "logprob: expected a LogprobContract"),
])
def test_loud_failures(over, match):
    with pytest.raises(LossContractError, match=match):
        make(**over)


def test_float_options_at_the_float32_limits_are_kept_unrounded():
    top = float.fromhex("0x1.fffffep+127")  # the largest float32; anything that rounds to it is fine too
    c = make(beta=top, clip_eps_high=3.4028235e38, normalizer="fixed_constant", normalizer_constant=2.0 ** -126)
    assert (c.beta, c.clip_eps_high, c.normalizer_constant) == (top, 3.4028235e38, 2.0 ** -126)
    assert make(beta=0.1).beta == 0.1  # the fingerprint sees the float given, not its float32 rounding


def test_singleton_groups_are_fine_without_std():
    assert make(samples_per_prompt=1, advantage_std="none").groups == tuple(range(9))


@pytest.mark.parametrize("spec,match", [
    (dict(cp_world_size=2, cp_rank=0), "cp_world_size: context parallelism is not supported"),
    (dict(sequence_shard_bounds=((0, 4), (5, 8)), dp_world_size=2), r"rank 1 starts at 5 .*\(a gap\)"),
    (dict(sequence_shard_bounds=((0, 5), (4, 8)), dp_world_size=2), "an overlap"),
    (dict(sequence_shard_bounds=((4, 8), (0, 4)), dp_world_size=2), "contiguous and in rank order"),
    (dict(sequence_shard_bounds=((0, 4), (4, 7)), dp_world_size=2), r"cover \[0, 8\) exactly"),
    (dict(sequence_shard_bounds=((0, 4), (4, 4), (4, 8)), dp_world_size=3), "empty or reversed"),
    (dict(sequence_shard_bounds=((0, 8),), dp_world_size=2), "expected 2 .* pairs"),
    (dict(vocab_shard_bounds=((0, 500), (500, 1000)), tp_world_size=2), "multiple of tile_width=128"),
    (dict(vocab_shard_bounds=((0, 512), (512, 999)), tp_world_size=2), r"cover \[0, 1000\) exactly"),
    (dict(vocab_shard_bounds=((0, 512), (600, 1000)), tp_world_size=2), "a gap"),
    (dict(vocab_shard_bounds=[[0, "a"]]), "one \\(lo, hi\\) int pair"),
    (dict(tp_rank=2, tp_world_size=2, vocab_shard_bounds=((0, 512), (512, 1000))), "tp_rank: expected < "),
])
def test_sharding_loud_failures(spec, match):
    kwargs = dict(vocab_shard_bounds=((0, 1000),), sequence_shard_bounds=((0, 8),))
    with pytest.raises(LossContractError, match=match):
        make(sharding=ShardingSpec(**{**kwargs, **spec}))


def test_sharding_uniform_builds_valid_even_bounds():
    s = ShardingSpec.uniform(vocab_size=1000, num_sequences=8, tp_world_size=4, dp_world_size=2, tp_rank=3,
                             dp_rank=1)
    assert s.vocab_shard_bounds == ((0, 256), (256, 512), (512, 768), (768, 1000))
    assert s.sequence_shard_bounds == ((0, 4), (4, 8))
    assert s.vocab_bounds == (768, 1000) and s.sequence_bounds == (4, 8)
    make(sharding=s)
    odd = ShardingSpec.uniform(vocab_size=1031, num_sequences=7, tp_world_size=3, dp_world_size=3, vocab_tile=64)
    assert odd.vocab_shard_bounds == ((0, 320), (320, 704), (704, 1031))  # 5, 6, 6 tiles
    assert odd.sequence_shard_bounds == ((0, 2), (2, 4), (4, 7))
    GRPOLossContract(num_sequences=7, padded_seq_len=4, vocab_size=1031, samples_per_prompt=7, vocab_tile=64,
                     sharding=odd)
    with pytest.raises(LossContractError, match="tp_world_size: expected <= 8"):
        ShardingSpec.uniform(vocab_size=1000, num_sequences=8, tp_world_size=9)
    with pytest.raises(LossContractError, match="dp_world_size: expected <= num_sequences=8"):
        ShardingSpec.uniform(vocab_size=1000, num_sequences=8, dp_world_size=9)


def test_nested_logprob_contract_must_agree():
    s = ShardingSpec.uniform(vocab_size=1000, num_sequences=8, dp_world_size=2, dp_rank=1)
    good = LogprobContract(vocab_size=1000, num_tokens=4 * 32, vocab_shard_bounds=((0, 1000),))
    assert make(sharding=s, logprob=good).logprob_contract == good
    with pytest.raises(LossContractError, match=r"logprob.num_tokens: .*\(expected 128 .* got 256\)"):
        make(sharding=s, logprob=dataclasses.replace(good, num_tokens=256))
    with pytest.raises(LossContractError, match="logprob.determinism_scope"):
        make(sharding=s, logprob=good, determinism_scope=DeterminismScope.TOPOLOGY_INVARIANT)
    with pytest.raises(LossContractError, match="logprob.tile_width"):
        make(sharding=s, logprob=dataclasses.replace(good, tile_width=64))


def test_fingerprint_stable_across_builds_and_processes():
    a, b = make(beta=0.1), make(beta=0.1)
    assert a == b and a.fingerprint() == b.fingerprint()
    code = ("from grpo_core import GRPOLossContract as C; print(C(num_sequences=8, padded_seq_len=32, "
            "vocab_size=1000, samples_per_prompt=4, beta=0.1).fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__)
                                                                              .parents[1]))
    assert out.stdout.strip() == a.fingerprint()
    # groups declared either way are the same numbers
    assert make().fingerprint() == make(samples_per_prompt=None, group_boundaries=(0, 4, 8)).fingerprint()
    # kept once computed; a contract built from another (replace, pickle) has its own fields' fingerprint
    assert a.fingerprint() is a.fingerprint() and "_fingerprint" not in repr(a)
    assert dataclasses.replace(a, beta=0.2).fingerprint() == make(beta=0.2).fingerprint() != a.fingerprint()
    stale = make(beta=0.1)
    object.__setattr__(stale, "_fingerprint", "computed by another version")
    assert pickle.loads(pickle.dumps(stale)) == a and pickle.loads(pickle.dumps(stale)).fingerprint() == a.fingerprint()
    assert a.logprob_contract is a.logprob_contract == dataclasses.replace(a).logprob_contract


def test_fingerprint_ignores_rank_indices_but_not_world_sizes_or_bounds():
    ranks = {make(sharding=ShardingSpec.uniform(vocab_size=1000, num_sequences=8, tp_world_size=2, dp_world_size=2,
                                                tp_rank=t, dp_rank=d)).fingerprint() for t in (0, 1) for d in (0, 1)}
    assert len(ranks) == 1
    tp4 = make(sharding=ShardingSpec.uniform(vocab_size=1000, num_sequences=8, tp_world_size=4)).fingerprint()
    uneven = make(sharding=ShardingSpec(vocab_shard_bounds=((0, 1000),), sequence_shard_bounds=((0, 3), (3, 8)),
                                        dp_world_size=2)).fingerprint()
    even = make(sharding=ShardingSpec.uniform(vocab_size=1000, num_sequences=8, dp_world_size=2)).fingerprint()
    assert len({tp4, uneven, even, make().fingerprint()}) == 4


@pytest.mark.parametrize("over", [
    dict(num_sequences=16), dict(padded_seq_len=64), dict(vocab_size=1001), dict(clip_eps=0.21),
    dict(clip_eps_high=0.28), dict(beta=0.05), dict(beta=0.0), dict(samples_per_prompt=2),
    dict(samples_per_prompt=None, group_boundaries=(0, 3, 8)), dict(advantage_std="unbiased"),
    dict(advantage_std="none"), dict(normalizer="per_sequence_then_mean"),
    dict(normalizer="fixed_constant", normalizer_constant=256.0), dict(determinism_scope="topology_invariant"),
    dict(vocab_tile=64),
])
def test_fingerprint_changes_with_every_numeric_field(over):
    base = make()
    assert make(**over).fingerprint() != base.fingerprint()


def test_fingerprint_sees_the_normalizer_constant_to_the_last_bit():
    c1 = make(normalizer="fixed_constant", normalizer_constant=256.0)
    c2 = make(normalizer="fixed_constant", normalizer_constant=float.fromhex("0x1.0000000000001p+8"))
    assert c1.fingerprint() != c2.fingerprint()


# Issue 15: the options added for migration, validated by name and in the fingerprint only when they are set.

@pytest.mark.parametrize("over,match", [
    (dict(temperature=0.0), r"^temperature: expected a finite float > 0 whose reciprocal is a finite normal float32"),
    (dict(temperature=-1.0), r"^temperature: expected a finite float > 0"),
    (dict(temperature=float("inf")), r"^temperature: expected a finite float > 0"),
    (dict(temperature=1e39), r"^temperature: expected a float that is finite in float32"),
    (dict(temperature=2.0 ** 127), r"^temperature: expected a finite float > 0 whose reciprocal"),  # 1/t subnormal
    (dict(temperature=True), r"^temperature: expected a float, got bool"),
    (dict(advantages_input="logits"), r"^advantages_input: expected one of 'rewards', 'sequence', 'token'"),
    (dict(loss_type="gspo"), r"^loss_type: expected one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', "
                             r"'luspo', 'vespo', got 'gspo'"),
    (dict(loss_type="dr_grpo", normalizer="fixed_constant", normalizer_constant=64.0),
     r"^loss_type / normalizer: loss_type='dr_grpo' is normalizer='sequences_times_max_length'"),
    (dict(loss_type="grpo", max_completion_length=32), r"^max_completion_length: only used with loss_type='dr_grpo'"),
    (dict(loss_type="dr_grpo", max_completion_length=-4), r"^max_completion_length: expected an int >= 1"),
    (dict(normalizer_constant=3.0, loss_type="dr_grpo"), r"^normalizer_constant: only used with"),
    (dict(advantages_input="sequence"), r"^samples_per_prompt: only used to normalize rewards per group"),
    (dict(advantages_input="token", samples_per_prompt=None, group_boundaries=(0, 4, 8)),
     r"^group_boundaries: only used to normalize rewards per group"),
    (dict(advantages_input="token", samples_per_prompt=None, advantage_std="none"),
     r"^advantage_std: only used to normalize rewards, but the advantages are given"),
    (dict(samples_per_prompt=1, advantage_std="unbiased_eps"), r"samples_per_prompt: expected >= 2 under "
                                                               r"advantage_std='unbiased_eps'"),
])
def test_migration_options_fail_loudly(over, match):
    with pytest.raises(LossContractError, match=match):
        make(**over)


def test_migration_options_resolve():
    assert make(loss_type="grpo").normalizer is TokenNormalizer.PER_SEQUENCE_THEN_BATCH_MEAN
    assert make(loss_type="bnpo", normalizer="global_active_tokens").normalizer is TokenNormalizer.GLOBAL_ACTIVE_TOKENS
    assert make(loss_type="dapo").normalizer is TokenNormalizer.GLOBAL_ACTIVE_TOKENS
    dr = make(loss_type="dr_grpo")
    assert dr.normalizer is TokenNormalizer.SEQUENCES_TIMES_MAX_LENGTH and dr.normalizer_value == 32.0
    assert make(loss_type="dr_grpo", max_completion_length=100).normalizer_value == 100.0
    assert make(normalizer="fixed_constant", normalizer_constant=7.0).normalizer_value == 7.0
    adv = make(advantages_input="token", samples_per_prompt=None)
    assert adv.groups is None and adv.advantage_std is None and adv.numeric_fields()["group_boundaries"] is None
    assert make(temperature=2).temperature == 2.0 and isinstance(make(temperature=2).temperature, float)


@pytest.mark.parametrize("over", [
    dict(temperature=0.9), dict(temperature=float.fromhex("0x1.0000000000001p+0")), dict(loss_type="grpo"),
    dict(loss_type="dr_grpo"), dict(normalizer="per_sequence_then_batch_mean"), dict(advantage_std="unbiased_eps"),
    dict(advantages_input="sequence", samples_per_prompt=None), dict(advantages_input="token", samples_per_prompt=None),
])
def test_fingerprint_changes_with_every_migration_option(over):
    assert make(**over).fingerprint() != make().fingerprint()


def test_fingerprint_is_one_per_set_of_numbers():
    """Two spellings of the same numbers, one fingerprint; defaults written out do not move it."""
    base = make().fingerprint()
    for same in (dict(temperature=1.0), dict(loss_type="bnpo"), dict(loss_type="dapo"),
                 dict(normalizer="global_active_tokens"), dict(advantage_std="population"),
                 dict(advantages_input="rewards")):
        assert make(**same).fingerprint() == base, same
    assert make(loss_type="grpo").fingerprint() == make(normalizer="per_sequence_then_batch_mean").fingerprint()
    assert make(loss_type="dr_grpo").fingerprint() == make(loss_type="dr_grpo", max_completion_length=32).fingerprint()
    assert make(loss_type="dr_grpo").fingerprint() != make(loss_type="dr_grpo", max_completion_length=33).fingerprint()
    seq, tok = (make(advantages_input=k, samples_per_prompt=None).fingerprint() for k in ("sequence", "token"))
    assert seq != tok


def test_default_fingerprints_are_those_of_the_goldens():
    """The options added for migration leave every existing contract's fingerprint (and golden) as it was."""
    import json
    from pathlib import Path

    from harness.scenarios import SCENARIOS
    manifest = json.loads((Path(__file__).resolve().parents[1] / "golden" / "canonical" / "MANIFEST.json").read_text())
    recorded = {name.removesuffix(".parquet"): entry["fingerprint"] for name, entry in manifest["files"].items()}
    assert recorded and {name: SCENARIOS[name].contract().fingerprint() for name in recorded} == recorded
