"""The deferred value checks' queues (`pending.py`) on the CPU: checks with a stub event and a 0-d CPU flag.

A call with a collective key stands for the distributed op in a TP x DP world (`poll(key)` at its start, then its
check queued under the key); a local call for the `triton` ops (`poll()`, then a local check)."""

from __future__ import annotations

import collections

import pytest
import torch

from grpo_core import LossContractError, pending, raise_pending
from grpo_core.pending import AHEAD

KEY, OTHER = ("tp group", "dp group"), ("another tp group", "another dp group")


class Event:
    """A CUDA event's `query()` / `synchronize()`: `ready` is whether the GPU has produced the flag."""

    def __init__(self, ready: bool) -> None:
        self.ready, self.waited = ready, False

    def query(self) -> bool:
        return self.ready

    def synchronize(self) -> None:
        self.ready = self.waited = True


@pytest.fixture(autouse=True)
def empty_queues(monkeypatch):
    """Each test starts with nothing pending and leaves the process's queues as they were."""
    monkeypatch.setattr(pending, "_local", collections.deque())
    monkeypatch.setattr(pending, "_shared", {})


def push(call: int, group=None, *, bad: bool = False, ready: bool = False) -> Event:
    """Queues call `call`'s check (under `group`, None: local) as `defer` does for a CUDA flag."""
    def recheck() -> None:
        raise LossContractError(f"old_logps: expected finite values at active tokens (call {call})")

    event = Event(ready)
    pending._enqueue(pending._Check(call, "op", torch.tensor(int(bad)), event, recheck), group)
    return event


def push_good(group, n: int) -> None:
    """`n` good checks under `group`, none produced yet."""
    for _ in range(n):
        push(0, group)


def raised(call: int):
    return pytest.raises(LossContractError, match=rf"^op \(call #{call}, checked after it returned\): old_logps: "
                                                  rf"expected finite values at active tokens \(call {call}\)$")


def local_calls(n: int) -> None:
    """`n` good calls of a local op (the `triton` ops): a local poll, then a local check the GPU has produced."""
    for _ in range(n):
        pending.poll()
        push(0, ready=True)


def test_a_collective_check_ages_only_by_its_key_and_is_never_read_early():
    push(1, KEY, bad=True, ready=True)  # produced at once: still read only at the AHEAD-th later call with KEY
    for _ in range(AHEAD - 1):  # KEY's next calls, with the fast op's calls (on this rank only) between them
        local_calls(3)
        pending.poll(KEY)
        push(0, KEY, ready=True)
    local_calls(3)
    with raised(1):
        pending.poll(KEY)


def test_two_keys_age_independently():
    push(1, KEY, bad=True)
    for _ in range(2 * AHEAD):  # OTHER's calls read OTHER's checks only
        pending.poll(OTHER)
        push(0, OTHER)
    for _ in range(AHEAD - 1):  # KEY's next calls: not yet
        pending.poll(KEY)
        push(0, KEY)
    with raised(1):
        pending.poll(KEY)


def test_an_error_empties_only_the_queue_that_raised():
    for call, group in ((1, KEY), (2, KEY), (3, OTHER), (4, None), (5, None)):
        push(call, group, bad=True)  # none produced yet
    push_good(KEY, AHEAD - 2)  # KEY holds AHEAD checks
    with raised(1):
        pending.poll(KEY)
    push_good(KEY, AHEAD - 1)
    pending.poll(KEY)  # call 2 went with call 1: AHEAD - 1 checks, none read
    push_good(None, AHEAD - 2)
    with raised(4):  # the local queue kept its checks
        pending.poll()
    push_good(None, AHEAD - 1)
    pending.poll()  # call 5 went with call 4
    push_good(OTHER, AHEAD - 1)
    with raised(3):  # OTHER kept its check through both errors
        pending.poll(OTHER)
    raise_pending()  # the rest: good


def test_raise_pending_reads_collective_queues_first_and_leaves_nothing_pending():
    events = [push(1, KEY), push(2), push(3, OTHER)]
    raise_pending()
    assert all(e.waited for e in events)  # it waited for every flag
    push(4, bad=True, ready=True)  # the earliest bad call, but local
    push(5, KEY, bad=True)
    push(6, KEY)
    push(7, OTHER, bad=True)
    push(8, bad=True)
    with raised(5):
        raise_pending()
    for group in (None, KEY, OTHER):  # every queue was emptied, the other keys' too
        pending.poll(group)
        push(0, group)
        pending.poll(group)
    raise_pending()
    push(10, KEY)
    push(11, bad=True)
    with raised(11):  # a good collective queue is read through, then the local one
        raise_pending()
    raise_pending()


def test_the_local_queue_reads_produced_flags_and_waits_for_the_oldest_of_ahead():
    first = push(1, bad=True)
    for _ in range(AHEAD - 2):  # fewer than AHEAD unread and none produced: nothing read, no wait
        pending.poll()
        push(0)
    pending.poll()
    assert not first.waited
    first.ready = True  # produced: the next local call reads it
    with raised(1):
        pending.poll()
    oldest = push(2, bad=True)
    push_good(None, AHEAD - 1)
    with raised(2):  # AHEAD unread: the oldest is waited for
        pending.poll()
    assert oldest.waited


def test_the_error_names_the_label_and_the_call():
    def recheck() -> None:
        raise LossContractError("action_ids: expected ids in [0, 50), got 50")

    pending.defer(torch.tensor(0), recheck, "grpo_loss (triton)")  # a CPU flag is read at once: good
    with pytest.raises(LossContractError, match=r"^grpo_loss \(triton\) \(call #\d+, checked after it returned\): "
                                                r"action_ids: expected ids in \[0, 50\), got 50$"):
        pending.defer(torch.tensor(1), recheck, "grpo_loss (triton)")
    pending._enqueue(pending._Check(7, "ratio_kl (triton)", torch.tensor(True), Event(True), lambda: None), KEY)
    with pytest.raises(LossContractError, match=r"^ratio_kl \(triton\) \(call #7, checked after it returned\): the "
                                                r"kernels flagged a bad input value that the inputs do not show now"):
        raise_pending()


def test_a_key_that_is_no_group_handle_names_no_queue():
    pending.poll(([0, 1], None))  # a list passed as a group: the preflight reports it, not a TypeError here
