"""`python -m harness COMMAND`: the determinism gate without nox. Exit codes: 0 when everything compared is
identical, 1 on any drift, missing row, golden mismatch or a world that did not finish, 2 on a mistake in the command
line (one line, before anything runs).

There is one golden set for every platform: the canonical math gives the same bits on every machine and on the
CPU and the GPU, so a golden recorded anywhere must hold everywhere. The one exception: the fused linear scenarios
run by the Triton kernels on a GPU, whose logits come from the tensor cores (no IEEE definition, no CPU twin): their
goldens are per GPU architecture, in a set beside the canonical one (`golden/sm_90` for the H200). With the torch
kernels (the CPU, or `--kernels torch`) they take the canonical set's, like every other scenario.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .cli import (GOLDEN, ROOT, UsageError, distinct_runs, from_checkout, harness_parser, missing_module,
                  under_torchrun, usage_error, world_size)

try:
    import pandas as pd
    import torch

    from .diff import (SINGLE, cells_of, compare, contract_differences, describe_cell, differences, drift_first,
                       format_differences, plural, summarize, topology_differences)
    from .golden import MANIFEST, PORTABLE, TENSOR_CORES, read_manifest, verify_golden, write_goldens
    from .record import TableError, git_commit, load_run, read_table, world_run, write_table
    from .scenarios import SCENARIOS
    from .topology import in_turn, layouts, run_torchrun, run_world
    from .training import cmd_diff_training, is_training_run, load_training_run
except ModuleNotFoundError as exc:  # an interpreter without the project (the system python3): one line, not a traceback
    if __name__ != "__main__":
        raise
    sys.exit(missing_module("python -m harness", exc))

PROVENANCE_KEYS = ("git_commit", "math_version", "machine", "cpu_model", "cpu_capability", "device", "device_type",
                   "torch", "triton", "python", "process_group", "kernels", "threads_per_rank")


def platform_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def _scenarios(args) -> list[str]:
    names = args.scenarios.split(",") if args.scenarios is not None else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise UsageError(f"--scenarios: expected names from {list(SCENARIOS)}, got {unknown}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"--scenarios: expected each name once, got {', '.join(repeated)} more than once")
    return names


def _check_device(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device: expected cpu (torch {torch.__version__} sees no CUDA device here), got cuda")
    if args.kernels == "triton" and args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError("--kernels: expected auto or torch with --device cpu (the Triton kernels need CUDA, or "
                         "TRITON_INTERPRET=1 for the CPU interpreter), got triton")
    if args.device == "cpu" and args.process_group == "nccl":
        raise UsageError("--process-group: expected gloo with --device cpu (NCCL needs GPUs), got nccl")


def _world(args) -> int:
    """The world size: torchrun's WORLD_SIZE under torchrun, else --max-world, $GRPO_MAX_WORLD or 4."""
    if args.torchrun:
        size = int(os.environ["WORLD_SIZE"])
        if args.max_world not in (None, size):
            raise UsageError(f"--max-world: expected nothing or {size} (torchrun's WORLD_SIZE), got {args.max_world}")
        return size
    if args.max_world is not None:
        return args.max_world
    try:
        return world_size(os.environ.get("GRPO_MAX_WORLD", "4"))
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"GRPO_MAX_WORLD: {err}") from None


def held_layouts(names: list[str], world: int) -> tuple[dict[str, list[str]], list[str]]:
    """Per scenario, the layouts of a world of `world` ranks it can be sharded on (TP at most its vocab tiles, DP
    at most its sequences: `ShardingSpec.uniform`'s bounds); and a line for each scenario that skips some."""
    held, skipped = {}, []
    for name in names:
        c = SCENARIOS[name].contract()
        tiles, seqs = c.logprob_contract.num_tiles, c.num_sequences
        held[name] = [l.name for l in layouts(world, max_tp=tiles, max_dp=seqs)]
        why = []
        if world > tiles:
            why.append(f"TP > {tiles} (vocab {c.vocab_size} holds {plural(tiles, 'tile')} of {c.vocab_tile})")
        if world > seqs:
            why.append(f"DP > {seqs} ({plural(seqs, 'sequence')})")
        if why:
            skipped.append(f"{name}: layouts with {' or '.join(why)} skipped")
    return held, skipped


def _record(args, held: dict[str, list[str]], world: int) -> dict | None:
    """Every scenario on the layouts it holds (`held_layouts`), in one world: the scenarios that hold the same
    layouts in one pass. Rank 0 gets the rows, the guards and the provenance; every other rank None."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, lays in held.items():
        groups.setdefault(tuple(lays), []).append(name)
    calls = [(names, list(lays), getattr(args, "plant_drift", None), args.kernels, True)
             for lays, names in groups.items()]
    if args.torchrun:
        outs = run_torchrun(in_turn, world_run, calls, device=args.device, timeout_s=args.timeout,
                            memory_fraction=args.cuda_memory_fraction)
    else:
        outs = run_world(in_turn, world, world_run, calls, device=args.device, backend=args.process_group,
                         timeout_s=args.timeout, memory_fraction=args.cuda_memory_fraction)[0]
    if outs[0] is None:
        return None
    return {"rows": [r for o in outs for r in o["rows"]], "provenance": outs[0]["provenance"],
            "guards": {k: v for o in outs for k, v in o["guards"].items()}}


def side_by_side(golden: dict, run: dict) -> str:
    """The golden's provenance next to this run's, one key a line, `*` where they differ."""
    lines = [f"  {'':16s} {'golden':44s} this run"]
    for k in PROVENANCE_KEYS:
        a, b = str(golden.get(k, "?")), str(run.get(k, "?"))
        lines.append(f"{'*' if a != b else ' '} {k:16s} {a:44s} {b}")
    return "\n".join(lines)


def _golden_dir(args) -> Path:
    """`--golden-dir`, or the golden set of the checkout this harness runs from; an installed harness has none."""
    if args.golden_dir is not None:
        return Path(args.golden_dir)
    if not from_checkout():
        raise UsageError(f"--golden-dir: expected the folder of a golden set, e.g. a checkout's golden/canonical (this "
                         f"harness is installed, in {ROOT}, and ships no golden set), got nothing")
    return GOLDEN


def golden_sets(args, names: list[str], canonical: Path) -> list[tuple[Path, list[str]]]:
    """`(folder, the scenarios whose golden it holds)`: the canonical set, and for the fused linear scenarios on a GPU
    with the Triton kernels the set of this GPU's architecture beside it."""
    linear = [n for n in names if SCENARIOS[n].linear]
    if args.device != "cuda" or args.kernels == "torch" or not linear:
        return [(canonical, names)]
    major, minor = torch.cuda.get_device_capability()
    return [(canonical, [n for n in names if n not in linear]), (canonical.parent / f"sm_{major}{minor}", linear)]


def _check_kind(folder: Path, canonical: Path) -> None:
    """The set at `folder` holds the kind of bits the run compares there (`bits` in its manifest): the canonical
    math's where `canonical` is, the tensor cores' of its architecture in a set beside it."""
    want = PORTABLE if folder == canonical else TENSOR_CORES.format(arch=folder.name)
    got = read_manifest(folder).get("bits", "")
    if got != want:
        sibling = canonical.parent / "canonical"
        advice = f"; pass --golden-dir {sibling}" if folder == canonical and (sibling / MANIFEST).is_file() else ""
        raise UsageError(f"--golden-dir: expected a golden set whose bits are {want.split(':')[0]} for this run, "
                         f"got {folder}, whose {MANIFEST} says {got.split(':')[0] or 'nothing'}{advice}")


def _record_cmd(args, folder: Path, served: list[str] | None = None, canonical: Path | None = None) -> str:
    """How to record the golden set at `folder` (only a checkout records goldens: they are committed there); a
    per-architecture set beside `canonical` is recorded with the Triton kernels, for its `served` scenarios."""
    if not from_checkout():
        return ("record it in a checkout, where goldens are committed (nox -s goldens), and point --golden-dir at its "
                "golden/canonical")
    canonical = canonical or folder
    extra = f"--device {args.device}" + ("" if args.golden_dir is None else f" --golden-dir {canonical}")
    if folder != canonical:
        extra += f" --kernels {args.kernels} --scenarios {','.join(served)}"
    return f"record it with: nox -s goldens -- {extra}   (or python -m harness goldens {extra})"


def _restore_hint(folder: Path) -> str:
    """How to restore a damaged golden set: from git when `folder` is in a git checkout."""
    try:
        inside = subprocess.run(["git", "-C", str(folder), "rev-parse", "--is-inside-work-tree"], capture_output=True,
                                text=True, timeout=10).stdout.strip() == "true"
    except (OSError, subprocess.SubprocessError):
        inside = False
    return f"git checkout -- {folder}" if inside else f"copy it again from where it came: {folder} is not under git"


def _claim(stamp: Path) -> Path:
    """Creates the folder `stamp`, or `stamp-2`, `stamp-3`, ... when it exists: runs started in the same second, in
    this process or beside it, each get their own (the check and the creation are one step)."""
    stamp.parent.mkdir(parents=True, exist_ok=True)  # a parent that is not a folder raises here, once
    run_dir, n = stamp, 1
    while True:
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            n += 1
            run_dir = stamp.with_name(f"{stamp.name}-{n}")


def _run_dir(args, golden_dir: Path) -> Path:
    """The run's folder: `--out` (refused when it holds a run, or lies in the golden set), or runs/<timestamp> (its
    start; `_claim`ed when the run is written)."""
    if args.out is None:  # the checkout's runs/ (ignored by git) wherever the command starts; installed: ./runs
        return (ROOT if from_checkout() else Path.cwd()) / "runs" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.out)
    held = [n for n in ("run.parquet", "summary.md", "summary.csv") if (run_dir / n).exists()]
    if run_dir.exists() and not run_dir.is_dir() or held:
        what = "a file" if not run_dir.is_dir() else f"a run ({', '.join(held)})"
        raise UsageError(f"--out: expected a new or empty folder (an existing run is never replaced), got {run_dir}, "
                         f"which is {what}")
    if run_dir.resolve().is_relative_to(golden_dir.resolve()):
        raise UsageError(f"--out: expected a folder outside the golden set {golden_dir} (a run never writes where its "
                         f"goldens are), got {run_dir}")
    return run_dir


def cmd_run(args) -> int:
    started = time.monotonic()
    world = _world(args)
    lays = [l.name for l in layouts(world)]
    names = _scenarios(args)
    held, skipped = held_layouts(names, world)
    _check_device(args)
    if args.plant_drift is not None and args.plant_drift not in lays:
        raise UsageError(f"--plant-drift: expected one of this run's layouts ({', '.join(lays)}), got "
                         f"{args.plant_drift}")
    if args.plant_drift is not None and not any(args.plant_drift in h for h in held.values()):
        raise UsageError(f"--plant-drift: expected a layout that one of the scenarios can be sharded on "
                         f"({'; '.join(skipped)}), got {args.plant_drift}")
    golden_dir = _golden_dir(args)
    if not golden_dir.is_dir():
        raise UsageError(f"--golden-dir: expected a folder holding a golden set, got {golden_dir} "
                         f"({'a file' if golden_dir.exists() else 'no such folder'})")
    sets = [(folder, served) for folder, served in golden_sets(args, names, golden_dir) if served]
    commands = {folder: _record_cmd(args, folder, served, golden_dir) for folder, served in sets}
    parts, recorded = [], {}
    for folder, served in sets:
        try:  # before the world starts: a damaged golden fails at once
            got = verify_golden(folder)
        except TableError as err:
            if os.environ.get("RANK", "0") == "0":
                print(f"FAIL: golden {err}\nThe golden set in {folder} is damaged or is not this code's. Restore it "
                      f"({_restore_hint(folder)}) or {commands[folder]}", file=sys.stderr)
                print("determinism: FAILED (1 problem)")
            return 1
        if got is None and folder == golden_dir:
            inside = sorted((m.parent for m in golden_dir.glob(f"*/{MANIFEST}")), key=lambda f: f.name != "canonical")
            holds = (f"the sets {', '.join(map(str, inside))} in folders of its own: pass one, e.g. --golden-dir "
                     f"{inside[0]}" if inside else f"none; {commands[folder]}")
            raise UsageError(f"--golden-dir: expected a folder holding a golden set (MANIFEST.json and its .parquet "
                             f"files), got {golden_dir}, which holds {holds}")
        if got is not None:  # a per-architecture set not recorded yet: its scenarios have no golden (below)
            _check_kind(folder, golden_dir)
            parts.append(got[0][got[0]["scenario"].isin(served)])
            recorded.update({k: v for k, v in got[1].items() if k in served})
    run_dir = _run_dir(args, golden_dir)
    out = _record(args, held, world)
    if out is None:  # a torchrun rank other than 0
        return 0
    if args.out is None:
        run_dir = _claim(run_dir)
    meta = {"provenance": out["provenance"], "guards": out["guards"], "layouts": lays,
            "platform": platform_name(args.device), "plant_drift": args.plant_drift}
    write_table(out["rows"], run_dir / "run.parquet", meta)
    df, _ = read_table(run_dir / "run.parquet")  # diff exactly what was written

    topo = topology_differences(df)
    table = summarize(cells_of(df), topo).rename(columns={"status": "vs_single_rank"})
    failures = [f"guard {name}: {msg}" for name, msg in out["guards"].items() if msg]
    golden = pd.concat(parts, ignore_index=True) if parts else df.iloc[:0]
    gold = differences(df[df["scenario"].isin(golden["scenario"].unique())], golden)
    gsum = summarize(cells_of(df), gold).set_index(["scenario", "topology"])
    table["vs_golden"] = [gsum.loc[(s, t), "status"] if s in recorded else "no golden"
                          for s, t in zip(table["scenario"], table["topology"])]
    for folder, served in sets:
        missing = sorted(set(served) - set(golden["scenario"]))
        if missing:
            failures.append(f"no golden for scenarios {missing} in {folder}; {commands[folder]}")
    ref = df[df["topology"] == SINGLE].groupby("scenario")["fingerprint"].first()
    stale = [s for s, fp in golden.groupby("scenario")["fingerprint"].first().items() if ref.get(s, fp) != fp]
    if stale:
        failures.append(f"golden contract fingerprints differ for {stale}: the scenario's contract changed; "
                        f"re-record the goldens only if the change is intended")
    grid = table.pivot(index="scenario", columns="topology", values="vs_single_rank")
    grid = grid.reindex(columns=lays, fill_value="skipped").fillna("skipped")  # not run there, not missing
    print(f"\n{plural(df['scenario'].nunique(), 'scenario')} x {plural(len(lays), 'layout')} on {meta['platform']} "
          f"({out['provenance']['process_group']}, world {world}) in {time.monotonic() - started:.1f} s")
    for line in skipped:
        print(line)
    if args.plant_drift:
        print(f"planted: a regrouped token sum at {args.plant_drift} (the gate must fail)")
    print(grid.to_string())
    print("vs golden:", ", ".join(f"{k}={v}" for k, v in table["vs_golden"].value_counts().items()))
    for what, diffs, names in (("drifted between topologies", topo, ("layout", SINGLE)),
                               ("differ from the golden", gold, ("run", "golden"))):
        if len(diffs):
            if len(diffs) == 1:
                what = what.replace("differ ", "differs ")
            cells = "\n".join("  " + describe_cell(c) for c in summarize(cells_of(diffs), diffs).itertuples())
            failures.append(f"{plural(len(diffs), 'row')} {what}:\n{cells}\n" + format_differences(diffs, names=names))
    if len(gold) and set(gold["topology"]) == {args.plant_drift}:  # the plant and nothing else moved
        failures[-1] += (f"\nEvery one of them is at {args.plant_drift}, where the drift was planted: the gate caught "
                         f"it, and the golden is not at fault (do not re-record it)")
    elif len(gold):  # what to do next: where the golden came from, and how to record one
        first = gold["scenario"].iloc[0]
        folder = next(f for f, served in sets if first in served)
        promise = ("The canonical math promises the same bits on every machine" if folder == golden_dir else
                   f"The tensor cores promise the same bits on every GPU of the architecture of {folder}")
        failures[-1] += ("\nThe golden was recorded here (`*`: differs from this run):\n"
                         + side_by_side(recorded.get(first, {}), out["provenance"])
                         + f"\n{promise}, so a difference is a change of the math (or a bug) to explain. Once the "
                           f"change is intended, " + commands[folder].replace("record", "re-record", 1))
    skips = [*(f"- {line}" for line in skipped), ""] if skipped else []
    report = ["# Determinism run", "", f"Platform `{meta['platform']}`, provenance:", "",
              "```json", json.dumps(out["provenance"], indent=1), "```", "", *skips, "```", grid.to_string(), "```", "",
              "## Failures" if failures else "All identical.", ""]
    report += [f"- {f}" for f in failures]
    (run_dir / "summary.md").write_text("\n".join(report) + "\n")
    table.to_csv(run_dir / "summary.csv", index=False)
    print(f"recorded {run_dir / 'run.parquet'}; summary {run_dir / 'summary.md'}")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    print(f"determinism: FAILED ({plural(len(failures), 'problem')})" if failures else "determinism: all identical")
    return 1 if failures else 0


def cmd_diff(args) -> int:
    training = is_training_run(args.a) or is_training_run(args.b)
    distinct_runs(args.a, args.b, lambda: (load_training_run if training else load_run)("RUN_A", args.a))
    if training:
        return cmd_diff_training(args.a, args.b)
    a, _ = load_run("RUN_A", args.a)
    b, _ = load_run("RUN_B", args.b)
    print(f"A = {args.a}\nB = {args.b}")
    a, b, shared = _shared_layouts(a, b)
    diffs, contracts = compare(a, b, ("A", "B")), contract_differences(a, b)
    cells = summarize(cells_of(a, b), diffs)
    other = cells.set_index(["scenario", "topology"]).index.isin(contracts.set_index(["scenario", "topology"]).index)
    cells["status"] = [f"contract differs, {st}".replace(", identical", "") if o else st
                       for st, o in zip(cells["status"], other)]
    cells = drift_first(cells)
    print(cells.to_string(index=False))
    if diffs.empty and contracts.empty:
        print(f"identical: {plural(len(cells), 'cell')} ({plural(cells['scenario'].nunique(), 'scenario')} x "
              f"{plural(cells['topology'].nunique(), 'layout')}{' both runs hold' * shared}), {plural(len(a), 'row')} "
              f"compared bitwise")
        return 0
    for c in contracts.itertuples(index=False):
        print(f"  {c.scenario} {c.topology}: contract fingerprint A {c.a} vs B {c.b}")
    print(format_differences(diffs, limit=50, names=("A", "B")))
    moved, gone = int((diffs["missing"] == "").sum()), int((diffs["missing"] != "").sum())
    unlike = (f"; the contracts differ in {plural(len(contracts), 'cell')} (different contracts are not the same "
              f"experiment)" if len(contracts) else "")
    print(f"FAILED: {plural(moved, 'value')} moved and {plural(gone, 'row')} missing on one side, in "
          f"{plural(int((cells['status'] != 'identical').sum()), 'cell')}{' of the layouts both runs hold' * shared}"
          f"{unlike}")
    return 1


def _shared_layouts(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, bool]:
    """Runs of different worlds (world 4 against world 2) are compared on the layouts both hold, and say so."""
    only_a, only_b = ([t for t in x["topology"].unique() if t not in set(y["topology"])] for x, y in ((a, b), (b, a)))
    if not only_a and not only_b:
        return a, b, False
    shared = [t for t in a["topology"].unique() if t in set(b["topology"])]
    print(f"The runs hold different layouts (only A: {', '.join(only_a) or 'none'}; only B: "
          f"{', '.join(only_b) or 'none'}): " + (f"comparing the {plural(len(shared), 'layout')} both hold, "
                                                 f"{', '.join(shared)}" if shared else "they share none"))
    if not shared:  # nothing to compare: every row is missing on one side
        return a, b, False
    keep = lambda run: run[run["topology"].isin(shared)]  # noqa: E731
    return keep(a), keep(b), True


def cmd_goldens(args) -> int:
    names = _scenarios(args)
    _check_device(args)
    folder = _golden_dir(args)
    commit = git_commit()
    if (commit == "unknown" or not from_checkout()) and not args.allow_no_git:
        where = "installed" if not from_checkout() else "in no git checkout"
        raise UsageError(f"--allow-no-git: expected a harness run from a git checkout or the flag, got {ROOT}, which "
                         f"is {where}; the manifest names the commit that recorded the goldens, and goldens belong "
                         f"in a checkout, committed")
    if commit.endswith("-dirty") and not args.allow_dirty:
        raise UsageError(f"--allow-dirty: expected a clean working tree or the flag, got uncommitted changes "
                         f"({commit}); commit first, so that the manifest names the code that recorded the goldens")
    platform = platform_name(args.device)
    sets = [(f, served) for f, served in golden_sets(args, names, folder) if served]
    every = dict(golden_sets(args, list(SCENARIOS), folder))  # each set: every scenario whose golden it holds
    keep = {}
    for target, served in sets:
        part = set(served) != set(every[target])
        if part:  # the other files stay: the set must be sound and of this platform
            try:
                existing = verify_golden(target)
            except TableError as err:
                raise UsageError(f"--scenarios: expected every scenario, since {target} fails a check ({err}); got "
                                 f"{args.scenarios}") from None
            if existing is not None:
                _check_kind(target, folder)
            if existing is not None and read_manifest(target)["platform"] != platform:
                raise UsageError(f"--scenarios: expected every scenario, since {target} was recorded on "
                                 f"{read_manifest(target)['platform']} and this is {platform}; got {args.scenarios}")
            part = existing is not None
        keep[target] = part
    out = _record(args, held_layouts(names, 1)[0], 1)
    if out is None:
        return 0
    rows = pd.DataFrame(out["rows"])
    for target, served in sets:
        bits = PORTABLE if target == folder else TENSOR_CORES.format(arch=target.name)
        write_goldens(target, rows[rows["scenario"].isin(served)], provenance=out["provenance"], platform=platform,
                      command="python -m harness goldens " + " ".join(sys.argv[2:]), keep_others=keep[target],
                      bits=bits)
        print(f"wrote {plural(len(served), 'golden')} to {target}"
              + (" (the other files of the set kept)" if keep[target] else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = harness_parser(__doc__, list(SCENARIOS)).parse_args(argv)
    if args.cmd != "diff":
        args.torchrun = args.torchrun or under_torchrun()
    try:
        return {"run": cmd_run, "diff": cmd_diff, "goldens": cmd_goldens}[args.cmd](args)
    except UsageError as err:
        if os.environ.get("RANK", "0") == "0":
            usage_error("python -m harness " + args.cmd, err)
        return 2
    except TimeoutError as err:  # a world that did not finish: one line, a failure (exit 1), not a traceback
        print(f"python -m harness {args.cmd}: FAILED: {err} (--timeout {args.timeout:g})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
