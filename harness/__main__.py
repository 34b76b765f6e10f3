"""`python -m harness run|diff|goldens`: the determinism gate without nox.

  run      every scenario on every TP x DP layout of up to --max-world ranks; bitwise diff of every topology
           against the single-rank run and of the run against the golden; exit 1 on any drift
  diff     two recorded runs (run.parquet files), bitwise
  goldens  record the goldens (explicit: never a side effect of `run`)

There is one golden set for every platform: the canonical math gives the same bits on every machine and on the
CPU and the GPU, so a golden recorded anywhere must hold everywhere.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import pandas as pd

from .diff import SINGLE, differences, format_differences, summarize, topology_differences
from .record import git_commit, read_table, world_run, write_table
from .scenarios import SCENARIOS
from .topology import layouts, run_torchrun, run_world

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "canonical"
PROVENANCE_KEYS = ("git_commit", "math_version", "machine", "cpu_model", "cpu_capability", "device", "device_type",
                   "torch", "triton", "python", "process_group", "threads_per_rank")


def platform_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def _record(args, layout_names: list[str], world: int) -> dict | None:
    names = args.scenarios.split(",") if args.scenarios else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        sys.exit(f"--scenarios: unknown {unknown}; expected names from {list(SCENARIOS)}")
    call = (names, layout_names, getattr(args, "plant_drift", None), True)
    if getattr(args, "torchrun", False):
        return run_torchrun(world_run, *call, device=args.device, timeout_s=args.timeout,
                            memory_fraction=args.cuda_memory_fraction)
    return run_world(world_run, world, *call, device=args.device, backend=args.backend, timeout_s=args.timeout,
                     memory_fraction=args.cuda_memory_fraction)[0]


def load_golden(folder: Path) -> tuple[pd.DataFrame, dict] | None:
    """The golden rows and the manifest's provenance, or None when the folder holds no golden."""
    files = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
    if not files:
        return None
    manifest = folder / "MANIFEST.json"
    recorded = json.loads(manifest.read_text()).get("provenance", {}) if manifest.is_file() else {}
    return pd.concat([read_table(f)[0] for f in files], ignore_index=True), recorded


def side_by_side(golden: dict, run: dict) -> str:
    """The golden's provenance next to this run's, one key a line, `*` where they differ."""
    lines = [f"  {'':16s} {'golden':44s} this run"]
    for k in PROVENANCE_KEYS:
        a, b = str(golden.get(k, "?")), str(run.get(k, "?"))
        lines.append(f"{'*' if a != b else ' '} {k:16s} {a:44s} {b}")
    return "\n".join(lines)


def cmd_run(args) -> int:
    started = time.monotonic()
    if args.torchrun:  # the world is torchrun's: every layout that fits in it
        args.max_world = int(os.environ["WORLD_SIZE"])
    lays = [l.name for l in layouts(args.max_world)]
    out = _record(args, lays, args.max_world)
    if out is None:  # a torchrun rank other than 0
        return 0
    run_dir = Path(args.out or ROOT / "runs" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    df = pd.DataFrame(out["rows"])
    meta = {"provenance": out["provenance"], "guards": out["guards"], "layouts": lays,
            "platform": platform_name(args.device), "plant_drift": args.plant_drift}
    write_table(out["rows"], run_dir / "run.parquet", meta)
    df, _ = read_table(run_dir / "run.parquet")  # diff exactly what was written

    topo = topology_differences(df)
    table = summarize(df, topo).rename(columns={"status": "vs_single_rank"})
    golden_dir = Path(args.golden_dir)
    loaded = load_golden(golden_dir)
    failures = [f"guard {name}: {msg}" for name, msg in out["guards"].items() if msg]
    record_cmd = f"nox -s goldens -- --device {args.device}   (or python -m harness goldens --device {args.device})"
    if loaded is None:
        table["vs_golden"] = "no golden"
        failures.append(f"no golden under {golden_dir}/; record one with: {record_cmd}")
        gold = pd.DataFrame(columns=topo.columns)
    else:
        golden, recorded = loaded
        gold = differences(df[df["scenario"].isin(golden["scenario"].unique())], golden)
        gsum = summarize(df, gold).set_index(["scenario", "topology"])
        table["vs_golden"] = [gsum.loc[(s, t), "status"] if (s, t) in gsum.index else "no golden"
                              for s, t in zip(table["scenario"], table["topology"])]
        missing = sorted(set(df["scenario"]) - set(golden["scenario"]))
        if missing:
            failures.append(f"no golden for scenarios {missing}; record them with: {record_cmd}")
        ref = df[df["topology"] == SINGLE].groupby("scenario")["fingerprint"].first()
        stale = [s for s, fp in golden.groupby("scenario")["fingerprint"].first().items() if ref.get(s, fp) != fp]
        if stale:
            failures.append(f"golden contract fingerprints differ for {stale}: the scenario's contract changed; "
                            f"re-record the goldens only if the change is intended")
    grid = table.pivot(index="scenario", columns="topology", values="vs_single_rank")[lays]
    print(f"\n{len(df['scenario'].unique())} scenarios x {len(lays)} layouts on {meta['platform']} "
          f"({out['provenance']['process_group']}, world {args.max_world}) in {time.monotonic() - started:.1f} s")
    print(grid.to_string())
    print("vs golden:", ", ".join(f"{k}={v}" for k, v in table["vs_golden"].value_counts().items()))
    for what, diffs in (("drifted between topologies", topo), ("differ from the golden", gold)):
        if len(diffs):
            cells = summarize(diffs, diffs)
            moved = "\n".join(f"  {c.scenario} {c.topology}: {c.sequences_moved} sequences moved ({c.fields_moved}); "
                              f"scalar moved: {'yes' if c.scalar_moved else 'no'}; max {c.max_ulp:.0f} ULP"
                              for c in cells.itertuples(index=False))
            failures.append(f"{len(diffs)} values {what}:\n{moved}\n" + format_differences(diffs))
    if len(gold):
        failures.append("the golden was recorded here (`*`: differs from this run):\n"
                        + side_by_side(recorded, out["provenance"])
                        + "\nThe canonical math promises the same bits on every machine, so a difference is a "
                          "change of the math (or a bug) to explain. Re-record the goldens, once the change is "
                          f"intended, with: {record_cmd}")
    report = ["# Determinism run", "", f"Platform `{meta['platform']}`, provenance:", "",
              "```json", json.dumps(out["provenance"], indent=1), "```", "", "```", grid.to_string(), "```", "",
              "## Failures" if failures else "All identical.", ""]
    report += [f"- {f}" for f in failures]
    (run_dir / "summary.md").write_text("\n".join(report) + "\n")
    table.to_csv(run_dir / "summary.csv", index=False)
    print(f"recorded {run_dir / 'run.parquet'}; summary {run_dir / 'summary.md'}")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    print(f"determinism: FAILED ({len(failures)} problems)" if failures else "determinism: all identical")
    return 1 if failures else 0


def cmd_diff(args) -> int:
    a, _ = read_table(Path(args.a))
    b, _ = read_table(Path(args.b))
    diffs = differences(a, b[b["topology"] == args.reference_topology])
    print(summarize(a, diffs).to_string(index=False))
    print(format_differences(diffs, limit=50) if len(diffs) else "identical")
    return 1 if len(diffs) else 0


def cmd_goldens(args) -> int:
    commit = git_commit()
    if commit.endswith("-dirty") and not args.allow_dirty:
        print(f"goldens: the working tree has uncommitted changes ({commit}); commit first, so that the manifest "
              f"names the code that recorded them, or pass --allow-dirty", file=sys.stderr)
        return 2
    out = _record(args, [SINGLE], 1)
    platform = platform_name(args.device)
    folder = Path(args.golden_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.parquet"):
        stale.unlink()
    df = pd.DataFrame(out["rows"])
    files = {}
    for name, rows in df.groupby("scenario"):
        path = folder / f"{name}.parquet"
        write_table(rows.to_dict("records"), path, {"provenance": out["provenance"], "platform": platform})
        files[path.name] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                            "fingerprint": rows["fingerprint"].iloc[0]}
    manifest = {"platform": platform, "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "command": "python -m harness goldens " + " ".join(sys.argv[2:]),
        "provenance": out["provenance"], "files": files}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(files)} goldens to {folder}")
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "goldens"):
        s = sub.add_parser(name)
        s.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
        s.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                       help="default: gloo on the CPU; NCCL with one GPU per rank; gloo when ranks share a GPU")
        s.add_argument("--scenarios", default=None, help="comma-separated names (default: all)")
        s.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung world is killed")
        s.add_argument("--cuda-memory-fraction", type=_fraction, default=0.2,
                       help="cap on each rank's share of its GPU's memory (default 0.2), so that a run can share a "
                            "node with a training job")
        s.add_argument("--torchrun", action="store_true", help="this process was started by torchrun")
        s.add_argument("--golden-dir", default=str(GOLDEN), help="the golden set (default: golden/canonical)")
        if name == "goldens":
            s.add_argument("--allow-dirty", action="store_true",
                           help="record from a working tree with uncommitted changes")
        if name == "run":
            s.add_argument("--max-world", type=int, default=int(os.environ.get("GRPO_MAX_WORLD", 4)))
            s.add_argument("--out", default=None, help="run folder (default: runs/<timestamp>)")
            s.add_argument("--plant-drift", default=None, metavar="LAYOUT",
                           help="run a regrouped token-sum op at this layout (e.g. tp2xdp1): the gate must fail")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--reference-topology", default=SINGLE)
    args = p.parse_args(argv)
    return {"run": cmd_run, "diff": cmd_diff, "goldens": cmd_goldens}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
