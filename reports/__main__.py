"""`python -m reports drift A B --out DIR` | `python -m reports study --seeds 12 --out DIR`."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.cli import Parser, UsageError, positive_int, usage_error


def parser() -> Parser:
    p = Parser(prog="python -m reports", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drift", help="compare two recorded runs (run folders or run.parquet files)")
    d.add_argument("a", help="a run folder or its run.parquet")
    d.add_argument("b", help="a run folder or its run.parquet")
    d.add_argument("--out", required=True)
    s = sub.add_parser("study", help="regrouped token sums over seeds: vector versus scalar")
    s.add_argument("--seeds", type=positive_int, default=12)
    s.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from .drift import drift_report, regroup_study  # after parsing: a mistake is answered before torch loads
    if args.cmd == "drift":
        try:
            diffs = drift_report(args.a, args.b, Path(args.out))
        except UsageError as err:
            return usage_error("python -m reports drift", err)
        print(f"{len(diffs)} differences (moved or missing); report: {Path(args.out) / 'report.html'}")
        return 0
    summary = regroup_study(args.seeds, Path(args.out))
    print(f"per-sequence vector moved in {summary['vector_moved']} of {summary['seeds']} seeds; scalar loss moved in "
          f"{summary['loss_moved']} of {summary['seeds']}; report: {Path(args.out) / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
