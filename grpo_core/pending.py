"""Value checks without a device sync: a GPU call's bad-value flag is read later, and surely.

A call on CUDA tensors flags bad values on the device (ids outside `[0, V)`, mask values other than 0 / 1,
non-finite rewards, advantages or old log-probs, non-finite log-probs at active tokens) and hands the flag here
with the call's inputs, which the precise check reads. The flag travels to a slot of a pinned host ring without
blocking the host, and waits in a queue: the local queue (this process's calls), or, for a collective call, the
queue of its key (the process groups over which the flag was gathered: every rank of them holds the same flag).
The error, the same `LossContractError` the native op raises, prefixed with the call that had the bad value,
surfaces:
- at the start of a later call of an op that defers its checks (`poll()`): a call reads the local flags the GPU
  has produced, and waits for the oldest while `AHEAD` are unread, so the host keeps running ahead of the GPU and
  the error comes at the latest `AHEAD` local checks after the bad one. A collective key's queue is read only by
  the calls with that key (`poll(key)`), and only by age: at the `AHEAD`-th of them after the bad one, never
  earlier, however far the GPU has gone and whatever else the rank runs, so that every rank of the key raises at
  the same call, provided every rank makes the same calls with that key;
- or at `raise_pending()`, which waits for every flag, for whoever wants certainty at a given point (before an
  optimizer step, say).
The call that had the bad value returns numbers that must not be used; the error empties the queue it came from
(on every rank of a collective key, that key's queue; `raise_pending()` empties them all). The inputs are not
copied: a caller that overwrites them in place before the error surfaces gets an error that says the kernels
flagged a value the inputs no longer show.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

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
    event: Any  # a torch.cuda.Event after the flag's copy (anything with `query()` and `synchronize()`)
    recheck: Callable[[], None]  # raises the precise LossContractError from the inputs


_calls = itertools.count(1)
_local: collections.deque[_Check] = collections.deque()  # this process's non-collective calls, oldest first
_shared: dict[Hashable, collections.deque[_Check]] = {}  # collective key -> its calls, oldest first
_rings: dict[torch.dtype, torch.Tensor] = {}


def check_mode(check_values: Any) -> None:
    """The contract-path ops' `check_values` argument: "deferred" (`defer`) or "sync" (`raise_now`)."""
    if check_values not in ("deferred", "sync"):
        raise LossContractError(f"check_values: expected 'deferred' or 'sync', got {check_values!r}")


def defer(flag: torch.Tensor, recheck: Callable[[], None], label: str, group: Hashable | None = None) -> None:
    """Queues the 0-d device tensor `flag` (nonzero: a bad value) of one call of `label`; `recheck()` must raise
    the precise error. `group`: None for a local flag, else the key of the process groups whose ranks all hold this
    same flag (read at the same call on each of them: `poll(group)`). CPU flags are read at once (there is no
    device to overlap with)."""
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
    _enqueue(_Check(call, label, host, event, recheck), group)


def _enqueue(check: _Check, group: Hashable | None = None) -> None:
    (_local if group is None else _shared.setdefault(group, collections.deque())).append(check)


def poll(group: Hashable | None = None) -> None:
    """At the start of a call: raises the error of the earliest call whose flag shows a bad value, among, with
    `group` None, the local flags the GPU has produced and the oldest beyond `AHEAD - 1` unread (waiting for them);
    with a key, the oldest of that key's flags beyond `AHEAD - 1` unread only, ready or not. The queue that raised
    is emptied."""
    if group is None:
        while _local and (len(_local) >= AHEAD or _local[0].event.query()):
            _read(_local)
        return
    try:
        queue = _shared.get(group)
    except TypeError:  # not a key (not a group handle): no queue; the caller's checks name the argument
        return
    while queue and len(queue) >= AHEAD:
        _read(queue)


def raise_pending() -> None:
    """Reads every pending flag, waiting for each: the collective queues first (the same on every rank of their
    key), oldest key first, then the local queue; raises the error of the first bad call in that order and drops
    the rest with it (a rank's other keys too, so that every rank of every key is left with nothing pending).
    Returns at once when nothing is pending. In a world, a collective point: call it on every rank or on none."""
    queues = [*_shared.values(), _local]
    try:
        for queue in queues:
            while queue:
                _read(queue)
    except LossContractError:
        for queue in queues:
            queue.clear()
        raise


def raise_now(flags: torch.Tensor, recheck: Callable[[], None]) -> None:
    """The synchronous variant: one device sync; `recheck()`'s error as it is (the call itself raises)."""
    if bool(flags.any()):
        recheck()
        raise LossContractError("the kernels flagged a bad input value that the host check did not find")


def _read(queue: collections.deque[_Check]) -> None:
    """Reads `queue`'s oldest flag (waiting for it); when it is bad, empties `queue` and raises."""
    check = queue.popleft()
    check.event.synchronize()
    if bool(check.flag):
        queue.clear()
        _raise(check.call, check.label, check.recheck)


def _raise(call: int, label: str, recheck: Callable[[], None]) -> None:
    try:
        recheck()
    except LossContractError as exc:
        raise LossContractError(f"{label} (call #{call}, checked after it returned): {exc}") from None
    raise LossContractError(f"{label} (call #{call}, checked after it returned): the kernels flagged a bad input "
                            f"value that the inputs do not show now (overwritten in place after the call?)")
