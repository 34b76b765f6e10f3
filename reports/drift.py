"""Drift between two recorded runs (two commits, two backends, two configurations), as Markdown + HTML + PNGs.

The runs are compared layout with layout, symmetrically; a cell that one run lacks is `missing`, never drift. The
report lists the cells that moved first, says what was planted in each run, and the HTML carries its figures inline
(base64), so that the one file can be sent.

Also the "comparing configurations" study: regroup each sequence's token sum (a real change of the summation
tree) and count, over seeds, how often the per-sequence vector moves versus how often the scalar loss moves.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from grpo_core.distributed import DistributedGRPOLossOp  # noqa: E402
from harness.diff import (cells_of, compare, contract_differences, drift_first, format_differences,  # noqa: E402
                          plural, summarize)
from harness.record import load_run  # noqa: E402
from harness.training import (CAUSES, LAYOUT, SCALAR_FIELDS, format_moved, is_training_run,  # noqa: E402
                              layout_text, sampler_text, training_comparison, verdict_text)
from harness.scenarios import RegroupedTokenSumOp, Scenario  # noqa: E402

VECTOR_FIELDS = ("per_sequence_policy", "per_sequence_kl", "advantages")


def _table(df: pd.DataFrame) -> str:
    if df.empty:
        return "_none_\n"
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


# Read in a browser: ruled tables, room between the columns, striped rows, one line per row.
STYLE = """body { font-family: sans-serif; margin: 2em; max-width: 80em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #999; padding: 0.3em 0.8em; }
th { background: #e8e8e8; text-align: left; }
td { font-variant-numeric: tabular-nums; white-space: nowrap; }
tbody tr:nth-child(even) { background: #f6f6f6; }
img { max-width: 720px; border: 1px solid #ccc; }"""


def _html_table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, border=0, justify="left") if not df.empty else "<p><em>none</em></p>"


def _write(out: Path, title: str, sections: list[tuple[str, str, pd.DataFrame | None, str | None]]) -> None:
    """Writes report.md (figures linked) and report.html (figures inline, base64): each section is (heading, prose,
    table, image file in `out`)."""
    md, body = [f"# {title}", ""], [f"<h1>{html.escape(title)}</h1>"]
    for heading, prose, table, image in sections:
        md += [f"## {heading}", "", prose, ""]
        body += [f"<h2>{html.escape(heading)}</h2>", f"<p>{html.escape(prose)}</p>".replace("\n", "<br>")]
        if table is not None:
            md.append(_table(table))
            body.append(_html_table(table))
        if image:
            md += [f"![{heading}]({image})", ""]
            data = base64.b64encode((out / image).read_bytes()).decode()
            body.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(heading)}">')
    (out / "report.md").write_text("\n".join(md) + "\n")
    (out / "report.html").write_text(f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
                                     f"<style>\n{STYLE}\n</style><body>" + "\n".join(body) + "</body>\n")


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ulp_histogram(moved: pd.DataFrame) -> Figure:
    """Histogram of the ULP distances of the moved per-sequence values (log x, integer counts)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if len(moved):
        ulps = moved["ulp"].astype(float).to_numpy()
        bins = np.unique(np.concatenate([[0.5], np.logspace(0, max(1.0, np.log10(ulps.max()) + 0.1), 30)]))
        ax.hist(ulps, bins=bins)
        ax.set_xscale("log")
    else:
        ax.text(0.5, 0.5, "no per-sequence value moved", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("How far the moved per-sequence values moved")
    ax.set_xlabel("ULP distance")
    ax.set_ylabel("moved values")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def moved_by_scenario(cells: pd.DataFrame) -> Figure:
    """Sequences moved per scenario, summed over layouts (integer counts)."""
    moved = cells.groupby("scenario")["sequences_moved"].sum()
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.35 * max(1, len(moved))))
    ax.barh(moved.index, moved.to_numpy())
    ax.set_title("Sequences moved, by scenario")
    ax.set_xlabel("sequences moved (summed over layouts)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _planted(meta: dict) -> str:
    return f"a regrouped token sum at {meta['plant_drift']}" if meta.get("plant_drift") else "nothing"


def per_step_figure(steps: pd.DataFrame) -> Figure:
    """Training runs: moved sequences per step by cause (stacked), sequences in one run only, and the largest ULP
    distance per step."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    x, base = steps["step"].to_numpy(), np.zeros(len(steps))
    for column, color in zip(CAUSES, ("#4c72b0", "#c44e52", "#8172b3", "#dd8452")):
        top.bar(x, steps[column], bottom=base, color=color, label=f"moved: {column}")
        base = base + steps[column].to_numpy()
    top.bar(x, steps["only_in_A"] + steps["only_in_B"], bottom=base, color="#999999", label="in one run only")
    top.set_ylabel("sequences")
    top.set_title("Sequences that moved, per step")
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylim(0, max(1.0, top.get_ylim()[1]))  # counts: never below 0, an axis even when nothing moved
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bottom.bar(x, steps["max_ulp"], color="#55a868")
    if steps["max_ulp"].max() > 0:
        bottom.set_yscale("log")
        bottom.set_ylim(bottom=0.5)  # below 1 ULP, the smallest distance: every bar that is not 0 shows
    else:
        bottom.set_ylim(0, 1)
        bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("largest ULP distance")
    bottom.set_xlabel("optimizer step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    return fig


PER_STEP = ("One row per step: the sequences matched by key in both runs (`sequences`), how many of them moved "
            "(`moved`) and why, then the other columns:\n\n" + "\n".join(f"- {cause}: {why}" for cause, why in CAUSES.items())
            + "\n- max_ulp: the largest ULP distance of a moved value\n- only_in_A, only_in_B: sequences that one run "
              "recorded at the step and the other did not\n- scalar_moved: a per-call scalar (loss, policy_loss, kl) "
              "moved")


def moved_scalars(c: dict) -> tuple[str, pd.DataFrame | None]:
    """The per-call scalars (a rank's micro-batch's loss, policy_loss, kl) that moved, as `harness diff` prints
    them: prose and a table (step, call, field, A, B, ULP), or why they were not compared."""
    if not c["scalars"]:
        return (f"Not compared: the layouts differ (A: {layout_text(c['meta_a'])}; B: {layout_text(c['meta_b'])}), "
                f"so a call's micro-batch holds other sequences in each run.", None)
    d = c["diffs"][c["diffs"]["field"].isin(SCALAR_FIELDS)]
    moved = d[d["missing"] == ""]
    table = pd.DataFrame({"step": moved["step"].astype("int64"), "call": moved["sequence"], "field": moved["field"],
                          "A": moved["value_a"].map(repr), "B": moved["value_b"].map(repr),
                          "ULP": moved["ulp"].astype("int64")})
    alone = len(d) - len(moved)
    return ("Each call (`rank<R>/micro-batch<M>`) whose loss, policy_loss or kl has other bits in B; at most 200 rows."
            + f" {plural(alone, 'per-call value')} in one run only, not listed." * bool(alone), table.head(200))


def training_report(a_path: str, b_path: str, out: Path) -> dict:
    """Two recorded training runs (`harness/training.py`): the verdict, a per-step view, the moved sequences, the
    per-call scalars that moved and the sequences in one run only; returns the comparison (`training_comparison`)."""
    c = training_comparison(a_path, b_path)
    out.mkdir(parents=True, exist_ok=True)
    _save(per_step_figure(c["steps"]), out / "per_step.png")
    runs = pd.DataFrame([{"run": name, "path": path, **{k: m.get("provenance", {}).get(k) for k in
                                                        ("device", "torch", "triton", "deterministic_algorithms")},
                          **{k: m.get("metadata", {}).get(k) for k in LAYOUT}, "ranks": len(m["ranks"]),
                          "steps": m["steps"]}
                         for name, path, m in (("A", a_path, c["meta_a"]), ("B", b_path, c["meta_b"]))])
    listing = c["verdicts"].astype({"max_ulp": "int64"}).merge(c["places"], on=["step", "sequence", "occurrence"],
                                                               how="left")
    listing = listing[["step", "rank", "micro_batch", "position", "sequence", "occurrence", "cause", "first_module",
                       "fields", "max_ulp", "text"]]
    gone = c["diffs"][c["diffs"]["in_one_run"] & ~c["diffs"]["field"].isin(SCALAR_FIELDS)]
    gone = gone[["step", "sequence", "occurrence", "missing"]].drop_duplicates().rename(
        columns={"missing": "missing in"})
    sections = [
        ("Runs", f"A = {a_path}\nB = {b_path}\n{verdict_text(c)}", runs, None),
        ("Per step", PER_STEP, c["steps"], "per_step.png"),
        ("Sequences that moved", "Where each sat in A (rank, micro-batch, its position in the call), its key, why it "
         "moved, the first module whose output moved (runs recorded with `record_layers`), the fields that moved and "
         "the start of its completion (runs that recorded their rollouts). At most 200 rows, by step.",
         listing.head(200), None),
        *layer_sections(c["verdicts"]),
        ("Per-call scalars that moved", *moved_scalars(c), None),
        ("In one run only", "One row per sequence (key#occurrence) that one run recorded at a step and the other did "
         "not; `missing in` names the run that lacks it. At most 200 rows.", gone.head(200), None),
    ]
    for side in ("A", "B"):
        sections += sampler_sections(side, c["sampler"][side])
    _write(out, "Training drift report", sections)
    (out / "differences.txt").write_text(format_moved(c["verdicts"], c["diffs"], c["places"], limit=10**9) + "\n")
    return c


def layer_sections(verdicts: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame, None]]:
    """Runs with layer digests: per step, the first module whose output moved and in how many sequences."""
    layered = verdicts[verdicts["first_module"] != ""]
    if layered.empty:
        return []
    table = layered.groupby(["step", "first_module"]).size().reset_index(name="sequences")
    return [("Where the drift starts", "Per step, for the sequences whose inputs moved: the first module (in the "
             "order the forward runs them) whose output rows have other bits; the modules before it kept theirs.",
             table, None)]


def sampler_sections(side: str, m: dict[str, pd.DataFrame] | None) -> list[tuple[str, str, pd.DataFrame, None]]:
    """A run recorded with `record_sampler`: its sampler's log-probs against its trainer's, per step, and the worst
    sequences and tokens."""
    if m is None:
        return []
    return [(f"Sampler against trainer, run {side}", sampler_text(side, m) + ". Per step, over the completion tokens "
             "(delta = the trainer's log-prob - the sampler's; k3 KL: the mean of exp(delta) - delta - 1; ratio: a "
             "sequence's exp(sum delta)).", m["steps"], None),
            (f"Worst sequences, run {side}", "By the largest |delta| of a token.", m["sequences"], None),
            (f"Worst tokens, run {side}", "The token of each sequence with the largest |delta|, the largest first.",
             m["tokens"], None)]


def drift_report(a_path: str, b_path: str, out: Path) -> pd.DataFrame | dict:
    """Compares run A with run B layout with layout (two training runs: step by step, sequence by sequence) and
    writes the report; returns the differences (two training runs: their comparison, `training_comparison`'s).

    Raises `UsageError` when a path is not a run (folder or run.parquet)."""
    if is_training_run(a_path) or is_training_run(b_path):
        return training_report(a_path, b_path, out)
    a, meta_a = load_run("RUN_A", a_path)
    b, meta_b = load_run("RUN_B", b_path)
    out.mkdir(parents=True, exist_ok=True)
    diffs = compare(a, b, ("A", "B"))
    cells = drift_first(summarize(cells_of(a, b), diffs))
    moved = diffs[diffs["missing"] == ""]
    seq = moved[moved["field"].isin(VECTOR_FIELDS)]
    _save(ulp_histogram(seq), out / "ulp_histogram.png")
    _save(moved_by_scenario(cells), out / "moved_by_scenario.png")

    prov = pd.DataFrame([{"run": name, "planted": _planted(m), **{k: m.get("provenance", {}).get(k) for k in
                                                                   ("git_commit", "torch", "triton", "device",
                                                                    "process_group")}}
                         for name, m in (("A", meta_a), ("B", meta_b))])
    vs = cells[["scenario", "topology", "status", "scalar_moved", "sequences_moved", "fields_moved", "max_ulp",
                "missing_rows"]].astype({"max_ulp": "int64"})
    listing = seq[["scenario", "topology", "field", "index", "value", "ref_value", "ulp"]].rename(
        columns={"value": "A", "ref_value": "B"}).astype({"ulp": "int64"})
    gone = diffs[diffs["missing"] != ""].groupby(["scenario", "topology", "missing"]).size().reset_index(
        name="rows").rename(columns={"missing": "missing in"})
    drifted, absent = cells["status"].str.contains("drift"), cells["status"].str.contains("missing")
    if diffs.empty:
        verdict = "identical: every value and gradient digest has the same bits"
    else:
        verdict = (f"{plural(len(moved), 'value')} moved in {plural(int(drifted.sum()), 'cell')} of {len(cells)} "
                   f"(scenario x layout); the scalar loss moved in {int(cells['scalar_moved'].sum())} of them")
        if absent.any():
            verdict += (f"; {plural(int(absent.sum()), 'cell')} with rows on one side only (listed under Missing on "
                        f"one side): missing, not drift")
    contracts = contract_differences(a, b)
    if len(contracts):  # whatever the bits say: not the same experiment
        verdict = (f"the contracts differ in {plural(len(contracts), 'cell')} (" + ", ".join(
            f"{c.scenario} {c.topology}" for c in contracts.head(8).itertuples()) + "): not the same experiment; "
            + verdict)
    _write(out, "Drift report", [
        ("Runs", f"A = {a_path} (planted: {_planted(meta_a)})\nB = {b_path} (planted: {_planted(meta_b)})\n{verdict}",
         prov, None),
        ("Scalar versus vector", "Per scenario x layout cell, the cells that moved first: did a scalar (loss, "
         "policy_loss, kl) move, how many sequences did, the largest ULP distance, rows present on one side only.",
         vs, None),
        ("Per-sequence ULP distances", "Histogram over every moved per-sequence value.", None, "ulp_histogram.png"),
        ("Sequences that moved", "By scenario (at most 200 rows listed).", listing.head(200), "moved_by_scenario.png"),
        ("Missing on one side", "Rows that one run has and the other lacks: not compared, not drift.", gone, None),
    ])
    (out / "differences.txt").write_text(format_differences(diffs, limit=10**9, names=("A", "B")) + "\n")
    return diffs


def study_figure(df: pd.DataFrame, sequences: int) -> Figure:
    """Per seed: how many per-sequence values moved next to whether the scalar loss moved. Each sequence has two
    values (its policy and its KL sums), so the count reaches 2 x `sequences`; the legend sits below the axes, where
    no bar is."""
    fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(df) + 2), 4.0))
    x = df["seed"].to_numpy()
    ax.bar(x - 0.2, df["sequence_values_moved"], width=0.4,
           label=f"per-sequence values moved (policy and KL of {sequences} sequences: at most {2 * sequences})")
    ax.bar(x + 0.2, df["loss_moved"].astype(int), width=0.4, label="scalar loss moved (0 or 1)")
    ax.set_title("Regrouped token sum: vector versus scalar, per seed")
    ax.set_xlabel("seed")
    ax.set_ylabel("values moved")
    ax.set_xticks(x)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=1, frameon=False)
    return fig


def study_verdict(vector_moved: int, loss_moved: int) -> str:
    """What the study's counts show about comparing the scalar loss only, and nothing more."""
    if vector_moved == 0:
        return "Nothing moved: on these inputs regrouping changed no bit."
    hidden = vector_moved - loss_moved
    if hidden > 0:
        return (f"In {plural(hidden, 'seed')} the per-sequence vector moved and the scalar loss did not: there, "
                "comparing only the scalar would have hidden the drift.")
    return ("The scalar loss moved in every seed in which the vector moved: on these inputs the scalar alone would "
            "have caught the drift (the vector still says which sequences moved, and by how many ULP). Many sequences "
            "of few tokens (--sequences 256 --tokens 16) are where the scalar can stay put.")


def regroup_study(seeds: int, out: Path, seq_len: int = 128, vocab: int = 1000, sequences: int = 8) -> dict:
    """Tree vs sequential per-sequence token sums over `seeds` seeds: how often each level moves."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in range(seeds):
        scn = Scenario(f"study_{seed}", vocab=vocab, seed=1000 + seed, seq_len=seq_len, num_sequences=sequences)
        inp, c = scn.inputs(), scn.contract()
        res = [op.apply(inp["policy_logits"], inp["action_ids"], inp["old_logps"], inp["rewards"], contract=c,
                        completion_mask=inp["completion_mask"], ref_local_logits=inp["ref_logits"])
               for op in (DistributedGRPOLossOp(), RegroupedTokenSumOp())]
        vec = sum(int((getattr(res[0], f).view(torch.int32) != getattr(res[1], f).view(torch.int32)).sum())
                  for f in ("per_sequence_policy", "per_sequence_kl"))
        rows.append(dict(seed=seed, sequence_values_moved=vec, vector_moved=vec > 0,
                         loss_moved=bool(res[0].loss.view(torch.int32) != res[1].loss.view(torch.int32)),
                         loss_ulp=abs(int(res[0].loss.view(torch.int32)) - int(res[1].loss.view(torch.int32)))))
    df = pd.DataFrame(rows)
    summary = {"seeds": seeds, "vector_moved": int(df["vector_moved"].sum()), "loss_moved": int(df["loss_moved"].sum()),
               "shape": f"{sequences} sequences x {seq_len} tokens x V={vocab}"}
    _save(study_figure(df, sequences), out / "study.png")
    _write(out, "Comparing configurations: regrouped token sums", [
        ("Result", f"Regrouping each sequence's token sum (fixed pairwise tree vs left-to-right) over "
         f"{plural(seeds, 'seed')} ({summary['shape']}): the per-sequence vector moved in {summary['vector_moved']} "
         f"of {plural(seeds, 'seed')}, the scalar loss in {summary['loss_moved']} of {plural(seeds, 'seed')}. "
         + study_verdict(summary["vector_moved"], summary["loss_moved"]), df, "study.png")])
    (out / "study.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
