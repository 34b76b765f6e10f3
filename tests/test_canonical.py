"""The canonical math: exp / log / sqrt / sigmoid accuracy, fixed trees, and the same bits under every CPU code path.

The exhaustive accuracy scan over every fp32 input is `benchmarks/canonical_accuracy.py`; here 10**7 random
inputs spread over every binade of each range, plus the edges, keep CI honest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_bitwise_equal, assert_close_verbose, bits, case_seed
from grpo_core import canonical

ROOT = Path(__file__).resolve().parents[1]
FLT_MAX = float(np.finfo(np.float32).max)


def random_floats(lo: float, hi: float, n: int, seed: int) -> torch.Tensor:
    """`n` fp32 in [lo, hi]: half uniform over the bit patterns (every binade), half uniform in value."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.randint(0, 0x7F800000, (n // 2,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    signs = torch.where(torch.rand(n // 2, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([mags * signs, lo + (hi - lo) * torch.rand(n - n // 2, generator=g, dtype=torch.float64).float()])
    return x[(x >= lo) & (x <= hi)]


def ulp_error(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(exact.abs().clamp(min=canonical.TINY))
    return (got.double() - exact).abs() / torch.ldexp(torch.ones_like(exact), e - 24)


def test_exp_is_nonzero_exactly_from_exp_nonzero():
    """`exp(x) > 0` exactly for `x >= EXP_NONZERO`, over every fp32 in [-104, -80] (the kernels' loops flush by
    comparing `x` with it instead of the result's exponent; above -80 exp is far from the flush)."""
    bits = torch.arange(torch.tensor(-80.0).view(torch.int32).item(), torch.tensor(-104.0).view(torch.int32).item() + 1,
                        dtype=torch.int32)
    x = bits.view(torch.float32)
    assert torch.equal(canonical.exp(x) > 0, x >= canonical.EXP_NONZERO)


@pytest.mark.parametrize("name, lo, hi, seed", [("exp", -87.33654, 88.72283, 1), ("log", canonical.TINY, FLT_MAX, 2)])
def test_exp_and_log_within_one_ulp_on_ten_million_inputs(name, lo, hi, seed):
    fn, ref = getattr(canonical, name), getattr(torch, name)
    worst, count, part = 0.0, 0, 0
    while count < 10_000_000:
        x = random_floats(lo, hi, 3_000_000, seed * 100 + part)
        worst, count, part = max(worst, float(ulp_error(fn(x), ref(x.double())).max())), count + x.numel(), part + 1
    assert worst <= 1.0, f"{name}: max error {worst:.4f} ULP over {count} inputs"


def test_sigmoid_within_three_ulp_on_ten_million_inputs():
    """Its normal results below 1 (every fp32 input: at most 2.40 ULP, benchmarks/README.md); the ends exact."""
    worst, count, part = 0.0, 0, 0
    while count < 10_000_000:
        x = random_floats(-87.33654, 17.32868, 3_000_000, 300 + part)
        worst = max(worst, float(ulp_error(canonical.sigmoid(x), torch.sigmoid(x.double())).max()))
        count, part = count + x.numel(), part + 1
    assert worst <= 3.0, f"sigmoid: max error {worst:.4f} ULP over {count} inputs"
    ends = canonical.sigmoid(torch.tensor([float("-inf"), -200.0, 0.0, -0.0, 40.0, float("inf"), float("nan")]))
    assert ends[:6].tolist() == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0] and ends[6].isnan()


def test_vespo_gamma_weight_is_as_accurate_as_trls_fp32_formula():
    """`vespo_phi` (one token whose log-ratio is log w) over 10**6 random log w whose phi is a normal float: its error
    is the fp32 formula's conditioning (the exponent's rounding times phi, ~1e2 ULP where `lam * w` is ~90; every
    input: benchmarks/README.md), within 1.25x of TRL's own fp32 torch formula's on the same inputs. Exact at log w = 0
    (phi(1) = 1); an overflow gives 0, as TRL's `nan_to_num`."""
    def phi(x, k, lam):
        n = x.numel()
        return canonical.vespo_phi(x.view(n, 1), torch.zeros(n, 1), torch.zeros(n), torch.ones(n, 1, dtype=torch.bool),
                                   None, (k, lam, k, lam)).view(-1)

    for k, lam, hi in ((2.0, 3.0, 3.47913337), (3.0, 2.0, 3.92301822)):
        x = random_floats(canonical.VESPO_LOG_W[0], hi, 1_000_000, 400 + int(k))
        exact = torch.exp((lam + k * x.double()) - lam * torch.exp(x.double()))
        ours = float(ulp_error(phi(x, k, lam), exact).max())
        trl = float(ulp_error(torch.exp(lam + k * x - lam * torch.exp(x)), exact).max())
        assert 10 < ours <= 1.25 * trl, f"phi k={k}, lambda={lam}: {ours:.1f} ULP, TRL's fp32 formula {trl:.1f} ULP"
        assert phi(torch.tensor([0.0]), k, lam).item() == 1.0
    assert phi(torch.tensor([9.0, 0.0]), 10.0, 0.0).tolist() == [0.0, 1.0]  # exp(89.2) overflows; lambda floor 1e-4


def test_sqrt_is_correctly_rounded():
    x = torch.cat([random_floats(canonical.TINY, FLT_MAX, 10_000_000, 3),
                   torch.arange(1, 4097, dtype=torch.float32) ** 2, torch.tensor([canonical.TINY, FLT_MAX, 2.0])])
    assert_bitwise_equal(canonical.sqrt(x), torch.from_numpy(np.sqrt(x.numpy())), "sqrt vs IEEE sqrt")
    assert canonical.sqrt(torch.tensor([0.0, 1e-45, 1e-39])).tolist() == [0.0, 0.0, 0.0]  # subnormals flush to 0
    edges = canonical.sqrt(torch.tensor([float("inf"), float("nan")]))  # as the GPU's sqrt_rn
    assert edges[0] == float("inf") and torch.isnan(edges[1])


def fp32_nearest(v: Fraction) -> float:
    """`v` rounded to the nearest fp32, ties to even, exactly (a float64 first would round twice)."""
    f = np.float32(float(v))
    near = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return float(min(near, key=lambda c: (abs(Fraction(float(c)) - v), int(np.array(c).view(np.int32)) & 1)))


def test_fma_rounds_once():
    """`canonical.fma` is IEEE's fusedMultiplyAdd on fp32: against exact rationals on products near the addend
    (cancellation), near an fp32 midpoint, and on random bit patterns; a float64 product + sum gets the first
    case wrong (it rounds to the midpoint, then to even)."""
    a, b, c = torch.tensor([1 + 2 ** -23]), torch.tensor([-(1 - 2 ** -23) * 2 ** -24]), torch.tensor([1 + 2 ** -23])
    assert (a.double() * b.double() + c.double()).float().item() == 1.0
    g = torch.Generator().manual_seed(5)
    n = 3000
    x = (torch.rand(n, generator=g) * 4 - 2, torch.rand(n, generator=g) * 4 - 2)
    near = (-(x[0].double() * x[1].double()) * (1 + (torch.rand(n, generator=g).double() - 0.5) * 2 ** -20)).float()
    mid_a = (1 + torch.randint(0, 2 ** 23, (n,), generator=g).double() / 2 ** 23).float()
    mid_b = -(1 - torch.randint(0, 2 ** 12, (n,), generator=g).double() / 2 ** 23).float() * 2 ** -24
    rnd = [random_floats(-1e15, 1e15, 2 * n, seed)[:n] for seed in (6, 7, 8)]
    cases = [(a, b, c), (*x, near), (mid_a, mid_b, mid_a), tuple(rnd)]
    for ta, tb, tc in cases:
        got = canonical.fma(ta, tb, tc)
        want = [fp32_nearest(Fraction(float(p)) * Fraction(float(q)) + Fraction(float(r)))
                for p, q, r in zip(ta.tolist(), tb.tolist(), tc.tolist())]
        assert_bitwise_equal(got, torch.tensor(want, dtype=torch.float32), "fma vs exact")


def test_edges():
    e = canonical.exp(torch.tensor([0.0, -0.0, float("-inf"), -1e4, -87.34, 88.73, 1e4, float("inf"), float("nan")]))
    assert e[:7].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, float("inf"), float("inf")] and e[7] == float("inf")
    assert torch.isnan(e[8])
    # Results that would be subnormal are flushed: a device that flushes and one that does not agree.
    near = torch.linspace(-87.5, -87.2, 10001)
    out = canonical.exp(near)
    assert bool(((out == 0) | (out >= canonical.TINY)).all()) and bool((out[near > -87.33] > 0).all())
    assert canonical.log(torch.tensor([1.0])).item() == 0.0
    assert canonical.log(torch.tensor([2.0 ** k for k in range(-126, 128)])).double().sub(
        torch.arange(-126, 128).double() * np.log(2)).abs().max() < 2e-5


def test_pair_sum_is_invariant_to_padding_and_rows_and_differs_from_a_framework_sum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 37, generator=g) * torch.exp2(torch.randint(-12, 13, (64, 37), generator=g).float())
    tree = canonical.pair_sum(x)
    assert_bitwise_equal(canonical.pair_sum(torch.nn.functional.pad(x, (0, 91))), tree, "zero padding")
    assert_bitwise_equal(torch.stack([canonical.pair_sum(row) for row in x]), tree, "one row at a time")
    assert_bitwise_equal(canonical.pair_sum(x.t().contiguous(), dim=0), tree, "transposed")
    assert int(bits(canonical.pair_sum(torch.tensor([-0.0, -0.0])))) == 0  # -0.0 sums to +0.0
    left_to_right = x[:, 0].clone()
    for i in range(1, x.shape[1]):
        left_to_right = left_to_right + x[:, i]
    assert bool((bits(left_to_right) != bits(tree)).any()), "vacuous: no row's bits depend on the summation order"


def test_tile_stats_merge_in_any_split_equals_the_whole_row():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1000, generator=g) * 4
    x[3] = float("-inf")
    x[5, 256:512] = float("-inf")  # two whole tiles of -inf
    m, s = canonical.tile_stats(x, 128)
    parts = [canonical.tile_stats(x[:, a:b], 128) for a, b in ((0, 384), (384, 640), (640, 1000))]
    m2, s2 = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
    assert_bitwise_equal(m2, m, "max") and assert_bitwise_equal(s2, s, "sumexp")
    lse = canonical.lse(*canonical.merge_stats(m, s))
    assert torch.isnan(lse[3]) and bool(torch.isfinite(lse[torch.arange(16) != 3]).all())
    torch.testing.assert_close(lse[torch.arange(16) != 3].double(),
                               torch.logsumexp(x.double(), -1)[torch.arange(16) != 3], rtol=0, atol=4e-6)


_PROBE = """
import hashlib, json, os, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from harness.scenarios import SCENARIOS
from grpo_core.distributed import DistributedGRPOLossOp
h = hashlib.sha256()
for name in sys.argv[2:]:
    scn = SCENARIOS[name]
    inp = scn.inputs()
    x = inp["policy_logits"].clone().requires_grad_(True)
    res = DistributedGRPOLossOp().apply(x, inp["action_ids"], inp["old_logps"], inp["rewards"], contract=scn.contract(),
                                        completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"])
    res.loss.backward()
    for t in (res.loss, res.per_sequence_policy, res.per_sequence_kl, res.advantages, x.grad):
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
g = torch.Generator().manual_seed(0)
guard = hashlib.sha256(torch.randn(1 << 16, generator=g).numpy().tobytes()).hexdigest()
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "bits": h.hexdigest(), "randn": guard}))
"""


@pytest.mark.slow
def test_same_bits_under_every_cpu_code_path_and_thread_count():
    """The canonical path under ATEN_CPU_CAPABILITY=default / avx2 / the machine's own, with 1 and 2 threads."""
    runs = []
    for cap in ("default", "avx2", None):
        for threads in (1, 2):
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            env.pop("ATEN_CPU_CAPABILITY", None)
            if cap:
                env["ATEN_CPU_CAPABILITY"] = cap
            proc = subprocess.run([sys.executable, "-c", _PROBE, str(threads), "wide_exponent", "bf16_logits",
                                   "csr_straddle_odd_v1031"], env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, proc.stderr[-2000:]
            runs.append({"threads": threads, **json.loads(proc.stdout.strip().splitlines()[-1])})
    capabilities = {r["capability"] for r in runs}
    if len(capabilities) < 2:
        pytest.skip(f"this CPU offers only {capabilities}")
    # The vacuity guard: the code paths really differ (torch's own sampler gives other bits under another one).
    assert len({r["randn"] for r in runs}) > 1, f"no CPU code path changed torch.randn's bits: {runs}"
    assert len({r["bits"] for r in runs}) == 1, json.dumps(runs, indent=1)


@pytest.mark.parametrize("grouping", ["uniform4", "csr"])
@pytest.mark.parametrize("normalizer,constant", [("global_active_tokens", None), ("per_sequence_then_mean", None),
                                                 ("fixed_constant", 64.0)])
@pytest.mark.parametrize("beta,clip", [(0.0, (0.2, 0.2)), (0.04, (0.2, 0.28))])
def test_deterministic_path_matches_float64_oracle(grouping, normalizer, constant, beta, clip):
    """The canonical math keeps the native op's float64-oracle tolerances (loss, vectors and gradient)."""
    from conftest import make_inputs
    from grpo_core import GRPOLossContract
    from grpo_core.distributed import DistributedGRPOLossOp
    from test_grpo_loss import GROUPINGS, oracle
    inp = make_inputs(8, 6, 37, seed=case_seed(grouping, normalizer, beta, clip), empty_rows=(2,))
    groups = list(range(0, 9, 4)) if grouping == "uniform4" else GROUPINGS["csr"]["group_boundaries"]
    exp_loss, exp_pol, exp_kl, exp_grad, exp_seq, exp_adv = oracle(
        **inp, clip_eps=clip[0], clip_eps_high=clip[1], beta=beta, groups=groups, normalizer=normalizer,
        constant=constant)
    c = GRPOLossContract(num_sequences=8, padded_seq_len=6, vocab_size=37, clip_eps=clip[0], clip_eps_high=clip[1],
                         beta=beta, normalizer=normalizer, normalizer_constant=constant,
                         determinism_scope="topology_invariant", **GROUPINGS[grouping])
    x = inp["policy_logits"].clone().requires_grad_(True)
    res = DistributedGRPOLossOp().apply(x, inp["action_ids"], inp["old_logps"], inp["rewards"], contract=c,
                                        completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"])
    res.loss.backward()
    for name, got, want in (("loss", res.loss, exp_loss), ("policy_loss", res.policy_loss, exp_pol),
                            ("kl", res.kl, exp_kl), ("per_sequence_policy", res.per_sequence_policy, exp_seq)):
        assert_close_verbose(got, want, atol=1e-5, rtol=1e-4, what=name)
    assert_close_verbose(res.advantages, exp_adv, atol=1e-5, rtol=1e-5, what="advantages")
    assert_close_verbose(x.grad, exp_grad, atol=1e-6, rtol=1e-4, what="grad")
    assert bool((bits(x.grad[2]) == 0).all())  # the empty sequence: exact +0.0


# Issue 15: the canonical definitions of the options added for migration.

@pytest.mark.parametrize("source", ["rewards_unbiased_eps", "sequence", "token"])
@pytest.mark.parametrize("loss_type,max_len,normalizer,constant", [
    (None, None, "global_active_tokens", None), ("grpo", None, "per_sequence_then_batch_mean", None),
    ("dr_grpo", 50, "sequences_times_max_length", 50)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_deterministic_path_options_match_float64_oracle(source, loss_type, max_len, normalizer, constant,
                                                         temperature):
    from conftest import make_inputs
    from grpo_core import GRPOLossContract
    from grpo_core.distributed import DistributedGRPOLossOp
    from test_grpo_loss import _given_advantages, oracle
    inp = make_inputs(8, 6, 37, seed=case_seed(source, loss_type, temperature), empty_rows=(2,))
    given = None if source.startswith("rewards") else _given_advantages(inp, source)
    extra = dict(group_boundaries=(0, 3, 5, 8), advantage_std="unbiased_eps") if given is None else dict(
        advantages_input=source)
    c = GRPOLossContract(num_sequences=8, padded_seq_len=6, vocab_size=37, clip_eps=0.1, clip_eps_high=0.15, beta=0.04,
                         temperature=temperature, loss_type=loss_type, max_completion_length=max_len,
                         determinism_scope="topology_invariant", **extra)
    exp = oracle(**{**inp, "rewards": inp["rewards"] if given is None else None}, clip_eps=0.1, clip_eps_high=0.15,
                 beta=0.04, groups=(0, 3, 5, 8), std="unbiased_eps", normalizer=normalizer, constant=constant,
                 temperature=temperature, advantages=None if given is None else torch.nan_to_num(given),
                 metrics=True)
    x = inp["policy_logits"].clone().requires_grad_(True)
    res = DistributedGRPOLossOp().apply(x, inp["action_ids"], inp["old_logps"], None if given is not None else
                                        inp["rewards"], contract=c, completion_mask=inp["completion_mask"],
                                        ref_local_logits=inp["ref_logits"], advantages=given)
    res.loss.backward()
    for name, got, want in (("loss", res.loss, exp[0]), ("policy_loss", res.policy_loss, exp[1]),
                            ("kl", res.kl, exp[2]), ("per_sequence_policy", res.per_sequence_policy, exp[4])):
        assert_close_verbose(got, want, atol=1e-5, rtol=1e-4, what=name)
    if given is None:
        assert_close_verbose(res.advantages, exp[5], atol=1e-5, rtol=1e-5, what="advantages")
    else:
        assert_bitwise_equal(res.advantages, given, "advantages as given")
    for name, want in zip(("clip_fraction", "mean_ratio", "kl_token_mean"), exp[6:]):
        assert_close_verbose(getattr(res, name), torch.tensor(want), atol=1e-6, rtol=1e-5, what=name)
    assert_close_verbose(x.grad, exp[3], atol=1e-6, rtol=1e-4, what="grad")
    assert bool((bits(x.grad[2]) == 0).all())  # the empty sequence: exact +0.0
    assert res.provenance["kernels"] == "torch"


@pytest.mark.parametrize("normalizer,constant", [("per_sequence_then_batch_mean", None),
                                                 ("sequences_times_max_length", 40.0), ("global_active_tokens", None),
                                                 ("per_sequence_then_mean", None), ("fixed_constant", 7.0),
                                                 ("sequence_sums_then_batch_mean", None)])
def test_normalizers_and_their_gradient_weights(normalizer, constant):
    """`normalize` against its float64 formula, and `token_weights` = d normalize / d (a token of the sequence)."""
    from grpo_core.contract import TokenNormalizer
    g = torch.Generator().manual_seed(4)
    sums, counts = torch.randn(9, generator=g), torch.tensor([3, 0, 5, 1, 0, 7, 2, 2, 4])
    n = TokenNormalizer(normalizer)
    got = canonical.normalize(sums, counts, n, constant)
    s64, c64, active = sums.double(), counts.double(), counts > 0
    want = {"global_active_tokens": s64.sum() / c64.sum(),
            "per_sequence_then_mean": (s64[active] / c64[active]).sum() / active.sum(),
            "per_sequence_then_batch_mean": (s64[active] / c64[active]).sum() / 9,
            "fixed_constant": s64.sum() / 7.0, "sequences_times_max_length": s64.sum() / (9 * 40.0),
            "sequence_sums_then_batch_mean": s64.sum() / 9}[normalizer]
    assert_close_verbose(got, want, atol=0, rtol=3e-7, what=normalizer)
    leaf = sums.clone().requires_grad_(True)
    # d normalize / d sums[i] is the weight of each of sequence i's tokens (a token enters its sequence's sum once)
    (grad,) = torch.autograd.grad(canonical.normalize(leaf, counts, n, constant), leaf)
    weights = canonical.token_weights(counts, n, constant)
    assert_close_verbose(weights[active], grad[active], atol=0, rtol=3e-7, what="weights")
    assert bool((weights[~active] == 0).all()) or normalizer in ("global_active_tokens", "fixed_constant",
                                                                 "sequences_times_max_length",
                                                                 "sequence_sums_then_batch_mean")
    empty = canonical.normalize(torch.zeros(9), torch.zeros(9, dtype=torch.int64), n, constant)
    assert int(bits(empty)) == 0  # no active token: +0.0


def test_unbiased_eps_std_is_trls():
    """`(r - mean) / (Bessel std + fp32(1e-4))`: no floor (a tiny spread is divided by about 1e-4), equal rewards
    give exact zeros, and it is not the clamped unbiased std."""
    from grpo_core.contract import AdvantageStd
    r = torch.tensor([1.0, 2.0, 4.0, 8.0, 3.0, 3.0, 3.0, 5.0, 5.0 + 2 ** -20])
    bounds = (0, 4, 7, 9)
    got = canonical.group_advantages(r, bounds, AdvantageStd.UNBIASED_EPS)
    want = torch.cat([(g - g.mean()) / (g.std() + 1e-4) for g in r.double().split((4, 3, 2))])
    assert_close_verbose(got, want, atol=0, rtol=1e-6, what="unbiased_eps")
    assert got[4:7].tolist() == [0.0, 0.0, 0.0]
    clamped = canonical.group_advantages(r, bounds, AdvantageStd.UNBIASED)
    assert abs(got[7].item()) < 0.01 < abs(clamped[7].item())  # 1e-4 added vs the 1e-6 floor: far apart
    assert canonical.STD_EPS == torch.tensor(1e-4, dtype=torch.float32).item()


def test_used_advantages_zero_what_no_active_token_reads():
    mask = torch.tensor([[True, False], [False, False]])
    seq = canonical.used_advantages(torch.tensor([2.0, float("nan")]), mask)
    tok = canonical.used_advantages(torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]]), mask)
    assert seq.tolist() == [2.0, 0.0] and tok.tolist() == [[1.0, 0.0], [0.0, 0.0]]
