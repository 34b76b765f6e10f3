"""`python -m reports drift RUN_A RUN_B --out DIR` | `python -m reports study --seeds 12 --out DIR`."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.cli import RUN_HELP, RUNS, Parser, UsageError, distinct_runs, missing_module, positive_int, usage_error


def parser() -> Parser:
    p = Parser(prog="python -m reports", description=__doc__)
    sub = p.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")
    d = sub.add_parser("drift", help="compare two recorded runs (gate or training runs) in a report",
                       description=f"Two recorded runs in a report (report.md, report.html). {RUNS} Exit code: "
                                   f"0 once the report is written, whatever moved (`python -m harness diff` is the "
                                   f"gate), 2 a mistake (one line, no report).")
    d.add_argument("a", metavar="RUN_A", help=RUN_HELP)
    d.add_argument("b", metavar="RUN_B", help="the other run, of RUN_A's kind")
    d.add_argument("--out", required=True, help="the report's folder (report.md, report.html); required")
    s = sub.add_parser("study", help="regrouped token sums over seeds: vector versus scalar")
    s.add_argument("--seeds", type=positive_int, default=12, help="seeds to run (default 12)")
    s.add_argument("--sequences", type=positive_int, default=8, help="sequences per seed, a multiple of 4 (default 8)")
    s.add_argument("--tokens", type=positive_int, default=128, help="tokens per sequence (default 128)")
    s.add_argument("--out", required=True, help="the report's folder (report.md, report.html); required")
    return p


def gate_verdict(diffs) -> str:
    """What `reports drift` counted in two gate runs: rows (one per scenario, layout, field and index)."""
    from harness.diff import plural
    moved, cells = int((diffs["missing"] == "").sum()), len(diffs[["scenario", "topology"]].drop_duplicates())
    return (f"{plural(len(diffs), 'differing row')} (value or digest, per field): {moved} moved, {len(diffs) - moved} "
            f"on one side only, in {plural(cells, 'cell')} (scenario x layout)")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "study" and args.sequences % 4:
        return usage_error("python -m reports study", UsageError(
            f"--sequences: expected a multiple of 4 (the study's groups hold 4 samples), got {args.sequences}"))
    if Path(args.out).exists() and not Path(args.out).is_dir():
        return usage_error("python -m reports " + args.cmd, UsageError(
            f"--out: expected a folder for the report, got {args.out}, a file"))
    try:  # after parsing: a mistake is answered before torch loads
        from harness.training import verdict_text
        from .drift import drift_report, regroup_study
    except ModuleNotFoundError as exc:  # an interpreter without the project: one line, not a traceback
        return missing_module("python -m reports", exc)
    if args.cmd == "drift":
        try:
            distinct_runs(args.a, args.b)
            result = drift_report(args.a, args.b, Path(args.out))
        except UsageError as err:
            return usage_error("python -m reports drift", err)
        print(verdict_text(result) if isinstance(result, dict) else gate_verdict(result))
        print(f"report: {Path(args.out) / 'report.html'}")
        return 0
    summary = regroup_study(args.seeds, Path(args.out), seq_len=args.tokens, sequences=args.sequences)
    print(f"per-sequence vector moved in {summary['vector_moved']} of {summary['seeds']} seeds; scalar loss moved in "
          f"{summary['loss_moved']} of {summary['seeds']}; report: {Path(args.out) / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
