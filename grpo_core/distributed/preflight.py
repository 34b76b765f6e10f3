"""Preflight: prove that every rank makes the same structural choices before any float is exchanged.

Invariant: when every rank of the TP x DP grid passes a handle for each axis of size > 1, a call either passes
the preflight on every rank, or raises `LossContractError` on every rank, in that same call, and the next call's
collectives pair with the peers' next call (the world stays usable). Nothing is raised before the gathers: a
local failure of any kind (a `LossContractError` of the checks, or an `AttributeError`, `RuntimeError`, ... of
checking or describing the arguments) becomes this rank's error message and travels with the others.

What travels: each rank's payload (`all_gather_object`) carries every structural choice: backend id, contract
fingerprint and numeric fields, which groups were passed (None or their size; rank indices from the contract),
whether ref logits are present, dtype, device type and shape of every tensor argument (the dims an axis shards are
left out of that axis' comparison), the choices a rank makes alone (the kernel set, the gradients wanted), digests
of the inputs TP siblings must share (the hidden states' by `digest.row_digests`, on the device: a few bytes travel), this
rank's errors, and a call sequence number per axis. It is gathered on the DP axis, then on the TP axis (carrying
what the DP axis reported), then on the DP axis again (carrying what the TP axis found), so that whatever is found
anywhere reaches every rank of the grid. All three stages run whatever was found before, so every rank makes the
same collectives in every call. A message says which rank it comes from (`rank 3: ...`, or `ranks 1 and 3: ...` for
a disagreement between two ranks, worded the same from either side so that merging removes duplicates).

Sequence numbers. Each rank counts its calls per axis seat (axis, the contract's TP and DP sizes and this
rank's place in them), a call whose handle is missing included, and per group handle (the largest number seen
on it). A gather that pairs calls with different numbers raises on every rank involved; all of them then adopt
the largest number, so that the next call agrees again.

What cannot be guaranteed: a rank that passes `tp_group=None` (or `dp_group=None`) while the contract says that
axis has size > 1 cannot join that axis' gather, and neither can it tell its peers there: no collective
reaches them without that handle. It raises in that call (after the stages on its other axis, which carry its
error to the peers it can reach). Its peers on the missing axis block in that gather until:
- its next call on that seat with a handle: that call first replays the skipped gathers with the skipped
  call's payload (same sequence number, same errors), so the blocked peers finish their call and raise its
  error, every rank of the grid with them, and the calls pair again from then on; or
- the process group's timeout, if it never comes: then they raise a `LossContractError` naming the axis, and
  the group may be unusable after a gloo timeout.
The replay goes to the handle of the next call on the same seat; if that is not the group the skipped call
belonged to, the sequence numbers disagree and that call raises (loud, not silent). A rank that skips a call
altogether (never calls the loss at all) is invisible: its peers' call pairs with its next call. Errors
raised after the preflight (a device error in the compute) are not covered.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..checks import check_logprobs
from ..contract import GRPOLossContract, LossContractError

STAGES = ("dp", "tp", "dp")
_seat_calls: dict[tuple, int] = {}  # (axis, tp_world, dp_world, tp_rank, dp_rank) -> calls made on it
_group_calls: dict[Any, int] = {}  # group handle -> the largest sequence number gathered on it
_owed: dict[tuple, list[dict]] = {}  # seat -> payloads of calls that could not gather on it (missing handle)


def replicated_digest(**tensors: torch.Tensor | None) -> dict[str, str | None]:
    """Per argument, a digest of what TP siblings must hold identically (mask, ids, old log-probs, rewards, the
    `row_digests` of the hidden states); None for an argument not passed."""
    out: dict[str, str | None] = {}
    for name, t in tensors.items():
        if t is None:
            out[name] = None
            continue
        h = hashlib.sha256(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()[:32]
    return out


def _group_size(group: Any) -> int | None:
    """The size of a usable group handle, else None (None passed, no process group, not a group)."""
    if group is None or not dist.is_initialized():
        return None
    try:
        return dist.get_world_size(group)
    except Exception:
        return None


def _axis_errors(contract: GRPOLossContract, axis: str, group: Any) -> list[str]:
    s = contract.sharding
    world, rank = getattr(s, f"{axis}_world_size"), getattr(s, f"{axis}_rank")
    if group is None:
        return [] if world == 1 else [f"{axis}_group: the contract has {axis}_world_size={world} but no "
                                      f"{axis}_group was passed"]
    if not dist.is_initialized():
        return [f"{axis}_group: a process group was passed but torch.distributed is not initialized"]
    if _group_size(group) is None:
        return [f"{axis}_group: expected a process group, got {type(group).__name__}"]
    actual_world, actual_rank = dist.get_world_size(group), dist.get_rank(group)
    if (actual_world, actual_rank) != (world, rank):
        return [f"{axis}_group: the contract says {axis}_world_size={world}, {axis}_rank={rank}, but the process "
                f"group passed has size {actual_world} and this process is its rank {actual_rank}"]
    return []


def _describe_arg(value: Any) -> Any:
    """A tensor argument's structure: `[dtype, device type, shape]`, None, or the name of its wrong type."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [str(value.dtype).removeprefix("torch."), value.device.type, list(value.shape)]
    return type(value).__name__


def _masked(desc: Any, name: str, axis: str) -> Any:
    """`desc` without the dim that `axis` shards: dim 0 (sequences) over DP, the vocabulary over TP."""
    if not isinstance(desc, list):
        return desc
    shape = list(desc[2])
    if axis == "dp":
        dim = 0
    else:  # the vocabulary: the last dim of logits, the rows of an lm_head weight and its bias
        dim = len(shape) - 1 if name.endswith("logits") else 0 if name.endswith(("weight", "bias")) else None
    if dim is not None and shape:
        shape[dim] = "*"
    return [desc[0], desc[1], shape]


def _who(a: dict, b: dict, axis: str) -> str:
    """`ranks 1 and 3 (dp ranks 0 and 1)`, lowest global rank first: the same words from either side."""
    a, b = sorted((a, b), key=lambda p: p["global_rank"])
    ra, rb = a["axis_ranks"].get(axis), b["axis_ranks"].get(axis)
    return f"ranks {a['global_rank']} and {b['global_rank']} ({axis} ranks {ra} and {rb})"


def _compare(mine: dict, theirs: dict, axis: str) -> list[str]:
    """Every disagreement between two payloads on `axis`, worded symmetrically."""
    if theirs["global_rank"] == mine["global_rank"]:
        return []
    who = _who(mine, theirs, axis)
    lo, hi = sorted((mine, theirs), key=lambda p: p["global_rank"])
    out = []

    def differ(what: str, x: Any, y: Any) -> None:
        out.append(f"{who}: preflight: they disagree on {what}: {x!r} on rank {lo['global_rank']}, {y!r} on rank "
                   f"{hi['global_rank']}")

    if lo["axis"] != hi["axis"]:
        out.append(f"{who}: preflight: rank {lo['global_rank']} gathered on its {lo['axis'].upper()} group, rank "
                   f"{hi['global_rank']} on its {hi['axis'].upper()} group: a group handle was passed for the wrong "
                   f"axis")
    if None not in (mine["nonce"], theirs["nonce"]) and mine["nonce"] != theirs["nonce"]:
        out.append(f"{who}: preflight: sequence mismatch on the {axis.upper()} axis: rank {lo['global_rank']} is "
                   f"in its call #{lo['nonce']} on this axis, rank {hi['global_rank']} in its call "
                   f"#{hi['nonce']}; their collectives paired different calls (a rank passed {axis}_group=None or "
                   f"a different group, or skipped a call); both raise and resynchronize for the next call")
    if lo["backend"] != hi["backend"]:
        differ("the backend", lo["backend"], hi["backend"])
    if lo["fingerprint"] != hi["fingerprint"] and None not in (lo["fields"], hi["fields"]):
        keys = sorted(k for k in {**lo["fields"], **hi["fields"]} if lo["fields"].get(k) != hi["fields"].get(k))
        detail = "; ".join(f"{k}: {lo['fields'].get(k)!r} on rank {lo['global_rank']}, {hi['fields'].get(k)!r} on "
                           f"rank {hi['global_rank']}" for k in keys)  # an option at its default is not a field
        out.append(f"{who}: preflight: contract mismatch on the {axis.upper()} axis: {detail}")
    if None not in (lo["choices"], hi["choices"]):
        for name in sorted({**lo["choices"], **hi["choices"]}):
            if lo["choices"].get(name) != hi["choices"].get(name):
                differ(name, lo["choices"].get(name), hi["choices"].get(name))
    for name in lo["groups"]:
        if lo["groups"][name] != hi["groups"][name]:
            differ(f"{name} (None or the size of the group passed)", lo["groups"][name], hi["groups"][name])
    for name in lo["tensors"]:
        x, y = _masked(lo["tensors"][name], name, axis), _masked(hi["tensors"][name], name, axis)
        if x != y:
            differ(f"{name} ([dtype, device, shape] or type; '*': the dim the {axis.upper()} axis shards)", x, y)
    if axis == "tp" and None not in (lo["replicated"], hi["replicated"]):  # None: a rank's checks failed
        names = [k for k in lo["replicated"] if lo["replicated"][k] != hi["replicated"].get(k)]
        if names:
            out.append(f"{who}: preflight: they hold different {' / '.join(names)} (at active tokens); every rank of "
                       f"a TP group must pass the same ones")
    return out


def _gather(payload: dict, axis: str, group: Any, global_rank: int) -> list[dict]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, payload, group=group)
    except Exception as exc:  # a peer never came (timeout) or the group broke
        raise LossContractError(
            f"{_tag(global_rank)}preflight: the {axis.upper()} axis gather failed ({type(exc).__name__}: {exc}); "
            f"a peer on this axis passed {axis}_group=None or stopped calling the loss; this process group may "
            f"be unusable now") from exc
    return gathered


def _resync(seat: tuple | None, group: Any, gathered: list[dict]) -> None:
    """Every rank of a gather adopts the largest sequence number in it."""
    top = max((p["nonce"] for p in gathered if p["nonce"] is not None), default=0)
    _group_calls[group] = max(_group_calls.get(group, 0), top)
    if seat is not None:
        _seat_calls[seat] = max(_seat_calls.get(seat, 0), top)


def _merge(errors: list[str], more: list[str]) -> list[str]:
    return errors + [e for e in dict.fromkeys(more) if e not in errors]


def _tag(global_rank: int) -> str:
    """`rank 3: `, the prefix of this rank's own messages; none in a single process (the message is then the
    very one a single-process backend raises)."""
    return f"rank {global_rank}: " if dist.is_initialized() and dist.get_world_size() > 1 else ""


def _local(fn: Callable[[], Any], global_rank: int, errors: list[str]) -> Any:
    """Runs `fn`; any exception becomes this rank's error message instead of escaping the preflight."""
    try:
        return fn()
    except LossContractError as exc:
        errors.append(f"{_tag(global_rank)}{exc}")
    except Exception as exc:
        errors.append(f"{_tag(global_rank)}{type(exc).__name__} while checking the inputs: {exc}")
    return None


def preflight(contract: Any, backend: str, tensors: dict[str, Any], local_checks: Callable[[], Any],
              replicated: Callable[[], dict[str, str | None]], tp_group: Any, dp_group: Any,
              choices: Callable[[], dict[str, Any]] = dict) -> Any:
    """Runs `local_checks()` on this rank, then agrees with the DP and TP axes; raises on every rank on any error.

    `tensors`: every tensor argument by name (dim 0 holds the sequences; the last dim of `*_logits` the local
    vocabulary). `replicated()`: the digests of what TP siblings must share (`replicated_digest`). `choices()`:
    the structural choices this rank made once its checks passed (the kernel set, the gradients wanted), which
    every rank of the grid must share. Returns what `local_checks()` returned."""
    global_rank = dist.get_rank() if dist.is_initialized() else 0
    groups = {"dp": dp_group, "tp": tp_group}
    errors: list[str] = []
    valid = isinstance(contract, GRPOLossContract)
    if not valid:
        errors.append(f"{_tag(global_rank)}contract: expected a GRPOLossContract, got {type(contract).__name__}")
    else:
        for axis in ("dp", "tp"):
            found = _local(lambda: _axis_errors(contract, axis, groups[axis]), global_rank, errors) or []
            errors += [f"{_tag(global_rank)}{e}" for e in found]
    result, digest, chosen, before = None, None, None, len(errors)
    if valid:
        result = _local(local_checks, global_rank, errors)
        if len(errors) == before:  # the digest reads the tensors the checks have just accepted
            digest = _local(replicated, global_rank, errors)
            chosen = _local(choices, global_rank, errors)

    s = contract.sharding if valid else None
    axis_ranks = {a: getattr(s, f"{a}_rank") for a in ("dp", "tp")} if valid else {}
    sizes = {a: _group_size(groups[a]) for a in ("dp", "tp")}
    seats, nonces = {}, {}
    for axis in ("dp", "tp"):
        world = getattr(s, f"{axis}_world_size") if valid else 1
        if valid and (world > 1 or (sizes[axis] or 1) > 1):
            seats[axis] = (axis, s.tp_world_size, s.dp_world_size, s.tp_rank, s.dp_rank)
            if (sizes[axis] or 1) > 1:
                _settle(seats[axis], axis, groups[axis], global_rank, errors)
            nonces[axis] = max(_seat_calls.get(seats[axis], 0),
                               _group_calls.get(groups[axis], 0) if sizes[axis] is not None else 0) + 1
            _seat_calls[seats[axis]] = nonces[axis]
    if not seats and all((sizes[a] or 1) == 1 for a in STAGES):  # a single process: nothing to gather or owe
        if errors:
            raise LossContractError("\n".join(errors))
        return result
    mine = {"global_rank": global_rank, "axis_ranks": axis_ranks, "backend": backend,
            "fingerprint": contract.fingerprint() if valid else None,
            "fields": contract.numeric_fields() if valid else None,
            "groups": {f"{a}_group": None if groups[a] is None else sizes[a] or type(groups[a]).__name__
                       for a in ("tp", "dp")},
            "tensors": {name: _describe_arg(t) for name, t in tensors.items()}, "replicated": digest,
            "choices": chosen}
    skipped = set()
    for axis in STAGES:
        group = groups[axis]
        if (sizes[axis] or 1) == 1:
            if axis in seats and getattr(s, f"{axis}_world_size") > 1:
                skipped.add(axis)  # no usable handle: the peers on this axis wait for the replay
            continue
        payload = {**mine, "axis": axis, "nonce": nonces.get(axis), "errors": errors}
        gathered = _gather(payload, axis, group, global_rank)
        _resync(seats.get(axis), group, gathered)
        found = [e for theirs in gathered for e in theirs["errors"] + _compare(payload, theirs, axis)]
        errors = _merge(errors, found)
    for axis in sorted(skipped):
        _owed.setdefault(seats[axis], []).append({**mine, "axis": axis, "nonce": nonces[axis], "errors": errors})
    if errors:
        raise LossContractError("\n".join(errors))
    return result


def _settle(seat: tuple, axis: str, group: Any, global_rank: int, errors: list[str]) -> None:
    """Replays, on the handle now passed, the gathers of earlier calls on `seat` that had none (see the module
    docstring); their peers are waiting in those gathers. A sequence mismatch found here fails this call too."""
    for payload in _owed.pop(seat, []):
        for _ in range(STAGES.count(axis)):  # the skipped call's gathers on this axis, in their order
            gathered = _gather(payload, axis, group, global_rank)
            _resync(seat, group, gathered)
            errors[:] = _merge(errors, [e for theirs in gathered for e in _compare(payload, theirs, axis)
                                        if "sequence mismatch" in e])


def check_logprobs_everywhere(logp: torch.Tensor, logp_ref: torch.Tensor | None, mask: torch.Tensor,
                              gather: Callable[[torch.Tensor], torch.Tensor],
                              names: tuple[str, str] = ("policy_logits", "ref_logits")) -> None:
    """`checks.check_logprobs` over the global batch, on every rank: call it on every rank together once the
    gathered flags say a log-prob is non-finite. `gather` concatenates every DP rank's `[n_local, ...]` rows
    (exact copies), so every rank raises the very message a single process gives, with global `(b, t)`."""
    ref = logp_ref if logp_ref is not None else torch.zeros_like(logp)
    full = gather(torch.stack([logp, ref, mask.to(logp.dtype)], -1))
    check_logprobs(full[..., 0], full[..., 1] if logp_ref is not None else None, full[..., 2] != 0, names)
    raise LossContractError(f"{' / '.join(names)}: expected finite log-probabilities at active tokens, got "
                            f"non-finite ones flagged by a rank")  # unreachable when the flags and values agree
