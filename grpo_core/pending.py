"""Value checks without a device sync: a GPU call's bad-value flag is read later, and surely.

A call on CUDA tensors flags bad values on the device (ids outside `[0, V)`, mask values other than 0 / 1,
non-finite rewards, advantages or old log-probs, non-finite log-probs at active tokens) and hands the flag here
with the call's inputs, which the precise check reads. The flag travels to a slot of a pinned host ring without
blocking the host. The error, the same `LossContractError` the native op raises, prefixed with the call that had
the bad value, surfaces:
- at the start of a later call of any grpo_core op that defers its checks (`poll()`), once the GPU has produced
  the flag: a call waits for a flag only when `AHEAD` calls' flags are still unread, so the host keeps running
  ahead of the GPU and the error comes at the latest `AHEAD` calls after the bad one. A collective call's flag
  (gathered over a process group) is read only then, never earlier, so that every rank raises at the same call
  whatever its GPU's progress;
- or at `raise_pending()`, which waits for every flag, for whoever wants certainty at a given point (before an
  optimizer step, say).
The call that had the bad value returns numbers that must not be used; after the error, nothing is pending. The
inputs are not copied: a caller that overwrites them in place before the error surfaces gets an error that says
the kernels flagged a value the inputs no longer show.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from .contract import LossContractError

__all__ = ["defer", "poll", "raise_now", "raise_pending"]

AHEAD = 2  # calls whose flags may be unread when a new call starts
_RING = 64  # pinned slots per flag dtype; a slot is reused `_RING` calls later, long after it was read


@dataclass
class _Check:
    call: int
    label: str
    flag: torch.Tensor  # a pinned host slot, nonzero = a bad value
    event: torch.cuda.Event
    recheck: Callable[[], None]  # raises the precise LossContractError from the inputs
    collective: bool  # the same flag on every rank of a group: read at the same call on every rank


_calls = itertools.count(1)
_pending: collections.deque[_Check] = collections.deque()
_rings: dict[torch.dtype, torch.Tensor] = {}


def defer(flag: torch.Tensor, recheck: Callable[[], None], label: str, collective: bool = False) -> None:
    """Queues the 0-d device tensor `flag` (nonzero: a bad value) of one call of `label`; `recheck()` must raise
    the precise error. CPU flags are read at once (there is no device to overlap with)."""
    call = next(_calls)
    if not flag.is_cuda:
        if bool(flag):
            _raise(call, label, recheck)
        return
    if flag.dtype not in _rings:
        _rings[flag.dtype] = torch.zeros(_RING, dtype=flag.dtype, pin_memory=True)
    host = _rings[flag.dtype][call % _RING]
    host.copy_(flag, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flag.device))
    _pending.append(_Check(call, label, host, event, recheck, collective))


def poll() -> None:
    """At the start of a call: raises the error of the earliest call whose flag shows a bad value, among the oldest
    flags beyond `AHEAD - 1` unread (waiting for them) and, up to the first collective one, those the GPU has
    produced."""
    while _pending and (len(_pending) >= AHEAD or (not _pending[0].collective and _pending[0].event.query())):
        _read(_pending.popleft(), wait=True)


def raise_pending() -> None:
    """Raises the error of the earliest pending call that had a bad value (waiting for its flag if needed); the
    others are dropped with it. Returns at once when nothing is pending."""
    while _pending:
        _read(_pending.popleft(), wait=True)


def raise_now(flags: torch.Tensor, recheck: Callable[[], None]) -> None:
    """The synchronous variant: one device sync; `recheck()`'s error as it is (the call itself raises)."""
    if bool(flags.any()):
        recheck()
        raise LossContractError("the kernels flagged a bad input value that the host check did not find")


def _read(check: _Check, wait: bool = False) -> None:
    if wait:
        check.event.synchronize()
    if bool(check.flag):
        _pending.clear()
        _raise(check.call, check.label, check.recheck)


def _raise(call: int, label: str, recheck: Callable[[], None]) -> None:
    try:
        recheck()
    except LossContractError as exc:
        raise LossContractError(f"{label} (call #{call}, checked after it returned): {exc}") from None
    raise LossContractError(f"{label} (call #{call}, checked after it returned): the kernels flagged a bad input "
                            f"value that the inputs do not show now (overwritten in place after the call?)")
