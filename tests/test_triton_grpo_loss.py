"""The Triton backend against the native op: under TRITON_INTERPRET=1 on the CPU (small shapes), compiled on CUDA."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import HAS_CUDA, assert_bitwise_equal, assert_close_verbose, make_inputs
from grpo_core import LossContractError, kernel_registry, pending, raise_pending
from grpo_core.canonical import group_advantages as native_advantages
from grpo_core.contract import AdvantageStd

DEV = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (conftest sets TRITON_INTERPRET=1)
triton = kernel_registry.get_op("grpo_loss", backend="triton")
native = kernel_registry.get_op("grpo_loss", backend="native")
GROUPINGS = {"uniform": dict(samples_per_prompt=2), "csr": dict(group_boundaries=[0, 4, 6])}
NORMALIZERS = [("global_active_tokens", None), ("per_sequence_then_mean", None), ("fixed_constant", 20.0)]
# Per-dtype tolerances of the Triton op on half-precision logits against the fp32 native op on the same values.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


def run(op, inp, **kw):
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss, pol, kl = op(**{**inp, "policy_logits": x}, **kw)
    loss.backward()
    return loss, pol, kl, x.grad


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("normalizer,constant", NORMALIZERS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("single_pass", [True, False])
def test_matches_native_fp32(grouping, normalizer, constant, beta, single_pass):
    inp = make_inputs(6, 5, 37, seed=3, device=DEV, empty_rows=(1,))
    if beta == 0.0:
        inp["ref_logits"] = None
    kw = dict(beta=beta, normalizer=normalizer, normalizer_constant=constant, clip_eps_high=0.28, **GROUPINGS[grouping])
    got = run(triton, inp, single_pass=single_pass, **kw)
    want = run(native, inp, **kw)
    for name, g, w in zip(("loss", "policy_loss", "kl"), got[:3], want[:3]):
        assert_close_verbose(g, w, atol=1e-4, rtol=1e-4, what=name)
    assert_close_verbose(got[3], want[3], atol=1e-5, rtol=1e-4, what="grad")
    assert bool((got[3][1] == 0).all())


# The options added for migration (issue 15). "sequence" / "token": given advantages `[B]` / `[B, T]` (rewards=None),
# NaN where no active token reads them (the empty sequence, masked tokens).
MIGRATION = {
    "temperature": dict(samples_per_prompt=2, temperature=0.7),
    "hot_no_ref": dict(samples_per_prompt=2, temperature=2.5, beta=0.0),
    "unbiased_eps": dict(group_boundaries=[0, 4, 6], advantage_std="unbiased_eps"),
    "grpo": dict(samples_per_prompt=2, loss_type="grpo"),
    "batch_mean": dict(samples_per_prompt=3, normalizer="per_sequence_then_batch_mean", clip_eps_high=0.28),
    "dr_grpo": dict(samples_per_prompt=2, loss_type="dr_grpo"),
    "dr_grpo_16": dict(samples_per_prompt=2, loss_type="dr_grpo", max_completion_length=16),
    "sequence": dict(advantages="sequence"),
    "token": dict(advantages="token"),
    "token_tempered_grpo": dict(advantages="token", temperature=0.7, loss_type="grpo"),
    "sequence_tempered_dr_grpo": dict(advantages="sequence", temperature=1.3, loss_type="dr_grpo",
                                      max_completion_length=7),
}


def migration_call(inp: dict, name: str) -> tuple[dict, dict]:
    """`(inputs, options)` of the MIGRATION case `name`: given advantages replace the rewards."""
    kw = dict(MIGRATION[name])
    kind = kw.pop("advantages", None)
    if kind is None:
        return inp, kw
    B, T = inp["completion_mask"].shape
    mask = inp["completion_mask"].cpu()
    adv = torch.randn((B, T) if kind == "token" else (B,), generator=torch.Generator().manual_seed(7))
    adv[~mask if kind == "token" else ~mask.any(-1)] = float("nan")  # read by no active token
    return {**inp, "rewards": None}, {**kw, "advantages": adv.to(inp["policy_logits"].device)}


@pytest.mark.parametrize("name", MIGRATION)
@pytest.mark.parametrize("single_pass", [True, False])
def test_migration_options_match_native(name, single_pass):
    inp = make_inputs(6, 5, 37, seed=3, device=DEV, empty_rows=(1,))  # a sequence without active tokens
    call, kw = migration_call(inp, name)
    got = run(triton, call, single_pass=single_pass, check_values="sync", **kw)
    want = run(native, call, **kw)
    for what, g, w in zip(("loss", "policy_loss", "kl"), got[:3], want[:3]):
        assert_close_verbose(g, w, atol=1e-5, rtol=1e-5, what=what)
    assert_close_verbose(got[3], want[3], atol=1e-6, rtol=1e-4, what="grad")
    assert bool((got[3][1] == 0).all())
    default = run(native, inp, samples_per_prompt=2)  # not vacuous: the option changes the numbers
    assert (want[0] - default[0]).abs() > 1e-3 * default[0].abs() and not torch.allclose(want[3], default[3])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("single_pass", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_half_precision_against_fp32_reference(dtype, single_pass, temperature):
    inp = make_inputs(4, 3, 4099, seed=5, dtype=dtype, device=DEV)  # 4099 > one 4096-wide chunk
    got = run(triton, inp, samples_per_prompt=2, single_pass=single_pass, temperature=temperature)
    ref = {**inp, "policy_logits": inp["policy_logits"].float(), "ref_logits": inp["ref_logits"].float()}
    want = run(native, ref, samples_per_prompt=2, temperature=temperature)
    atol, rtol = TOL[dtype]
    assert got[3].dtype == dtype and got[0].dtype == torch.float32
    assert_close_verbose(got[0], want[0], atol=atol, rtol=rtol, what="loss")
    assert_close_verbose(got[3].float(), want[3], atol=atol * 1e-2, rtol=rtol, what="grad")


@pytest.mark.parametrize("single_pass", [True, False])
def test_strided_policy_and_mixed_dtypes(single_pass):
    # Policy logits sliced out of a padded vocabulary (rows 9006 apart, so their starts sit at other offsets from
    # a 16-byte boundary than the packed gradient rows) and fp32 reference logits next to fp16 policy logits, at
    # an odd V over more than two 4096-wide chunks (head, aligned body and tail pieces all run).
    inp = make_inputs(4, 3, 9001, seed=12, dtype=torch.float16, device=DEV)
    padded = torch.cat([inp["policy_logits"], inp["policy_logits"][..., :5]], -1).requires_grad_(True)
    call = {**inp, "policy_logits": padded[..., :9001], "ref_logits": inp["ref_logits"].float()}
    assert call["policy_logits"].stride(1) == 9006
    got = triton(**call, samples_per_prompt=2, single_pass=single_pass)
    got[0].backward()
    got = (*got, padded.grad[..., :9001])
    want = run(triton, {**call, "policy_logits": inp["policy_logits"]}, samples_per_prompt=2, single_pass=single_pass)
    for name, a, b in zip(("loss", "policy_loss", "kl", "grad"), got, want):
        assert_bitwise_equal(a, b, name)
    assert bool((padded.grad[..., 9001:] == 0).all())
    ref = run(native, {**call, "policy_logits": inp["policy_logits"].float()}, samples_per_prompt=2)
    assert_close_verbose(got[0], ref[0], atol=1e-3, rtol=1e-3, what="loss")
    assert_close_verbose(got[3].float(), ref[3], atol=1e-5, rtol=1e-3, what="grad")


@pytest.mark.parametrize("V", [1, 3, 5])
@pytest.mark.parametrize("single_pass", [True, False])
def test_tiny_vocabulary_in_half_precision(V, single_pass):
    # Rows of 2-6 bytes: 16-byte-aligned chunks start up to 7 columns before a row, more than the row is wide.
    inp = make_inputs(6, 5, V, seed=13, dtype=torch.bfloat16, device=DEV)
    got = run(triton, inp, samples_per_prompt=2, single_pass=single_pass)
    ref = {**inp, "policy_logits": inp["policy_logits"].float(), "ref_logits": inp["ref_logits"].float()}
    want = run(native, ref, samples_per_prompt=2)
    assert_close_verbose(got[0], want[0], atol=1e-2, rtol=1e-2, what="loss")
    assert_close_verbose(got[3].float(), want[3], atol=1e-4, rtol=1e-2, what="grad")


@pytest.mark.parametrize("name", [None, "token_tempered_grpo"])
def test_single_pass_equals_two_pass(name):
    inp = make_inputs(4, 6, 129, seed=8, device=DEV)
    call, kw = migration_call(inp, name) if name else (inp, {})
    kw.setdefault("samples_per_prompt", None if "advantages" in kw else 4)
    one = run(triton, call, single_pass=True, **kw)
    two = run(triton, call, single_pass=False, **kw)
    for name, a, b in zip(("loss", "policy_loss", "kl"), one[:3], two[:3]):
        assert_bitwise_equal(a, b, name)  # the same kernel log-probs, the same torch reductions
    assert_close_verbose(one[3], two[3], atol=1e-7, rtol=1e-5, what="grad")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_inplace_writes_the_gradient_into_the_logits(temperature):
    inp = make_inputs(4, 3, 50, seed=9, device=DEV)
    want = run(triton, inp, samples_per_prompt=2, single_pass=True, temperature=temperature)
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss, _, _ = triton(**{**inp, "policy_logits": x}, samples_per_prompt=2, inplace=True, temperature=temperature)
    assert_bitwise_equal(x.detach(), want[3], "logits storage now holds the gradient")
    loss.backward()
    assert_bitwise_equal(x.grad, want[3], "grad")
    assert_close_verbose(x.grad, run(native, inp, samples_per_prompt=2, temperature=temperature)[3], atol=1e-6,
                         rtol=1e-4, what="grad vs native")
    with pytest.raises(ValueError, match="inplace: writing the gradient into policy_logits needs"):
        triton(**inp, samples_per_prompt=2, inplace=True)  # no grad wanted: nothing to write


def test_masked_tokens_are_never_read():
    inp = make_inputs(4, 5, 40, seed=11, device=DEV)
    mask = inp["completion_mask"]
    base = run(triton, inp, samples_per_prompt=2)
    junk = dict(inp)
    junk["policy_logits"] = torch.where(mask[..., None], inp["policy_logits"], float("nan"))
    junk["ref_logits"] = torch.where(mask[..., None], inp["ref_logits"], float("inf"))
    junk["action_ids"] = torch.where(mask, inp["action_ids"], -100)
    junk["old_logps"] = torch.where(mask, inp["old_logps"], float("nan"))
    got = run(triton, junk, samples_per_prompt=2)
    for name, a, b in zip(("loss", "policy_loss", "kl", "grad"), got, base):
        assert_bitwise_equal(a, b, name)
    assert bool((got[3][~mask].view(torch.int32) == 0).all())


def test_ratio_kl_matches_native():
    inp = make_inputs(3, 4, 77, seed=2, device=DEV)
    args = (inp["policy_logits"], inp["ref_logits"], inp["action_ids"], inp["completion_mask"], inp["old_logps"])
    r1, k1 = kernel_registry.get_op("ratio_kl", backend="triton")(*args)
    r2, k2 = kernel_registry.get_op("ratio_kl", backend="native")(*args)
    assert_close_verbose(r1, r2, atol=1e-5, rtol=1e-5, what="ratio")
    assert_close_verbose(k1, k2, atol=1e-5, rtol=1e-5, what="kl")
    x = inp["policy_logits"].clone().requires_grad_(True)
    y = inp["policy_logits"].clone().requires_grad_(True)
    kernel_registry.get_op("ratio_kl", backend="triton")(x, *args[1:])[0].sum().backward()
    kernel_registry.get_op("ratio_kl", backend="native")(y, *args[1:])[0].sum().backward()
    assert_close_verbose(x.grad, y.grad, atol=1e-5, rtol=1e-4, what="d ratio / d logits")


@pytest.mark.parametrize("std", list(AdvantageStd))
def test_group_norm_any_group_size(std):
    from grpo_core.triton.group_norm import group_advantages
    bounds = (0, 2, 1029, 1032, 3100) if std is not AdvantageStd.NONE else (0, 1, 1029, 1032, 3100)
    r = torch.randn(3100, generator=torch.Generator().manual_seed(0)).to(DEV) * 3 + 1
    adv, flags = group_advantages(r, bounds, std)
    assert_close_verbose(adv, native_advantages(r, bounds, std), atol=1e-5, rtol=1e-5, what=std.value)
    assert flags.tolist() == [0, 0, 0, 0]
    r[2000] = float("nan")
    assert group_advantages(r, bounds, std)[1].tolist() == [0, 0, 0, 1]  # the group of the non-finite reward


def _layouts(t: torch.Tensor):
    """The same values in other memory layouts: transposed and back, a slice of a wider tensor, a storage offset."""
    yield "transposed", t.transpose(0, -1).contiguous().transpose(0, -1)
    yield "sliced", torch.cat([t, torch.zeros_like(t)], -1)[..., :t.shape[-1]]
    yield "offset", torch.cat([torch.zeros(3, dtype=t.dtype, device=t.device), t.reshape(-1)])[3:].view(t.shape)


@pytest.mark.parametrize("name", ["policy_logits", "ref_logits", "action_ids", "old_logps", "rewards",
                                  "completion_mask"])
@pytest.mark.parametrize("single_pass", [True, False])
def test_every_argument_honours_its_strides(name, single_pass):
    """Non-contiguous, sliced, offset and stride-0 views give the bits of their contiguous copies."""
    inp = make_inputs(4, 6, 40, seed=21, device=DEV)
    cases = [(kind, inp, {**inp, name: view}) for kind, view in _layouts(inp[name])]
    if name in ("old_logps", "rewards"):  # stride 0: equal values along the expanded dimension
        same = {**inp, name: inp[name][..., :1].expand(inp[name].shape).contiguous()}
        cases.append(("expanded", same, {**same, name: inp[name][..., :1].expand(inp[name].shape)}))
    for kind, dense, strided in cases:
        want = run(triton, dense, samples_per_prompt=2, single_pass=single_pass)
        got = run(triton, strided, samples_per_prompt=2, single_pass=single_pass)
        for what, a, b in zip(("loss", "policy_loss", "kl", "grad"), got, want):
            assert_bitwise_equal(a, b, f"{name} {kind} {what}")


def test_both_gradient_loops_give_the_same_bits():
    """Rows on 16-byte boundaries take the plain chunk loop, the others the aligned chunks (`_plain_grad_row`,
    `_write_grad`): from the same forward statistics, over several chunks and a masked end, with a temperature and the
    entropy bonus's term, the same bits."""
    from grpo_core.triton.ratio_kl import launch_forward, launch_grad
    inp = make_inputs(3, 4, 9001, seed=8, device=DEV)
    odd = inp["policy_logits"][..., :9000]  # rows 9001 floats apart
    dense = odd.contiguous()
    assert dense.stride(1) % 4 == 0 and odd.stride(1) % 4 != 0
    ids, mask, inv = inp["action_ids"] % 9000, inp["completion_mask"], 1 / 0.7
    out = launch_forward(lambda k: k, dense, None, ids, mask, None, inv=inv, entropy=True)
    coef, weight = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)).to(DEV)
    grads = [launch_grad(lambda k: k, x, ids, mask, out, coef, inv=inv, entropy_weight=weight.reshape(-1))
             for x in (dense, odd)]
    assert_bitwise_equal(grads[0], grads[1], "grad")


def test_bad_ids_raise_without_reading_out_of_bounds():
    inp = make_inputs(2, 3, 17, seed=1, device=DEV)
    inp["action_ids"][1, 0] = 17
    with pytest.raises(LossContractError, match=r"action_ids: expected ids in \[0, 17\)"):
        triton(**inp, samples_per_prompt=2, check_values="sync")
    inp["action_ids"][1, 0] = 0
    inp["rewards"][0] = float("inf")
    with pytest.raises(LossContractError, match="rewards: expected finite values"):
        triton(**inp, samples_per_prompt=2, check_values="sync")


@pytest.mark.parametrize("single_pass", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grad_output_scales_the_gradient(single_pass, temperature):
    inp = make_inputs(4, 3, 50, seed=6, device=DEV)
    want = run(triton, inp, samples_per_prompt=2, single_pass=single_pass, temperature=temperature)[3]
    x = inp["policy_logits"].clone().requires_grad_(True)
    (triton(**{**inp, "policy_logits": x}, samples_per_prompt=2, single_pass=single_pass,
            temperature=temperature)[0] * -3.0).backward()
    if single_pass:  # the stored gradient, scaled in place once
        assert_bitwise_equal(x.grad, want * -3.0, "grad * -3")
    else:  # the scale enters the in-kernel coefficient
        assert_close_verbose(x.grad, want * -3.0, atol=1e-7, rtol=1e-6, what="grad * -3")


@pytest.mark.parametrize("single_pass", [True, False])
def test_a_second_backward_through_the_graph(single_pass):
    """Two-pass mode recomputes: twice the gradient. Single pass handed its stored gradient over (scaled in place):
    a second scaling would compound the first (it gave 2x once), so the second backward raises."""
    inp = make_inputs(4, 3, 50, seed=7, device=DEV)
    want = run(triton, inp, samples_per_prompt=2, single_pass=single_pass)[3]
    x = inp["policy_logits"].clone().requires_grad_(True)
    loss = triton(**{**inp, "policy_logits": x}, samples_per_prompt=2, single_pass=single_pass)[0] * 3.0
    loss.backward(retain_graph=True)
    if single_pass:
        with pytest.raises(RuntimeError, match="single_pass: the gradient is computed in the forward and handed over"):
            loss.backward()
        assert_bitwise_equal(x.grad, want * 3.0, "the first backward's gradient, untouched")
    else:
        loss.backward()
        assert_close_verbose(x.grad, want * 6.0, atol=1e-7, rtol=1e-6, what="grad of two backwards")


@pytest.mark.parametrize("bad,match", [
    (dict(action_ids=17), r"action_ids: expected ids in \[0, 17\) at active tokens, got \[17\]"),
    (dict(action_ids=-1), r"action_ids: expected ids in \[0, 17\) at active tokens, got \[-1\]"),
    (dict(completion_mask=2), "completion_mask: expected bool or 0/1 values"),
    (dict(completion_mask=0.5), "completion_mask: expected bool or 0/1 values"),
    (dict(rewards=float("inf")), "rewards: expected finite values, got non-finite at sequences \\[1\\]"),
])
@pytest.mark.parametrize("single_pass", [True, False])
def test_bad_values_raise_like_native(bad, match, single_pass):
    inp = make_inputs(2, 3, 17, seed=1, device=DEV)
    (name, value), = bad.items()
    if name == "completion_mask":
        inp[name] = inp[name].to(torch.float32 if isinstance(value, float) else torch.int64)
        inp[name][1, 2] = value
    elif name == "action_ids":
        inp["completion_mask"][1, 0] = True
        inp[name][1, 0] = value
    else:
        inp[name][1] = value
    x = inp["policy_logits"].clone().requires_grad_(True)
    call = {**inp, "policy_logits": x}
    with pytest.raises(LossContractError, match=match):
        native(**call, samples_per_prompt=2)
    with pytest.raises(LossContractError, match=match):
        triton(**call, samples_per_prompt=2, single_pass=single_pass, check_values="sync")
    # Deferred (the default): on the GPU the call returns and the error, naming it, comes at the next call or at
    # raise_pending(); on the CPU there is nothing to overlap with and it comes at once.
    with pytest.raises(LossContractError, match=r"grpo_loss \(triton\) \(call #\d+, checked after it returned\): "
                       + match):
        triton(**call, samples_per_prompt=2, single_pass=single_pass)
        raise_pending()
    raise_pending()  # nothing left
    if not HAS_CUDA:  # on the CPU the assert is synchronous; on CUDA it would end the process's CUDA context
        with pytest.raises(RuntimeError, match="grpo_core: bad action_ids, rewards, old_logps"):
            triton(**call, samples_per_prompt=2, single_pass=single_pass, check_values="assert")


@pytest.mark.parametrize("kind", ["sequence", "token"])
@pytest.mark.parametrize("single_pass", [True, False])
def test_bad_given_advantages_raise_like_native(kind, single_pass):
    inp = make_inputs(4, 3, 17, seed=1, device=DEV, empty_rows=(2,))
    call, kw = migration_call(inp, kind)  # NaN where no active token reads them: no error, native's numbers
    got = run(triton, call, single_pass=single_pass, check_values="sync", **kw)
    want = run(native, call, **kw)
    for what, a, b in zip(("loss", "policy_loss", "kl", "grad"), got, want):
        assert_close_verbose(a, b, atol=1e-6, rtol=1e-5, what=what)
    bad = kw["advantages"].double()  # 1e300: finite in float64, inf in float32, the precision the loss reads
    bad[(1, 0) if kind == "token" else 1] = 1e300  # the first token is active in every non-empty sequence
    with pytest.raises(LossContractError) as exc:
        native(**call, advantages=bad)
    match = re.escape(str(exc.value))
    assert str(exc.value).startswith("advantages: expected finite values")
    with pytest.raises(LossContractError, match=f"^{match}$"):
        triton(**call, advantages=bad, single_pass=single_pass, check_values="sync")
    with pytest.raises(LossContractError, match=r"grpo_loss \(triton\) \(call #\d+, checked after it returned\): "
                       + match):
        triton(**call, advantages=bad, single_pass=single_pass)
        raise_pending()
    raise_pending()  # nothing left
    if not HAS_CUDA:  # on the CPU the assert is synchronous; on CUDA it would end the process's CUDA context
        with pytest.raises(RuntimeError, match="grpo_core: bad action_ids, rewards, old_logps"):
            triton(**call, advantages=bad, single_pass=single_pass, check_values="assert")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: on the CPU the check is immediate")
@pytest.mark.parametrize("overwrite", [False, True])
def test_deferred_check_raises_at_a_later_call_naming_the_bad_one(overwrite):
    inp = make_inputs(2, 3, 17, seed=1, device=DEV)
    bad = {**inp, "old_logps": inp["old_logps"].clone()}
    bad["old_logps"][0, 0] = float("nan")
    triton(**bad, samples_per_prompt=2)  # returns: no device sync
    if overwrite:  # the check reads the inputs, not copies: it still raises, and says why it cannot name the value
        bad["old_logps"].fill_(0.0)
        match = "the kernels flagged a bad input value that the inputs do not show now"
    else:
        match = "old_logps: expected finite values at active tokens"
    with pytest.raises(LossContractError, match=r"\(call #(\d+), checked after it returned\): " + match):
        for _ in range(pending.AHEAD):  # at the latest AHEAD calls later, whether or not the GPU is done
            triton(**inp, samples_per_prompt=2)
    raise_pending()  # the error cleared what was pending
    triton(**inp, samples_per_prompt=2)  # and the next good call runs
    raise_pending()


def test_unchecked_call_gives_the_checked_result():
    inp = make_inputs(4, 3, 50, seed=7, device=DEV)
    inp["completion_mask"] = inp["completion_mask"].to(torch.int32)
    want = run(triton, inp, samples_per_prompt=2)
    got = run(triton, inp, samples_per_prompt=2, check_values="assert")
    for name, a, b in zip(("loss", "policy_loss", "kl", "grad"), got, want):
        assert_bitwise_equal(a, b, name)


def test_t_equals_one_and_all_masked():
    inp = make_inputs(2, 1, 33, seed=4, device=DEV)
    got, want = run(triton, inp, samples_per_prompt=2), run(native, inp, samples_per_prompt=2)
    assert_close_verbose(got[0], want[0], atol=1e-5, rtol=1e-4, what="loss")
    inp["completion_mask"][:] = False
    got = run(triton, inp, samples_per_prompt=2)
    assert got[0].item() == 0.0 and bool((got[3] == 0).all())


@pytest.mark.parametrize("empty", ["T", "V"])
@pytest.mark.parametrize("single_pass", [True, False])
def test_empty_sequences_or_vocabulary_match_native(empty, single_pass):
    inp = make_inputs(2, 3, 11, seed=4, device=DEV)
    if empty == "T":  # [B, 0, V]
        inp = {k: v[:, :0] if v.dim() >= 2 else v for k, v in inp.items()}
    else:  # [B, T, 0]: legal only when no token is active
        inp = {k: v[..., :0] if v.dim() == 3 else v for k, v in inp.items()}
        inp["completion_mask"][:] = False
    got, want = run(triton, inp, samples_per_prompt=2, single_pass=single_pass), run(native, inp, samples_per_prompt=2)
    for name, a, b in zip(("loss", "policy_loss", "kl", "grad"), got, want):
        assert_bitwise_equal(a, b, name)


def test_no_sequences_is_refused_by_both_ops():
    inp = {k: v[:0] for k, v in make_inputs(2, 3, 11, seed=4, device=DEV).items()}
    for op in (native, triton):
        with pytest.raises(LossContractError, match=r"policy_logits: expected at least one sequence \(B >= 1\)"):
            op(**inp, samples_per_prompt=2)


def test_registry_auto_never_picks_triton_for_cpu_tensors():
    inp = make_inputs(2, 2, 9, seed=0)
    auto = kernel_registry.get_op("grpo_loss")
    auto(**inp, samples_per_prompt=2)
    assert auto.last_backend == "native" and "CUDA tensors" in auto.last_rejected["triton"][0]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", MIGRATION)
def test_registry_auto_picks_triton_for_every_option_on_cuda(name):
    call, kw = migration_call(make_inputs(6, 5, 37, seed=3, device="cuda", empty_rows=(1,)), name)
    auto = kernel_registry.get_op("grpo_loss")
    got = auto(**call, **kw)
    assert auto.last_backend == "triton", auto.last_rejected
    for what, a, b in zip(("loss", "policy_loss", "kl"), got, native(**call, **kw)):
        assert_close_verbose(a, b, atol=1e-5, rtol=1e-5, what=what)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
class TestCompiledOnGPU:
    def test_largest_vocab_and_long_sequence(self):
        inp = make_inputs(2, 64, 151936, seed=0, device="cuda", dtype=torch.bfloat16)
        got, want = run(triton, inp, samples_per_prompt=2), run(native, inp, samples_per_prompt=2)
        assert_close_verbose(got[0], want[0], atol=1e-3, rtol=1e-3, what="loss")
        assert_close_verbose(got[3].float(), want[3].float(), atol=1e-4, rtol=1e-2, what="grad")
        long = make_inputs(1, 70000, 64, seed=1, device="cuda")  # > 65535 tokens on one grid axis
        long["rewards"] = torch.randn(2, device="cuda")
        long = {k: torch.cat([v, v]) if k != "rewards" else v for k, v in long.items()}
        got, want = run(triton, long, samples_per_prompt=2), run(native, long, samples_per_prompt=2)
        assert_close_verbose(got[0], want[0], atol=1e-4, rtol=1e-4, what="long loss")

    def test_torch_compile_fullgraph_and_opcheck(self):
        from grpo_core.triton.grpo_loss import TritonGRPOLossOp
        from grpo_core.triton.ratio_kl import token_logprobs
        inp = make_inputs(6, 8, 1000, seed=2, device="cuda", empty_rows=(1,))  # the MIGRATION cases' 6 sequences
        op = TritonGRPOLossOp()
        weights = torch.rand(6, 8, generator=torch.Generator().manual_seed(1)).cuda() + 0.5
        options = {"trl_options": dict(samples_per_prompt=2, delta=1.3, use_bias_correction_kl=True,
                                       importance_sampling_ratio=weights),
                   "sapo": dict(samples_per_prompt=2, loss_type="sapo", sapo_temperature_neg=2.0,
                                importance_sampling_ratio=weights[:, :1])}
        for name, single in ((None, True), (None, False), ("token_tempered_grpo", False), ("unbiased_eps", True),
                             ("sequence_tempered_dr_grpo", True), ("trl_options", False), ("sapo", True)):
            call, kw = (inp, options.get(name, dict(samples_per_prompt=2))) if name in (None, *options) else (
                migration_call(inp, name))
            compiled = torch.compile(lambda x: op(**{**call, "policy_logits": x}, **kw, single_pass=single)[0],
                                     fullgraph=True)
            x = inp["policy_logits"].clone().requires_grad_(True)
            with torch._dynamo.config.patch(specialize_float=True):  # the float options are checked as Python floats
                loss = compiled(x)
            loss.backward()
            want = run(native, call, **kw)
            assert_close_verbose(loss, want[0], atol=1e-4, rtol=1e-4, what=f"compiled loss {name} single={single}")
            assert_close_verbose(x.grad, want[3], atol=1e-5, rtol=1e-4, what=f"compiled grad {name} single={single}")
        mask8 = inp["completion_mask"].view(torch.int8)
        torch.library.opcheck(token_logprobs, (inp["policy_logits"].requires_grad_(True), inp["ref_logits"],
                                               inp["action_ids"], mask8))

    def test_sgd_step_lowers_the_loss(self):
        inp = make_inputs(8, 16, 5000, seed=3, device="cuda", dtype=torch.bfloat16)
        loss, _, _, grad = run(triton, inp, samples_per_prompt=4)
        stepped = (inp["policy_logits"].float() - 0.5 * grad.float() / grad.float().norm()).to(torch.bfloat16)
        after = triton(**{**inp, "policy_logits": stepped}, samples_per_prompt=4)[0]
        assert after.item() < loss.item()
