"""The distributed backend: bitwise identical at every TP x DP layout, with negative controls that prove the
comparison can fail. One world of real processes runs every check; each test reads its part. The world has four
ranks (gloo on the CPU; on CUDA, NCCL when there is a GPU per rank, else gloo); `GRPO_TEST_WORLD=8` runs every
power-of-two layout of eight ranks instead (tp8, dp8, tp2 x dp4, tp4 x dp2 besides the four-rank ones)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from conftest import HAS_CUDA, assert_bitwise_equal, assert_close_verbose, bits, make_inputs
from grpo_core import GRPOLossContract, LossContractError, ShardingSpec, kernel_registry, pending
from grpo_core.distributed import DistributedGRPOLossOp, VocabParallelLogprobOp
from harness.topology import Layout, layouts, run_world

S, T = 8, 32
WORLD = int(os.environ.get("GRPO_TEST_WORLD", "4"))
if WORLD not in (4, 8):
    raise ValueError(f"GRPO_TEST_WORLD: expected 4 or 8, got {WORLD}")
LAYOUTS = [lay for lay in layouts(WORLD) if lay.tp & (lay.tp - 1) == 0 and lay.dp & (lay.dp - 1) == 0]
CUDA_MEMORY_FRACTION = 0.1  # each CUDA rank's cap: the suite can share a node with a training job
GROUPINGS = {"uniform": dict(samples_per_prompt=4), "csr": dict(group_boundaries=(0, 3, 5, 8))}  # 3:5 straddles dp
NORMALIZERS = [("global_active_tokens", None), ("per_sequence_then_mean", None), ("fixed_constant", 100.0)]
CASES = [dict(V=V, grouping=g, normalizer=n, constant=c, beta=b, seed=i)
         for i, (V, g, (n, c), b) in enumerate(itertools.product((1000, 1031), GROUPINGS, NORMALIZERS, (0.0, 0.04)))]
# A DP shard whose sequences are all empty (dp2's and dp4's first ranks read no logits at all).
CASES.append(dict(V=1000, grouping="csr", normalizer="per_sequence_then_mean", constant=None, beta=0.04, seed=99,
                  empty=(0, 1, 2, 3)))
FIELDS = ("loss", "policy_loss", "kl", "per_sequence_policy", "per_sequence_kl", "advantages",
          "per_sequence_active_tokens", "grad")
OP = DistributedGRPOLossOp()


def case_inputs(case: dict) -> dict:
    # V=1031 cases use logits spread over many exponents (the vacuity guard); sequences 2 and 5 are empty.
    return make_inputs(S, T, case["V"], seed=case["seed"], wide=case["V"] == 1031,
                       empty_rows=case.get("empty", (2, 5)))


def contract_for(case: dict, layout: Layout, tp_rank: int = 0, dp_rank: int = 0, **over) -> GRPOLossContract:
    sharding = ShardingSpec.uniform(vocab_size=case["V"], num_sequences=S, tp_world_size=layout.tp,
                                    dp_world_size=layout.dp, tp_rank=tp_rank, dp_rank=dp_rank)
    fields = dict(num_sequences=S, padded_seq_len=T, vocab_size=case["V"], beta=case["beta"],
                  normalizer=case["normalizer"], normalizer_constant=case["constant"], sharding=sharding,
                  determinism_scope="topology_invariant", **GROUPINGS[case["grouping"]])
    return GRPOLossContract(**{**fields, **over})


def run_local(inp: dict, contract: GRPOLossContract, device, tp_group=None, dp_group=None, **over) -> dict:
    """Slices the global inputs to this rank's shard, runs the op and its backward; returns CPU tensors."""
    (lo, hi), (vlo, vhi) = contract.sharding.sequence_bounds, contract.sharding.vocab_bounds
    inp = {**inp, **over}
    x = inp["policy_logits"][lo:hi, :, vlo:vhi].to(device).clone().requires_grad_(True)
    ref = None if inp["ref_logits"] is None or contract.beta == 0 else inp["ref_logits"][lo:hi, :, vlo:vhi].to(device)
    res = OP.apply(x, inp["action_ids"][lo:hi].to(device), inp["old_logps"][lo:hi].to(device),
                   inp["rewards"][lo:hi].to(device), contract=contract,
                   completion_mask=inp["completion_mask"][lo:hi].to(device), ref_local_logits=ref,
                   tp_group=tp_group, dp_group=dp_group)
    res.loss.backward()
    out = {f: getattr(res, f).detach().cpu() for f in FIELDS if f != "grad"}
    out["grad"] = x.grad.cpu()
    return out


def compare(got: dict, want: dict, contract: GRPOLossContract, label: str, fields=FIELDS) -> list[str]:
    """Bitwise comparison of one rank's outputs with the single-rank reference (gradient: this rank's slice)."""
    (lo, hi), (vlo, vhi) = contract.sharding.sequence_bounds, contract.sharding.vocab_bounds
    bad = []
    for f in fields:
        w = want[f][lo:hi, :, vlo:vhi] if f == "grad" else want[f]
        try:
            assert_bitwise_equal(got[f], w, f"{label} {f}")
        except AssertionError as exc:
            bad.append(str(exc))
    return bad


def _tp_tiled_lse(x: torch.Tensor, group) -> torch.Tensor:
    """Negative control: one 'tile' per TP shard (tiling set by the TP degree), merged by logsumexp."""
    local = torch.logsumexp(x, -1)
    if group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.logsumexp(torch.stack(parts, -1), -1)


def _allreduce_lse(x: torch.Tensor, group) -> torch.Tensor:
    """Negative control: framework sums of exp per shard, combined with a float all_reduce."""
    m = x.amax(-1)
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = torch.exp(x - m[:, None]).sum(-1)
    if group is not None:
        dist.all_reduce(s, group=group)
    return m + torch.log(s)


def _allreduce_token_sum(values: torch.Tensor, group) -> torch.Tensor:
    """Negative control: the DP token sum as local framework sums combined with a float all_reduce."""
    total = values.sum()
    if group is not None:
        dist.all_reduce(total, group=group)
    return total


def _expect_error(fn) -> str:
    try:
        fn()
    except LossContractError as exc:
        return str(exc)
    return "NO ERROR"


def world_suite(ctx) -> dict:
    """Everything the tests check, run once on every rank."""
    dev = ctx.device
    out = {"mismatches": [], "compared": 0, "controls": {}, "identity": [], "repeats": [], "errors": {},
           "memory_capped": None}
    if dev.type == "cuda":  # the cap holds: an allocation just above it fails
        try:
            torch.empty(int(torch.cuda.get_device_properties(dev).total_memory * CUDA_MEMORY_FRACTION) + 2**28,
                        dtype=torch.uint8, device=dev)
            out["memory_capped"] = False
        except torch.OutOfMemoryError:
            out["memory_capped"] = True
    for case in CASES:
        inp = case_inputs(case)
        want = run_local(inp, contract_for(case, Layout(1, 1)), dev)
        for lay in LAYOUTS:
            p = ctx.place(lay)
            if p is None:
                continue
            c = contract_for(case, lay, p.tp_rank, p.dp_rank)
            got = run_local(inp, c, dev, p.tp_group, p.dp_group)
            out["mismatches"] += compare(got, want, c, f"case {case} {lay.name} rank {ctx.rank}")
            out["compared"] += 1
            if case["V"] == 1031 and case["beta"] == 0.04:  # wide-exponent logits: the controls must move
                (lo, hi), (vlo, vhi) = c.sharding.sequence_bounds, c.sharding.vocab_bounds
                rows = inp["policy_logits"][lo:hi].reshape(-1, case["V"]).to(dev)
                local = rows[:, vlo:vhi].contiguous()
                ctl = out["controls"].setdefault(lay.name, {"tp_tiled": 0, "allreduce_tp": 0, "allreduce_dp": 0})
                ctl["tp_tiled"] += int((bits(_tp_tiled_lse(local, p.tp_group)) != bits(_tp_tiled_lse(rows, None)))
                                       .any())
                ctl["allreduce_tp"] += int((bits(_allreduce_lse(local, p.tp_group))
                                            != bits(_allreduce_lse(rows, None))).any())
                tok = inp["old_logps"].to(dev)
                ctl["allreduce_dp"] += int(bits(_allreduce_token_sum(tok[lo:hi], p.dp_group))
                                           != bits(_allreduce_token_sum(tok, None)))

    # Identity: reference == policy and old_logps == the policy's own log-probs.
    case = CASES[1]
    inp = case_inputs(case)
    full = contract_for(case, Layout(1, 1)).logprob_contract
    own, _ = VocabParallelLogprobOp()(inp["policy_logits"].reshape(S * T, -1).to(dev), inp["action_ids"].reshape(-1)
                                      .to(dev), contract=full, mask=inp["completion_mask"].reshape(-1).to(dev))
    ident = {**inp, "ref_logits": inp["policy_logits"], "old_logps": own.view(S, T).cpu()}
    for lay in LAYOUTS:
        p = ctx.place(lay)
        if p is None:
            continue
        losses = []
        for eps in (0.1, 0.3):
            c = contract_for(case, lay, p.tp_rank, p.dp_rank, clip_eps=eps)
            r = run_local(ident, c, dev, p.tp_group, p.dp_group)
            losses.append(r["loss"])
            (lo, hi), lp = c.sharding.sequence_bounds, c.logprob_contract
            vlo, vhi = c.sharding.vocab_bounds
            logp, _ = VocabParallelLogprobOp()(
                inp["policy_logits"][lo:hi, :, vlo:vhi].reshape((hi - lo) * T, -1).to(dev),
                inp["action_ids"][lo:hi].reshape(-1).to(dev), contract=lp, tp_group=p.tp_group,
                mask=inp["completion_mask"][lo:hi].reshape(-1).to(dev))
            ratio = torch.exp(logp.cpu() - own.view(S, T)[lo:hi].reshape(-1).cpu())
            out["identity"].append({"layout": lay.name, "ratio_is_one": bool((ratio == 1.0).all()),
                                    "kl_zero_bits": bool((bits(r["per_sequence_kl"]) == 0).all())
                                    and int(bits(r["kl"])) == 0})
        out["identity"][-1]["loss_clip_independent"] = bool(bits(losses[0]) == bits(losses[1]))

    # Run-to-run: three repeats at tp2 x dp2 give identical bytes (ranks 0-3; the others sit this out).
    lay, p = Layout(2, 2), ctx.place(Layout(2, 2))
    if p is None:
        return out
    case = CASES[-2]
    inp = case_inputs(case)
    runs = [run_local(inp, contract_for(case, lay, p.tp_rank, p.dp_rank), dev, p.tp_group, p.dp_group)
            for _ in range(3)]
    for f in FIELDS:
        out["repeats"].append(all(bool((bits(r[f]) == bits(runs[0][f])).all()) for r in runs[1:]))

    # A bad value on one DP rank (a NaN old log-prob): every rank raises, at the same call, and the next call runs.
    # The Triton kernels (CUDA) defer the check to `pending.AHEAD` calls later; the torch ones raise in the call.
    nan_old = inp["old_logps"].clone()
    nan_old[tuple(inp["completion_mask"].nonzero()[0].tolist())] = float("nan")
    # Old log-probs of -1e30 (finite): ratios of inf, a loss of inf; every rank raises it as one, at the same call.
    c = contract_for(case, lay, p.tp_rank, p.dp_rank)
    for key, bad in (("deferred", nan_old), ("overflow", torch.full_like(inp["old_logps"], -1e30))):
        out[key] = None
        for call in range(1 + pending.AHEAD):
            msg = _expect_error(lambda: run_local(inp, c, dev, p.tp_group, p.dp_group,
                                                  **({"old_logps": bad} if call == 0 else {})))
            if msg != "NO ERROR":
                out[key] = (call, msg, torch.device(dev).type)
                break
        run_local(inp, c, dev, p.tp_group, p.dp_group)

    # Preflight: every rank raises, none hangs.
    def bad_run(**over):
        contract_over = {k: v for k, v in over.items() if k in ("beta", "normalizer", "normalizer_constant")}
        c = contract_for(case, lay, p.tp_rank, p.dp_rank, **contract_over)
        inputs_over = {k: v for k, v in over.items() if k not in contract_over}
        return _expect_error(lambda: run_local(inp, c, dev, p.tp_group, p.dp_group, **inputs_over))

    out["errors"]["tp_beta"] = bad_run(**({"beta": 0.05} if p.tp_rank == 1 else {}))
    out["errors"]["dp_normalizer"] = bad_run(**({"normalizer": "global_active_tokens", "normalizer_constant": None}
                                                if p.dp_rank == 1 else {}))
    out["errors"]["missing_ref"] = bad_run(**({"ref_logits": None} if ctx.rank == 1 else {}))
    flipped = inp["completion_mask"].clone()
    flipped[0, -1] = ~flipped[0, -1]
    out["errors"]["tp_mask"] = bad_run(**({"completion_mask": flipped} if p.tp_rank == 1 else {}))
    c4 = contract_for(case, Layout(4, 1), ctx.rank, 0)  # the contract says tp4; the groups are tp2 x dp2's
    out["errors"]["group_size"] = _expect_error(lambda: run_local(inp, c4, dev, p.tp_group, p.dp_group))
    return out


def _world(device: str) -> list[dict]:
    return run_world(world_suite, WORLD, device=device, timeout_s=900,
                     memory_fraction=CUDA_MEMORY_FRACTION if device == "cuda" else None)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def world(request):
    if request.param == "cuda" and not HAS_CUDA:
        pytest.skip("needs CUDA")
    return _world(request.param)


pytestmark = pytest.mark.distributed


def test_every_layout_is_bitwise_identical_to_single_rank(world):
    for r, res in enumerate(world):
        assert res["mismatches"] == [], "\n".join(res["mismatches"][:10])
    # every (case, layout) ran on every rank that takes part in it (world 4: rank 0 in all 6 layouts, rank 1 in 5)
    assert [res["compared"] for res in world] == [len(CASES) * sum(lay.world > r for lay in LAYOUTS)
                                                  for r in range(WORLD)]


def test_negative_controls_are_detected(world):
    ctl = world[0]["controls"]
    assert sorted(ctl) == sorted(lay.name for lay in LAYOUTS)
    for lay in LAYOUTS:
        c = ctl[lay.name]
        if lay.tp > 1:
            assert c["tp_tiled"] > 0, f"tiling by TP degree went unnoticed at {lay.name}: {c}"
            assert c["allreduce_tp"] > 0, f"float all_reduce over TP went unnoticed at {lay.name}: {c}"
        if lay.dp > 1:
            assert c["allreduce_dp"] > 0, f"float all_reduce over DP went unnoticed at {lay.name}: {c}"
    assert ctl["tp1xdp1"] == {"tp_tiled": 0, "allreduce_tp": 0, "allreduce_dp": 0}  # controls agree with themselves


def test_identity_ratio_one_kl_zero_clip_independent(world):
    for res in world:
        for row in res["identity"]:
            assert row["ratio_is_one"] and row["kl_zero_bits"], row
            if "loss_clip_independent" in row:
                assert row["loss_clip_independent"], row


def test_cuda_ranks_cap_their_memory(world):
    capped = [res["memory_capped"] for res in world]
    if capped[0] is None:
        pytest.skip("a CPU world: no CUDA memory to cap")
    assert all(capped), f"an allocation above the {CUDA_MEMORY_FRACTION} cap succeeded on ranks {capped}"


def test_run_to_run_repeats_identical(world):
    for res in world[:4]:  # the ranks of tp2 x dp2
        assert len(res["repeats"]) == len(FIELDS) and all(res["repeats"]), res["repeats"]


def test_a_bad_value_raises_on_every_rank_at_the_same_call(world):
    got = [res["deferred"] for res in world[:4]]  # the ranks of tp2 x dp2
    assert all(g is not None for g in got), got
    assert {g[0] for g in got} == {pending.AHEAD if got[0][2] == "cuda" else 0}, got
    # the rank pair that holds it names it (the preflight of the torch kernels tells every rank)
    assert sum("old_logps: expected finite values at active tokens" in g[1] for g in got) >= 2, got
    got = [res["overflow"] for res in world[:4]]
    assert all(g is not None for g in got), got
    assert {g[0] for g in got} == {pending.AHEAD if got[0][2] == "cuda" else 0}, got
    assert all("loss: expected a finite float32 loss from finite inputs" in g[1] for g in got), got


@pytest.mark.parametrize("check,needles", [
    ("tp_beta", ["TP axis", "beta"]),
    ("dp_normalizer", ["DP axis", "normalizer"]),
    ("missing_ref", ["ref_logits: required when beta > 0", "rank 1"]),
    ("tp_mask", ["completion_mask"]),
    ("group_size", ["tp_group: the contract says tp_world_size=4"]),
])
def test_preflight_raises_on_every_rank(world, check, needles):
    for r, res in enumerate(world[:4]):  # the ranks of tp2 x dp2
        msg = res["errors"][check]
        assert all(n in msg for n in needles), f"rank {r}: {msg}"


def test_single_rank_matches_native_within_fp32_tolerance():
    for case in CASES[:6] + CASES[-6:]:
        inp = case_inputs(case)
        got = run_local(inp, contract_for(case, Layout(1, 1)), "cpu")
        x = inp["policy_logits"].clone().requires_grad_(True)
        ref = inp["ref_logits"] if case["beta"] else None
        loss, pol, kl = kernel_registry.get_op("grpo_loss", backend="native")(
            **{**inp, "policy_logits": x, "ref_logits": ref}, beta=case["beta"], normalizer=case["normalizer"],
            normalizer_constant=case["constant"], **GROUPINGS[case["grouping"]])
        loss.backward()
        assert_close_verbose(got["loss"], loss, atol=1e-5, rtol=1e-4, what="loss")
        assert_close_verbose(got["grad"], x.grad, atol=1e-6, rtol=1e-4, what="grad")


def test_batch_and_padding_invariance():
    """A pair of sequences (one group) gives the same per-sequence bits alone, anywhere in larger batches, and
    with a longer padded_seq_len; with a fixed normalizer their gradient rows match too."""
    V = 1031
    pair = make_inputs(2, T, V, seed=42, wide=True)

    def embed(batch: int, at: int, length: int) -> dict:
        other = make_inputs(batch, length, V, seed=batch * 7 + at, wide=True)
        for k, v in pair.items():
            if k == "rewards":
                other[k][at:at + 2] = v
            else:
                other[k][at:at + 2] = 0 if k != "completion_mask" else False
                other[k][at:at + 2, :T] = v
        return other

    def run(inp: dict, batch: int, length: int) -> dict:
        c = GRPOLossContract(num_sequences=batch, padded_seq_len=length, vocab_size=V, samples_per_prompt=2,
                             normalizer="fixed_constant", normalizer_constant=64.0,
                             determinism_scope="topology_invariant")
        return run_local(inp, c, "cpu")

    alone = run(pair, 2, T)
    for batch, at, length in [(4, 2, T), (8, 0, T), (8, 6, T), (6, 4, 48), (2, 0, 64)]:
        got = run(embed(batch, at, length), batch, length)
        for f in ("per_sequence_policy", "per_sequence_kl", "advantages", "per_sequence_active_tokens"):
            assert_bitwise_equal(got[f][at:at + 2], alone[f], f"{f} at {at} of {batch}, T={length}")
        assert_bitwise_equal(got["grad"][at:at + 2, :T], alone["grad"], f"grad at {at} of {batch}, T={length}")
        assert bool((got["grad"][at:at + 2, T:] == 0).all())


def test_registry_routes_multi_rank_contracts_to_distributed():
    case = CASES[0]
    assert kernel_registry.get_loss_op(contract_for(case, Layout(2, 2), 1, 1)).backend == "distributed"
    d = kernel_registry.get_loss_op(contract_for(case, Layout(1, 1), determinism_scope="run_to_run"))
    assert d.backend == "native"
    d = kernel_registry.get_loss_op(contract_for(case, Layout(1, 1), determinism_scope="run_to_run"),
                                    backend="distributed")
    assert d.backend == "distributed"
    d = kernel_registry.get_loss_op(contract_for(case, Layout(1, 2), 0, 1))
    assert "native" in d.rejected and "tp_world_size=1, dp_world_size=2" in d.rejected["native"][0]


def test_group_passed_without_initialized_world_fails_clearly():
    case = CASES[0]
    with pytest.raises(LossContractError, match="dp_group: the contract has dp_world_size=2 but no dp_group"):
        run_local(case_inputs(case), contract_for(case, Layout(1, 2)), "cpu")


# Issue 12: the distributed backend raises the very message the native op raises (in a single process, where no
# rank prefix is added), and sends no gradient into old_logps / rewards / ref logits.

def _native_and_distributed_errors(bad: dict) -> tuple[str, str]:
    case = CASES[1]  # beta = 0.04: ref logits present
    inp = {**case_inputs(case), **bad}
    out = []
    with pytest.raises(LossContractError) as exc:
        kernel_registry.get_op("grpo_loss", backend="native")(**inp, beta=case["beta"], **GROUPINGS[case["grouping"]])
    out.append(str(exc.value))
    with pytest.raises(LossContractError) as exc:
        OP.apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], inp["rewards"],
                 contract=contract_for(case, Layout(1, 1)), completion_mask=inp["completion_mask"],
                 ref_local_logits=inp["ref_logits"])
    out.append(str(exc.value))
    return out[0], out[1]


def _with(name: str, index: tuple, value: float) -> dict:
    t = case_inputs(CASES[1])[name].clone()
    t[index] = value
    return {name: t}


@pytest.mark.parametrize("bad", [
    pytest.param(lambda: {"ref_logits": [[0.0]]}, id="ref-list"),
    pytest.param(lambda: {"rewards": None}, id="rewards-none"),
    pytest.param(lambda: {"rewards": case_inputs(CASES[1])["rewards"].numpy()}, id="rewards-numpy"),
    pytest.param(lambda: {"old_logps": case_inputs(CASES[1])["old_logps"].to("meta")}, id="old-meta"),
    pytest.param(lambda: {"rewards": case_inputs(CASES[1])["rewards"].double().index_fill(0, torch.tensor([3]),
                                                                                        1e300)}, id="rewards-1e300"),
    pytest.param(lambda: _with("old_logps", (1, 0), float("nan")), id="old-nan"),
    pytest.param(lambda: _with("policy_logits", (6, 0, 5), float("nan")), id="policy-nan"),
    pytest.param(lambda: _with("ref_logits", (4, 0, 7), float("inf")), id="ref-inf"),
    pytest.param(lambda: _with("policy_logits", (3, 0, int(case_inputs(CASES[1])["action_ids"][3, 0])), float("-inf")),
                 id="policy-minus-inf-at-action"),
])
def test_single_process_errors_match_native_word_for_word(bad):
    native_msg, distributed_msg = _native_and_distributed_errors(bad())
    assert native_msg == distributed_msg


def test_non_contract_raises_a_contract_error():
    inp = case_inputs(CASES[0])
    with pytest.raises(LossContractError, match="^contract: expected a GRPOLossContract, got dict$"):
        OP.apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], inp["rewards"], contract={},
                 completion_mask=inp["completion_mask"])


@pytest.mark.parametrize("backend", ["native", "distributed"])
def test_policy_logits_that_disagree_with_the_contract_are_blamed_not_the_reference(backend):
    """T of the contract 3, of `policy_logits` 2, of `ref_logits` 3: the error names the policy logits' shape (it
    used to say the reference disagreed with the policy)."""
    B, T, V = 4, 3, 17
    inp = make_inputs(B, T, V, seed=5)
    c = GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, samples_per_prompt=2,
                         determinism_scope="topology_invariant" if backend == "distributed" else "run_to_run")
    op = kernel_registry.get_loss_op(c, backend=backend).op
    with pytest.raises(LossContractError, match=r"^policy_local_logits: expected \[.*\] = \[4, 3, 17\] .*got "
                                                r"\[4, 2, 17\]$"):
        op.apply(inp["policy_logits"][:, :2], inp["action_ids"], inp["old_logps"], inp["rewards"], contract=c,
                 completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"])


def test_only_policy_logits_get_a_gradient_on_the_distributed_path():
    case = CASES[1]
    inp = case_inputs(case)
    old, rewards = inp["old_logps"].clone().requires_grad_(True), inp["rewards"].clone().requires_grad_(True)
    ref = inp["ref_logits"].clone().requires_grad_(True)
    res = OP.apply(inp["policy_logits"], inp["action_ids"], old, rewards, contract=contract_for(case, Layout(1, 1)),
                   completion_mask=inp["completion_mask"], ref_local_logits=ref)
    assert not res.loss.requires_grad  # policy logits without grad: nothing to differentiate
    x = inp["policy_logits"].clone().requires_grad_(True)
    res = OP.apply(x, inp["action_ids"], old, rewards, contract=contract_for(case, Layout(1, 1)),
                   completion_mask=inp["completion_mask"], ref_local_logits=ref)
    res.loss.backward()
    assert x.grad is not None and (old.grad, rewards.grad, ref.grad) == (None, None, None)


def test_preflight_comparison_is_symmetric_and_names_both_ranks():
    from grpo_core.distributed.preflight import _compare
    base = {"axis": "tp", "nonce": 3, "backend": "distributed/2", "fingerprint": "f", "fields": {"beta": "x"},
            "groups": {"tp_group": 2, "dp_group": None}, "replicated": {"rewards": "d"}, "choices": {},
            "tensors": {"policy_local_logits": ["float32", "cpu", [4, 8, 512]], "rewards": ["float32", "cpu", [4]]}}
    a = {**base, "global_rank": 0, "axis_ranks": {"tp": 0, "dp": 0}}
    b = {**base, "global_rank": 1, "axis_ranks": {"tp": 1, "dp": 0}, "nonce": 4, "backend": "other",
         "tensors": {"policy_local_logits": ["float32", "cuda", [4, 8, 488]], "rewards": ["float64", "cpu", [4]]}}
    ab, ba = _compare(a, b, "tp"), _compare(b, a, "tp")
    assert ab == ba and len(ab) == 4, ab  # sequence, backend, device (the vocab dim is TP's: ignored), dtype
    assert all(m.startswith("ranks 0 and 1 (tp ranks 0 and 1): preflight: ") for m in ab)
    assert not any("here" in m or "this rank" in m for m in ab)
    assert "'cpu', [4, 8, '*']] on rank 0, ['float32', 'cuda', [4, 8, '*']] on rank 1" in ab[2]
    assert _compare(a, {**a, "global_rank": 2, "axis_ranks": {"tp": 0, "dp": 1}}, "tp") == []
