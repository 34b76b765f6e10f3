"""Preflight: prove that every rank runs the same contract before any float is exchanged.

Each rank runs its local checks, then `all_gather_object`s its contract fingerprint, backend id, numeric
fields, a digest of the inputs its TP siblings must share, and its errors: on the DP axis, then on the TP axis
(carrying what the DP axis reported), then on the DP axis again (carrying what the TP axis found), so an error
found anywhere, at any stage, reaches every rank of the TP x DP grid and every rank raises a
`LossContractError`. Nothing is gathered on an axis of size 1.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..contract import GRPOLossContract, LossContractError


def _axis_errors(contract: GRPOLossContract, axis: str, group: Any) -> list[str]:
    s = contract.sharding
    world, rank = getattr(s, f"{axis}_world_size"), getattr(s, f"{axis}_rank")
    if group is None:
        return [] if world == 1 else [f"{axis}_group: the contract has {axis}_world_size={world} but no "
                                      f"{axis}_group was passed"]
    if not dist.is_initialized():
        return [f"{axis}_group: a process group was passed but torch.distributed is not initialized"]
    actual_world, actual_rank = dist.get_world_size(group), dist.get_rank(group)
    if (actual_world, actual_rank) != (world, rank):
        return [f"{axis}_group: the contract says {axis}_world_size={world}, {axis}_rank={rank}, but the process "
                f"group passed has size {actual_world} and this process is its rank {actual_rank}"]
    return []


def replicated_digest(*tensors: torch.Tensor | None) -> str:
    """A digest of tensors that TP siblings must hold identically (mask, ids, old log-probs, rewards)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(str((tuple(t.shape), t.dtype)).encode())
            h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def _describe(mine: dict, theirs: dict, axis: str, their_rank: int, their_global: int) -> list[str]:
    who = f"{axis} rank {their_rank} (global rank {their_global})"
    out = []
    if theirs["backend"] != mine["backend"]:
        out.append(f"preflight: {who} runs backend {theirs['backend']!r}, this rank {mine['backend']!r}")
    if theirs["fingerprint"] != mine["fingerprint"]:
        fields = sorted(k for k in mine["fields"] if mine["fields"][k] != theirs["fields"].get(k))
        detail = ", ".join(f"{k}: {theirs['fields'].get(k)!r} there vs {mine['fields'][k]!r} here" for k in fields)
        out.append(f"preflight: contract mismatch on the {axis.upper()} axis: {who} differs in {detail}")
    if axis == "tp" and theirs["replicated"] != mine["replicated"]:
        out.append(f"preflight: {who} holds different completion_mask / action_ids / old_logps / rewards than its "
                   f"TP siblings; every rank of a TP group must pass the same ones")
    return out


def preflight(contract: GRPOLossContract, backend: str, local_checks: Callable[[], Any], tp_group: Any,
              dp_group: Any, replicated: Callable[[], str]) -> Any:
    """Runs `local_checks()` on this rank, then agrees with the DP and TP axes; raises on every rank on any error.

    Returns what `local_checks()` returned.
    """
    errors: list[str] = []
    result, digest = None, ""
    global_rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        result = local_checks()
        digest = replicated()
    except LossContractError as exc:
        errors.append(f"rank {global_rank}: {exc}")
    errors += [f"rank {global_rank}: {e}" for axis, group in (("dp", dp_group), ("tp", tp_group))
               for e in _axis_errors(contract, axis, group)]
    mine = {"backend": backend, "fingerprint": contract.fingerprint(), "fields": contract.numeric_fields(),
            "replicated": digest, "global_rank": global_rank}
    for axis, group in (("dp", dp_group), ("tp", tp_group), ("dp", dp_group)):
        # Gather over the group actually passed (even when its size is wrong) so that no member waits alone.
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            continue
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, {**mine, "errors": errors}, group=group)
        merged: list[str] = []
        for their_rank, theirs in enumerate(gathered):
            for e in theirs["errors"] + _describe(mine, theirs, axis, their_rank, theirs["global_rank"]):
                if e not in merged:
                    merged.append(e)
        errors = merged
    if errors:
        raise LossContractError("\n".join(errors))
    return result
