"""`ref_logps`: the reference model's log-probs `[B, T]` in place of its `[B, T, V]` logits, on every backend.

Given the very log-probs a backend computes from the reference logits, each backend gives the bits it gives with
those logits (loss, policy loss, KL, per-sequence vectors, gradient); the fast Triton op in both of its modes.
Bad `ref_logps` raise the same error on every backend."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import HAS_CUDA, assert_bitwise_equal, make_inputs
from grpo_core import GRPOLossContract, LossContractError, kernel_registry
from grpo_core.distributed import DistributedGRPOLossOp
from grpo_core.distributed.vocab_parallel_logprob import VocabParallelLogprobOp
from grpo_core.native.ratio_kl import selected_logprobs
from grpo_core.triton.ratio_kl import token_logprobs

DEV = "cuda" if HAS_CUDA else "cpu"
native = kernel_registry.get_op("grpo_loss", backend="native")
fast = kernel_registry.get_op("grpo_loss", backend="triton")
OPTS = dict(beta=0.04, samples_per_prompt=2, temperature=0.7, clip_eps_high=0.28)


def inputs(dtype=torch.bfloat16):
    inp = make_inputs(4, 5, 37, seed=3, dtype=dtype, device=DEV)
    inp["ref_logits"][1, 2] = float("nan")  # a masked row of the logits, and so a masked NaN log-prob
    inp["completion_mask"][1, 2] = False
    return inp


def plain(op, inp, ref, **kw):
    """`op`'s plain call with the reference as `ref` (a dict) and its gradient."""
    x = inp["policy_logits"].detach().clone().requires_grad_(True)
    out = op(x, ref.get("ref_logits"), inp["action_ids"], inp["old_logps"], inp["rewards"], inp["completion_mask"],
             ref_logps=ref.get("ref_logps"), **{**OPTS, **kw})
    out[0].backward()
    return [*out, x.grad]


def contract_of(inp) -> GRPOLossContract:
    """At temperature 1: `VocabParallelLogprobOp` (the canonical log-probs) takes no temperature."""
    B, T, V = inp["policy_logits"].shape
    return GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, determinism_scope="topology_invariant",
                            **{**OPTS, "temperature": 1.0})


def deterministic(kernels, inp, ref, backward=True):
    x = inp["policy_logits"].detach().clone().requires_grad_(True)
    res = DistributedGRPOLossOp(kernels=kernels).apply(
        x, inp["action_ids"], inp["old_logps"], inp["rewards"], contract=contract_of(inp),
        completion_mask=inp["completion_mask"], ref_local_logits=ref.get("ref_logits"), ref_logps=ref.get("ref_logps"),
        check_values="sync")
    if backward:
        res.loss.backward()
    return [res.loss, res.policy_loss, res.kl, res.per_sequence_policy, res.per_sequence_kl, x.grad]


def assert_same_bits(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"output {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_takes_its_own_reference_logprobs_to_the_bit(dtype):
    inp = inputs(dtype)
    inv = torch.tensor(1 / 0.7, dtype=torch.float32).item()
    own = selected_logprobs(inp["ref_logits"], inp["action_ids"], inp["completion_mask"], inv)
    assert_same_bits(plain(native, inp, dict(ref_logps=own)), plain(native, inp, dict(ref_logits=inp["ref_logits"])))


@pytest.mark.parametrize("single_pass", [False, True])
def test_the_fast_triton_op_takes_its_own_reference_logprobs_to_the_bit(single_pass):
    inp = inputs()
    scaled = (inp["ref_logits"].float() * torch.tensor(1 / 0.7)).to(inp["ref_logits"].dtype)  # temperature 1 below
    out, _ = token_logprobs(scaled, None, inp["action_ids"], inp["completion_mask"])
    own = out[0].view(4, 5)
    kw = dict(check_values="sync", single_pass=single_pass, temperature=1.0)
    assert_same_bits(plain(fast, inp | {"ref_logits": scaled}, dict(ref_logps=own), **kw),
                     plain(fast, inp | {"ref_logits": scaled}, dict(ref_logits=scaled), **kw))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_deterministic_path_takes_the_canonical_reference_logprobs_to_the_bit(kernels):
    inp = inputs()
    B, T, V = inp["ref_logits"].shape
    own, _ = VocabParallelLogprobOp()(inp["ref_logits"].reshape(B * T, V), inp["action_ids"].reshape(-1),
                                      contract=contract_of(inp).logprob_contract,
                                      mask=inp["completion_mask"].reshape(-1))
    assert_same_bits(deterministic(kernels, inp, dict(ref_logps=own.view(B, T))),
                     deterministic(kernels, inp, dict(ref_logits=inp["ref_logits"])))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_deterministic_loss_keeps_no_reference_logits_alive(kernels):
    """Until its backward the loss holds what the gradient needs, not the reference logits: a caller can free them
    right after the call (a second logits-sized tensor; a reviewer found them pinned)."""
    inp = inputs()
    ref = inp.pop("ref_logits").clone()
    alive = weakref.ref(ref)
    got = deterministic(kernels, inp | {"ref_logits": ref}, dict(ref_logits=ref), backward=False)
    del ref, inp
    gc.collect()
    assert alive() is None
    got[0].backward()


def every_backend(inp, ref) -> dict[str, str]:
    """Each backend's LossContractError message (or 'NO ERROR')."""
    calls = {"native": lambda: plain(native, inp, ref), "triton": lambda: plain(fast, inp, ref, check_values="sync"),
             **{f"deterministic_{k}": (lambda k=k: deterministic(k, inp, ref)) for k in ("torch", "triton")}}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "NO ERROR"
        except LossContractError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.parametrize("change, message", [
    ("nan", "ref_logps: expected finite values at active tokens, got non-finite at (b, t) [(2, 3)] (checked in "
            "float32)"),
    ("both", "ref_logits / ref_logps: expected at most one reference, got both (the reference model's logits, or "
             "its log-probs of the action ids)"),
    ("shape", "ref_logps: expected shape [B, T] = [4, 5], got [4, 6]"),
    ("dtype", "ref_logps: expected a floating dtype, got torch.int64"),
    ("sparse", "ref_logps: expected a dense (strided) tensor, got layout torch.sparse_coo; convert it with "
               ".to_dense()"),
    ("negated", "ref_logps: expected a tensor without a lazy negation or conjugation bit, got one; materialize it "
                "with .resolve_neg() / .resolve_conj()"),
    ("neither", "ref_logits: required when beta > 0 (beta=0.04); pass the reference model's logits, or its "
                "log-probs as ref_logps, or set beta=0"),
])
def test_bad_ref_logps_raise_the_same_words_on_every_backend(change, message):
    inp = inputs()
    ref = {"ref_logps": torch.full((4, 5), -1.5, device=DEV)}
    ref["ref_logps"][1, 2] = float("nan")  # masked: never read
    if change == "nan":
        inp["completion_mask"][2, 3] = True
        ref["ref_logps"][2, 3] = float("nan")
    elif change == "both":
        ref["ref_logits"] = inp["ref_logits"]
    elif change == "shape":
        ref["ref_logps"] = torch.zeros(4, 6, device=DEV)
    elif change == "dtype":
        ref["ref_logps"] = torch.zeros(4, 5, dtype=torch.int64, device=DEV)
    elif change == "sparse":
        ref["ref_logps"] = ref["ref_logps"].to_sparse()
    elif change == "negated":  # the fast op once read its storage, +1.5 (a helper's find)
        ref["ref_logps"] = torch._neg_view(-ref["ref_logps"])
    else:
        ref = {}
    got = every_backend(inp, ref)
    assert set(got.values()) == {message}, got
    assert set(every_backend(inputs(), {"ref_logps": torch.full((4, 5), -1.5, device=DEV)}).values()) == {"NO ERROR"}
