"""The deterministic path's Triton kernels give the torch reference's bits: primitives, the whole op, every TP x DP.

On the CPU the kernels run under TRITON_INTERPRET=1 (conftest sets it); on a GPU they compile for real."""

from __future__ import annotations

import collections

import pytest
import torch
import triton
import triton.language as tl

from conftest import HAS_CUDA, assert_bitwise_equal, make_inputs
from grpo_core import GRPOLossContract, LossContractError, ShardingSpec, canonical, pending, raise_pending
from grpo_core.contract import AdvantageStd
from grpo_core.distributed import DistributedGRPOLossOp
from grpo_core.distributed.grpo_loss import check_derived_advantages
from grpo_core.triton import canonical as kernels
from harness.topology import Layout, run_world

DEV = "cuda" if HAS_CUDA else "cpu"
FIELDS = ("loss", "policy_loss", "kl", "per_sequence_policy", "per_sequence_kl", "advantages",
          "per_sequence_active_tokens")


@triton.jit
def _primitives(X, OUT, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n)
    tl.store(OUT + i, kernels.exp(x), mask=i < n)
    tl.store(OUT + n + i, kernels.exp_nonpos(-tl.abs(x)), mask=i < n)
    tl.store(OUT + 2 * n + i, kernels.log(tl.abs(x)), mask=i < n)
    tl.store(OUT + 3 * n + i, kernels.sigmoid(x), mask=i < n)
    tl.store(OUT + 4 * n + i, kernels.exp_nonpos_loop(-tl.abs(x)), mask=i < n)


def test_primitives_give_the_torch_bits():
    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(0, 0x7F800000, (1 << 17,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([patterns.view(torch.float32) * torch.where(torch.rand(1 << 17, generator=g) < 0.5, -1.0, 1.0),
                   torch.randn(1 << 16, generator=g) * 30, torch.tensor([0.0, -0.0, float("-inf"), float("inf"),
                                                                       -87.33655, -104.5, 88.72, 1.0])])
    x = x.to(DEV)
    nonzero = torch.tensor(canonical.EXP_NONZERO)  # and the floats around the flush's threshold
    x = torch.cat([x, torch.tensor([-17.0, 17.5, 1e-30, float("nan"), -3e38], device=DEV),
                   (nonzero.view(torch.int32) + torch.arange(-4, 5, dtype=torch.int32)).view(torch.float32).to(DEV)])
    out = torch.empty(5 * x.numel(), device=DEV)
    _primitives[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, enable_fp_fusion=False)
    out = out.view(5, -1).cpu()
    xc = x.cpu()
    num = ~xc.isnan()  # at NaN: NaN (its sign and payload not specified), exp_nonpos_loop 0.0
    assert out[[0, 1, 3]][:, ~num].isnan().all() and (out[4][~num] == 0.0).all()
    out, xc = out[:, num], xc[num]
    assert_bitwise_equal(out[0], canonical.exp(xc), "exp")
    assert_bitwise_equal(out[1], canonical.exp(-xc.abs()), "exp_nonpos == exp on x <= 0")
    assert_bitwise_equal(out[4], canonical.exp(-xc.abs()), "exp_nonpos_loop == exp on x <= 0")
    assert_bitwise_equal(out[3], canonical.sigmoid(xc), "sigmoid")
    normal = xc.abs() >= canonical.TINY
    assert_bitwise_equal(out[2][normal & torch.isfinite(xc)], canonical.log(xc.abs()[normal & torch.isfinite(xc)]),
                         "log")


@triton.jit
def _fma_kernel(A, B, C, OUT, n, BLOCK: tl.constexpr, TL_FMA: tl.constexpr = False):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a, b, c = tl.load(A + i, mask=i < n), tl.load(B + i, mask=i < n), tl.load(C + i, mask=i < n)
    tl.store(OUT + i, tl.fma(a, b, c) if TL_FMA else kernels._fma(a, b, c), mask=i < n)


def fma_cases() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 `a, b, c` whose `a * b + c` rounded once differs from the product rounded to fp32 first, or the sum to
    float64 first, and with subnormal results."""
    g = torch.Generator().manual_seed(1)
    n = 1 << 16
    a = 1 + torch.randint(0, 2 ** 23, (n,), generator=g).double() / 2 ** 23
    b = -(1 - torch.randint(0, 2 ** 12, (n,), generator=g).double() / 2 ** 23) * 2 ** -24
    c = 1 + torch.randint(0, 2 ** 23, (n,), generator=g).double() / 2 ** 23
    x = torch.randn(n, generator=g)
    a, b, c = (torch.cat([t.float(), x, torch.tensor([1 + 2 ** -23])]) for t in (a, b, c))
    c[n:2 * n] = -(x * x) * (1 + 2 ** -20)
    b[n:2 * n] = x
    b[-1], c[-1] = -(1 - 2 ** -23) * 2 ** -24, 1 + 2 ** -23
    tiny = torch.randint(1, 2 ** 12, (3, 1024), generator=g).float() * torch.tensor([[2.0 ** -75], [2.0 ** -75],
                                                                                         [-(2.0 ** -149)]])
    return tuple(torch.cat([t, u]) for t, u in zip((a, b, c), tiny))  # products and sums below 2**-126


@pytest.mark.parametrize("form", ["default", "emulated"] if kernels._INTERPRET else ["gpu"])
def test_fma_gives_the_torch_bits(form, monkeypatch):
    """The kernels' fma (the GPU's instruction; under the interpreter, the interpreter's own fma where that rounds
    once, and the emulation, which Tritons whose fma rounds twice run) is `canonical.fma`, on cases where rounding
    the product and the sum apart, in fp32 or in float64, gives other bits, and on subnormal results; an overflow
    or an infinite operand gives IEEE's inf (not the emulation's infinite operands: its callers clamp them), a NaN,
    inf * 0 and inf - inf a positive NaN, as the GPU does (x86 makes a negative one of inf * 0)."""
    if form == "emulated":
        monkeypatch.setattr(kernels, "_NATIVE_FMA", tl.constexpr(False))
    emulation = kernels._INTERPRET and not kernels._NATIVE_FMA
    a, b, c = fma_cases()
    want = canonical.fma(a, b, c)
    assert not torch.equal(want.view(torch.int32), (a.double() * b.double() + c.double()).float().view(torch.int32))
    assert not torch.equal(want.view(torch.int32), (a * b + c).view(torch.int32))
    assert (want[-1024:].abs() < 2 ** -126).sum() > 100
    inf, nan = float("inf"), float("nan")
    nans = [[nan, 1.0, 1.0], [1.0, 1.0, nan], [inf, 0.0, 1.0], [inf, 1.0, -inf]]
    infs = [[3e38, -3e38, 1.0]] + ([] if emulation else [[-inf, 2.0, 1.0], [inf, -1.0, 5.0]])
    a, b, c = (torch.cat([t, u]) for t, u in zip((a, b, c), torch.tensor(nans + infs).T))
    out = torch.empty(a.numel(), device=DEV)
    _fma_kernel[(triton.cdiv(a.numel(), 1024),)](a.to(DEV), b.to(DEV), c.to(DEV), out, a.numel(), BLOCK=1024)
    out, n = out.cpu(), want.numel()
    assert_bitwise_equal(out[:n], want, "fma")
    got = out[n:n + len(nans)].view(torch.int32)
    assert (got >= 0x7FC00000).all(), f"NaNs that are not positive quiet NaNs: {got}"
    assert_bitwise_equal(out[n + len(nans):], torch.full((len(infs),), -inf), "fma to -inf")


@pytest.mark.skipif(not kernels._INTERPRET, reason="the interpreter's choice")
def test_the_interpreters_own_fma_is_taken_exactly_where_it_rounds_once():
    """`_NATIVE_FMA` (the probe's one case at import) says whether the interpreter's `tl.fma` gives `canonical.fma`'s
    bits on every case of `fma_cases`."""
    a, b, c = fma_cases()
    out = torch.empty(a.numel())
    _fma_kernel[(triton.cdiv(a.numel(), 1024),)](a, b, c, out, a.numel(), BLOCK=1024, TL_FMA=True)
    assert bool(kernels._NATIVE_FMA) == torch.equal(out.view(torch.int32), canonical.fma(a, b, c).view(torch.int32))


def contract(V: int, B: int, T: int, layout: Layout = Layout(1, 1), tp_rank: int = 0, dp_rank: int = 0, **over):
    sharding = ShardingSpec.uniform(vocab_size=V, num_sequences=B, tp_world_size=layout.tp, dp_world_size=layout.dp,
                                    tp_rank=tp_rank, dp_rank=dp_rank, vocab_tile=over.get("vocab_tile", 128))
    fields = dict(num_sequences=B, padded_seq_len=T, vocab_size=V, samples_per_prompt=2, beta=0.04,
                  sharding=sharding, determinism_scope="topology_invariant")
    return GRPOLossContract(**{**fields, **over})


def run(op, inp, c, tp_group=None, dp_group=None):
    (lo, hi), (vlo, vhi) = c.sharding.sequence_bounds, c.sharding.vocab_bounds
    x = inp["policy_logits"][lo:hi, :, vlo:vhi].to(DEV).clone().requires_grad_(True)
    ref = inp["ref_logits"]
    res = op.apply(x, inp["action_ids"][lo:hi].to(DEV), inp["old_logps"][lo:hi].to(DEV),
                   inp["rewards"][lo:hi].to(DEV), contract=c, completion_mask=inp["completion_mask"][lo:hi].to(DEV),
                   ref_local_logits=None if ref is None or c.beta == 0 else ref[lo:hi, :, vlo:vhi].to(DEV),
                   tp_group=tp_group, dp_group=dp_group)
    res.loss.backward()
    out = {f: getattr(res, f).detach().cpu() for f in FIELDS}
    out["grad"] = x.grad.cpu()
    out["kernels"] = res.provenance["kernels"]
    return out


def assert_same(got: dict, want: dict, c: GRPOLossContract, label: str) -> None:
    (lo, hi), (vlo, vhi) = c.sharding.sequence_bounds, c.sharding.vocab_bounds
    for f in FIELDS:
        assert_bitwise_equal(got[f], want[f], f"{label} {f}")
    assert_bitwise_equal(got["grad"], want["grad"][lo:hi, :, vlo:vhi], f"{label} grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalizer,constant", [("global_active_tokens", None), ("per_sequence_then_mean", None),
                                                 ("fixed_constant", 7.0)])
def test_triton_kernels_give_the_reference_bits(dtype, normalizer, constant):
    inp = make_inputs(4, 5, 300, seed=7, dtype=dtype, wide=True, empty_rows=(1,))
    inp["policy_logits"][0, 0, :40] = float("-inf")  # vocabulary masking
    c = contract(300, 4, 5, normalizer=normalizer, normalizer_constant=constant)
    got = run(DistributedGRPOLossOp(kernels="triton"), inp, c)
    want = run(DistributedGRPOLossOp(kernels="torch"), inp, c)
    assert got["kernels"] == "triton" and want["kernels"] == "torch"
    assert_same(got, want, c, f"{dtype} {normalizer}")


@pytest.mark.parametrize("width, chunk, merge, V", [(16, 64, 16, 1000), (128, 256, 64, 3001), (8, 8, 4096, 77),
                                                    (512, 4096, 2, 700), (128, 4096, 4096, 1)])
def test_many_chunks_tiles_and_odd_vocabularies(monkeypatch, width, chunk, merge, V):
    """Chunks of several tiles, one tile per chunk, a chunk count that is not a power of two, partial tiles; merges
    of several blocks of tiles per row, and of several rows per program."""
    monkeypatch.setattr(kernels, "CHUNK", chunk)
    monkeypatch.setattr(kernels, "MERGE_BLOCK", merge)
    monkeypatch.setattr(kernels, "BLOCK_T", 2)  # several token chunks per sequence too
    monkeypatch.setattr(kernels, "BLOCK_S", 1)  # and several chunks of sequences in the finish
    inp = make_inputs(2, 5, V, seed=V, wide=True, dtype=torch.bfloat16 if V == 1 else torch.float32)
    c = contract(V, 2, 5, vocab_tile=width)
    assert_same(run(DistributedGRPOLossOp(kernels="triton"), inp, c),
                run(DistributedGRPOLossOp(kernels="torch"), inp, c), c, f"W={width} chunk={chunk} V={V}")


@pytest.mark.parametrize("merge_tiles", [8, 256])
def test_merges_in_blocks_give_the_reference_bits(monkeypatch, merge_tiles):
    """`merge_lse` over rows of 37 tile statistics in blocks of 8 (five, the last one padded, then a tree over 8
    blocks, three never loaded) or of the whole row: `canonical.merge_stats`, then `canonical.lse`, the first
    tensor's entropies (`entropy_of`) and the log-probs; tiles of -inf alone across a block's edge, a masked row.
    Every tile count's blocks cover its power of two exactly (the same tree)."""
    monkeypatch.setattr(kernels, "MERGE_TILES", merge_tiles)
    for tiles in range(1, 1 << 15):
        _, bt, chunks = kernels.merge_blocks(3, tiles)
        assert bt * chunks == triton.next_power_of_2(tiles) and bt <= kernels.MERGE_BLOCK, tiles
    N, tiles = 6, 37
    g = torch.Generator().manual_seed(3)
    m, s = torch.randn(2, N, tiles, generator=g) * 4, torch.rand(2, N, tiles, generator=g) * 50 + 1.0
    u = -torch.rand(2, N, tiles, generator=g) * s
    m[:, 1, 5:9], s[:, 1, 5:9], u[:, 1, 5:9] = float("-inf"), 0.0, 0.0
    u[1] = 0.0  # the second tensor's third plane is not read
    sel = torch.randn(2, N, generator=g)
    mask = torch.arange(N) != 4
    assert kernels.merge_blocks(N, tiles)[1:] == ((8, 8) if merge_tiles == 8 else (64, 1))
    logp = sel.to(DEV, copy=True)  # replaced in place
    lse, ent = kernels.merge_lse(torch.stack([m, s, u], 1).to(DEV), mask.to(DEV), True, logp)
    M, S, U = canonical.merge_stats(m, s, u)
    want = torch.where(mask, canonical.lse(M, S), 0.0)
    label = f"blocks of {merge_tiles}"
    assert_bitwise_equal(lse.cpu(), want, f"{label}: lse")
    assert_bitwise_equal(ent.cpu(), torch.where(mask, canonical.entropy_of(M[0], S[0], U[0]), 0.0),
                         f"{label}: entropy")
    assert_bitwise_equal(logp.cpu(), torch.where(mask, sel - want, 0.0), f"{label}: log-probs")


@pytest.mark.parametrize("dtype, ref_dtype, entropy", [(torch.bfloat16, torch.bfloat16, False),
                                                       (torch.bfloat16, torch.bfloat16, True),
                                                       (torch.bfloat16, torch.float16, False),
                                                       (torch.float16, torch.float32, True),
                                                       (torch.float32, torch.float32, False)])
@pytest.mark.parametrize("offset", [0, 1])
def test_rows_at_every_offset_give_the_reference_bits(monkeypatch, dtype, ref_dtype, entropy, offset):
    """The row kernel's aligned loads (`_row`'s branch per offset, `_window`): rows of an odd width start at every
    offset from a 16-byte boundary; two whole chunks each, then the masked rest in smaller chunks; one copy of the
    code for both tensors (same dtype, no entropy) or one each (another dtype, the policy's entropy sums); a
    temperature; `offset` 1: the policy's data itself off a 16-byte boundary (plain loads); a tile of -inf alone, a
    tile whose maximum is -0.0 (stored as +0.0)."""
    monkeypatch.setattr(kernels, "CHUNK", 64)
    monkeypatch.setattr(kernels, "TAIL_CHUNK", 32)  # the masked rest in chunks of 2 tiles
    N, V, W, inv = 17, 16 * 9 + 5, 16, 1 / 0.7  # V: 10 tiles, chunks of 4 tiles (2 whole), rows 149 elements apart
    g = torch.Generator().manual_seed(1)
    flat = (torch.randn(N * V + offset, generator=g) * 3).to(dtype).to(DEV)
    flat[offset + 5 * V + 17] = float("-inf")
    x, r = flat[offset:].view(N, V), (torch.randn(N, V, generator=g) * 3).to(ref_dtype).to(DEV)
    for t in (x, r):  # a tile of -inf alone, a tile whose maximum is -0.0
        t[3, 16:32] = float("-inf")
        t[4, 32:48] = -t[4, 32:48].abs()
        t[4, 40] = -0.0
    assert kernels._shifts(x, 64) == (0 if offset else kernels._vec(x)) and kernels._shifts(r, 64) == kernels._vec(r)
    ids = torch.randint(0, V, (N,), generator=g).to(DEV)
    mask = torch.ones(N, dtype=torch.bool, device=DEV)
    inv = float(torch.tensor(inv, dtype=torch.float32))
    sel, stats = kernels.row_stats(x, r, ids, mask, 0, W, inv, entropy=entropy)
    for k, (t, ent) in enumerate(((x, entropy), (r, False))):
        z = t.cpu().float() * canonical.fp32(inv, t.cpu().float())
        want = canonical.tile_stats(z, W, entropy=ent)
        for j, w in enumerate(want):
            assert_bitwise_equal(stats[k, j].cpu(), w, f"{dtype} offset {offset} tensor {k} statistic {j}")
        assert_bitwise_equal(sel[k].cpu(), z[torch.arange(N), ids.cpu()], f"tensor {k} selected logits")


@pytest.mark.parametrize("width", [1, 2])
def test_bf16_rows_in_tiles_narrower_than_a_vector_give_the_reference_bits(monkeypatch, width):
    """bf16 rows read as int32 words (`_load`) in tiles of 1 or 2 columns: rows at every offset, whole chunks, then
    the masked rest in chunks of a vector (8 columns); a tile of -inf alone at each row's end; an fp32 reference
    beside them."""
    monkeypatch.setattr(kernels, "CHUNK", 16)
    monkeypatch.setattr(kernels, "TAIL_CHUNK", 4)  # under a vector: the masked rest in chunks of one (8 columns)
    N, V = 9, 45
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(N, V, generator=g) * 3).to(torch.bfloat16).to(DEV)
    x[:, -1] = float("-inf")
    r = (torch.randn(N, V, generator=g) * 3).to(DEV)
    assert kernels._shifts(x, 16) == 8 and kernels._shifts(r, 16) == 4
    ids = torch.randint(0, V, (N,), generator=g).to(DEV)
    sel, stats = kernels.row_stats(x, r, ids, torch.ones(N, dtype=torch.bool, device=DEV), 0, width)
    for k, t in enumerate((x, r)):
        for j, want in enumerate(canonical.tile_stats(t.cpu().float(), width)):
            assert_bitwise_equal(stats[k, j].cpu(), want, f"width {width} tensor {k} statistic {j}")
        assert_bitwise_equal(sel[k].cpu(), t.cpu().float()[torch.arange(N), ids.cpu()], f"tensor {k} selected")


@pytest.mark.parametrize("dtype, over", [(torch.bfloat16, {}), (torch.bfloat16, dict(entropy_coef=0.01)),
                                         (torch.float16, dict(temperature=0.7)), (torch.float32, {})])
@pytest.mark.parametrize("V", [16 * 9 + 5, 16 * 9 + 8])
def test_gradient_rows_at_every_offset_give_the_reference_bits(monkeypatch, dtype, over, V):
    """The gradient kernel's aligned blocks (`_grad_vec` > 0): rows of an odd width start at every offset from a
    16-byte boundary (V = 149), or on boundaries that Triton cannot see (V = 152, not a multiple of 16); blocks of
    16 columns, so that each row has whole unmasked blocks between its masked first and last; the entropy bonus's
    term, a temperature; the whole op's gradient against the torch kernels'."""
    monkeypatch.setattr(kernels, "GRAD_BLOCK", 16)
    taken, grad_vec = [], kernels._grad_vec
    monkeypatch.setattr(kernels, "_grad_vec", lambda *a: taken.append(grad_vec(*a)) or taken[-1])
    inp = make_inputs(2, 9, V, seed=11, wide=True, dtype=dtype)
    c = contract(V, 2, 9, vocab_tile=16, **over)
    assert_same(run(DistributedGRPOLossOp(kernels="triton"), inp, c),
                run(DistributedGRPOLossOp(kernels="torch"), inp, c), c, f"{dtype} {over}")
    assert taken == [16 // inp["policy_logits"].element_size()]


def both_kernels_raise(inp: dict, c: GRPOLossContract) -> list[str]:
    """The error messages of the torch kernels (raised in the call) and of the Triton ones (through `pending`)."""
    messages = []
    for k in ("torch", "triton"):
        with pytest.raises(Exception) as info:
            run(DistributedGRPOLossOp(kernels=k), inp, c)
            raise_pending()
        messages.append(str(info.value))
    return messages


def test_non_finite_logits_raise_like_the_reference():
    """The torch kernels raise in the call; the Triton ones hand their flags to `pending` (on the CPU the flags are
    read at once), with the same words after the call's label."""
    inp = make_inputs(2, 3, 50, seed=2)
    inp["policy_logits"][1, 0, 7] = float("nan")
    messages = both_kernels_raise(inp, contract(50, 2, 3))
    assert "finite log-probabilities at active tokens" in messages[0]
    assert messages[1].startswith("grpo_loss (distributed, triton kernels) (call #") and messages[1].endswith(
        "checked after it returned): " + messages[0])


def test_derived_advantages_name_overflow_only_in_groups_of_finite_rewards():
    """A NaN reward makes its group's advantages NaN too; that is the rewards check's error (on the rank holding the
    reward), so the overflow check, which every rank runs on the gathered vectors, names only the other groups."""
    rewards = torch.tensor([1.0, float("nan"), 1e20, 5e19, 0.5, 0.25])
    adv = canonical.group_advantages(rewards, (0, 2, 4, 6), AdvantageStd.POPULATION)
    with pytest.raises(LossContractError, match=r"sequences \[2, 3\] are not finite.*up to 1e\+20"):
        check_derived_advantages(adv, rewards, (0, 2, 4, 6))
    rewards[2:4] = torch.tensor([1.0, 2.0])
    check_derived_advantages(canonical.group_advantages(rewards, (0, 2, 4, 6), AdvantageStd.POPULATION), rewards,
                             (0, 2, 4, 6))  # only the NaN reward's group: nothing to say here


def test_statistics_the_kernels_cannot_address_are_refused():
    """Between 2**30 and 2**31 tile statistics per tensor the row kernel's 32-bit offsets wrap: 'triton' refuses,
    'auto' takes the torch kernels. Only the shape is read (an expanded tensor stands for the logits)."""
    # on the device the kernels run on (a CPU tensor on a GPU machine is refused first, for its device)
    logits = torch.empty((), dtype=torch.bfloat16, device=DEV).expand(1 << 12, 256, 16 * 1024)  # 2**20 x 1024 tiles
    with pytest.raises(LossContractError, match=r"cannot address the tile statistics of 1073741824"):
        DistributedGRPOLossOp(kernels="triton")._triton_runs(logits, 16)
    assert DistributedGRPOLossOp(kernels="triton")._triton_runs(logits, 32)  # 2**29 statistics
    assert DistributedGRPOLossOp(kernels="triton")._triton_runs(logits, 4)  # 2**32: an int64 argument


@pytest.mark.parametrize("scale", [1e20, 3e38])
def test_overflowing_rewards_raise_like_the_reference(scale):
    """Finite rewards whose group variance (1e20) or sum (3e38) overflows fp32 give non-finite advantages, which
    both kernels refuse with the same words (not a loss computed from advantages of 0 or NaN)."""
    inp = make_inputs(4, 3, 50, seed=3)
    inp["rewards"][2:4] = torch.tensor([scale, scale / 2])  # the second group of two
    messages = both_kernels_raise(inp, contract(50, 4, 3))
    assert messages[0].startswith("rewards: the advantages of sequences [2, 3] are not finite"), messages[0]
    assert messages[1].endswith("checked after it returned): " + messages[0]), messages[1]


def test_a_single_process_call_repaired_in_place_is_not_blamed_on_another_rank(monkeypatch):
    """1x1, Triton kernels, a deferred check (as on a GPU): a caller that repairs the bad value in place before the
    check reads it gets the fast op's words (the inputs changed since), never "on another rank": there is none."""
    class Produced:  # a CUDA event whose flag the GPU has produced
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    def defer(flag, recheck, label, group=None):  # what `pending.defer` does with a CUDA flag: queue it, read later
        pending._enqueue(pending._Check(7, label, flag.clone(), Produced(), recheck), group)

    monkeypatch.setattr(pending, "_local", collections.deque())
    monkeypatch.setattr(pending, "defer", defer)
    inp = make_inputs(2, 3, 50, seed=2, device=DEV)  # on the op's device: the repair below is of what it read
    inp["old_logps"][1, 0] = float("nan")  # the first token is active
    run(DistributedGRPOLossOp(kernels="triton"), inp, contract(50, 2, 3))
    inp["old_logps"][1, 0] = 0.0  # repaired in place before the check reads it
    with pytest.raises(LossContractError) as info:
        raise_pending()
    assert str(info.value) == ("grpo_loss (distributed, triton kernels) (call #7, checked after it returned): the "
                               "kernels flagged a bad input value that the inputs do not show now (overwritten in "
                               "place after the call?)")


LAYOUTS = [Layout(2, 1), Layout(4, 1), Layout(1, 2), Layout(2, 2)]


def _world(ctx) -> list[str]:
    """Every layout's Triton run against the single-rank torch reference, on this rank."""
    failures = []
    inp = make_inputs(4, 3, 520, seed=11, wide=True, empty_rows=(2,))
    for over in (dict(), dict(normalizer="per_sequence_then_mean", group_boundaries=(0, 3, 4), samples_per_prompt=None,
                              advantage_std="none"), dict(temperature=0.7, loss_type="grpo")):
        want = run(DistributedGRPOLossOp(kernels="torch"), inp, contract(520, 4, 3, vocab_tile=32, **over))
        for lay in LAYOUTS:
            p = ctx.place(lay)
            if p is None:
                continue
            c = contract(520, 4, 3, lay, p.tp_rank, p.dp_rank, vocab_tile=32, **over)
            try:
                assert_same(run(DistributedGRPOLossOp(kernels="triton"), inp, c, p.tp_group, p.dp_group), want, c,
                            f"{lay.name} rank {ctx.rank} {over}")
            except AssertionError as exc:
                failures.append(str(exc))
    return failures


@pytest.mark.distributed
def test_every_layout_with_the_triton_kernels_gives_the_single_rank_reference_bits():
    results = run_world(_world, 4, device=DEV, timeout_s=600,
                        memory_fraction=0.1 if DEV == "cuda" else None)
    assert [f for r in results for f in r] == []


def test_the_host_sizes_are_tritons():
    """`launch.cdiv` and `launch.next_power_of_2`, the host's own, give Triton's constexpr functions' values."""
    from grpo_core.triton.launch import cdiv, next_power_of_2
    for n in [*range(0, 4100), 2**31 - 1, 2**31, 2**31 + 1, 151936 * 8192]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 7, 64, 1024):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
