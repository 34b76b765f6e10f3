"""The fused linear loss: the materialized reference's numbers, its own log-probs' bits, and the same bits at every
TP x DP layout, batch, position and padding, with both kernel sets (Triton under the interpreter on the CPU).

Each invariance test also runs a planted change (a batch-dependent dot, a TP reduction that sums per-rank partials)
and requires it to move a bit, so that the comparison is shown able to fail."""

from __future__ import annotations

import contextlib
import re
import weakref
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import HAS_CUDA, assert_bitwise_equal, assert_close_verbose, bits
from grpo_core import GRPOLossContract, LossContractError, ShardingSpec, kernel_registry, linear
from grpo_core.linear import LinearGRPOLossOp, linear_grpo_loss, linear_logprobs
from harness.topology import Layout, run_world

DEV = "cuda" if HAS_CUDA else "cpu"
KERNELS = ["torch", "triton"]
FIELDS = ("loss", "policy_loss", "kl", "per_sequence_policy", "per_sequence_kl", "advantages",
          "per_sequence_active_tokens", "clip_fraction", "mean_ratio", "kl_token_mean")


def make(B=4, T=5, H=16, V=160, *, seed=0, dtype=torch.float32, wide=True, device=DEV, bias=True):
    """Hidden states over many binary exponents (a reordered sum moves bits), a weight, ids, mask, rewards."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    if wide:
        hidden = hidden * torch.exp2(torch.randint(-8, 3, (B, T, H), generator=g).float())
    weight = torch.randn(V, H, generator=g) * 0.5
    out = dict(hidden=hidden, weight=weight, ref_hidden=hidden + 0.1 * torch.randn(B, T, H, generator=g),
               bias=torch.randn(V, generator=g) if bias else None, action_ids=torch.randint(0, V, (B, T), generator=g),
               completion_mask=torch.rand(B, T, generator=g) < 0.8, rewards=torch.randn(B, generator=g))
    out["completion_mask"][:, 0] = True
    logits = out["hidden"] @ weight.T
    own = torch.log_softmax(logits.double(), -1).gather(-1, out["action_ids"][..., None])[..., 0]
    out["old_logps"] = (own + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    for k in ("hidden", "weight", "ref_hidden", "bias"):
        if out[k] is not None:
            out[k] = out[k].to(dtype)
    return {k: None if v is None else v.to(device) for k, v in out.items()}


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def run(inp, kernels="torch", **options):
    """`linear_grpo_loss` on fresh leaves: `(result, (d hidden, d weight, d bias))`."""
    h, w, b = leaf(inp["hidden"]), leaf(inp["weight"]), leaf(inp["bias"])
    res = linear_grpo_loss(h, w, inp["action_ids"], inp["old_logps"], inp["rewards"], inp["completion_mask"], bias=b,
                           kernels=kernels, **{"samples_per_prompt": 2, "ref_hidden": inp["ref_hidden"], **options})
    res.loss.backward()
    return res, (h.grad, w.grad, None if b is None else b.grad)


OPTIONS = [
    dict(),
    dict(beta=0.0, ref_hidden=None, loss_type="grpo", temperature=0.7),
    dict(loss_type="dr_grpo", max_completion_length=9, clip_eps_high=0.28, advantage_std="unbiased_eps"),
    dict(normalizer="per_sequence_then_mean", group_boundaries=(0, 3, 4), samples_per_prompt=None,
         advantage_std="none"),
    dict(rewards=None, advantages="token", samples_per_prompt=None, normalizer="fixed_constant",
         normalizer_constant=7.0),
    dict(old_logps=None, loss_type="bnpo", beta=0.1),
]


def _resolve(inp, over):
    """The inputs and options of one OPTIONS entry (`advantages="token"`: a random [B, T] tensor)."""
    inp, over = dict(inp), dict(over)
    if over.get("advantages") == "token":
        over["advantages"] = torch.randn(inp["action_ids"].shape, generator=torch.Generator().manual_seed(5)).to(DEV)
    for key in ("rewards", "old_logps"):
        if key in over:
            inp[key] = over.pop(key)
    return inp, over


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("over", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_the_materialized_reference_gives_the_same_numbers(kernels, over):
    """Against `h W^T + b` materialized and the native logits op (fp32 inputs, so only summation order differs)."""
    inp, over = _resolve(make(wide=False), over)
    res, grads = run(inp, kernels, **over)
    h, w, b = leaf(inp["hidden"]), leaf(inp["weight"]), leaf(inp["bias"])
    ref_hidden = over.pop("ref_hidden", inp["ref_hidden"])
    ref_logits = None if ref_hidden is None else (ref_hidden @ inp["weight"].T + inp["bias"]).detach()
    old = inp["old_logps"]
    logits = h @ w.T + b
    if old is None:  # on-policy: the old log-probs are the policy's own
        old = torch.log_softmax(logits.detach().double() / over.get("temperature", 1.0), -1).gather(
            -1, inp["action_ids"][..., None])[..., 0].float()
    native = kernel_registry.get_op("grpo_loss", backend="native")
    want = native(logits, ref_logits, inp["action_ids"], old, inp["rewards"], inp["completion_mask"],
                  **{"samples_per_prompt": 2, **over})
    want[0].backward()
    for name, got, expected in zip(("loss", "policy_loss", "kl"), res, want):
        assert_close_verbose(got, expected, atol=2e-5, rtol=2e-5, what=name)
    for name, got, expected in zip("hwb", grads, (h.grad, w.grad, b.grad)):
        assert_close_verbose(got, expected, atol=2e-6, rtol=1e-4, what=f"d {name}")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_own_logprobs_give_its_bits(kernels, dtype):
    """`linear_logprobs` are the loss's log-probs: as `ref_logps` they give the `ref_hidden` run's bits, and as
    `old_logps` the on-policy run's (every ratio exactly 1)."""
    inp = make(dtype=dtype)
    res, grads = run(inp, kernels, temperature=0.9)
    ref_logps = linear_logprobs(inp["ref_hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"],
                                bias=inp["bias"], temperature=0.9, kernels=kernels)
    res2, grads2 = run(inp, kernels, temperature=0.9, ref_hidden=None, ref_logps=ref_logps)
    for f in FIELDS:
        assert_bitwise_equal(getattr(res2, f), getattr(res, f), f)
    for a, b, name in zip(grads2, grads, "hwb"):
        assert_bitwise_equal(a, b, f"d {name}")
    own = linear_logprobs(inp["hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"], bias=inp["bias"],
                          kernels=kernels)
    on_policy, g1 = run({**inp, "old_logps": None}, kernels)
    given, g2 = run({**inp, "old_logps": own}, kernels)
    assert float(on_policy.mean_ratio) == 1.0
    for f in FIELDS:
        assert_bitwise_equal(getattr(given, f), getattr(on_policy, f), f)
    for a, b, name in zip(g1, g2, "hwb"):
        assert_bitwise_equal(a, b, f"d {name}")


_LOGITS = linear.TorchKernels.logits


def _planted_logits(self, h, w, b):
    """A batch-dependent dot: the products summed left to right, not by the tree, when the chunk holds more than 8
    tokens."""
    if h.shape[0] <= 8:
        return _LOGITS(self, h, w, b)
    products = h.float()[:, None, :] * w.float()[None, :, :]
    z = products[..., 0] + 0.0
    for k in range(1, products.shape[-1]):
        z = z + products[..., k]
    return z if b is None else z + b.float()


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_sequence_gives_the_same_bits_alone_in_any_batch_at_any_position_under_any_padding(kernels):
    """Per-sequence values and hidden-gradient rows of one sequence: alone (T = 5), and as sequence 2 of a batch of 4
    padded to T = 8. Given advantages and a fixed normalizer constant make its token weights the batch's too."""
    B, T, pad = 4, 5, 3
    inp = make(B=B, T=T, seed=3)
    over = dict(beta=0.04, normalizer="fixed_constant", normalizer_constant=16.0, samples_per_prompt=None)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(1)).to(DEV)
    alone = {k: None if v is None else (v[1:2] if k not in ("weight", "bias") else v) for k, v in inp.items()}

    def padded(t, fill):
        return torch.cat([t, torch.full((B, pad, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)], 1)

    batch = {k: None if v is None else (v.roll(1, 0) if k not in ("weight", "bias") else v) for k, v in inp.items()}
    for k, fill in (("hidden", 3.0), ("ref_hidden", -2.0), ("action_ids", 7), ("completion_mask", False),
                    ("old_logps", float("nan"))):
        batch[k] = padded(batch[k], fill)

    def both(logits=None):
        with mock.patch.object(linear.TorchKernels, "logits", logits) if logits else contextlib.nullcontext():
            one = run({**alone, "rewards": None}, kernels, advantages=adv[1:2], **over)
            many = run({**batch, "rewards": None}, kernels, advantages=adv.roll(1, 0), **over)
        return one, many

    (one, g_one), (many, g_many) = both()
    for f in ("per_sequence_policy", "per_sequence_kl", "per_sequence_active_tokens"):
        assert_bitwise_equal(getattr(many, f)[2:3], getattr(one, f), f)
    assert_bitwise_equal(g_many[0][2:3, :T], g_one[0], "d hidden rows")
    assert not bits(g_many[0][:, T:]).any(), "padding tokens get exactly zero hidden gradient"
    if kernels == "torch":  # the planted batch-dependent dot must move a bit (the comparison can fail)
        (one, g_one), (many, g_many) = both(_planted_logits)
        assert not torch.equal(bits(g_many[0][2:3, :T]), bits(g_one[0]))


def _layout_run(ctx, inp, kernels, lay, over):
    place = ctx.place(lay)
    if place is None:
        return None
    B, T, _ = inp["hidden"].shape
    V = inp["weight"].shape[0]
    s = ShardingSpec.uniform(vocab_size=V, num_sequences=B, tp_world_size=lay.tp, dp_world_size=lay.dp,
                             tp_rank=place.tp_rank, dp_rank=place.dp_rank, vocab_tile=32)
    c = GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, beta=0.04, samples_per_prompt=2,
                         vocab_tile=32, sharding=s, determinism_scope="topology_invariant", **over)
    (lo, hi), (vlo, vhi) = s.sequence_bounds, s.vocab_bounds
    h = inp["hidden"][lo:hi].to(ctx.device).requires_grad_(True)
    w = inp["weight"][vlo:vhi].to(ctx.device).requires_grad_(True)
    b = inp["bias"][vlo:vhi].to(ctx.device).requires_grad_(True)
    res = LinearGRPOLossOp(kernels).apply(
        h, w, inp["action_ids"][lo:hi].to(ctx.device), inp["old_logps"][lo:hi].to(ctx.device),
        inp["rewards"][lo:hi].to(ctx.device), contract=c, completion_mask=inp["completion_mask"][lo:hi].to(ctx.device),
        bias=b, ref_hidden=inp["ref_hidden"][lo:hi].to(ctx.device), tp_group=place.tp_group, dp_group=place.dp_group)
    res.loss.backward()
    return dict(fields={f: getattr(res, f).detach().cpu() for f in FIELDS}, dp=(lay.dp, place.dp_rank),
                seqs=(lo, hi), vocab=(vlo, vhi), dh=h.grad.cpu(), dw=w.grad.cpu(), db=b.grad.cpu())


def _planted_fold(local, start, lp, tp_group):
    """What a float all-reduce does: each TP rank sums its own shard from zero, then the partials are added."""
    import torch.distributed as dist
    mine = local(torch.zeros_like(start))
    if len(lp.vocab_shard_bounds) == 1:
        return mine
    parts = [torch.empty_like(mine) for _ in lp.vocab_shard_bounds]
    dist.all_gather(parts, mine.contiguous(), group=tp_group)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


LAYOUTS = [Layout(1, 1), Layout(2, 1), Layout(3, 1), Layout(4, 1), Layout(1, 2), Layout(2, 2), Layout(1, 4)]


def _world(ctx, kernels):
    inp = make(B=4, T=4, H=16, V=200, seed=7, device="cpu")
    out = {}
    for name, over in (("default", {}), ("grpo_temperature", dict(loss_type="grpo", temperature=0.8))):
        out[name] = [_layout_run(ctx, inp, kernels, lay, over) for lay in LAYOUTS]
    with mock.patch.object(linear, "_fold_over_tp", _planted_fold):
        out["planted"] = [_layout_run(ctx, inp, kernels, lay, {}) for lay in LAYOUTS]
    return out


def _compare(results, name):
    """Per layout: the scalars and vectors equal the 1x1 run's; hidden-gradient rows too; weight and bias gradient
    rows equal those of the TP = 1 run with the same DP layout. Returns the differences."""
    runs = [[r[name][i] for r in results if r[name][i] is not None] for i in range(len(LAYOUTS))]
    base = runs[0][0]
    diffs = []
    for lay, ranks in zip(LAYOUTS, runs):
        for r in ranks:
            for f in FIELDS:
                if not torch.equal(bits(r["fields"][f]), bits(base["fields"][f])):
                    diffs.append(f"{lay.name} {f}")
            lo, hi = r["seqs"]
            if not torch.equal(bits(r["dh"]), bits(base["dh"][lo:hi])):
                diffs.append(f"{lay.name} d hidden")
            same_dp = next(x for x in runs[LAYOUTS.index(Layout(1, lay.dp))] if x["dp"] == r["dp"])
            vlo, vhi = r["vocab"]
            for g in ("dw", "db"):
                if not torch.equal(bits(r[g]), bits(same_dp[g][vlo:vhi])):
                    diffs.append(f"{lay.name} {g}")
    return diffs


@pytest.mark.distributed
@pytest.mark.parametrize("kernels", KERNELS)
def test_every_layout_gives_the_same_bits(kernels):
    results = run_world(_world, 4, kernels, device=DEV, timeout_s=900, memory_fraction=0.1 if DEV == "cuda" else None)
    assert _compare(results, "default") == []
    assert _compare(results, "grpo_temperature") == []
    planted = _compare(results, "planted")
    assert planted and all("d hidden" in d for d in planted) and any("tp2" in d for d in planted), planted


@pytest.mark.parametrize("change, match", [
    (dict(weight=torch.zeros(160, 15)),
     r"weight: expected \[V, H\] with H = 16 like hidden's last dim, got \[160, 15\]"),
    (dict(bias=torch.zeros(159)), r"bias: expected shape \[V\] = \[160\]"),
    (dict(ref_hidden=None), r"ref_logps / ref_hidden: one is required when beta > 0"),
    (dict(ref_logps=torch.zeros(4, 5)), r"ref_logps / ref_hidden: expected at most one"),
    (dict(hidden="x"), r"hidden: expected a torch.Tensor, got str"),
    (dict(weight_dtype=torch.bfloat16), r"weight: expected dtype torch.float32 like hidden"),
    (dict(action_ids=torch.full((4, 5), 160)), r"action_ids: expected ids in \[0, 160\) at active tokens"),
    (dict(old_logps=torch.full((4, 5), float("nan"))), r"old_logps: expected finite values at active tokens"),
    (dict(ref_logps=torch.full((4, 5), float("inf")), ref_hidden=None),
     r"ref_logps: expected finite values at active tokens, got non-finite at \(b, t\) .* \(checked in float32\)"),
    (dict(ref_logps=torch.zeros(4, 6), ref_hidden=None),
     r"ref_logps: expected shape \[B, T\] = \[4, 5\], got \[4, 6\]"),
    (dict(ref_logps=torch.zeros(4, 5, dtype=torch.int64), ref_hidden=None),
     r"ref_logps: expected a floating dtype, got torch.int64"),
    (dict(kernels="cuda"), r"kernels: expected 'auto', 'triton' or 'torch', got 'cuda'"),
    (dict(check_values="later"), r"^check_values: expected 'deferred' or 'sync', got 'later'$"),
])
def test_bad_inputs_name_the_argument(change, match):
    inp = make(device="cpu")
    kw = dict(bias=inp["bias"], ref_hidden=inp["ref_hidden"], samples_per_prompt=2, kernels="torch")
    for key in ("ref_hidden", "ref_logps", "bias", "kernels", "check_values"):
        if key in change:
            kw[key] = change.pop(key)
    if "weight_dtype" in change:
        inp["weight"] = inp["weight"].to(change.pop("weight_dtype"))
    inp.update(change)
    with pytest.raises(LossContractError, match=match):
        linear_grpo_loss(inp["hidden"], inp["weight"], inp["action_ids"], inp["old_logps"], inp["rewards"],
                         inp["completion_mask"], **kw)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case, match", [
    ("rewards", r"rewards: the advantages of sequences \[0, 1\] are not finite: the sum or the variance"),
    ("masked group", r"rewards: the advantages of sequences \[0, 1\] are not finite: the sum or the variance"),
    ("advantages", r"loss: expected a finite float32 loss from finite inputs, got a non-finite one"),
    ("hidden", r"hidden / weight / bias: expected finite log-probabilities at active tokens, got NaN at \(b, t\) "
               r"\[\(1, 0\)\]"),
])
def test_what_is_found_after_the_chunks_raises_the_logits_ops_words(kernels, case, match):
    """Checked once, after the chunks are queued (one device sync): a group's reward variance that overflows fp32
    (with active tokens or none), a loss that overflows it (given advantages of 3e38) and a non-finite log-prob each
    raise the logits ops' error."""
    inp, kw = make(), dict(samples_per_prompt=2)
    if case in ("rewards", "masked group"):
        inp["rewards"] = torch.tensor([3e38, -3e38, 0.5, -1.0], device=DEV)
        if case == "masked group":  # its NaN advantages reach no loss; the result would report them
            inp["completion_mask"][:2] = False
    elif case == "advantages":
        inp["rewards"], kw = None, dict(advantages=torch.full((4,), 3e38, device=DEV), samples_per_prompt=None)
    else:
        inp["hidden"][1, 0, 0] = float("inf")
    with pytest.raises(LossContractError, match=match):
        run(inp, kernels, **kw)
        linear.pending.raise_pending()  # the Triton kernels' deferred check, on the GPU read here


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_run_to_run_on_the_gpu():
    inp = make(B=8, T=64, H=256, V=5003, dtype=torch.bfloat16, wide=False)
    first, g1 = run(inp, "triton")
    second, g2 = run(inp, "triton")
    for f in FIELDS:
        assert_bitwise_equal(getattr(first, f), getattr(second, f), f)
    for a, b, name in zip(g1, g2, "hwb"):
        assert_bitwise_equal(a, b, f"d {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_and_pointer_loads_give_the_same_bits(dtype):
    """The matmul's two ways of loading operands (`triton/matmul.py`) feed the same tiles to the same instructions,
    for each of the three products the loss runs (logits, dH, dW), with ragged edges."""
    from grpo_core.triton.matmul import matmul
    g = torch.Generator(device="cuda").manual_seed(0)
    C, H, V = 1000, 520, 3000
    h = torch.randn(C, H, device="cuda", generator=g).to(dtype)
    w = torch.randn(V, H, device="cuda", generator=g).to(dtype)
    dz = (torch.randn(C, V, device="cuda", generator=g) * 1e-2).to(dtype)
    for a, b, acc, block_k in ((h, w.T, False, 64), (dz, w, True, 32), (dz.T, h, True, 64)):
        start = torch.randn(a.shape[0], b.shape[1], device="cuda", generator=g)
        one = matmul(a, b, start.clone() if acc else None, accumulate=acc, block_k=block_k, tma=True)
        two = matmul(a, b, start.clone() if acc else None, accumulate=acc, block_k=block_k, tma=False)
        assert_bitwise_equal(one, two, f"{tuple(a.shape)} @ {tuple(b.shape)}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_written_product_is_one_added_onto_zeros(dtype):
    """The first chunk writes `dW = dz^T h` (`accumulate=False`: the kernel's accumulator starts at 0.0) where the
    later chunks add onto it: the bits of adding onto zeros, signed zeros included (columns of `dz` all -0.0 or
    +0.0 against columns of `h` all positive: sums of -0.0 products)."""
    from grpo_core.triton.matmul import matmul
    g = torch.Generator(device=DEV).manual_seed(2)
    C, H, V = (1000, 520, 3000) if HAS_CUDA else (70, 130, 150)
    h = torch.randn(C, H, device=DEV, generator=g)
    h[:, :8] = h[:, :8].abs()
    dz = torch.randn(C, V, device=DEV, generator=g) * 1e-2
    dz[:, ::5], dz[:, 1::5] = -0.0, 0.0
    dz, h = dz.to(dtype), h.to(dtype)
    written = matmul(dz.T, h, torch.full((V, H), float("nan"), device=DEV))
    added = matmul(dz.T, h, torch.zeros(V, H, device=DEV), accumulate=True)
    assert bool(torch.signbit(added[::5, :8]).logical_not().all())  # 0.0 + (-0.0) is +0.0
    assert_bitwise_equal(written, added, "dz^T h")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_persistent_matmuls_programs_change_no_bit(dtype):
    """`triton/matmul.py`'s programs each walk several output tiles: one program, a few, or one per tile (as many as
    there are tiles), the same bits, for each of the three products the loss runs, with a bias and ragged edges."""
    from grpo_core.triton import matmul as mm
    g = torch.Generator(device=DEV).manual_seed(0)
    C, H, V = (1000, 520, 3000) if HAS_CUDA else (70, 130, 150)
    h = torch.randn(C, H, device=DEV, generator=g).to(dtype)
    w = torch.randn(V, H, device=DEV, generator=g).to(dtype)
    bias = torch.randn(V, device=DEV, generator=g).to(dtype)
    dz = (torch.randn(C, V, device=DEV, generator=g) * 1e-2).to(dtype)
    for a, b, acc, b_ in ((h, w.T, False, bias), (dz, w, True, None), (dz.T, h, True, None)):
        tiles = -(-a.shape[0] // mm.BLOCK_M) * -(-b.shape[1] // mm.BLOCK_N)
        start = torch.randn(a.shape[0], b.shape[1], device=DEV, generator=g)
        outs = []
        for programs in (tiles, 1, 2, 5):
            with mock.patch.object(mm, "_programs", lambda device, p=programs: p):
                outs.append(mm.matmul(a, b, start.clone(), accumulate=acc, bias=b_, block_k=32))
        assert tiles > 5
        for programs, out in zip((1, 2, 5), outs[1:]):
            assert_bitwise_equal(out, outs[0], f"{tuple(a.shape)} @ {tuple(b.shape)}, {programs} programs")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_matmuls_statistics_are_the_row_kernels_over_the_stored_logits(dtype):
    """`matmul_stats` (the tile statistics and selected logits from the accumulator, the logits never stored) gives
    the bits of `row_stats` over the stored logits: every tile width that fits the output tile, a bias, a temperature,
    the entropy sums, ragged edges (a last tile of 6 columns, rows past the last block), ids in and outside the
    columns, several tiles a program; and refuses a width that does not fit."""
    from grpo_core.triton import canonical as rows, matmul as mm
    g = torch.Generator(device=DEV).manual_seed(1)
    C, H, V, lo = (1000, 520, 3014, 640) if HAS_CUDA else (70, 40, 166, 32)
    h = torch.randn(C, H, device=DEV, generator=g).to(dtype)
    w = (torch.randn(V, H, device=DEV, generator=g) * 3).to(dtype)
    bias = torch.randn(V, device=DEV, generator=g).to(dtype)
    ids = torch.randint(lo - 40, lo + V + 40, (C,), device=DEV, generator=g)
    ids[:4] = torch.tensor([lo, lo + V - 1, lo - 1, lo + V])  # the first and last columns, and just outside
    ones = torch.ones(C, dtype=torch.bool, device=DEV)
    widths = [wd for wd in (16, 32, 64, 128, 256) if mm.stats_fit(wd)]
    assert len(widths) >= 3 and not mm.stats_fit(2 * mm.BLOCK_N) and not mm.stats_fit(48)
    options = [(1.0 / 0.7, True, bias), (1.0, False, None), (1.0, True, bias)]  # (inv, entropy, bias), in turn
    z = {id(b): mm.matmul(h, w.T, bias=b) for b in (None, bias)}
    for i, width in enumerate(widths):
        inv, entropy, b = options[i % len(options)]
        sel, stats = rows.row_stats(z[id(b)], None, ids, ones, lo, width, inv, entropy)
        got = mm.matmul_stats(h, w.T, ids, lo, width, inv, entropy, bias=b)
        want = (stats[0, 0], stats[0, 1], sel[0], *stats[0, 2:])
        assert len(got) == len(want) == 3 + entropy
        for name, x, y in zip(("max", "sum", "selected", "entropy"), got, want):
            assert_bitwise_equal(x, y, f"width {width}, inv {inv}, {name}")
    assert int(((ids >= lo) & (ids < lo + V)).sum()) < C  # some ids outside: their selected value is 0.0
    with pytest.raises(ValueError, match="width: expected a power of two"):
        mm.matmul_stats(h, w.T, ids, lo, 48)


def _poisoned(real):
    """`torch.empty` / `empty_like` whose memory holds NaN (integers -12345, booleans True), not what was there."""
    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else True if t.dtype == torch.bool else -12345)
    return empty


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", ["chunks", "no active token"])
def test_no_uninitialized_memory_is_read(kernels, case):
    """The `dW` accumulator and every other buffer are taken uninitialized: with their memory poisoned the loss and
    the gradients are the same bits (the first chunk writes `dW`; with no active token it is zeros), in several
    chunks, scaled in the backward by a `grad_output` other than 1."""
    inp = make(B=8, T=12, seed=6, dtype=torch.bfloat16)  # dW handed over in bf16: `scaled_cast` on the Triton side
    if case == "no active token":
        inp["completion_mask"][:] = False

    def once():
        h, w, b = leaf(inp["hidden"]), leaf(inp["weight"]), leaf(inp["bias"])
        res = linear_grpo_loss(h, w, inp["action_ids"], inp["old_logps"], inp["rewards"], inp["completion_mask"],
                               bias=b, kernels=kernels, samples_per_prompt=2, ref_hidden=inp["ref_hidden"])
        (res.loss * 0.37).backward()
        return [getattr(res, f) for f in FIELDS] + [h.grad, w.grad, b.grad]

    with mock.patch.object(linear.TritonKernels, "chunk", 64), mock.patch.object(linear.TorchKernels, "chunk", 64):
        want = once()
        with mock.patch("torch.empty", _poisoned(torch.empty)), \
                mock.patch("torch.empty_like", _poisoned(torch.empty_like)):
            got = once()
    assert (int(inp["completion_mask"].sum()) > 64) == (case == "chunks")
    if case == "no active token":
        assert not bits(want[-2]).any() and not bits(want[-3]).any()  # +0.0
    for name, a, b in zip([*FIELDS, "d hidden", "d weight", "d bias"], got, want):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_cast_rounds_as_torch_mul(dtype):
    """`matmul.scaled_cast` (the fused loss's backward: `dW * grad_output` into the weight's dtype) gives the bits of
    `torch.mul(x, g, out=<dtype>)`: every binary exponent, halfway cases, subnormals, overflow, infinities, signed
    zeros; a NaN stays a NaN. Refuses what it does not take."""
    from grpo_core.triton.matmul import scaled_cast
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g) * torch.exp2(torch.randint(-149, 128, (3000,), generator=g).float())
    ties = ((torch.randint(0, 1 << 16, (1000,), generator=g, dtype=torch.int32) << 16) | 0x8000).view(torch.float32)
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45,
                                          3.4e38, 65504.0, 65520.0, 6e-8])]).to(DEV)
    for scale in (1.0, 0.37, -3.0, 1e30, 0.0):
        gt = torch.tensor(scale, device=DEV)
        want, got = torch.mul(x, gt, out=torch.empty_like(x, dtype=dtype)), scaled_cast(x, gt, dtype)
        assert bool((want.isnan() == got.isnan()).all()), scale
        assert_bitwise_equal(got[~got.isnan()], want[~want.isnan()], f"scale {scale}")
    with pytest.raises(ValueError, match="scaled_cast: expected contiguous fp32 x and a bf16 or fp16 dtype"):
        scaled_cast(x.to(dtype), gt, dtype)


def test_the_triton_chunk_size_changes_no_bit():
    """With the Triton kernels the chunk is free: a logit, a `dH` row and the `dW` fold (continued across chunks on
    K-step boundaries) are the same bits in chunks of 64 tokens as in one chunk."""
    inp = make(B=8, T=12, seed=4)
    one, g_one = run(inp, "triton")
    with mock.patch.object(linear.TritonKernels, "chunk", 64):
        many, g_many = run(inp, "triton")
    assert int(one.per_sequence_active_tokens.sum()) > 64  # two chunks at least
    for f in FIELDS:
        assert_bitwise_equal(getattr(many, f), getattr(one, f), f)
    for a, b, name in zip(g_many, g_one, "hwb"):
        if name != "b":  # the bias gradient is a pair tree per chunk, folded over the chunks
            assert_bitwise_equal(a, b, f"d {name}")


STAGE_OPTIONS = [  # one pass (the coefficients known before it), then the two-pass options
    dict(),
    dict(old_logps=None, loss_type="bnpo", advantages="token", rewards=None, samples_per_prompt=None),
    dict(entropy_coef=0.01, top_entropy_quantile=0.5, temperature=0.7),
    dict(importance_sampling_level="sequence", advantages="token", rewards=None, samples_per_prompt=None),
    dict(loss_type="vespo", beta=0.0, ref_hidden=None, advantages="token", rewards=None, samples_per_prompt=None),
    dict(off_policy_mask_threshold=0.3, importance_sampling_ratio="token", advantages="token", rewards=None,
         samples_per_prompt=None),
]


@pytest.mark.parametrize("over", STAGE_OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_the_triton_stages_give_the_torch_stages_bits(over):
    """With the Triton kernel set the stages after the log-probs (the advantages, the token terms and their sums, the
    finish) are the logits op's Triton kernels, a launch each: the same bits of every field and gradient as the
    torch stages with the same log-probs (given advantages NaN at masked tokens, which nothing may read)."""
    from grpo_core.distributed import grpo_loss as stages
    inp, over = _resolve(make(B=4, T=6, V=96, seed=7), over)
    if "advantages" in over:
        over["advantages"] = over["advantages"].masked_fill(~inp["completion_mask"], float("nan"))
    if over.get("importance_sampling_ratio") == "token":
        over["importance_sampling_ratio"] = torch.rand(inp["action_ids"].shape,
                                                       generator=torch.Generator().manual_seed(8)).to(DEV) + 0.5
    with mock.patch.object(stages._TritonKernels, "terms", wraps=stages._TritonKernels.terms) as spy:
        fast, g_fast = run(inp, "triton", vocab_tile=16, **over)
    assert spy.call_count == 1
    with mock.patch.object(LinearGRPOLossOp, "_stages", lambda self, k: stages._TorchKernels(self._token_sum)):
        ref, g_ref = run(inp, "triton", vocab_tile=16, **over)
    for f in FIELDS:
        assert_bitwise_equal(getattr(fast, f), getattr(ref, f), f)
    for a, b, name in zip(g_fast, g_ref, "hwb"):
        assert_bitwise_equal(a, b, f"d {name}")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("over", [dict(), dict(entropy_coef=0.01, importance_sampling_level="sequence",
                                               temperature=0.7)], ids=["defaults", "entropy,gspo"])
def test_vocabulary_slices_change_no_bit(kernels, over):
    """`dz`, and the stored logits not kept for it (the reference's, the log-probs'), a slice of vocabulary columns at
    a time (`linear.SLICE_COLUMNS`; here slices of 48, 48, 48 and 16 columns: whole tiles of 16, whole steps of the
    dH fold): the same bits of every field, every gradient and `linear_logprobs` as with the whole row in one slice.
    Triton: the statistics of the logits not kept come from the matmul's accumulator (`matmul_stats`, the whole row
    in one launch); the same bits again with those logits stored and read by the row kernel, sliced or not."""
    from grpo_core.triton import matmul as mm
    inp = make(B=4, T=5, V=160, seed=5)
    logprobs = lambda: linear_logprobs(inp["ref_hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"],
                                       bias=inp["bias"], vocab_tile=16, kernels=kernels, temperature=0.7)
    one, g_one = run(inp, kernels, vocab_tile=16, **over)
    lp_one = logprobs()
    sliced = [(0, 48), (48, 96), (96, 144), (144, 160)]
    variants = [(True, True)] + ([(True, False), (False, False)] if kernels == "triton" else [])
    if kernels == "triton":
        assert mm.stats_fit(16)
    for narrow, fit in variants:  # (SLICE_COLUMNS = 56, matmul_stats takes the tiles)
        with (mock.patch.object(linear, "SLICE_COLUMNS", 56 if narrow else linear.SLICE_COLUMNS),
              mock.patch.object(mm, "stats_fit", lambda width: fit and width == 16),
              mock.patch.object(mm, "matmul_stats", wraps=mm.matmul_stats) as spy):
            k = linear.TritonKernels() if kernels == "triton" else linear.TorchKernels()
            assert k.logit_slices(160, 16) == ([(0, 160)] if kernels == "triton" and fit or not narrow else sliced)
            assert linear._slices(160, 16) == (sliced if narrow else [(0, 160)])
            many, g_many = run(inp, kernels, vocab_tile=16, **over)
            lp_many = logprobs()
        assert spy.called == (kernels == "triton" and fit)
        for f in FIELDS:
            assert_bitwise_equal(getattr(many, f), getattr(one, f), f)
        for a, b, name in zip(g_many, g_one, "hwb"):
            assert_bitwise_equal(a, b, f"d {name}")
        assert_bitwise_equal(lp_many, lp_one, "linear_logprobs")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("call", ["logprobs", "loss with ref_hidden"])
def test_one_logits_buffer_is_alive_at_a_time(kernels, call):
    """The largest buffer, a chunk's `[chunk, V]` fp32 logits: each one is gone before the next is made (the next
    chunk's, or the policy's after the reference's), with and without gradients."""
    inp = make(B=8, T=12, seed=6)
    cls = linear.TritonKernels if kernels == "triton" else linear.TorchKernels
    made, logits = [], cls.logits

    def tracked(self, h, w, b):
        alive = [i for i, ref in enumerate(made) if ref() is not None]
        assert not alive, f"logits buffers {alive} of {len(made)} are still alive when another is made"
        z = logits(self, h, w, b)
        made.append(weakref.ref(z))
        return z

    from grpo_core.triton import matmul as mm  # the logits stored, not only their statistics (`matmul_stats`)
    with mock.patch.object(cls, "logits", tracked), mock.patch.object(cls, "chunk", 64), \
            mock.patch.object(mm, "stats_fit", lambda width: False):
        if call == "logprobs":
            linear_logprobs(inp["hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"], kernels=kernels)
        else:
            run(inp, kernels)
    assert len(made) >= (2 if call == "logprobs" else 4)  # two chunks at least (the reference's too)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("which", ["weight", "bias"])
def test_an_integer_weight_or_bias_is_refused(kernels, which):
    """An integer lm_head would give an all-zero hidden gradient: refused, naming the argument."""
    h = torch.randn(2, 3, 16, requires_grad=True)
    w, b = torch.randn(8, 16), None
    if which == "weight":
        w = torch.randint(-2, 3, (8, 16))
    else:
        b = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(LossContractError, match=rf"^{which}: expected dtype torch.float32 like hidden \(one matmul "
                                                rf"dtype\), got torch.int64$"):
        linear_grpo_loss(h, w, torch.randint(0, 8, (2, 3)), torch.full((2, 3), -2.), torch.tensor([1., 0.]), None,
                         bias=b, beta=0., samples_per_prompt=2, kernels=kernels)


@pytest.mark.parametrize("shape", [(2, 0, 16), (0, 3, 16), (2, 3, 0)])
def test_empty_hidden_states_name_hidden(shape):
    B, T, H = shape
    match = (r"hidden: expected a hidden size H >= 1, got shape \[2, 3, 0\]" if H == 0 else
             rf"hidden: expected at least one sequence and one token \(B >= 1, T >= 1\), got shape \[{B}, {T}, 16\]")
    with pytest.raises(LossContractError, match=match):
        linear_grpo_loss(torch.randn(shape), torch.randn(8, H), torch.zeros((B, T), dtype=torch.long),
                         torch.zeros(B, T), torch.zeros(B), None, beta=0.0, samples_per_prompt=1,
                         advantage_std="none", kernels="torch")


DEFERRED = r"linear_grpo_loss \(triton kernels\) \(call #\d+, checked after it returned\): "


@pytest.mark.parametrize("kernels, check", [("torch", "sync"), ("triton", "sync"), ("triton", "deferred")])
def test_the_fused_loss_names_the_hidden_states_and_weights(kernels, check):
    """A NaN weight row names hidden / weight (not the logits the caller never passed); reference hidden states
    whose log-probs lie too far above the policy's name ref_hidden, not the rewards. The Triton kernels' deferred
    check says so after the op and the call (on the CPU it reads its flag at once: the call itself raises)."""
    prefix = DEFERRED if check == "deferred" else ""
    inp = make()
    inp["weight"][inp["action_ids"][0, 0]] = float("nan")
    with pytest.raises(LossContractError, match=rf"^{prefix}hidden / weight / bias: expected finite log-probabilities "
                                                r"at active tokens, got NaN at \(b, t\) \[\(0, 0\)"):
        run(inp, kernels, check_values=check)
        linear.pending.raise_pending()
    inp = make(bias=False)
    inp["hidden"], inp["ref_hidden"] = inp["hidden"] * 1e4, inp["ref_hidden"] * 1e4
    with pytest.raises(LossContractError, match=rf"^{prefix}ref_hidden: expected reference log-probs within float32 "
                                                r"reach of the policy's, got a KL term that overflows float32"):
        run(inp, kernels, check_values=check)
        linear.pending.raise_pending()


@pytest.mark.parametrize("case", ["id", "negative id", "mask value", "reward", "old", "ref_logps", "advantages",
                                  "importance ratio", "importance ratio, off-policy mask", "sampling"])
def test_the_triton_kernels_flag_every_value_the_torch_kernels_check(case):
    """The torch kernels check the inputs' values before the pass (device syncs); the Triton kernels run the pass and
    flag them in the stages: `check_values="sync"` raises the torch kernels' very words, "deferred" the same after
    the op and the call."""
    inp, kw = make(), dict(samples_per_prompt=2)
    B, T = inp["action_ids"].shape
    if case == "id":
        inp["action_ids"][1, 0] = inp["weight"].shape[0]
    elif case == "negative id":
        inp["action_ids"][2, 0] = -1
    elif case == "mask value":
        inp["completion_mask"] = inp["completion_mask"].float()
        inp["completion_mask"][0, 0] = 2.0
    elif case == "reward":
        inp["rewards"][1] = float("nan")
    elif case == "old":
        inp["old_logps"][3, 0] = float("inf")
    elif case == "ref_logps":
        kw.update(ref_hidden=None, ref_logps=inp["old_logps"].clone())
        kw["ref_logps"][3, 0] = float("nan")
    elif case == "advantages":
        inp["rewards"] = None
        kw = dict(advantages=torch.randn(B, T, device=DEV), samples_per_prompt=None)
        kw["advantages"][1, 0] = float("inf")
    elif case.startswith("importance ratio"):
        kw["importance_sampling_ratio"] = torch.ones(B, T, device=DEV)
        kw["importance_sampling_ratio"][0, 0] = -1.0
        if case.endswith("mask"):  # the mask drops sequence 0 (A < 0, far off policy): its weights read 0.0
            inp["rewards"][:2] = torch.tensor([-1.0, 1.0])
            kw.update(off_policy_mask_threshold=0.5, sampling_logps=inp["old_logps"] + 10.0)
    else:
        kw.update(off_policy_mask_threshold=0.5, sampling_logps=inp["old_logps"].clone())
        kw["sampling_logps"][2, 0] = -float("inf")
    with pytest.raises(LossContractError) as want:
        run(inp, "torch", **kw)
    for check, prefix in (("sync", ""), ("deferred", DEFERRED)):
        with pytest.raises(LossContractError, match=f"^{prefix}{re.escape(str(want.value))}$"):
            run(inp, "triton", check_values=check, **kw)
            linear.pending.raise_pending()  # on the GPU the deferred check is read here


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: on the CPU the check is immediate")
def test_the_deferred_check_raises_at_a_later_call():
    """On the GPU a call with a bad value returns (no device sync); the error names it at the latest
    `pending.AHEAD` calls later, and the next good call runs."""
    inp = make()
    bad = {**inp, "rewards": inp["rewards"].clone()}
    bad["rewards"][1] = float("nan")
    run(bad, "triton")
    with pytest.raises(LossContractError, match=DEFERRED + r"rewards: expected finite values, got non-finite at "
                                                          r"sequences \[1\]"):
        for _ in range(linear.pending.AHEAD):
            run(inp, "triton")
    run(inp, "triton")
    linear.pending.raise_pending()


class _HostReads(TorchDispatchMode):
    """Logs the ops that read a tensor's values on the host (a device sync on CUDA)."""

    READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::masked_select")

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        masks = [t for a in args if isinstance(a, (list, tuple)) for t in a
                 if isinstance(t, torch.Tensor) and t.dtype == torch.bool]
        if name in self.READS or (name.startswith("aten::index") and masks):  # a boolean index: a nonzero
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("over", [dict(), dict(old_logps=None, beta=0.0, ref_hidden=None),
                                  dict(importance_sampling_level="sequence", entropy_coef=0.01)])
def test_the_triton_kernels_read_one_value_on_the_host(over):
    """With the Triton kernels and the deferred check, a forward+backward reads one thing on the host, the active
    tokens (`nonzero`): the values are checked by the stages' flags, handed to `pending` unread."""
    inp, over = _resolve(make(), over)
    with mock.patch.object(linear.pending, "defer") as defer, _HostReads() as log:
        run(inp, "triton", **over)
    assert log.reads == ["aten::nonzero"]
    assert defer.call_count == 1 and defer.call_args.args[2] == "linear_grpo_loss (triton kernels)"


LOGPROBS_DEFERRED = r"linear_logprobs \(call #\d+, checked after it returned\): "


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("check", ["sync", "deferred"])
def test_linear_logprobs_raise_the_losss_words(kernels, check):
    """Non-finite log-probs at active tokens raise as in the loss; masked tokens may hold anything. Deferred, the
    error says so (on the CPU the flag is read at once: the call itself raises). A bad `check_values` is named as the
    loss names it."""
    prefix = LOGPROBS_DEFERRED if check == "deferred" else ""
    inp = make()
    hidden, ids, mask = inp["hidden"].clone(), inp["action_ids"], inp["completion_mask"]
    hidden[1, 0, 3] = float("nan")
    with pytest.raises(LossContractError, match=rf"^{prefix}hidden / weight: expected finite log-probabilities at "
                                                r"active tokens, got NaN at \(b, t\) \[\(1, 0\)\]"):
        linear_logprobs(hidden, inp["weight"], ids, mask, kernels=kernels, check_values=check)
        linear.pending.raise_pending()
    masked = mask.clone()
    masked[1, 0] = False
    assert torch.isfinite(linear_logprobs(hidden, inp["weight"], ids, masked, kernels=kernels,
                                          check_values=check)).all()
    linear.pending.raise_pending()
    bias = torch.zeros(inp["weight"].shape[0], device=inp["weight"].device)
    bias[ids[0, 0]] = -float("inf")
    with pytest.raises(LossContractError, match=rf"^{prefix}hidden / weight / bias: expected finite log-probabilities "
                                                r"at active tokens, got -inf at \(b, t\) \[\(0, 0\)"):
        linear_logprobs(inp["hidden"], inp["weight"], ids, mask, bias=bias, kernels=kernels, check_values=check)
        linear.pending.raise_pending()
    with pytest.raises(LossContractError, match=r"^check_values: expected 'deferred' or 'sync', got 'later'$"):
        linear_logprobs(inp["hidden"], inp["weight"], ids, mask, kernels=kernels, check_values="later")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("check", ["sync", "deferred"])
@pytest.mark.parametrize("bad, words", [
    ("id", r"action_ids: expected ids in \[0, 160\) at active tokens, got \[160\]"),
    ("negative id", r"action_ids: expected ids in \[0, 160\) at active tokens, got \[-1\]"),
    ("mask", r"completion_mask: expected bool or 0/1 values, got other values \(dtype torch.float32\)")],
    ids=["id", "negative id", "mask"])
def test_linear_logprobs_check_ids_and_mask_values(kernels, check, bad, words):
    """An id outside the vocabulary or a mask value other than 0 / 1 at an active token raises `check_inputs`'
    words, read with the log-probs; masked tokens may hold any id."""
    prefix = LOGPROBS_DEFERRED if check == "deferred" else ""
    inp = make()
    ids, mask = inp["action_ids"].clone(), inp["completion_mask"].float()
    ids[0, 1] = -7  # masked: anything goes
    mask[0, 1] = 0.0
    call = lambda: linear_logprobs(inp["hidden"], inp["weight"], ids, mask, kernels=kernels, check_values=check)
    clean = call()
    linear.pending.raise_pending()
    if bad == "mask":
        mask[2, 0] = 2.0
    else:
        ids[2, 0] = 160 if bad == "id" else -1
    with pytest.raises(LossContractError, match=f"^{prefix}{words}$"):
        call()
        linear.pending.raise_pending()
    assert torch.isfinite(clean).all()


@pytest.mark.parametrize("check", ["sync", "deferred"])
def test_linear_logprobs_read_the_active_tokens_alone_on_the_host(check):
    """The Triton kernels' `linear_logprobs` reads the active tokens (`nonzero`) on the host, and `"sync"` its one
    flag too (the ids, the mask values and the log-probs' finiteness together); `"deferred"` hands the flag to
    `pending` unread."""
    inp = make()
    with mock.patch.object(linear.pending, "defer") as defer, _HostReads() as log:
        linear_logprobs(inp["hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"].float(),
                        kernels="triton", check_values=check)
    assert log.reads == ["aten::nonzero"] + (["aten::_local_scalar_dense"] if check == "sync" else [])
    assert defer.call_count == (check == "deferred")
    if check == "deferred":
        assert defer.call_args.args[2] == "linear_logprobs" and defer.call_args.kwargs == {"group": None}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: on the CPU the check is immediate")
def test_linear_logprobs_deferred_check_raises_at_a_later_call():
    """On the GPU a `linear_logprobs` call with a bad id returns (no device sync); the error names it at the latest
    `pending.AHEAD` calls later, and the next good call runs."""
    inp = make()
    ids = inp["action_ids"].clone()
    ids[1, 0] = 160
    linear_logprobs(inp["hidden"], inp["weight"], ids, inp["completion_mask"], kernels="triton")
    with pytest.raises(LossContractError, match=LOGPROBS_DEFERRED + r"action_ids: expected ids in \[0, 160\) at "
                                                                    r"active tokens, got \[160\]$"):
        for _ in range(linear.pending.AHEAD):
            linear_logprobs(inp["hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"], kernels="triton")
    linear_logprobs(inp["hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"], kernels="triton")
    linear.pending.raise_pending()


@pytest.mark.parametrize("num_items, shown", [(-5, "-5.0"), (float("nan"), "nan"), (torch.tensor(float("inf")), "inf")])
def test_grpo_linear_loss_refuses_a_bad_token_count(num_items, shown):
    from grpo_core.integrations.trl import GRPOLinearLoss
    inp = make(device="cpu")
    with pytest.raises(ValueError, match=rf"^num_items_in_batch: expected a finite token count >= 0, got {shown}$"):
        GRPOLinearLoss(beta=0.0)(inp["hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"],
                                 inp["rewards"], num_items_in_batch=num_items)


@pytest.mark.parametrize("num_items", [0.5, 3, 0])
def test_grpo_linear_loss_divides_by_the_token_count_as_given(num_items):
    """TRL's dapo normalizer: the count over the world size, a count of 0 taken as 1 (TRL's clamp); never raised."""
    from grpo_core.integrations.trl import GRPOLinearLoss
    inp = make(device="cpu")
    got = GRPOLinearLoss(beta=0.0)(inp["hidden"], inp["weight"], inp["action_ids"], inp["completion_mask"],
                                   inp["rewards"], num_items_in_batch=num_items)[0]
    want = linear_grpo_loss(inp["hidden"], inp["weight"], inp["action_ids"], None, None, inp["completion_mask"],
                            advantages=inp["rewards"], beta=0.0, normalizer="fixed_constant",
                            normalizer_constant=float(num_items or 1.0)).loss
    assert_bitwise_equal(got, want, "loss")
