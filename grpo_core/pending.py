"""Value checks without a device sync: a GPU call's bad-value flags are read later, and surely.

A call on CUDA tensors flags bad values on the device (ids outside `[0, V)`, mask values other than 0 / 1,
non-finite rewards or old log-probs, non-finite log-probs at active tokens) and hands the flags here with copies
of the small inputs the precise check needs. The flags travel to pinned host memory without blocking the host.
The error, the same `LossContractError` the native op raises, prefixed with the call that had the bad value,
surfaces:
- at the start of the next call of any grpo_core op that defers its checks (it waits for the earlier calls'
  flags if the GPU has not produced them yet: the host never runs more than one call ahead of an unread flag);
- or at `raise_pending()`, for whoever wants certainty at a given point (before an optimizer step, say).
The call that had the bad value returns numbers that must not be used; after the error, nothing is pending.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from .contract import LossContractError

__all__ = ["defer", "raise_now", "raise_pending"]


@dataclass
class _Check:
    call: int
    label: str
    flags: torch.Tensor  # pinned host copy, nonzero = a bad value
    event: torch.cuda.Event
    recheck: Callable[[], None]  # raises the precise LossContractError from copies of the inputs


_calls = itertools.count(1)
_pending: collections.deque[_Check] = collections.deque()


def defer(flags: torch.Tensor, recheck: Callable[[], None], label: str) -> None:
    """Queues the device tensor `flags` (nonzero: a bad value) of one call of `label`; `recheck()` must raise the
    precise error. CPU flags are read at once (there is no device to overlap with)."""
    call = next(_calls)
    if not flags.is_cuda:
        if bool(flags.any()):
            _raise(call, label, recheck)
        return
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending.append(_Check(call, label, host, event, recheck))


def raise_pending() -> None:
    """Raises the error of the earliest pending call that had a bad value (waiting for its flags if needed); the
    others are dropped with it. Returns at once when nothing is pending."""
    while _pending:
        check = _pending.popleft()
        check.event.synchronize()
        if bool(check.flags.any()):
            _pending.clear()
            _raise(check.call, check.label, check.recheck)


def raise_now(flags: torch.Tensor, recheck: Callable[[], None]) -> None:
    """The synchronous variant: one device sync; `recheck()`'s error as it is (the call itself raises)."""
    if bool(flags.any()):
        recheck()
        raise LossContractError("the kernels flagged a bad input value that the host check did not find")


def _raise(call: int, label: str, recheck: Callable[[], None]) -> None:
    try:
        recheck()
    except LossContractError as exc:
        raise LossContractError(f"{label} (call #{call}, checked after it returned): {exc}") from None
    raise LossContractError(f"{label} (call #{call}, checked after it returned): the kernels flagged a bad input "
                            f"value that the inputs' copies do not show")
