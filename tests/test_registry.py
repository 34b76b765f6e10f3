"""The registry as the one front door: the fused linear loss is found like every other loss (`get_op` by kernel set,
`get_loss_op(contract, backend="linear")`), and an explicit backend that cannot run at all raises at `get_op`."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import assert_bitwise_equal
from grpo_core import GRPOLossContract, kernel_registry
from grpo_core.contract import LossContractError
from grpo_core.linear import LinearGRPOLossOp, linear_grpo_loss
from grpo_core.registry import BackendUnavailableError
from test_linear import make

FIELDS = ("loss", "policy_loss", "kl", "per_sequence_policy", "per_sequence_kl", "advantages")


@pytest.mark.parametrize("name", ["grpo_loss", "ratio_kl", "linear_grpo_loss"])
def test_an_explicit_triton_backend_without_triton_raises_at_get_op(name, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == "triton" else find_spec(mod, *a))
    with pytest.raises(BackendUnavailableError, match=rf"^backend: 'triton' cannot run {name}: triton is not "
                                                      rf"installed \(pip install '\.\[triton\]'\)$"):
        kernel_registry.get_op(name, backend="triton")
    assert kernel_registry.get_op(name, backend="native" if name != "linear_grpo_loss" else "torch")


def _args(inp):
    return ((inp["hidden"], inp["weight"], inp["action_ids"], inp["old_logps"], inp["rewards"], inp["completion_mask"]),
            dict(bias=inp["bias"], ref_hidden=inp["ref_hidden"], samples_per_prompt=2))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_get_op_finds_the_fused_linear_loss_by_kernel_set(kernels):
    inp = make()  # CUDA tensors on a GPU machine (the Triton kernels' device), else the interpreter on the CPU
    args, kw = _args(inp)
    want = linear_grpo_loss(*args, kernels=kernels, **kw)
    got = kernel_registry.get_op("linear_grpo_loss", backend=kernels)(*args, **kw)
    for f in FIELDS:
        assert_bitwise_equal(getattr(got, f), getattr(want, f), f)
    assert got.provenance["kernels"] == kernels
    with pytest.raises(LossContractError, match=rf"^kernels: expected none \(this op runs the '{kernels}' kernels"):
        kernel_registry.get_op("linear_grpo_loss", backend=kernels)(*args, kernels="auto", **kw)


def test_get_op_chooses_the_torch_kernels_for_cpu_hidden_states():
    inp = make(device="cpu")
    args, kw = _args(inp)
    auto = kernel_registry.get_op("linear_grpo_loss")
    assert kernel_registry.backends("linear_grpo_loss") == ["triton", "torch"]
    assert auto(*args, **kw).provenance["kernels"] == "torch" and auto.last_backend == "torch"
    assert "hidden is on cpu" in auto.last_rejected["triton"][0]


def test_the_contract_path_finds_the_fused_linear_loss_when_asked():
    inp = make(device="cpu")
    B, T, _ = inp["hidden"].shape
    contract = GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=inp["weight"].shape[0], beta=0.04,
                                samples_per_prompt=2, determinism_scope="topology_invariant")
    assert kernel_registry.get_loss_op(contract).backend == "distributed"  # logits in: never the linear op
    dispatched = kernel_registry.get_loss_op(contract, backend="linear")
    assert dispatched.backend == "linear" and isinstance(dispatched.op, LinearGRPOLossOp)
    got = dispatched.op.apply(inp["hidden"], inp["weight"], inp["action_ids"], inp["old_logps"], inp["rewards"],
                              contract=contract, completion_mask=inp["completion_mask"], bias=inp["bias"],
                              ref_hidden=inp["ref_hidden"])
    args, kw = _args(inp)
    want = linear_grpo_loss(*args, **kw)
    for f in FIELDS:
        assert_bitwise_equal(getattr(got, f), getattr(want, f), f)
