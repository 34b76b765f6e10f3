"""Training runs recorded by `grpo_core.recorder.TrainingRecorder`: read, checked, and compared sequence by sequence.

A run is a folder of `rank-<R>/step-<S>.parquet` files. Two runs are matched on (step, sequence key, occurrence,
field), never on position: the occurrence numbers the repeats of one key within a step (a completion sampled twice),
in the order of rank, then call. A sequence that moved is attributed to one side of the loss:
- `upstream`: what the loss was given moved (the hidden states or logits, `input_digest`; the given old or reference
  log-probs, `logps_digest`; the advantages): the model's forward, the data, the rewards or the batch composition;
- `loss`: every input has the same bits and a per-sequence value moved (a term, the entropy): the loss computation;
- `scale`: inputs and values the same bits, the gradient moved by a power of two alone (its mantissas kept their
  bits): the normalizer, which spans the micro-batch (grpo, bnpo: each sequence's share of the micro-batch's mean)
  or the process (DDP averages the processes' gradients), so other layouts scale each sequence's gradient;
- `gradient`: inputs and values the same bits, the gradient's mantissas moved: the loss's backward.
The per-call scalars (loss, policy_loss, kl of one rank's micro-batch) are compared only when both runs have the same
layout (world size, accumulation, micro-batch size): otherwise their micro-batches hold other sequences.
"""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from grpo_core.digest import LANES
from grpo_core.recorder import DIGEST_FIELDS, LAYER_FIELD, SCALAR_FIELDS, SEQUENCE_FIELDS, schema
from grpo_core.rollouts import read_rollouts

from .cli import UsageError
from .diff import plural, ulp_distance
from .record import TableError, check_table, table_metadata

KEY = ["step", "sequence", "occurrence", "field"]
UNFINISHED = re.compile(r"rank-(\d+)/(?:step|rollout)-(\d+)\.parquet\S*\.tmp")  # a write the process did not end
INPUTS = ("input_digest", "logps_digest", "advantages")  # what the loss is given
GRADIENT = ("grad_digest", "grad_mantissa_digest")
LAYOUT = ("world_size", "gradient_accumulation_steps", "per_device_train_batch_size")
FIELDS = SEQUENCE_FIELDS + DIGEST_FIELDS + SCALAR_FIELDS
CAUSES = {"upstream": "what the loss was given moved (hidden states, log-probs or advantages): the model's forward, "
                      "the data, the rewards or the batch",
          "loss": "its inputs the same bits, a per-sequence value moved: the loss computation",
          "scale": "inputs and values the same bits, the gradient scaled by a power of two (its mantissas the same "
                   "bits): the normalizer spans another micro-batch or process count",
          "gradient": "inputs and values the same bits, the gradient's mantissas moved: the loss's backward"}


def is_training_run(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and next(p.glob("rank-*/step-*.parquet"), None) is not None


def _read_file(path: Path) -> tuple[pa.Table, dict[str, Any]]:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise TableError("readable", f"{path} is not a Parquet file ({str(exc).splitlines()[0]})") from None
    want = schema()
    if table.schema.remove_metadata() != want:
        raise TableError("schema", f"{path}: expected columns {want.names} typed {[str(t) for t in want.types]}, got "
                                   f"{table.schema.names} typed {[str(t) for t in table.schema.types]}")
    meta = table_metadata(table, path)
    if not isinstance(meta, dict) or not isinstance(meta.get("metadata", {}), dict):
        raise TableError("metadata", f"{path}: expected a JSON object whose `metadata` is one, got {meta!r}")
    try:
        rank, step = int(path.parent.name.removeprefix("rank-")), int(path.stem.removeprefix("step-"))
    except ValueError:
        raise TableError("file name", f"{path}: expected rank-<R>/step-<S>.parquet with integers R and S") from None
    if meta.get("kind") != "training" or meta.get("rank") != rank:
        raise TableError("metadata", f"{path}: expected a training record of rank {rank}, got kind "
                                     f"{meta.get('kind')!r}, rank {meta.get('rank')!r}")
    for col, want_value in (("step", step), ("rank", rank)):
        if table.num_rows and not (pc.min(table[col]).as_py() == pc.max(table[col]).as_py() == want_value):
            raise TableError(col, f"{path}: expected every row of {col} {want_value} (the file's name), got "
                                  f"{sorted(set(table[col].to_pylist()))}")
    return table.replace_schema_metadata(None), meta


def layer_fields(fields: pd.Series) -> pd.Series:
    """Whether each field is a module's output digest (`record_layers`: `layer/<index>/<module name>`)."""
    return fields.str.fullmatch(LAYER_FIELD)


def check_training_rows(df: pd.DataFrame, where: str) -> None:
    """Known fields, no empty key, `value` equal to the number `bits` encodes, digests of the recorder's width, one
    row per (rank, step, order)."""
    def first(mask: pd.Series) -> str:
        r = df[mask].iloc[0]
        return f"{int(mask.sum())} rows, first step {r['step']} {r['sequence']} {r['field']}"

    layers = tuple(df.loc[layer_fields(df["field"]), "field"].unique())
    check_table(df, where, first, required=["step", "sequence", "field", "rank", "order"], fields=FIELDS + layers,
                unique=["rank", "step", "order"], digests=DIGEST_FIELDS + layers, digest_hex=8 * LANES)


def read_training_run(folder: Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Every step file of every rank, checked, as one table with the `occurrence` column; and the run's metadata
    (the same in every file but for the rank, or `TableError`)."""
    paths = sorted(folder.glob("rank-*/step-*.parquet"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:  # pyarrow reads without the GIL
        read = list(pool.map(_read_file, paths))
    meta = None
    for path, (_, m) in zip(paths, read):
        m = {k: v for k, v in m.items() if k != "rank"}
        if meta is None:
            meta = m
        elif m != meta:
            diff = sorted(k for k in set(m) | set(meta) if m.get(k) != meta.get(k))
            raise TableError("metadata", f"{path}: expected the run's metadata of the first file, got other {diff}")
    df = pa.concat_tables([t for t, _ in read]).to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    check_training_rows(df, str(folder))
    df = df.sort_values(["step", "rank", "order"], ignore_index=True)
    df["occurrence"] = df.groupby(["step", "sequence", "field"]).cumcount()
    unfinished = sorted({(int(m[1]), int(m[2])) for p in folder.glob("rank-*/*.tmp")
                         if (m := UNFINISHED.fullmatch(f"{p.parent.name}/{p.name}"))})
    try:
        rollouts = read_rollouts(folder)
    except ValueError as exc:
        raise TableError("rollout", str(exc)) from None
    meta = {**meta, "ranks": sorted(int(r) for r in df["rank"].unique()), "steps": int(df["step"].nunique()),
            "files": sorted({(int(r), int(s)) for r, s in zip(df["rank"], df["step"])}), "unfinished": unfinished,
            "rollouts": rollouts}
    return df, meta


def load_training_run(arg: str, path: str) -> tuple[pd.DataFrame, dict[str, Any]]:
    """A training run given on the command line; `UsageError` (one line) when a file fails its check."""
    try:
        return read_training_run(Path(path))
    except TableError as err:
        raise UsageError(f"{arg}: expected a training run recorded by grpo_core's TrainingRecorder, got {path} "
                         f"({err})") from None


def same_layout(meta_a: dict, meta_b: dict) -> bool:
    return all(meta_a.get("metadata", {}).get(k) == meta_b.get("metadata", {}).get(k) for k in LAYOUT) and \
        meta_a["ranks"] == meta_b["ranks"]


def layout_text(meta: dict) -> str:
    m = meta.get("metadata", {})
    return ", ".join(f"{k} {m.get(k)}" for k in LAYOUT)


def sequences_of(run: pd.DataFrame) -> pd.DataFrame:
    """The run's (step, sequence, occurrence), once each."""
    return run.loc[~run["field"].isin(SCALAR_FIELDS), ["step", "sequence", "occurrence"]].drop_duplicates()


def compare_training(a: pd.DataFrame, b: pd.DataFrame, scalars: bool) -> pd.DataFrame:
    """Rows matched on (step, sequence, occurrence, field) whose bits or digest differ, or that one side lacks
    (`missing`: "A" or "B", the side that lacks it; `in_one_run`: the whole sequence, or call, is in one run only,
    not just this field); the per-call scalars only when `scalars`."""
    cols = KEY + ["value", "bits", "digest"]
    if not scalars:
        a, b = (r[~r["field"].isin(SCALAR_FIELDS)] for r in (a, b))
    m = a[cols].merge(b[cols], on=KEY, how="outer", suffixes=("_a", "_b"), indicator=True)
    bits_differ = (m["bits_a"].fillna(-1) != m["bits_b"].fillna(-1)) | (m["bits_a"].isna() != m["bits_b"].isna())
    out = m[(m["_merge"] != "both") | bits_differ | (m["digest_a"].fillna("") != m["digest_b"].fillna(""))].copy()
    out["ulp"] = ulp_distance(out["bits_a"], out["bits_b"], out["field"]).where(out["_merge"] == "both")
    out["missing"] = out["_merge"].map({"left_only": "B", "right_only": "A", "both": ""}).astype(str)
    in_both = sequences_of(a).merge(sequences_of(b)).assign(in_both=True)
    out = out.merge(in_both, on=["step", "sequence", "occurrence"], how="left")
    out["in_one_run"] = (out["missing"] != "") & out["in_both"].isna()
    return out.drop(columns=["_merge", "in_both"]).sort_values(KEY, ignore_index=True)


def sequence_verdicts(diffs: pd.DataFrame) -> pd.DataFrame:
    """One row per moved (step, sequence, occurrence) present in both runs: the fields that moved or that one run
    lacks, the largest ULP distance, and `cause` (`CAUSES`)."""
    moved = diffs[~diffs["in_one_run"] & ~diffs["field"].isin(SCALAR_FIELDS)].sort_values(KEY)
    by = [moved[k] for k in ("step", "sequence", "occurrence")]  # whole columns: a long run has many sequences
    layer = layer_fields(moved["field"])
    out = pd.DataFrame({"fields": moved[~layer]["field"].groupby([b[~layer] for b in by], sort=True).agg(",".join),
                        "upstream": (moved["field"].isin(INPUTS) | layer).groupby(by, sort=True).any(),
                        "gradient": moved["field"].isin(GRADIENT).groupby(by, sort=True).all(),
                        "first_module": moved[layer]["field"].groupby([b[layer] for b in by], sort=True).min(),
                        "max_ulp": moved["ulp"].groupby(by, sort=True).max().fillna(0.0).astype("float64")})
    out["fields"] = out["fields"].fillna("")
    out["first_module"] = out["first_module"].fillna("").str.replace(r"^layer/\d+/", "", regex=True)
    out["cause"] = np.select([out["upstream"], out["fields"] == "grad_digest", out["gradient"]],
                             ["upstream", "scale", "gradient"], "loss")
    out = out.reset_index().astype({"step": "int64", "occurrence": "int64"})
    return out[["step", "sequence", "occurrence", "fields", "cause", "first_module", "max_ulp"]]


def step_summary(a: pd.DataFrame, b: pd.DataFrame, diffs: pd.DataFrame, verdicts: pd.DataFrame) -> pd.DataFrame:
    """Per step: sequences in both runs, how many moved (by cause), the largest ULP distance, sequences in one run
    only, whether a per-call scalar moved."""
    both = sequences_of(a).merge(sequences_of(b), how="outer", indicator=True)
    out = pd.crosstab(both["step"], both["_merge"]).reindex(
        index=sorted(set(a["step"]) | set(b["step"])), columns=["both", "left_only", "right_only"], fill_value=0)
    out.columns = ["sequences", "only_in_A", "only_in_B"]
    causes = pd.crosstab(verdicts["step"], verdicts["cause"]).reindex(columns=list(CAUSES), fill_value=0)
    out = out.join(causes).fillna(0)
    out["moved"] = out[list(CAUSES)].sum(axis=1)
    out["max_ulp"] = verdicts.groupby("step")["max_ulp"].max()
    scalar = diffs[diffs["field"].isin(SCALAR_FIELDS) & (diffs["missing"] == "")]
    out["scalar_moved"] = out.index.isin(scalar["step"])
    out = out.fillna({"max_ulp": 0}).astype({c: "int64" for c in ["moved", *CAUSES, "max_ulp"]})
    return out.reset_index()[["step", "sequences", "moved", *CAUSES, "max_ulp", "only_in_A", "only_in_B",
                              "scalar_moved"]]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level, keys joined with '.'."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


NOT_A_SETTING = ("replay_from",)  # where a run read its completions: said apart, not a setting that moves numbers
MODEL_KEYS = ("model_config.", "weights_digest")


def metadata_differences(meta_a: dict, meta_b: dict) -> list[str]:
    """`key: A vs B` for each run setting that differs: the recorded run description (the layout, the configuration,
    the model, the versions; nested keys joined with '.') and the provenance (the device, torch's settings)."""
    out = []
    top = set(meta_a.get("metadata", {})) | set(meta_b.get("metadata", {}))  # the layout: said once, not as config.*
    for part in ("metadata", "provenance"):
        a, b = (_flat({k: v for k, v in m.get(part, {}).items() if k not in NOT_A_SETTING}) for m in (meta_a, meta_b))
        a, b = ({k: v for k, v in x.items() if not (k.startswith("config.") and k[len("config."):] in top)}
                for x in (a, b))
        prefix = "" if part == "metadata" else "provenance."
        out += [f"{prefix}{k}: A {a.get(k)!r} vs B {b.get(k)!r}" for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)]
    if meta_a["ranks"] != meta_b["ranks"]:
        out.append(f"ranks: A {meta_a['ranks']} vs B {meta_b['ranks']}")
    return out


def missing_files(meta_a: dict, meta_b: dict) -> list[str]:
    """A step file one run lacks (by rank where both runs have the same ranks, else a step no rank of one run wrote),
    and a partial file a run left: the runs are not identical while any is there."""
    out = []
    for side, other, m, n in (("A", "B", meta_a, meta_b), ("B", "A", meta_b, meta_a)):
        if m["ranks"] == n["ranks"]:
            out += [f"{side} has no file for step {step} of rank {rank} ({other} has one)"
                    for rank, step in sorted(set(n["files"]) - set(m["files"]))]
        else:
            out += [f"{side} has no file for step {step} ({other} has one)"
                    for step in sorted({s for _, s in n["files"]} - {s for _, s in m["files"]})]
        out += [f"{side}: step {step} of rank {rank} was being written when the run stopped (a partial file is left)"
                for rank, step in m["unfinished"]]
    return out


def run_notes(meta_a: dict, meta_b: dict) -> list[str]:
    """What the reader must know before the per-sequence comparison: runs of different models, a replay, the files
    one run lacks (`missing_files`)."""
    notes = [f"the runs train different models ({'; '.join(models)}): every sequence's hidden states differ by "
             f"construction, so the comparison below says where they moved, not why"
             for models in [[d for d in metadata_differences(meta_a, meta_b) if d.startswith(MODEL_KEYS)]] if models]
    for side, m in (("A", meta_a), ("B", meta_b)):
        if m.get("metadata", {}).get("replay_from"):
            notes.append(f"{side} replayed the completions of {m['metadata']['replay_from']}")
    return notes + missing_files(meta_a, meta_b)


def training_comparison(a_path: str, b_path: str) -> dict[str, Any]:
    """Everything `harness diff` and `reports drift` say of two training runs; `UsageError` when either is not
    one."""
    for arg, path in (("RUN_A", a_path), ("RUN_B", b_path)):
        if not is_training_run(path):
            why = "does not exist" if not Path(path).exists() else "no rank-*/step-*.parquet in it"
            raise UsageError(f"{arg}: expected a training run (a folder of rank-*/step-*.parquet) like the other run, "
                             f"got {path} ({why})")
    a, meta_a = load_training_run("RUN_A", a_path)
    b, meta_b = load_training_run("RUN_B", b_path)
    keys_a, keys_b = (m.get("sequence_keys", "none named (an earlier recorder's JSON token lists)")
                      for m in (meta_a, meta_b))
    if keys_a != keys_b:
        raise UsageError(f"RUN_B: expected sequence keys of RUN_A's format, {keys_a}, got {keys_b} in {b_path} (runs "
                         f"recorded by grpo_core versions that key sequences otherwise cannot be matched)")
    scalars = same_layout(meta_a, meta_b)
    diffs = compare_training(a, b, scalars)
    verdicts = sequence_verdicts(diffs)
    steps = step_summary(a, b, diffs, verdicts)
    first = None if diffs.empty else int(diffs["step"].min())
    return dict(a=a, b=b, meta_a=meta_a, meta_b=meta_b, scalars=scalars, diffs=diffs, verdicts=verdicts, steps=steps,
                first=first, identical=first is None and not missing_files(meta_a, meta_b),
                settings=metadata_differences(meta_a, meta_b),
                notes=run_notes(meta_a, meta_b), places=sequence_places(a, meta_a["rollouts"]),
                sampler={side: sampler_mismatch(m["rollouts"]) for side, m in (("A", meta_a), ("B", meta_b))})


def sequence_places(run: pd.DataFrame, rollouts: dict[int, list[dict]]) -> pd.DataFrame:
    """Where each (step, sequence, occurrence) of `run` sat: its rank, micro-batch and position in that call, and the
    start of its completion's text where the run recorded its rollouts."""
    rows = run[run["field"] == "per_sequence_policy"].sort_values(["step", "rank", "micro_batch", "order"])
    out = rows[["step", "sequence", "occurrence", "rank", "micro_batch"]].copy()
    out["position"] = rows.groupby(["step", "rank", "micro_batch"]).cumcount()
    text = {r["sequence"]: r["text"] for rs in rollouts.values() for r in rs}
    out["text"] = [text.get(k, "") for k in out["sequence"]]
    return out.reset_index(drop=True)


def sampler_mismatch(rollouts: dict[int, list[dict]], worst: int = 10) -> dict[str, pd.DataFrame] | None:
    """The sampler's log-probs against the trainer's, where a run recorded both (`record_sampler`): per step, over
    the completion tokens, the share whose bits differ, max and mean |trainer - sampler|, the k3 estimate of
    KL(sampler || trainer) (mean of exp(d) - d - 1, d = trainer - sampler) and the range of the sequences' importance
    ratios exp(sum d); the `worst` sequences (by max |d|) and tokens. None when the run has none."""
    seqs, tokens = [], []
    for step, rows in sorted(rollouts.items()):
        for r in rows:
            if r["sampler_logps"] is None or r["trainer_logps"] is None:
                continue
            s, t = r["sampler_logps"], r["trainer_logps"]
            d = t.astype(np.float64) - s.astype(np.float64)
            seqs.append(dict(step=step, sequence=r["sequence"], rank=r["rank"], position=r["position"],
                             tokens=len(d), other_bits=int((s.view(np.int32) != t.view(np.int32)).sum()),
                             max_abs=float(np.abs(d).max(initial=0.0)), sum_abs=float(np.abs(d).sum()),
                             k3_sum=float((np.expm1(d) - d).sum()), ratio=float(np.exp(d.sum())), text=r["text"]))
            k = int(np.abs(d).argmax()) if len(d) else 0
            if len(d):
                tokens.append(dict(step=step, sequence=r["sequence"], token=k, id=r["completion_ids"][k],
                                   sampler=float(s[k]), trainer=float(t[k]), delta=float(d[k])))
    if not seqs:
        return None
    df = pd.DataFrame(seqs)
    g = df.groupby("step")
    steps = pd.DataFrame({"sequences": g.size(), "tokens": g["tokens"].sum(), "other_bits": g["other_bits"].sum(),
                          "max_abs_delta": g["max_abs"].max(), "mean_abs_delta": g["sum_abs"].sum() / g["tokens"].sum(),
                          "k3_kl": g["k3_sum"].sum() / g["tokens"].sum(), "min_ratio": g["ratio"].min(),
                          "max_ratio": g["ratio"].max()}).reset_index()
    df["mean_abs"] = df["sum_abs"] / df["tokens"].clip(lower=1)
    df["k3_kl"] = df["k3_sum"] / df["tokens"].clip(lower=1)
    top = df.sort_values(["max_abs", "step"], ascending=[False, True]).head(worst)
    top = top[["step", "sequence", "rank", "position", "tokens", "other_bits", "max_abs", "mean_abs", "k3_kl",
               "ratio", "text"]]
    toks = pd.DataFrame(tokens).assign(abs_delta=lambda t: t["delta"].abs()).sort_values(
        "abs_delta", ascending=False).drop(columns="abs_delta").head(worst)
    return {"steps": steps, "sequences": top.reset_index(drop=True), "tokens": toks.reset_index(drop=True)}


def sampler_text(side: str, m: dict[str, pd.DataFrame] | None) -> str | None:
    """One line: the run's sampler against its trainer over all steps."""
    if m is None:
        return None
    st = m["steps"]
    tokens = int(st["tokens"].sum())
    k3 = float((st["k3_kl"] * st["tokens"]).sum() / max(tokens, 1))
    mean = float((st["mean_abs_delta"] * st["tokens"]).sum() / max(tokens, 1))
    return (f"sampler vs trainer, {side}: {int(st['other_bits'].sum())} of {tokens} completion tokens' log-probs have "
            f"other bits; max |delta log p| {st['max_abs_delta'].max():.3g}, mean {mean:.3g}; k3 KL {k3:.3g}; sequence "
            f"importance ratios {st['min_ratio'].min():.6g} to {st['max_ratio'].max():.6g}")


def verdict_text(c: dict[str, Any]) -> str:
    """The comparison in a few lines: what was compared, the first step that moved and why."""
    steps, v = c["steps"], c["verdicts"]
    lines = [f"{plural(len(steps), 'step')}, {plural(int(steps['sequences'].sum()), 'sequence')} in both runs "
             f"(A: {layout_text(c['meta_a'])}; B: {layout_text(c['meta_b'])})"]
    lines += c["notes"]
    if c["settings"]:
        lines.append("settings that differ: " + "; ".join(c["settings"]))
    if not c["scalars"]:
        lines.append("per-call scalars (loss, policy_loss, kl) not compared: the layouts differ, so the micro-batches "
                     "hold other sequences")
    lines += [t for side in ("A", "B") if (t := sampler_text(side, c["sampler"][side]))]
    if c["first"] is None:
        lines.append("identical: every recorded value and digest has the same bits at every step" if c["identical"]
                     else "every value and digest both runs recorded has the same bits, but a step file is missing "
                          "(above)")
        return "\n".join(lines)
    first = steps[steps["step"] == c["first"]].iloc[0]
    scalars = c["diffs"][(c["diffs"]["step"] == c["first"]) & c["diffs"]["field"].isin(SCALAR_FIELDS)]
    lines.append(f"first step where anything moved: {c['first']} ({plural(int(first['moved']), 'sequence')} moved: "
                 + _causes(first) + f"; {int(first['only_in_A']) + int(first['only_in_B'])} in one run only"
                 + ("; a per-call scalar moved" if first["scalar_moved"] else "")
                 + ("; a per-call scalar in one run only" if scalars["in_one_run"].any() else "") + ")")
    layered = v[(v["step"] == c["first"]) & (v["first_module"] != "")]
    if len(layered):
        module = layered["first_module"].value_counts()
        lines.append(f"first module whose output moved at step {c['first']}: {module.index[0]} (in "
                     f"{plural(int(module.iloc[0]), 'sequence')} of {len(layered)})"
                     + "".join(f", {name} ({n})" for name, n in module.iloc[1:4].items()))
    total = steps[list(CAUSES)].sum()
    lines.append(f"over all steps: {plural(len(v), 'sequence')} moved: " + _causes(total) + "; "
                 f"{int(steps['only_in_A'].sum()) + int(steps['only_in_B'].sum())} in one run only")
    lines += [f"  {cause}: {CAUSES[cause]}" for cause in CAUSES if total[cause]]
    return "\n".join(lines)


def _causes(counts) -> str:
    return (f"{int(counts['upstream'])} upstream of the loss, {int(counts['loss'])} in the loss, "
            f"{int(counts['scale'])} in the gradient's scale alone, {int(counts['gradient'])} in the gradient alone")


def format_moved(verdicts: pd.DataFrame, diffs: pd.DataFrame, places: pd.DataFrame | None = None,
                 limit: int = 20) -> str:
    """One line per moved sequence: step, where it sat in A (rank, micro-batch, position), its key, cause, the first
    module whose output moved, the fields with their ULP distances, the start of its completion."""
    parts: dict[tuple, list[str]] = {}  # one pass over the differences: a long run lists every sequence
    for f in diffs[~diffs["in_one_run"] & ~layer_fields(diffs["field"])].itertuples(index=False):
        parts.setdefault((f.step, f.sequence, f.occurrence), []).append(
            f"{f.field} (missing in {f.missing})" if f.missing else f.field if np.isnan(f.ulp)
            else f"{f.field} {f.ulp:.0f} ULP")
    where = {} if places is None else {(p.step, p.sequence, p.occurrence): p for p in places.itertuples(index=False)}
    lines = []
    for r in verdicts.head(limit).itertuples():
        p = where.get((r.step, r.sequence, r.occurrence))
        at = "" if p is None else f"rank {p.rank} micro-batch {p.micro_batch} #{p.position} "
        module = f"; first moved: {r.first_module}" if r.first_module else ""
        text = f" {p.text!r}" if p is not None and p.text else ""
        lines.append(f"  step {r.step} {at}sequence {r.sequence}#{r.occurrence}: {r.cause}{module} "
                     f"({', '.join(parts.get((r.step, r.sequence, r.occurrence), []))}){text}")
    if len(verdicts) > limit:
        lines.append(f"  ... and {len(verdicts) - limit} more")
    return "\n".join(lines)


def cmd_diff_training(a_path: str, b_path: str) -> int:
    """`python -m harness diff A B` for two training runs: the per-step table, the verdict, the moved sequences;
    exit code 1 when anything moved or is missing on one side."""
    c = training_comparison(a_path, b_path)
    print(f"A = {a_path}\nB = {b_path}")
    print(c["steps"].to_string(index=False))
    print(verdict_text(c))
    if c["first"] is None:
        return 0 if c["identical"] else 1
    if len(c["verdicts"]):
        print("moved sequences (where they sat in A, key#occurrence):\n"
              + format_moved(c["verdicts"], c["diffs"], c["places"]))
    scalars = c["diffs"][c["diffs"]["field"].isin(SCALAR_FIELDS) & (c["diffs"]["missing"] == "")]
    for r in scalars.head(10).itertuples(index=False):
        print(f"  step {r.step} {r.sequence} {r.field}: A {r.value_a!r} vs B {r.value_b!r}, {r.ulp:.0f} ULP")
    print(f"FAILED: the runs differ from step {c['first']} on")
    return 1
