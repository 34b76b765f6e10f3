"""Runs scenarios on layouts inside a world and records every number as a long Parquet table.

One row per (scenario, topology, field, index): the value, its exact bit pattern (`bits`, the integer view),
and for the gradient a per-sequence SHA-256 digest of its bytes in global vocab order. File metadata carries
the provenance: versions, device, git commit, pinned numerics. A table is checked when it is read (schema, unique
keys, known fields, `value` against `bits`, digests): a damaged file raises `TableError` naming the check, never
a library traceback.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F

from grpo_core.contract import MATH_VERSION
from grpo_core import raise_pending

from .cli import UsageError
from .scenarios import SCENARIOS, Scenario
from .topology import Layout, RankContext

SCALARS = ("loss", "policy_loss", "kl")
VECTORS = ("per_sequence_policy", "per_sequence_kl", "advantages", "per_sequence_active_tokens")
OPTIONAL = ("per_sequence_entropy",)  # recorded where the scenario's contract computes it
FIELDS = SCALARS + VECTORS + OPTIONAL + ("grad_digest",)
SCHEMA = pa.schema([("scenario", pa.string()), ("topology", pa.string()), ("field", pa.string()),
                    ("index", pa.int64()), ("value", pa.float64()), ("bits", pa.int64()), ("digest", pa.string()),
                    ("fingerprint", pa.string())])
COLUMNS = SCHEMA.names
KEY = ["scenario", "topology", "field", "index"]


class TableError(Exception):
    """A recorded table or golden set that fails a check; `check` names it (`schema`, `value vs bits`, ...)."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check


def bit_pattern(t: torch.Tensor) -> list[int]:
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.float32:
        return t.view(torch.int32).long().tolist()
    return t.long().tolist()


def _gather_grad_digests(grad: torch.Tensor, contract, tp_group, dp_group) -> list[str]:
    """Per-sequence SHA-256 of the full gradient row block `[T, V]` in global vocab order (exact gathers only)."""
    bounds = contract.sharding.vocab_shard_bounds
    if len(bounds) > 1 and tp_group is not None:  # None: a gradient every TP rank holds whole
        widths = [hi - lo for lo, hi in bounds]
        padded = F.pad(grad, (0, max(widths) - grad.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in widths]
        dist.all_gather(parts, padded, group=tp_group)
        grad = torch.cat([p[..., :w] for p, w in zip(parts, widths)], -1)
    raw = grad.detach().cpu().contiguous()
    mine = [hashlib.sha256(raw[b].view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]
            for b in range(raw.shape[0])]
    if len(contract.sharding.sequence_shard_bounds) == 1:
        return mine
    gathered: list[Any] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(gathered, mine, group=dp_group)
    return [d for part in gathered for d in part]


def run_case(scn: Scenario, inputs: dict, layout: Layout, tp_rank: int, dp_rank: int, tp_group, dp_group,
             device: torch.device, op) -> list[dict]:
    """Runs one scenario on one layout (this rank's part) and returns its rows. The gradient digested is that of
    the logits, or for a linear scenario that of the hidden states (`[T, hidden]` per sequence, the same on every
    TP rank)."""
    c = scn.contract(layout.tp, layout.dp, tp_rank, dp_rank)
    (lo, hi), (vlo, vhi) = c.sharding.sequence_bounds, c.sharding.vocab_bounds

    def mine(name: str, vocab: bool = False) -> torch.Tensor | None:
        t = inputs[name]
        return None if t is None else (t[vlo:vhi] if vocab else t[lo:hi]).to(device)

    common = dict(contract=c, completion_mask=mine("completion_mask"), tp_group=tp_group, dp_group=dp_group)
    if scn.linear:
        x = mine("hidden").requires_grad_(True)
        res = op.apply(x, mine("weight", True), mine("action_ids"), mine("old_logps"), mine("rewards"),
                       bias=mine("bias", True), ref_hidden=mine("ref_hidden"), ref_logps=mine("ref_logps"),
                       importance_sampling_ratio=mine("importance_sampling_ratio"),
                       sampling_logps=mine("sampling_logps"), **common)
    else:
        x = inputs["policy_logits"][lo:hi, :, vlo:vhi].to(device).clone().requires_grad_(True)
        ref = inputs["ref_logits"]
        res = op.apply(x, mine("action_ids"), mine("old_logps"), mine("rewards"),
                       ref_local_logits=None if ref is None else ref[lo:hi, :, vlo:vhi].to(device),
                       ref_logps=mine("ref_logps"), importance_sampling_ratio=mine("importance_sampling_ratio"),
                       sampling_logps=mine("sampling_logps"), **common)
    res.loss.backward()
    digests = _gather_grad_digests(x.grad, c, None if scn.linear else tp_group, dp_group)
    rows, fp, topo = [], c.fingerprint(), layout.name
    for f in SCALARS:
        t = getattr(res, f)
        rows.append(dict(scenario=scn.name, topology=topo, field=f, index=-1, value=t.item(),
                         bits=bit_pattern(t)[0], digest=None, fingerprint=fp))
    for f in VECTORS + tuple(f for f in OPTIONAL if getattr(res, f) is not None):
        t = getattr(res, f)
        for i, (v, b) in enumerate(zip(t.tolist(), bit_pattern(t))):
            rows.append(dict(scenario=scn.name, topology=topo, field=f, index=i, value=float(v), bits=b, digest=None,
                             fingerprint=fp))
    for i, d in enumerate(digests):
        rows.append(dict(scenario=scn.name, topology=topo, field="grad_digest", index=i, value=None, bits=None,
                         digest=d, fingerprint=fp))
    return rows


def world_run(ctx: RankContext, scenario_names: list[str], layout_names: list[str], plant_drift: str | None,
              kernels: str, progress: bool) -> dict | None:
    """Every scenario on every layout inside one world, with the deterministic path's `kernels`; rank 0 returns
    the rows, the guards and the provenance. Deferred value checks are read before returning."""
    lays = [Layout.parse(n) for n in layout_names]
    steps, done, rows, guards = len(scenario_names) * len(lays), 0, [], {}
    for name in scenario_names:
        scn = SCENARIOS[name]
        inputs = scn.inputs()
        for lay in lays:
            place = ctx.place(lay)
            if place is not None:
                op = scn.op(kernels, planted=lay.name == plant_drift)
                got = run_case(scn, inputs, lay, place.tp_rank, place.dp_rank, place.tp_group, place.dp_group,
                               ctx.device, op)
                if ctx.rank == 0:
                    rows += got
            done += 1
            if progress and ctx.rank == 0 and (sys.stderr.isatty() or lay == lays[-1]):
                bar = "#" * (30 * done // steps)
                end = "" if sys.stderr.isatty() else "\n"
                print(f"\r[{bar:<30}] {done}/{steps} {name:<28} {lay.name:<10}", end=end, file=sys.stderr,
                      flush=True)
        if ctx.rank == 0:
            guards[name] = _guard(scn, inputs, ctx.device, kernels)
    if progress and ctx.rank == 0 and sys.stderr.isatty():
        print(file=sys.stderr)
    raise_pending()  # a value check the Triton kernels deferred must not outlive the run
    if ctx.rank != 0:
        return None
    return {"rows": rows, "guards": guards, "provenance": {**provenance(ctx), "kernels": kernels}}


def _guard(scn: Scenario, inputs: dict, device: torch.device, kernels: str) -> str | None:
    """A scenario's own sanity check; returns an error string, or None when it holds."""
    if scn.wide:  # the vacuity guard: regrouping the token sum must visibly change bits on these inputs
        base = run_case(scn, inputs, Layout(1, 1), 0, 0, None, None, device, scn.op(kernels))
        moved = run_case(scn, inputs, Layout(1, 1), 0, 0, None, None, device, scn.op(kernels, planted=True))
        if all(a["bits"] == b["bits"] for a, b in zip(base, moved) if a["field"] == "per_sequence_policy"):
            return "vacuous: regrouping the token sum changed no per-sequence bit on the wide-exponent inputs"
    if scn.identity:
        rows = run_case(scn, inputs, Layout(1, 1), 0, 0, None, None, device, scn.op(kernels))
        kl_bits = [r["bits"] for r in rows if r["field"] in ("kl", "per_sequence_kl")]
        if any(kl_bits):
            return "identity: KL is not exactly 0.0 with reference == policy"
    return None


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[1])
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def provenance(ctx: RankContext) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev = ctx.device
    return {
        "backend": "distributed", "math_version": MATH_VERSION, "process_group": ctx.backend,
        "world_size": ctx.world_size, "torch": torch.__version__, "triton": triton_version,
        "python": platform.python_version(), "machine": platform.machine(), "cpu_model": cpu_model(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine(),
        "device_type": dev.type, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads_per_rank": torch.get_num_threads(), "tf32": torch.backends.cuda.matmul.allow_tf32,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(), "git_commit": git_commit(),
    }


def write_table(rows: list[dict], path: Path, metadata: dict[str, Any]) -> None:
    df = pd.DataFrame(rows, columns=COLUMNS).astype({"index": "int64", "bits": "Int64"})
    table = pa.Table.from_pandas(df, schema=SCHEMA, preserve_index=False)
    meta = {**(table.schema.metadata or {}), b"grpo_core": json.dumps(metadata, sort_keys=True).encode()}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata(meta), path)


def _kind(t: pa.DataType) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_integer(t):
        return "integer"
    return "float" if pa.types.is_floating(t) else str(t)


def read_table(path: Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The rows and the metadata of a recorded table, checked; raises `TableError` naming the failed check."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise TableError("readable", f"{path} is not a Parquet file ({str(exc).splitlines()[0]})") from None
    got = {f.name: f.type for f in table.schema}
    absent = [c for c in COLUMNS if c not in got]
    extra = [c for c in got if c not in COLUMNS]
    if absent or extra:
        raise TableError("schema", f"{path}: expected columns {COLUMNS}, got {list(got)} (missing {absent}, "
                                   f"unexpected {extra})")
    for want in SCHEMA:
        if _kind(got[want.name]) not in (_kind(want.type), "null"):
            raise TableError("schema", f"{path}: column {want.name} expected {_kind(want.type)} values, got "
                                       f"{got[want.name]}")
    meta = table_metadata(table, path)
    df = table.select(COLUMNS).cast(SCHEMA).to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    check_rows(df, str(path))
    return df, meta


def table_metadata(table: pa.Table, path: Path) -> Any:
    """The grpo_core metadata a recorded table carries (JSON), or `TableError`."""
    try:
        return json.loads((table.schema.metadata or {}).get(b"grpo_core", b"{}"))
    except ValueError:
        raise TableError("metadata", f"{path}: the grpo_core metadata is not JSON") from None


def check_rows(df: pd.DataFrame, where: str) -> None:
    """Known fields, unique keys, one fingerprint per cell, `value` equal to the number `bits` encodes, digests."""
    def first(mask: pd.Series) -> str:
        r = df[mask].iloc[0]
        return f"{int(mask.sum())} rows, first {r['scenario']} {r['topology']} {r['field']}[{r['index']}]"

    check_table(df, where, first, required=KEY + ["fingerprint"], fields=FIELDS, unique=KEY,
                digests=("grad_digest",), digest_hex=24)
    fps = df.groupby(["scenario", "topology"])["fingerprint"].transform("nunique")
    if (fps > 1).any():
        raise TableError("fingerprint", f"{where}: one cell carries several contract fingerprints ({first(fps > 1)})")


def check_table(df: pd.DataFrame, where: str, first, *, required: list[str], fields: tuple[str, ...],
                unique: list[str], digests: tuple[str, ...], digest_hex: int) -> None:
    """The checks every recorded table takes (a gate run's, a training run's): no empty `required` column, known
    `fields`, one row per `unique` key, the `digests` fields holding `digest_hex` hex digits and no value or bits,
    every other row's `value` the number its `bits` encode. `first(mask)` names the first row of a failure."""
    for col in required:
        if df[col].isna().any():
            raise TableError("schema", f"{where}: column {col} has empty values ({first(df[col].isna())})")
    unknown = ~df["field"].isin(fields)
    if unknown.any():
        raise TableError("fields", f"{where}: expected fields from {list(fields)}, got "
                                   f"{sorted(df.loc[unknown, 'field'].unique())}")
    dup = df.duplicated(unique, keep="first")
    if dup.any():
        raise TableError("unique keys", f"{where}: a ({', '.join(unique)}) key appears twice ({first(dup)})")
    digest = df["field"].isin(digests)
    bad = digest & ~(df["digest"].fillna("").str.fullmatch(f"[0-9a-f]{{{digest_hex}}}") & df["bits"].isna()
                     & df["value"].isna())
    if bad.any():
        raise TableError("digest", f"{where}: a digest row needs a {digest_hex}-hex-digit digest and no value or bits "
                                   f"({first(bad)})")
    num = df[~digest]
    ok = bits_encode_values(num)
    if not ok.all():
        raise TableError("value vs bits", f"{where}: `value` is not the number that `bits` encodes "
                                          f"({first(df.index.isin(num.index[~ok]))})")


def bits_encode_values(num: pd.DataFrame) -> np.ndarray:
    """Per row of `num` (columns field, value, bits): whether `value` is the number `bits` encodes (an fp32 bit
    pattern, or the count itself for `per_sequence_active_tokens`)."""
    bits = num["bits"].astype("float64").to_numpy()  # NaN where absent; int32 patterns and counts fit exactly
    value = num["value"].astype("float64").to_numpy()
    counts = (num["field"] == "per_sequence_active_tokens").to_numpy()
    in_range = (bits >= -(2**31)) & (bits < 2**31)
    as_float = np.where(in_range, bits, 0).astype(np.int64).astype(np.int32).view(np.float32).astype(np.float64)
    same = np.where(counts, value == bits, (as_float == value) | (np.isnan(as_float) & np.isnan(value)))
    return ~np.isnan(bits) & in_range & same


def load_run(arg: str, path: str) -> tuple[pd.DataFrame, dict[str, Any]]:
    """A run given on the command line as a run folder or its run.parquet; `UsageError` (one line) if it is not."""
    p = Path(path)
    file = p / "run.parquet" if p.is_dir() else p
    expected = f"{arg}: expected a run folder or a run.parquet file, got {path}"
    if not p.exists():
        raise UsageError(f"{expected} (does not exist)")
    if not file.is_file():
        raise UsageError(f"{expected} (a folder without run.parquet)")
    try:
        return read_table(file)
    except TableError as err:
        raise UsageError(f"{expected} ({err})") from None
