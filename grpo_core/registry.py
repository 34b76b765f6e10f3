"""One registry for every backend: explicit requests never fall back, automatic choices say what they chose.

    grpo_loss = kernel_registry.get_op("grpo_loss")                    # auto, decided per call from the inputs
    grpo_loss = kernel_registry.get_op("grpo_loss", backend="native")  # explicit: raises if it cannot run
    dispatched = kernel_registry.get_loss_op(contract)                 # contract path: .op, .backend, .rejected
    linear = kernel_registry.get_op("linear_grpo_loss", backend="torch")  # the fused linear loss, its kernel set
    dispatched = kernel_registry.get_loss_op(contract, backend="linear")  # its contract path (hidden states in)

A backend declares why it cannot run at all (`available`: `get_op` raises with those reasons) and why it cannot
serve a call (`reasons`); an explicit request for such a backend raises with those reasons, and an automatic choice
records them. Once a backend is chosen its errors propagate: no
automatic choice retries another backend behind the caller's back.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .contract import DEFAULT_VOCAB_TILE, GRPOLossContract, LossContractError

__all__ = ["BackendUnavailableError", "DispatchedLossOp", "KernelRegistry", "kernel_registry"]


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot serve this request; the message lists why."""


@dataclass(frozen=True)
class _OpEntry:
    backend: str
    load: Callable[[], Any]  # returns the op (a callable); imports lazily
    reasons: Callable[[tuple, dict, bool], list[str]]  # (args, kwargs, explicit) -> why it cannot serve them
    available: Callable[[], list[str]]  # why it cannot run at all, whatever the call (a package missing)


@dataclass(frozen=True)
class DispatchedLossOp:
    op: Any
    backend: str
    rejected: dict[str, list[str]] = field(default_factory=dict)  # backend -> reasons it was not chosen


class _AutoOp:
    """Picks, per call, the first registered backend that can serve the inputs."""

    def __init__(self, registry: KernelRegistry, name: str) -> None:
        self.name, self._registry = name, registry
        self.last_backend: str | None = None
        self.last_rejected: dict[str, list[str]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rejected = {}
        for entry in self._registry._ops[self.name]:
            reasons = entry.reasons(args, kwargs, False)
            if not reasons:
                self.last_backend, self.last_rejected = entry.backend, rejected
                return entry.load()(*args, **kwargs)
            rejected[entry.backend] = reasons
        raise BackendUnavailableError(f"{self.name}: no backend can serve these inputs: {rejected}")


class KernelRegistry:
    def __init__(self) -> None:
        self._ops: dict[str, list[_OpEntry]] = {}
        self._loss_backends: list[tuple[str, Callable[[], Any], bool]] = []

    def register_op(self, name: str, backend: str, load: Callable[[], Any],
                    reasons: Callable[[tuple, dict, bool], list[str]] = lambda args, kwargs, explicit: [],
                    available: Callable[[], list[str]] = list) -> None:
        """Registers `backend` for op `name`; earlier registrations are preferred by the automatic choice.

        `reasons(args, kwargs, explicit)` says why the backend cannot serve a call (empty: it can); `available()`
        why it cannot run at all (empty: it can), checked by `get_op`.
        """
        entries = self._ops.setdefault(name, [])
        if any(e.backend == backend for e in entries):
            raise ValueError(f"backend: {backend!r} is already registered for op {name!r}")
        entries.append(_OpEntry(backend, load, reasons, available))

    def register_loss_backend(self, backend: str, load: Callable[[], Any], automatic: bool = True) -> None:
        """Registers a contract-path backend; `load()` returns an op with `supports(contract)` and `apply(...)`.
        `automatic=False`: only an explicit request gets it (its `apply` takes other inputs than logits)."""
        if any(name == backend for name, *_ in self._loss_backends):
            raise ValueError(f"backend: {backend!r} is already registered as a loss backend")
        self._loss_backends.append((backend, load, automatic))

    def backends(self, name: str) -> list[str]:
        return [e.backend for e in self._entries(name)]

    def _entries(self, name: str) -> list[_OpEntry]:
        if name not in self._ops:
            raise KeyError(f"name: expected one of {sorted(self._ops)}, got {name!r}")
        return self._ops[name]

    def get_op(self, name: str, backend: str | None = None) -> Any:
        """The op `name` from `backend`, or an automatic chooser when `backend` is None.

        An explicit backend that cannot run at all raises `BackendUnavailableError` with the reasons here; if the
        inputs of a call are outside what it supports, that call raises it with the reasons instead of falling back.
        """
        entries = self._entries(name)
        if backend is None:
            return _AutoOp(self, name)
        for entry in entries:
            if entry.backend == backend:
                reasons = entry.available()
                if reasons:
                    raise BackendUnavailableError(f"backend: {backend!r} cannot run {name}: " + "; ".join(reasons))
                return _Explicit(entry, name)
        raise BackendUnavailableError(f"backend: expected one of {[e.backend for e in entries]} for op {name!r}, "
                                      f"got {backend!r}")

    def get_loss_op(self, contract: GRPOLossContract, backend: str | None = None) -> DispatchedLossOp:
        """The contract-path op for `contract`: the first backend whose `supports(contract)` has no reasons (of those
        registered as automatic, when `backend` is None)."""
        if not isinstance(contract, GRPOLossContract):
            raise LossContractError(f"contract: expected a GRPOLossContract, got {type(contract).__name__}")
        names = [name for name, *_ in self._loss_backends]
        if backend is not None and backend not in names:
            raise BackendUnavailableError(f"backend: expected one of {names}, got {backend!r}")
        rejected: dict[str, list[str]] = {}
        for name, load, automatic in self._loss_backends:
            if name != backend and (backend is not None or not automatic):
                continue
            op = load()
            reasons = op.supports(contract)
            if not reasons:
                return DispatchedLossOp(op=op, backend=name, rejected=rejected)
            rejected[name] = reasons
        raise BackendUnavailableError(f"contract: no loss backend can serve it: {rejected}")


class _Explicit:
    """An explicitly requested backend: checks its reasons on every call and raises instead of falling back."""

    def __init__(self, entry: _OpEntry, name: str) -> None:
        self._entry, self.name, self.backend = entry, name, entry.backend

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reasons = self._entry.reasons(args, kwargs, True)
        if reasons:
            raise BackendUnavailableError(f"backend: {self.backend!r} cannot run {self.name}: " + "; ".join(reasons))
        return self._entry.load()(*args, **kwargs)


def _lazy(module: str, attr: str, *args: Any) -> Callable[[], Any]:
    cache: list[Any] = []

    def load() -> Any:
        if not cache:
            cache.append(getattr(importlib.import_module(module, __package__), attr)(*args))
        return cache[0]

    return load


def _triton_installed() -> list[str]:
    return [] if importlib.util.find_spec("triton") is not None else ["triton is not installed (pip install "
                                                                       "'.[triton]')"]


def _triton_reasons(arg: str) -> Callable[[tuple, dict, bool], list[str]]:
    """Triton serves CUDA tensors; an explicit request may also run CPU tensors under TRITON_INTERPRET=1.

    Reads nothing but the type and device of the first argument, `arg` (and, for the automatic choice, the fused
    linear loss's `vocab_tile`): whatever else is wrong with the inputs is the chosen op's `LossContractError` (the
    same from every backend), never an error of the dispatch."""

    def reasons(args: tuple, kwargs: dict, explicit: bool) -> list[str]:
        missing = _triton_installed()
        if missing:
            return missing
        first = args[0] if args else kwargs.get(arg)
        if not isinstance(first, torch.Tensor):  # explicit: the op itself raises the LossContractError
            return [] if explicit else [f"{arg} is a {type(first).__name__}, not a torch.Tensor"]
        if arg == "hidden" and not explicit:  # what `linear._kernels` reads for kernels='auto'
            from .linear import MAX_TRITON_TILE, MIN_TRITON_TILE
            width = kwargs.get("vocab_tile", DEFAULT_VOCAB_TILE)
            if not (isinstance(width, int) and MIN_TRITON_TILE <= width <= MAX_TRITON_TILE):
                return [f"vocab_tile={width!r}: the Triton kernels take tiles of {MIN_TRITON_TILE} to "
                        f"{MAX_TRITON_TILE} columns"]
        device = first.device
        if device.type == "cuda":
            return []
        if explicit and os.environ.get("TRITON_INTERPRET") == "1":
            return []
        return [f"{arg} is on {device}; the Triton backend needs CUDA tensors (or, when requested explicitly, "
                f"TRITON_INTERPRET=1 for the CPU interpreter)"]

    return reasons


kernel_registry = KernelRegistry()
kernel_registry.register_op("grpo_loss", "triton", _lazy(".triton", "TritonGRPOLossOp"),
                            _triton_reasons("policy_logits"), _triton_installed)
kernel_registry.register_op("grpo_loss", "native", _lazy(".native", "NativeGRPOLossOp"))
kernel_registry.register_op("ratio_kl", "triton", _lazy(".triton", "TritonRatioKLOp"), _triton_reasons("policy_logits"),
                            _triton_installed)
kernel_registry.register_op("ratio_kl", "native", _lazy(".native", "NativeRatioKLOp"))
kernel_registry.register_op("linear_grpo_loss", "triton", _lazy(".linear", "LinearGRPOLossOp", "triton"),
                            _triton_reasons("hidden"), _triton_installed)
kernel_registry.register_op("linear_grpo_loss", "torch", _lazy(".linear", "LinearGRPOLossOp", "torch"))
kernel_registry.register_loss_backend("native", _lazy(".native", "NativeGRPOLossOp"))
kernel_registry.register_loss_backend("distributed", _lazy(".distributed", "DistributedGRPOLossOp"))
kernel_registry.register_loss_backend("linear", _lazy(".linear", "LinearGRPOLossOp"), automatic=False)
