"""Bitwise comparison of recorded runs: every topology against the single-rank run, every run against the golden,
and two runs against each other, layout with layout.

Values are compared by their bit patterns (integer views) and gradients by digest, so -0.0 vs +0.0 and NaN
payloads count as differences. Rows are matched on (scenario, topology, field, index); a row that one side lacks
is a difference too, marked `missing` with the name of the side that lacks it, never counted as drift. The
comparison is symmetric: swapping the two sides swaps the value columns and the names, not the rows found.
"""

from __future__ import annotations

import pandas as pd

SINGLE = "tp1xdp1"
KEY = ["scenario", "topology", "field", "index"]


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def ulp_distance(a: pd.Series, b: pd.Series, field: pd.Series) -> pd.Series:
    """ULP distance between fp32 bit patterns (integer distance for the integer counts)."""
    def ordered(bits: pd.Series) -> pd.Series:
        bits = bits.astype("float64")  # int32 patterns fit exactly
        return bits.where(bits >= 0, -(bits + 2**31))
    dist = (ordered(a) - ordered(b)).abs()
    counts = field == "per_sequence_active_tokens"
    return dist.where(~counts, (a.astype("float64") - b.astype("float64")).abs())


def compare(a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str] = ("A", "B")) -> pd.DataFrame:
    """Rows of `a` and `b` matched on (scenario, topology, field, index) whose bits or digest differ, and rows that
    one side lacks (`missing` holds the name of that side). `ulp` is NaN where it does not apply."""
    ref = b[KEY + ["value", "bits", "digest"]].rename(
        columns={"value": "ref_value", "bits": "ref_bits", "digest": "ref_digest"})
    merged = a[KEY + ["value", "bits", "digest"]].merge(ref, on=KEY, how="outer", indicator=True)
    missing = merged["_merge"] != "both"
    bits_differ = (merged["bits"].fillna(-1) != merged["ref_bits"].fillna(-1)) | (
        merged["bits"].isna() != merged["ref_bits"].isna())
    digest_differ = merged["digest"].fillna("") != merged["ref_digest"].fillna("")
    out = merged[missing | bits_differ | digest_differ].copy()
    out["ulp"] = ulp_distance(out["bits"], out["ref_bits"], out["field"]).where(out["_merge"] == "both")
    out["missing"] = out["_merge"].map({"left_only": names[1], "right_only": names[0], "both": ""}).astype(str)
    return out.drop(columns="_merge").sort_values(KEY, ignore_index=True)


def differences(run: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Every topology of `run` against `reference`, which holds one topology per scenario (the single-rank rows or
    the golden); scenarios the run lacks are left out of the reference."""
    cells = run[["scenario", "topology"]].drop_duplicates()
    return compare(run, reference.drop(columns="topology").merge(cells, on="scenario"), ("run", "reference"))


def topology_differences(run: pd.DataFrame) -> pd.DataFrame:
    """Every topology of one run against its single-rank (tp1 x dp1) rows."""
    return differences(run[run["topology"] != SINGLE], run[run["topology"] == SINGLE])


def cells_of(*runs: pd.DataFrame) -> pd.DataFrame:
    """The (scenario, topology) cells present in any of `runs`, in first-seen order."""
    return pd.concat([r[["scenario", "topology"]] for r in runs]).drop_duplicates(ignore_index=True)


def summarize(cells: pd.DataFrame, diffs: pd.DataFrame) -> pd.DataFrame:
    """One row per (scenario, topology) cell: `identical`, `drift` (bits moved), `missing` (rows on one side only)
    or `drift, missing`; how many sequences moved, whether a scalar moved, the largest ULP distance of a moved
    value (0 when only digests moved), and the number of missing rows."""
    rows = []
    for scenario, topology in cells[["scenario", "topology"]].drop_duplicates().itertuples(index=False):
        d = diffs[(diffs["scenario"] == scenario) & (diffs["topology"] == topology)]
        moved, gone = d[d["missing"] == ""], d[d["missing"] != ""]
        status = ", ".join(s for s, on in (("drift", len(moved)), ("missing", len(gone))) if on) or "identical"
        rows.append(dict(scenario=scenario, topology=topology, status=status,
                         fields_moved=",".join(sorted(moved["field"].unique())),
                         sequences_moved=int(moved.loc[moved["index"] >= 0, "index"].nunique()),
                         scalar_moved=bool((moved["index"] < 0).any()),
                         max_ulp=float(moved["ulp"].max()) if moved["ulp"].notna().any() else 0.0,
                         missing_rows=len(gone)))
    return pd.DataFrame(rows, columns=["scenario", "topology", "status", "fields_moved", "sequences_moved",
                                       "scalar_moved", "max_ulp", "missing_rows"])


def drift_first(cells: pd.DataFrame) -> pd.DataFrame:
    """Summarized cells with the ones that are not identical first (stable otherwise)."""
    return cells.sort_values("status", key=lambda s: s == "identical", kind="stable", ignore_index=True)


def describe_cell(c) -> str:
    """One line for a summarized cell that is not identical, e.g. `3 sequences moved (per_sequence_policy); ...`."""
    parts = []
    if c.fields_moved:
        ulp = f"; max {c.max_ulp:.0f} ULP" if c.max_ulp else ""
        parts.append(f"{plural(c.sequences_moved, 'sequence')} moved ({c.fields_moved}); scalar moved: "
                     f"{'yes' if c.scalar_moved else 'no'}{ulp}")
    if c.missing_rows:
        parts.append(f"{plural(c.missing_rows, 'row')} missing")
    return f"{c.scenario} {c.topology}: " + "; ".join(parts)


def contract_differences(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """The (scenario, topology) cells of both runs whose contract fingerprints differ, with both fingerprints: two
    contracts are not the same experiment, whatever their bits."""
    def fingerprints(run: pd.DataFrame, side: str) -> pd.Series:
        return run.groupby(["scenario", "topology"], sort=False)["fingerprint"].first().rename(side)

    both = pd.concat([fingerprints(a, "a"), fingerprints(b, "b")], axis=1, join="inner")
    return both[both["a"] != both["b"]].reset_index()


def format_differences(diffs: pd.DataFrame, limit: int = 20, names: tuple[str, str] = ("run", "reference")) -> str:
    """One line per difference; each value is preceded by the name of its side (`names`: the run's, the
    reference's)."""
    lines = []
    a, b = names
    for r in diffs.head(limit).itertuples(index=False):
        if r.missing:
            lines.append(f"  {r.scenario} {r.topology} {r.field}[{r.index}]: missing in the {r.missing}")
        elif r.field == "grad_digest":
            lines.append(f"  {r.scenario} {r.topology} grad of sequence {r.index}: digest {a} {r.digest} vs {b} "
                         f"{r.ref_digest}")
        else:
            mask = 0xFFFFFFFF if r.field != "per_sequence_active_tokens" else -1
            lines.append(f"  {r.scenario} {r.topology} {r.field}[{r.index}]: {a} {r.value!r} "
                         f"(0x{int(r.bits) & mask:08x}) vs {b} {r.ref_value!r} (0x{int(r.ref_bits) & mask:08x}), "
                         f"{r.ulp:.0f} ULP")
    if len(diffs) > limit:
        lines.append(f"  ... and {len(diffs) - limit} more")
    return "\n".join(lines)
