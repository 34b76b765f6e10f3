"""Argument parsing for `python -m harness` and `python -m reports`, standard library only (nox checks a session's
arguments with it before installing anything).

A user mistake ends in one line, `<prog>: error: <argument>: expected X, got Y`, and exit code 2: never a
traceback. Checks that need torch or the data (is there a CUDA device, is this folder a run) raise `UsageError`,
which the entry points print the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "canonical"


def from_checkout() -> bool:
    """True when this harness runs from a source tree (pyproject.toml beside it), False when it is installed
    (site-packages holds no golden set: `--golden-dir` is required there)."""
    return (ROOT / "pyproject.toml").is_file()


class UsageError(Exception):
    """A mistake in the command line, found after parsing; printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """One line per mistake, blamed on the command that was given (`python -m harness goldens`, not the top level)."""

    def error(self, message: str):  # one line (argparse prints the whole usage block first)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        if commands and getattr(parsed, "cmd", None) is None:
            self.error(f"COMMAND: expected one of {', '.join(commands)}, got nothing")
        if extra:
            (commands.get(getattr(parsed, "cmd", None)) or self).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def usage_error(prog: str, err: UsageError) -> int:
    print(f"{prog}: error: {err}", file=sys.stderr)
    return 2


def missing_module(prog: str, err: ModuleNotFoundError) -> int:
    """One line for an interpreter without the project's dependencies (the system python3, say), exit code 2."""
    return usage_error(prog, UsageError(
        f"{err.name}: expected an interpreter with grpo-core and its [harness] extras installed, got {sys.executable}, "
        f"which lacks {err.name}; after `nox -s determinism` use .nox/determinism/bin/python (README, Which Python)"))


def distinct_runs(a: str, b: str, read_a: Callable[[], object] | None = None) -> None:
    """`UsageError` when RUN_B names RUN_A's run (a mistyped path: a run compared with itself is identical). A gate
    run's folder and its run.parquet are the same run. `read_a`: reads RUN_A before the refusal, so that a damaged
    run is named first."""
    a_run, b_run = (p / "run.parquet" if (p / "run.parquet").is_file() else p for p in (Path(a), Path(b)))
    if a_run.exists() and b_run.exists() and os.path.samefile(a_run, b_run):
        if read_a is not None:
            read_a()
        raise UsageError(f"RUN_B: expected another run than RUN_A, got {b}, which is the same folder as RUN_A ({a})")


def _checked(text: str, cast, ok, expected: str):
    """`cast(text)` when `ok` of it, else an argparse error naming what is accepted."""
    try:
        value = cast(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "an integer >= 1")


MAX_WORLD = 64  # ranks the harness spawns on one host: one process each, every one importing torch
MIN_TIMEOUT = 10.0  # seconds: a world takes seconds to start (each rank imports torch) before its first collective


def world_size(text: str) -> int:
    return _checked(text, int, lambda v: 1 <= v <= MAX_WORLD,
                    f"an integer from 1 to {MAX_WORLD} (the harness spawns one process per rank on this host)")


def timeout_seconds(text: str) -> float:
    return _checked(text, float, lambda v: MIN_TIMEOUT <= v < float("inf"),
                    f"a number of seconds >= {MIN_TIMEOUT:g} (a world takes seconds to start)")


def fraction(text: str) -> float:
    return _checked(text, float, lambda v: 0.0 < v <= 1.0, "a fraction in (0, 1]")


def layout_name(text: str) -> str:
    """`tp<T>xdp<D>`, both >= 1 (whether the run has that layout is checked against --max-world later)."""
    tp, sep, dp = text.removeprefix("tp").partition("xdp")
    if not (text.startswith("tp") and sep and tp.isdigit() and dp.isdigit() and int(tp) >= 1 and int(dp) >= 1):
        raise argparse.ArgumentTypeError(f"expected a layout such as tp2xdp1, got {text}")
    return f"tp{int(tp)}xdp{int(dp)}"


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE for env://)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


COMMANDS = {"run": "every scenario on every TP x DP layout, diffed bitwise against the single-rank run and the golden",
            "goldens": "record the golden set (explicit; never a side effect of run)",
            "diff": "two recorded runs, bitwise: gate runs layout with layout, training runs step by step"}
RUNS = ("RUN_A and RUN_B: two gate runs (the folder `python -m harness run` wrote, or its run.parquet), compared "
        "layout with layout; or two training runs (a folder of rank-*/step-*.parquet written by TrainingRecorder or "
        "GRPOCoreTrainer(record_dir=...)), compared step by step, sequence by sequence.")
RUN_HELP = "a gate run (its folder or run.parquet) or a training run (a folder of rank-*/step-*.parquet)"


def harness_parser(description: str | None = None, scenarios: list[str] | None = None) -> Parser:
    """`scenarios`: the names `--scenarios` accepts, listed in its help (the caller knows them; this module imports
    no torch)."""
    p = Parser(prog="python -m harness", description=description,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")
    names = ", ".join(scenarios) if scenarios else "see python -m harness run --help"
    for name in ("run", "goldens"):
        s = sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name])
        s.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the ranks compute (default cpu)")
        s.add_argument("--process-group", choices=["gloo", "nccl"], default=None,
                       help="default: gloo on the CPU; NCCL with one GPU per rank; gloo when ranks share a GPU")
        s.add_argument("--kernels", choices=["auto", "triton", "torch"], default="auto",
                       help="the deterministic path's kernels: auto (the default: Triton for CUDA tensors), the "
                            "Triton kernels, or the torch reference; all must give the golden's bits")
        s.add_argument("--scenarios", default=None, help=f"comma-separated names (default: all): {names}")
        s.add_argument("--timeout", type=timeout_seconds, default=600.0,
                       help=f"seconds before a hung world is killed (default 600, at least {MIN_TIMEOUT:g})")
        s.add_argument("--cuda-memory-fraction", type=fraction, default=0.2,
                       help="cap on each rank's share of its GPU's memory (default 0.2), so that a run can share a "
                            "node with a training job")
        s.add_argument("--torchrun", action="store_true",
                       help="this process was started by torchrun (detected from its environment anyway)")
        s.add_argument("--golden-dir", default=None,
                       help="the golden set (default: golden/canonical of the checkout this harness runs from; "
                            "required when the harness is installed)")
        if name == "goldens":
            s.add_argument("--allow-dirty", action="store_true",
                           help="record from a working tree with uncommitted changes")
            s.add_argument("--allow-no-git", action="store_true",
                           help="record from a harness outside a git checkout (the manifest then names no commit)")
        if name == "run":
            s.add_argument("--max-world", type=world_size, default=None,
                           help=f"largest world, 1 to {MAX_WORLD} (default 4, or $GRPO_MAX_WORLD; under torchrun: its "
                                f"WORLD_SIZE)")
            s.add_argument("--out", default=None, help="a new run folder (default: runs/<timestamp> in the checkout, "
                                                       "wherever the command starts); an existing run is never "
                                                       "replaced")
            s.add_argument("--plant-drift", type=layout_name, default=None, metavar="LAYOUT",
                           help="run a regrouped token-sum op at this layout (e.g. tp2xdp1): the gate must fail")
    d = sub.add_parser("diff", help=COMMANDS["diff"], description=f"Two recorded runs, bitwise. {RUNS} Exit code: 0 "
                       f"identical, 1 anything moved or missing on one side, 2 a mistake (one line, nothing compared).")
    d.add_argument("a", metavar="RUN_A", help=RUN_HELP)
    d.add_argument("b", metavar="RUN_B", help="the other run, of RUN_A's kind")
    return p
