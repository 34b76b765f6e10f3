"""Fault injection (issue 12): every structural mismatch and every local failure, injected on each rank position
of 2- and 4-rank gloo worlds, raises `LossContractError` on every rank within seconds, each rank's message names
the faulty rank, and a correct call right after gives the single-rank bits on every rank (the world stays
usable). One world per world size runs every fault in turn; the test prints its figures (faults injected,
raised on all ranks, world usable after, slowest raise)."""

from __future__ import annotations

import re
import time

import pytest
import torch

from conftest import HAS_CUDA, attempt
from grpo_core import LossContractError, kernel_registry
from grpo_core.distributed import DistributedGRPOLossOp
from harness.topology import Layout, run_world
from test_distributed_grpo_loss import OP, case_inputs, compare, contract_for, run_local

pytestmark = pytest.mark.distributed

CASE = dict(V=300, grouping="uniform", normalizer="global_active_tokens", constant=None, beta=0.04, seed=12)
LAYOUTS = {2: [Layout(2, 1), Layout(1, 2)], 4: [Layout(2, 2)]}
RAISE_BOUND_S = 10.0  # generous: a preflight error takes milliseconds here
WORLD_TIMEOUT_S = 300.0


def _everyone(**over):
    """Overrides for every rank of the fault's call (the faulty rank then deviates from them)."""
    return over


def _set(**values):
    def inject(a: dict, lay: Layout) -> None:
        a.update(values)
    return inject


def _map(key: str, fn):
    def inject(a: dict, lay: Layout) -> None:
        a[key] = fn(a[key])
    return inject


def _contract(**over):
    def inject(a: dict, lay: Layout) -> None:
        a["contract"] = contract_for(CASE, lay, a["contract"].sharding.tp_rank, a["contract"].sharding.dp_rank,
                                     **over)
    return inject


def _nan_old(a: dict, lay: Layout) -> None:
    a["old"] = a["old"].clone()
    a["old"][0, 0] = float("nan")  # token (lo, 0) is active in every shard


def _flip_mask(a: dict, lay: Layout) -> None:
    a["mask"] = a["mask"].clone()
    a["mask"][0, -1] = ~a["mask"][0, -1]


def _nan_logit(a: dict, lay: Layout) -> None:
    a["policy"] = a["policy"].clone()
    a["policy"][0, 0, 0] = float("nan")


def _negative_weight(a: dict, lay: Layout) -> None:
    a["is_ratio"] = torch.ones_like(a["old"])
    a["is_ratio"][0, 0] = -1.0  # token (lo, 0) is active in every shard


def _lose_a_call(a: dict, lay: Layout) -> None:
    """As if this rank's count of calls had lost one (no public path leads there: the sequence numbers are
    the last line of defence, and this proves they hold: every rank involved raises, then they agree again)."""
    from grpo_core.distributed import preflight
    s = a["contract"].sharding
    for axis in ("tp", "dp"):
        seat = (axis, s.tp_world_size, s.dp_world_size, s.tp_rank, s.dp_rank)
        if seat in preflight._seat_calls:
            preflight._seat_calls[seat] += 1


def _to_cuda(a: dict, lay: Layout) -> None:
    for k in ("policy", "ref", "ids", "old", "rewards", "mask"):
        a[k] = a[k].cuda()


# name, applies to the layout, overrides for every rank, what the faulty rank does, a needle of every message
FAULTS = [
    ("tp_group=None", lambda lay: lay.tp > 1, {}, _set(tp_group=None), "no tp_group was passed"),
    ("dp_group=None", lambda lay: lay.dp > 1, {}, _set(dp_group=None), "no dp_group was passed"),
    ("ref only on one rank (beta=0)", lambda lay: True, _everyone(beta=0.0, ref=None),
     lambda a, lay: a.update(ref=a["ref_full"]), "ref_local_logits"),
    ("ref missing on one rank (beta=0)", lambda lay: True, _everyone(beta=0.0), _set(ref=None), "ref_local_logits"),
    ("bfloat16 policy", lambda lay: True, {}, _map("policy", lambda t: t.bfloat16()), "policy_local_logits"),
    ("float64 old_logps", lambda lay: True, {}, _map("old", lambda t: t.double()), "old_logps"),
    ("cuda tensors", lambda lay: torch.cuda.is_available(), {}, _to_cuda, "'cuda'"),
    ("vocab shard one column short", lambda lay: True, {},
     lambda a, lay: a.update(policy=a["policy"][..., :-1], ref=a["ref"][..., :-1]), "policy_local_logits"),
    ("contract beta", lambda lay: True, {}, _contract(beta=0.05), "beta"),
    ("contract groups", lambda lay: True, {}, _contract(samples_per_prompt=None, group_boundaries=(0, 3, 8)),
     "group_boundaries"),
    ("contract=None", lambda lay: True, {}, _set(contract=None), "contract: expected a GRPOLossContract, got NoneType"),
    ("ref_logits as a list", lambda lay: True, {}, _map("ref", lambda t: t.tolist()),
     "ref_logits: expected a torch.Tensor or None, got list"),
    ("numpy rewards", lambda lay: True, {}, _map("rewards", lambda t: t.numpy()),
     "rewards: expected a torch.Tensor, got numpy.ndarray"),
    ("meta policy", lambda lay: True, {}, _map("policy", lambda t: t.to("meta")),
     "policy_logits: expected a tensor with data"),
    ("meta rewards", lambda lay: True, {}, _map("rewards", lambda t: t.to("meta")),
     "rewards: expected a tensor with data"),
    ("rewards=None", lambda lay: True, {}, _set(rewards=None), "rewards: expected a torch.Tensor, got None"),
    ("raising local check", lambda lay: True, {}, _set(explode=True),
     "RuntimeError while checking the inputs: injected"),
    ("old_logps NaN at an active token", lambda lay: True, {}, _nan_old,
     "old_logps: expected finite values at active tokens"),
    ("importance weights on one rank only", lambda lay: True, {},
     lambda a, lay: a.update(is_ratio=torch.ones_like(a["old"])), "importance_sampling_ratio"),
    ("importance weight -1 at an active token", lambda lay: True, {}, _negative_weight,
     "importance_sampling_ratio: expected finite values >= 0 at active tokens"),
    ("TP siblings hold different importance weights", lambda lay: lay.tp > 1, _everyone(is_ratio="ones"),
     lambda a, lay: a.update(is_ratio=torch.full_like(a["old"], 2.0)), "importance_sampling_ratio (at active tokens)"),
    ("TP siblings hold different masks", lambda lay: lay.tp > 1, {}, _flip_mask, "completion_mask"),
    ("call numbers out of step", lambda lay: True, {}, _lose_a_call, "sequence mismatch"),
    ("check_values='later'", lambda lay: True, {}, _set(check_values="later"),
     "check_values: expected 'deferred' or 'sync', got 'later'"),
    ("another check_values", lambda lay: True, {}, _set(check_values="sync"), "they disagree on check_values: "),
    ("another kernel set", lambda lay: True, {}, _set(op=DistributedGRPOLossOp("triton")),
     "they disagree on kernels: " if not HAS_CUDA else "kernels: 'triton' needs CUDA tensors"),
    ("NaN policy logit at an active token", lambda lay: True, {}, _nan_logit, None),  # after the preflight
]


def _args(inp: dict, lay: Layout, p, beta: float, ref: bool = True) -> dict:
    c = contract_for(CASE, lay, p.tp_rank, p.dp_rank, beta=beta)
    (lo, hi), (vlo, vhi) = c.sharding.sequence_bounds, c.sharding.vocab_bounds
    ref_local = inp["ref_logits"][lo:hi, :, vlo:vhi]
    return dict(contract=c, policy=inp["policy_logits"][lo:hi, :, vlo:vhi], ref_full=ref_local,
                ref=ref_local if ref else None, ids=inp["action_ids"][lo:hi], old=inp["old_logps"][lo:hi],
                rewards=inp["rewards"][lo:hi], mask=inp["completion_mask"][lo:hi], tp_group=p.tp_group,
                dp_group=p.dp_group, explode=False, is_ratio=None, op=OP, check_values="deferred")


def _call(a: dict) -> None:
    import grpo_core.distributed.grpo_loss as module
    original = module.check_inputs
    if a["explode"]:
        def explode(*args, **kwargs):
            raise RuntimeError("injected")
        module.check_inputs = explode
    try:
        a["op"].apply(a["policy"], a["ids"], a["old"], a["rewards"], contract=a["contract"], completion_mask=a["mask"],
                 ref_local_logits=a["ref"], tp_group=a["tp_group"], dp_group=a["dp_group"],
                 importance_sampling_ratio=a["is_ratio"], check_values=a["check_values"])
    finally:
        module.check_inputs = original


def _native_message(inp: dict, lay: Layout, faulty: int) -> str:
    """What the native op raises for the NaN logit of `_nan_logit` placed in the faulty rank's shard."""
    dp_rank, tp_rank = divmod(faulty, lay.tp)
    c = contract_for(CASE, lay, tp_rank, dp_rank)
    (lo, _), (vlo, _) = c.sharding.sequence_bounds, c.sharding.vocab_bounds
    policy = inp["policy_logits"].clone()
    policy[lo, 0, vlo] = float("nan")
    try:
        kernel_registry.get_op("grpo_loss", backend="native")(**{**inp, "policy_logits": policy}, beta=CASE["beta"],
                                                               samples_per_prompt=4)
    except LossContractError as exc:
        return str(exc)
    return "NO ERROR from native"


def fault_suite(ctx) -> list[dict]:
    """Runs on every rank: for each layout, fault and faulty rank, the faulty call then a correct one."""
    inp = case_inputs(CASE)
    records = []
    for lay in LAYOUTS[ctx.world_size]:
        p = ctx.place(lay)
        want = run_local(inp, contract_for(CASE, Layout(1, 1)), ctx.device)
        for name, applies, everyone, inject, needle in FAULTS:
            if not applies(lay):
                continue
            for faulty in range(lay.world):
                a = _args(inp, lay, p, everyone.get("beta", CASE["beta"]), ref="ref" not in everyone)
                if everyone.get("is_ratio") == "ones":
                    a["is_ratio"] = torch.ones_like(a["old"])
                if ctx.rank == faulty:
                    inject(a, lay)
                error, other, seconds = attempt(_call, a)
                c = contract_for(CASE, lay, p.tp_rank, p.dp_rank)
                try:
                    mismatches = compare(run_local(inp, c, ctx.device, p.tp_group, p.dp_group), want, c,
                                         f"after {name} on rank {faulty}")
                except Exception as exc:
                    mismatches = [f"the correct call raised {type(exc).__name__}: {exc}"]
                records.append(dict(layout=lay.name, fault=name, faulty=faulty, rank=ctx.rank, error=error,
                                    other=other, seconds=seconds, mismatches=mismatches,
                                    needle=needle if needle is not None else _native_message(inp, lay, faulty),
                                    exact=needle is None))
    return records


def _check(record: dict) -> list[str]:
    """What is wrong with one rank's outcome of one fault (empty: as promised)."""
    where = f"{record['layout']} {record['fault']!r} on rank {record['faulty']}, seen by rank {record['rank']}"
    msg = record["error"]
    if msg is None:
        return [f"{where}: no LossContractError ({record['other'] or 'no error at all'})"]
    bad = []
    if record["exact"]:  # raised after the preflight: the native op's very words, on every rank
        if msg != record["needle"]:
            bad.append(f"{where}: {msg!r} is not the native message {record['needle']!r}")
        return bad
    if record["needle"] not in msg:
        bad.append(f"{where}: {record['needle']!r} not in {msg!r}")
    sources = [_source(line) for line in msg.splitlines()]
    if not any(record["faulty"] in ranks for ranks in sources):
        bad.append(f"{where}: no line of the message comes from rank {record['faulty']}: {msg!r}")
    for line, ranks in zip(msg.splitlines(), sources):
        if not ranks or " here" in line or "this rank" in line:
            bad.append(f"{where}: a line that does not say which rank it comes from: {line!r}")
    return bad


def _source(line: str) -> tuple[int, ...]:
    """The global ranks a message line says it comes from: `rank 3: ...` or `ranks 1 and 3 (...): ...`."""
    m = re.match(r"rank (\d+): |ranks (\d+) and (\d+) \(", line)
    return tuple(int(g) for g in m.groups() if g is not None) if m else ()


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_fault_raises_on_every_rank_and_the_world_stays_usable(world_size):
    start = time.monotonic()
    per_rank = run_world(fault_suite, world_size, timeout_s=WORLD_TIMEOUT_S)
    elapsed = time.monotonic() - start
    records = [r for rank_records in per_rank for r in rank_records]
    faults = sorted({(r["layout"], r["fault"], r["faulty"]) for r in records})
    by_fault = {f: [r for r in records if (r["layout"], r["fault"], r["faulty"]) == f] for f in faults}
    raised_all = [f for f, rs in by_fault.items() if all(not _check(r) for r in rs)]
    usable = [f for f, rs in by_fault.items() if all(not r["mismatches"] for r in rs)]
    slowest = max(records, key=lambda r: r["seconds"])
    print(f"\nworld of {world_size} ({', '.join(lay.name for lay in LAYOUTS[world_size])}): {len(faults)} faults "
          f"injected ({len({f[1] for f in faults})} kinds x every rank position), {len(raised_all)} raised "
          f"LossContractError on every rank, {len(usable)} left the world usable (the next correct call gave the "
          f"single-rank bits on every rank); slowest raise {slowest['seconds']:.3f} s ({slowest['fault']!r} on "
          f"rank {slowest['faulty']}, seen by rank {slowest['rank']}); world {elapsed:.1f} s")
    assert len(faults) >= 15 * world_size
    problems = [p for r in records for p in _check(r)]
    assert not problems, "\n".join(problems[:20])
    broken = [m for r in records for m in r["mismatches"]]
    assert not broken, "\n".join(broken[:20])
    assert slowest["seconds"] < RAISE_BOUND_S, slowest
    assert len(raised_all) == len(usable) == len(faults)
