"""`python -m reports drift A B --out DIR` | `python -m reports study --seeds 12 --out DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .drift import drift_report, regroup_study


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reports", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drift", help="compare two recorded runs (run folders or run.parquet files)")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--out", required=True)
    s = sub.add_parser("study", help="regrouped token sums over seeds: vector versus scalar")
    s.add_argument("--seeds", type=int, default=12)
    s.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "drift":
        diffs = drift_report(args.a, args.b, Path(args.out))
        print(f"{len(diffs)} values differ; report: {Path(args.out) / 'report.html'}")
        return 0
    summary = regroup_study(args.seeds, Path(args.out))
    print(f"per-sequence vector moved in {summary['vector_moved']} of {summary['seeds']} seeds; scalar loss moved in "
          f"{summary['loss_moved']} of {summary['seeds']}; report: {Path(args.out) / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
