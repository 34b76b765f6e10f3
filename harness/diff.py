"""Bitwise comparison of recorded runs: every topology against the single-rank run, every run against the golden.

Values are compared by their bit patterns (integer views) and gradients by digest, so -0.0 vs +0.0 and NaN
payloads count as differences. Each difference names scenario, topology, field and sequence index, with both
values, both bit patterns and the ULP distance.
"""

from __future__ import annotations

import pandas as pd

SINGLE = "tp1xdp1"
KEY = ["scenario", "field", "index"]


def ulp_distance(a: pd.Series, b: pd.Series, field: pd.Series) -> pd.Series:
    """ULP distance between fp32 bit patterns (integer distance for the integer counts)."""
    def ordered(bits: pd.Series) -> pd.Series:
        bits = bits.astype("float64")  # int32 patterns fit exactly
        return bits.where(bits >= 0, -(bits + 2**31))
    dist = (ordered(a) - ordered(b)).abs()
    counts = field == "per_sequence_active_tokens"
    return dist.where(~counts, (a.astype("float64") - b.astype("float64")).abs())


def differences(run: pd.DataFrame, reference: pd.DataFrame, same_topology: bool = False) -> pd.DataFrame:
    """Rows of `run` whose bits (or digest) differ from `reference` on (scenario, field, index), and rows that
    either side lacks. `reference` holds one topology per scenario and each topology of `run` is compared with
    it, or, with `same_topology`, each topology is compared with the same topology of `reference`.
    """
    ref = reference[KEY + ["topology", "value", "bits", "digest"]].rename(
        columns={"value": "ref_value", "bits": "ref_bits", "digest": "ref_digest", "topology": "ref_topology"})
    ref = ref[ref["scenario"].isin(run["scenario"].unique())]
    frames = []
    for topology, part in run.groupby("topology"):
        mine = ref[ref["scenario"].isin(part["scenario"].unique())]
        if same_topology:
            mine = mine[mine["ref_topology"] == topology]
        merged = part.merge(mine.drop(columns="ref_topology"), on=KEY, how="outer", indicator=True)
        merged["topology"] = topology
        frames.append(merged)
    if not frames:
        return pd.DataFrame(columns=list(run.columns) + ["ref_value", "ref_bits", "ref_digest", "ulp", "missing"])
    merged = pd.concat(frames, ignore_index=True)
    missing = merged["_merge"] != "both"
    bits_differ = (merged["bits"].fillna(-1) != merged["ref_bits"].fillna(-1)) | (
        merged["bits"].isna() != merged["ref_bits"].isna())
    digest_differ = merged["digest"].fillna("") != merged["ref_digest"].fillna("")
    out = merged[missing | bits_differ | digest_differ].copy()
    out["ulp"] = ulp_distance(out["bits"], out["ref_bits"], out["field"])
    out["missing"] = out["_merge"].map({"left_only": "reference", "right_only": "run", "both": ""}).astype(str)
    return out.drop(columns="_merge").sort_values(["scenario", "topology", "field", "index"])


def topology_differences(run: pd.DataFrame) -> pd.DataFrame:
    """Every topology of one run against its single-rank (tp1 x dp1) rows."""
    single = run[run["topology"] == SINGLE]
    others = run[run["topology"] != SINGLE]
    return differences(others, single)


def summarize(run: pd.DataFrame, diffs: pd.DataFrame) -> pd.DataFrame:
    """One row per (scenario, topology): identical or drift, sequences moved, whether a scalar moved."""
    cells = run[["scenario", "topology"]].drop_duplicates()
    rows = []
    for scenario, topology in cells.itertuples(index=False):
        d = diffs[(diffs["scenario"] == scenario) & (diffs["topology"] == topology)]
        seq = d[d["index"] >= 0]
        rows.append(dict(scenario=scenario, topology=topology, status="drift" if len(d) else "identical",
                         fields_moved=",".join(sorted(d["field"].unique())), sequences_moved=seq["index"].nunique(),
                         scalar_moved=bool((d["index"] < 0).any()), max_ulp=float(d["ulp"].max()) if len(d) else 0.0))
    return pd.DataFrame(rows)


def format_differences(diffs: pd.DataFrame, limit: int = 20) -> str:
    lines = []
    for r in diffs.head(limit).itertuples(index=False):
        if r.missing:
            lines.append(f"  {r.scenario} {r.topology} {r.field}[{r.index}]: missing in the {r.missing}")
        elif r.field == "grad_digest":
            lines.append(f"  {r.scenario} {r.topology} grad of sequence {r.index}: digest {r.digest} vs "
                         f"{r.ref_digest}")
        else:
            bits = int(r.bits) & 0xFFFFFFFF if r.field != "per_sequence_active_tokens" else int(r.bits)
            ref_bits = int(r.ref_bits) & 0xFFFFFFFF if r.field != "per_sequence_active_tokens" else int(r.ref_bits)
            lines.append(f"  {r.scenario} {r.topology} {r.field}[{r.index}]: {r.value!r} (0x{bits:08x}) vs "
                         f"{r.ref_value!r} (0x{ref_bits:08x}), {r.ulp:.0f} ULP")
    if len(diffs) > limit:
        lines.append(f"  ... and {len(diffs) - limit} more")
    return "\n".join(lines)
