"""The fused linear loss's structural faults in 2-rank gloo worlds (TP = 2 and DP = 2), each on either rank: a rank
that wants no gradient, hidden states that differ between TP peers, another kernel set, an option set on one rank
only, a weight shard of the wrong size. Each raises `LossContractError` on every rank within seconds, names what
differs (both values), and a correct call right after gives the single-rank bits (the world stays usable)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from conftest import HAS_CUDA, attempt, bits
from grpo_core import GRPOLossContract, ShardingSpec
from grpo_core.linear import LinearGRPOLossOp
from harness.topology import Layout, run_world
from test_linear import make

pytestmark = pytest.mark.distributed

B, T, H, V = 4, 4, 16, 64
LAYOUTS = [Layout(2, 1), Layout(1, 2)]
RAISE_BOUND_S = 10.0
FIELDS = ("loss", "per_sequence_policy", "per_sequence_kl", "advantages", "per_sequence_active_tokens")


def _contract(lay: Layout, tp_rank: int, dp_rank: int, **over) -> GRPOLossContract:
    s = ShardingSpec.uniform(vocab_size=V, num_sequences=B, tp_world_size=lay.tp, dp_world_size=lay.dp,
                             tp_rank=tp_rank, dp_rank=dp_rank, vocab_tile=16)
    return GRPOLossContract(num_sequences=B, padded_seq_len=T, vocab_size=V, beta=0.04, samples_per_prompt=2,
                            vocab_tile=16, sharding=s, determinism_scope="topology_invariant", **over)


def _args(inp: dict, lay: Layout, place, **over) -> dict:
    tp_rank, dp_rank = (place.tp_rank, place.dp_rank) if place is not None else (0, 0)
    c = _contract(lay, tp_rank, dp_rank, **over)
    (lo, hi), (vlo, vhi) = c.sharding.sequence_bounds, c.sharding.vocab_bounds
    return dict(kernels="torch", contract=c, hidden=inp["hidden"][lo:hi], weight=inp["weight"][vlo:vhi],
                bias=inp["bias"][vlo:vhi], ids=inp["action_ids"][lo:hi], old=inp["old_logps"][lo:hi],
                rewards=inp["rewards"][lo:hi], mask=inp["completion_mask"][lo:hi], ref_hidden=inp["ref_hidden"][lo:hi],
                grad_mode=True, hidden_grad=True, tp_group=None if place is None else place.tp_group,
                dp_group=None if place is None else place.dp_group)


def _call(a: dict) -> dict:
    """One call, its backward when it has one: the fields and the hidden gradient."""
    h = a["hidden"].detach().clone().requires_grad_(a["hidden_grad"])
    w, b = (t.detach().clone().requires_grad_(True) for t in (a["weight"], a["bias"]))
    with contextlib.nullcontext() if a["grad_mode"] else torch.no_grad():
        res = LinearGRPOLossOp(a["kernels"]).apply(
            h, w, a["ids"], a["old"], a["rewards"], contract=a["contract"], completion_mask=a["mask"], bias=b,
            ref_hidden=a["ref_hidden"], tp_group=a["tp_group"], dp_group=a["dp_group"])
    if res.loss.requires_grad:
        res.loss.backward()
    return dict(fields={f: getattr(res, f).detach() for f in FIELDS}, dh=None if h.grad is None else h.grad)


def _nudge(key: str, t: int):
    """One ULP up at element 0 of token (0, t) of `key`."""
    def inject(a: dict) -> None:
        x = a[key].clone()
        x[0, t, 0] = torch.nextafter(x[0, t, 0], torch.tensor(float("inf")))
        a[key] = x
    return inject


def _delta(a: dict) -> None:
    s = a["contract"].sharding
    a["contract"] = _contract(Layout(s.tp_world_size, s.dp_world_size), s.tp_rank, s.dp_rank, delta=1.5)


_DELTA = r"contract mismatch on the (TP|DP) axis: delta: (None|'0x1\.8000000000000p\+0') on rank 0, " \
         r"(None|'0x1\.8000000000000p\+0') on rank 1"
# name, applies to the layout, contract options of every rank, what the faulty rank does, a regex every message holds
# (a '!' prefix: one no message may hold)
FAULTS = [
    ("hidden without requires_grad", lambda lay: True, {}, lambda a: a.update(hidden_grad=False),
     [r"they disagree on gradients \(requires_grad under grad mode\): '(hidden / )?weight / bias' on rank 0, "
      r"'(hidden / )?weight / bias' on rank 1"]),
    ("torch.no_grad()", lambda lay: True, {}, lambda a: a.update(grad_mode=False),
     [r"they disagree on gradients \(requires_grad under grad mode\): '(none|hidden / weight / bias)' on rank 0"]),
    ("hidden without requires_grad, sequence level", lambda lay: True, dict(importance_sampling_level="sequence"),
     lambda a: a.update(hidden_grad=False), [r"they disagree on gradients"]),
    ("another kernel set", lambda lay: True, {}, lambda a: a.update(kernels="triton"),
     [r"they disagree on kernels: '(torch|triton)' on rank 0, '(torch|triton)' on rank 1" if not HAS_CUDA else
      r"kernels: 'triton' needs CUDA tensors"]),  # a GPU machine: the Triton rank's own check refuses CPU tensors
    ("delta on one rank only", lambda lay: True, {}, _delta, [_DELTA]),
    ("TP peers hold different hidden states", lambda lay: lay.tp > 1, {}, _nudge("hidden", 0),
     [r"preflight: they hold different hidden \(at active tokens\)"]),
    ("TP peers hold different reference hidden states", lambda lay: lay.tp > 1, {}, _nudge("ref_hidden", 0),
     [r"preflight: they hold different ref_hidden \(at active tokens\)"]),
    ("a weight shard one row short", lambda lay: lay.tp > 1, {}, lambda a: a.update(weight=a["weight"][:-1]),
     [r"weight: expected 32 rows .* got \[31, 16\]", "!hold different"]),
]


def suite(ctx) -> list[dict]:
    inp = make(B=B, T=T, H=H, V=V, seed=11, device="cpu")
    masked = (~inp["completion_mask"]).nonzero()[0].tolist()  # a masked token, for the check below
    want = _call(_args(inp, Layout(1, 1), None))
    records = []
    for lay in LAYOUTS:
        place = ctx.place(lay)

        def usable(a: dict) -> list[str]:
            got = _call(a)
            lo, hi = a["contract"].sharding.sequence_bounds
            bad = [f for f in FIELDS if not torch.equal(bits(got["fields"][f]), bits(want["fields"][f]))]
            return bad + ([] if torch.equal(bits(got["dh"]), bits(want["dh"][lo:hi])) else ["d hidden"])

        for name, applies, everyone, inject, needles in FAULTS:
            if not applies(lay):
                continue
            for faulty in range(lay.world):
                a = _args(inp, lay, place, **everyone)
                if ctx.rank == faulty:
                    inject(a)
                error, other, seconds = attempt(_call, a)
                records.append(dict(layout=lay.name, fault=name, faulty=faulty, rank=ctx.rank, error=error, other=other,
                                    seconds=seconds, needles=needles,
                                    after=usable(_args(inp, lay, place))))
        if lay.tp > 1:  # hidden states that differ at a masked token only: no error, the single-rank bits
            a = _args(inp, lay, place)
            if ctx.rank == 1:
                b, t = masked
                a["hidden"] = a["hidden"].clone()
                a["hidden"][b, t] += 1.0
            records.append(dict(layout=lay.name, fault="masked token differs (not a fault)", faulty=1, rank=ctx.rank,
                                error=None, other=None, seconds=0.0, needles=None, after=usable(a)))
    return records


def _problems(r: dict) -> list[str]:
    where = f"{r['layout']} {r['fault']!r} on rank {r['faulty']}, seen by rank {r['rank']}"
    out = [f"{where}: the next correct call differs from the single-rank bits in {r['after']}"] if r["after"] else []
    if r["needles"] is None:
        return out
    if r["error"] is None:
        return out + [f"{where}: no LossContractError ({r['other'] or 'no error at all'})"]
    for needle in r["needles"]:
        found = re.search(needle.removeprefix("!"), r["error"]) is not None
        if found == needle.startswith("!"):
            out.append(f"{where}: {needle!r} {'in' if found else 'not in'} {r['error']!r}")
    if r["seconds"] > RAISE_BOUND_S:
        out.append(f"{where}: raised after {r['seconds']:.1f} s")
    return out


def test_every_linear_fault_raises_on_every_rank_and_the_world_stays_usable():
    records = [r for rank in run_world(suite, 2, timeout_s=120) for r in rank]
    assert len({(r["layout"], r["fault"], r["faulty"]) for r in records}) == 2 * (5 + 5 + 3) + 1
    problems = [p for r in records for p in _problems(r)]
    assert not problems, "\n".join(problems)
