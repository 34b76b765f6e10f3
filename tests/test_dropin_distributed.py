"""The distributed op with the options added for migration (temperature, given advantages, TRL / Liger loss types,
TRL's std, the metrics): every TP x DP layout of four ranks gives the single-rank bits, and the Triton kernels
give the torch kernels' bits. One world of real processes runs every check, as in `test_distributed_grpo_loss.py`,
whose layouts and comparison this file shares."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import assert_bitwise_equal, assert_close_verbose, bits, make_inputs
from grpo_core import GRPOLossContract, ShardingSpec, kernel_registry
from grpo_core.distributed import DistributedGRPOLossOp
from grpo_core.triton import canonical as canonical_kernels
from harness.topology import Layout, run_world
from test_distributed_grpo_loss import _expect_error as _error, compare

S, T = 8, 32
LAYOUTS = [Layout(1, 1), Layout(2, 1), Layout(4, 1), Layout(1, 2), Layout(1, 4), Layout(2, 2)]
FIELDS = ("loss", "policy_loss", "kl", "per_sequence_policy", "per_sequence_kl", "advantages",
          "per_sequence_active_tokens", "clip_fraction", "mean_ratio", "kl_token_mean", "grad")
CASES = [
    dict(V=1031, temperature=0.7, groups=dict(samples_per_prompt=4)),
    dict(V=1000, temperature=1.3, loss_type="grpo", groups=dict(group_boundaries=(0, 3, 5, 8))),
    dict(V=1031, source="sequence", loss_type="dr_grpo", max_completion_length=40),
    dict(V=1000, source="token", loss_type="grpo", temperature=0.9, beta=0.0),
    dict(V=1031, advantage_std="unbiased_eps", loss_type="dapo", groups=dict(group_boundaries=(0, 3, 5, 8))),
    dict(V=1000, source="sequence", loss_type="grpo", empty=(0, 1, 2, 3)),  # dp2 / dp4's first ranks: all empty
    dict(V=1000, advantage_std="unbiased", loss_type="bnpo", groups=dict(samples_per_prompt=2)),
]
CASES = [dict(case, seed=i) for i, case in enumerate(CASES)]
OP = DistributedGRPOLossOp()
TRITON_OP = DistributedGRPOLossOp(kernels="triton")
TRITON_CASES = [CASES[2], CASES[3], CASES[4]]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # conftest sets it where there is no GPU
TRITON_LAYOUTS = [Layout(2, 2)]
# The Triton kernels' runs under the interpreter take 4 tokens a sequence, not 32, and chunks of 512 columns, not 4096:
# the interpreter's time goes with the rows and the chunk (its generic reductions are Python loops), while the options
# these tests are about, and the bits, do not depend on either (test_triton_canonical.py covers the shapes and chunks).
T_KERNELS = 4 if INTERPRET else T


def case_inputs(case: dict, T: int = T) -> dict:
    """The inputs, with given advantages (NaN wherever no active token reads them) and rewards=None for those."""
    inp = make_inputs(S, T, case["V"], seed=case["seed"], wide=case["V"] == 1031, empty_rows=case.get("empty", (2, 5)))
    source = case.get("source", "rewards")
    if source != "rewards":
        g = torch.Generator().manual_seed(5)
        mask = inp["completion_mask"]
        adv = torch.randn(S, generator=g) if source == "sequence" else torch.randn(S, T, generator=g)
        inp["advantages"] = torch.where(mask.any(-1) if source == "sequence" else mask, adv, float("nan"))
        inp["rewards"] = None
    return inp


def contract_for(case: dict, layout: Layout, tp_rank: int = 0, dp_rank: int = 0, T: int = T) -> GRPOLossContract:
    sharding = ShardingSpec.uniform(vocab_size=case["V"], num_sequences=S, tp_world_size=layout.tp,
                                    dp_world_size=layout.dp, tp_rank=tp_rank, dp_rank=dp_rank)
    source = case.get("source", "rewards")
    return GRPOLossContract(num_sequences=S, padded_seq_len=T, vocab_size=case["V"], beta=case.get("beta", 0.04),
                            clip_eps=0.1, clip_eps_high=0.15, temperature=case.get("temperature", 1.0),
                            loss_type=case.get("loss_type"), max_completion_length=case.get("max_completion_length"),
                            advantage_std=case.get("advantage_std"), advantages_input=source, sharding=sharding,
                            determinism_scope="topology_invariant", **case.get("groups", {}))


def run_local(inp: dict, contract: GRPOLossContract, device, tp_group=None, dp_group=None, op=OP) -> dict:
    """This rank's shard of the inputs through the op and its backward; CPU copies of every field."""
    (lo, hi), (vlo, vhi) = contract.sharding.sequence_bounds, contract.sharding.vocab_bounds
    x = inp["policy_logits"][lo:hi, :, vlo:vhi].to(device).clone().requires_grad_(True)
    ref = None if contract.beta == 0 else inp["ref_logits"][lo:hi, :, vlo:vhi].to(device)
    local = {k: None if inp.get(k) is None else inp[k][lo:hi].to(device) for k in ("rewards", "advantages")}
    res = op.apply(x, inp["action_ids"][lo:hi].to(device), inp["old_logps"][lo:hi].to(device), local["rewards"],
                   contract=contract, completion_mask=inp["completion_mask"][lo:hi].to(device),
                   ref_local_logits=ref, tp_group=tp_group, dp_group=dp_group, advantages=local["advantages"])
    res.loss.backward()
    out = {f: getattr(res, f).detach().cpu() for f in FIELDS if f != "grad"}
    out["grad"], out["kernels"] = x.grad.cpu(), res.provenance["kernels"]
    return out


def world_suite(ctx) -> dict:
    dev = ctx.device
    out = {"mismatches": [], "errors": {}}

    def against_one_rank(cases: list[dict], layouts: list[Layout], op, label: str, seq_len: int = T
                         ) -> tuple[set, int]:
        """Each case at each layout this rank is placed in, against the single-rank torch run (mismatches go to
        `out`): the kernels that ran and how many runs were compared."""
        kernels, compared = set(), 0
        for case in cases:
            inp = case_inputs(case, seq_len)
            want = run_local(inp, contract_for(case, Layout(1, 1), T=seq_len), dev)
            for lay in layouts:
                p = ctx.place(lay)
                if p is None:
                    continue
                c = contract_for(case, lay, p.tp_rank, p.dp_rank, T=seq_len)
                got = run_local(inp, c, dev, p.tp_group, p.dp_group, op=op)
                kernels.add(got.pop("kernels"))
                out["mismatches"] += compare(got, want, c, f"{label}case {case['seed']} {lay.name} rank {ctx.rank}",
                                             FIELDS)
                compared += 1
        return kernels, compared

    out["kernels"], out["compared"] = against_one_rank(CASES, LAYOUTS, OP, "")
    # The Triton kernels in this CPU world (under the interpreter, as on CI, at T_KERNELS tokens), on the options
    # only they compute in a world: given advantages per sequence and per token, dr_grpo, TRL's std.
    if INTERPRET:
        canonical_kernels.CHUNK = 512
        out["triton_kernels"], out["triton_compared"] = against_one_rank(TRITON_CASES, TRITON_LAYOUTS, TRITON_OP,
                                                                         "triton ", T_KERNELS)

    # Preflight at tp2 x dp2 (ranks 0-3): TP siblings must hold the same advantages where active tokens read them.
    lay, p = Layout(2, 2), ctx.place(Layout(2, 2))
    case = CASES[3]  # per-token advantages
    inp = case_inputs(case)
    c = contract_for(case, lay, p.tp_rank, p.dp_rank)
    mask = inp["completion_mask"]
    active = torch.nonzero(mask)[3].tolist()
    masked = torch.nonzero(~mask)[0].tolist()
    moved = inp["advantages"].clone()
    moved[tuple(active)] += 1.0
    mine = moved if p.tp_rank == 1 else inp["advantages"]
    out["errors"]["tp_advantages"] = _error(lambda: run_local({**inp, "advantages": mine}, c, dev, p.tp_group,
                                                              p.dp_group))
    junk = inp["advantages"].clone()
    junk[tuple(masked)] = 123.0 if p.tp_rank == 1 else float("nan")  # masked: may differ
    out["masked_junk_runs"] = _error(lambda: run_local({**inp, "advantages": junk}, c, dev, p.tp_group,
                                                       p.dp_group)) == "NO ERROR"
    wrong = {**inp, "rewards": torch.randn(S)} if ctx.rank == 2 else inp  # rank 2 passes both
    out["errors"]["both"] = _error(lambda: run_local(wrong, c, dev, p.tp_group, p.dp_group))
    wide = {**inp, "advantages": inp["advantages"].double()} if p.dp_rank == 1 else inp  # DP peers: other dtype
    out["errors"]["dp_dtype"] = _error(lambda: run_local(wide, c, dev, p.tp_group, p.dp_group))
    return out


@pytest.fixture(scope="module")
def world():
    return run_world(world_suite, 4, device="cpu", timeout_s=600)


pytestmark = pytest.mark.distributed


def test_every_layout_gives_the_single_rank_bits_with_the_migration_options(world):
    for res in world:
        assert res["mismatches"] == [], "\n".join(res["mismatches"][:10])
    assert [res["compared"] for res in world] == [len(CASES) * sum(lay.world > r for lay in LAYOUTS)
                                                  for r in range(4)]
    assert all(res["kernels"] == {"torch"} for res in world)
    if INTERPRET:
        assert [(res["triton_kernels"], res["triton_compared"]) for res in world] == [({"triton"}, 3)] * 4


def test_preflight_compares_the_advantages_peers_hold(world):
    """TP siblings: the same values where active tokens read them (masked ones may differ); DP peers: the same
    dtype, device and shape but for the sequences; and every rank gives exactly one of rewards / advantages."""
    for r, res in enumerate(world):
        assert "every rank of a TP group must pass the same ones" in res["errors"]["tp_advantages"], (r, res)
        assert "rewards / advantages: expected exactly one of them, got both" in res["errors"]["both"], (r, res)
        msg = res["errors"]["dp_dtype"]
        assert "(dp ranks 0 and 1): preflight: they disagree on advantages" in msg and "'float64'" in msg, (r, msg)
        assert res["masked_junk_runs"], r


def test_single_rank_matches_native_within_fp32_tolerance():
    native = kernel_registry.get_op("grpo_loss", backend="native")
    for case in CASES:
        inp = case_inputs(case)
        c = contract_for(case, Layout(1, 1))
        got = run_local(inp, c, "cpu")
        x = inp["policy_logits"].clone().requires_grad_(True)
        loss, _, _ = native(x, inp["ref_logits"] if c.beta else None, inp["action_ids"], inp["old_logps"],
                            inp["rewards"], inp["completion_mask"], clip_eps=0.1, clip_eps_high=0.15, beta=c.beta,
                            temperature=c.temperature, loss_type=case.get("loss_type"),
                            max_completion_length=case.get("max_completion_length"),
                            advantage_std=case.get("advantage_std"), advantages=inp.get("advantages"),
                            **case.get("groups", {}))
        loss.backward()
        assert_close_verbose(got["loss"], loss, atol=1e-5, rtol=1e-4, what=f"case {case['seed']} loss")
        assert_close_verbose(got["grad"], x.grad, atol=1e-6, rtol=1e-4, what=f"case {case['seed']} grad")


@pytest.mark.parametrize("case", CASES, ids=[str(c["seed"]) for c in CASES])
def test_triton_kernels_give_the_torch_bits_with_every_option(case, monkeypatch):
    """Temperature and given advantages (per sequence, per token) run in the kernels; loss types, the std and the
    metrics on the per-sequence vectors: the bits of the torch kernels, under the interpreter and on a GPU."""
    if INTERPRET:
        monkeypatch.setattr(canonical_kernels, "CHUNK", 512)
    inp = case_inputs(case, T_KERNELS)
    c = contract_for(case, Layout(1, 1), T=T_KERNELS)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = run_local(inp, c, dev, op=DistributedGRPOLossOp(kernels="triton"))
    want = run_local(inp, c, dev, op=DistributedGRPOLossOp(kernels="torch"))
    assert (got.pop("kernels"), want.pop("kernels")) == ("triton", "torch")
    for f in FIELDS:
        assert_bitwise_equal(got[f], want[f], f"case {case['seed']} {f}")


def test_temperature_one_changes_no_bit_of_the_distributed_path():
    case = dict(CASES[0], temperature=1.0)
    inp = case_inputs(case)
    a = run_local(inp, contract_for(case, Layout(1, 1)), "cpu")
    default = GRPOLossContract(num_sequences=S, padded_seq_len=T, vocab_size=case["V"], beta=0.04, clip_eps=0.1,
                               clip_eps_high=0.15, samples_per_prompt=4, determinism_scope="topology_invariant")
    b = run_local(inp, default, "cpu")
    assert default.fingerprint() == contract_for(case, Layout(1, 1)).fingerprint()
    for f in FIELDS:
        assert_bitwise_equal(a[f], b[f], f)
    hot = run_local(inp, contract_for(CASES[0], Layout(1, 1)), "cpu")
    assert bool((bits(hot["grad"]) != bits(a["grad"])).any())  # vacuity: 0.7 does change them


def test_metrics_on_the_triton_kernels_are_the_torch_bits():
    """On the Triton kernels (the default math) the metrics come from the kernels' log-probs by the same canonical
    ops: the same bits as on the torch kernels (CPU: the interpreter)."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    inp = make_inputs(4, 8, 300, seed=21, empty_rows=(1,))
    c = GRPOLossContract(num_sequences=4, padded_seq_len=8, vocab_size=300, samples_per_prompt=2, beta=0.04,
                         clip_eps=0.1, determinism_scope="topology_invariant")
    got = {}
    for kernels in ("triton", "torch"):
        out = run_local({k: v.to(dev) for k, v in inp.items()}, c, dev, op=DistributedGRPOLossOp(kernels=kernels))
        assert out.pop("kernels") == kernels
        got[kernels] = out
    for f in ("clip_fraction", "mean_ratio", "kl_token_mean", "loss", "grad"):
        assert_bitwise_equal(got["triton"][f], got["torch"][f], f)
    assert 0 < got["torch"]["clip_fraction"].item() < 1


def test_grad_output_and_temperature_scale_the_gradient():
    """`((coef * grad_output) * inv) * (onehot - softmax)`: a loss scaled by 3 gives 3x the gradient (fp32)."""
    case = CASES[1]
    inp = case_inputs(case)
    c = contract_for(case, Layout(1, 1))
    grads = []
    for scale in (1.0, 3.0):
        x = inp["policy_logits"].clone().requires_grad_(True)
        res = OP.apply(x, inp["action_ids"], inp["old_logps"], inp["rewards"], contract=c,
                       completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"])
        (res.loss * scale).backward()
        grads.append(x.grad)
    assert_close_verbose(grads[1], 3 * grads[0], atol=1e-9, rtol=1e-6, what="grad of 3 * loss")
