"""Shared benchmark plumbing: inputs, the measured copy bandwidth, do_bench medians, the long Parquet table."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

import pandas as pd
import torch
import triton
from triton.testing import do_bench

RESULTS = Path(__file__).resolve().parent / "results"


def parse_configs(text: str) -> list[tuple[int, int, int, int]]:
    """`"P,S,L,V;..."`: prompts, samples per prompt, completion length, vocabulary."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = [int(v) for v in part.split(",")]
        if len(fields) != 4 or min(fields) < 1:
            raise SystemExit(f"--configs: expected 'P,S,L,V' groups of positive ints, got {part!r}")
        out.append(tuple(fields))
    return out


def make_inputs(B: int, T: int, V: int, dtype: torch.dtype, active: float, extra_t: int = 0, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    policy = torch.randn(B, T + extra_t, V, device="cuda", dtype=dtype, generator=g)
    ref = torch.randn(B, T + extra_t, V, device="cuda", dtype=dtype, generator=g)
    ids = torch.randint(0, V, (B, T), device="cuda", generator=g)
    mask = torch.rand(B, T, device="cuda", generator=g) < active
    old = -torch.rand(B, T, device="cuda", generator=g) * 2 - 10
    return dict(policy_logits=policy, ref_logits=ref, action_ids=ids, old_logps=old,
                rewards=torch.randn(B, device="cuda", generator=g), completion_mask=mask)


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (median of do_bench)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def timed(fn, grad_to_none=None) -> tuple[float, float, float, float]:
    """(p50, p20, p80 in ms, peak extra MiB over what was allocated before the first call)."""
    fn()
    torch.cuda.synchronize()
    if grad_to_none:
        for t in grad_to_none:
            t.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    p50, p20, p80 = do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8], grad_to_none=grad_to_none)
    return p50, p20, p80, peak


def provenance() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=RESULTS.parent).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "git_commit": commit,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def append(rows: list[dict], name: str) -> Path:
    """Appends to `results/<name>.parquet`, or to `name` itself when it ends with `.parquet`."""
    path = Path(name) if name.endswith(".parquet") else RESULTS / f"{name}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    if path.exists():
        df = pd.concat([pd.read_parquet(path), df], ignore_index=True)
    df.to_parquet(path, index=False)
    return path


def report(rows: list[dict], name: str, cols: list[str] | None = None) -> None:
    """Appends the run's rows to `results/<name>.parquet` and prints them (`cols` of them) as a Markdown table."""
    path = append(rows, name)
    print(markdown(rows, cols))
    print(f"appended {len(rows)} rows to {path}")


def markdown(rows: list[dict], cols: list[str] | None = None) -> str:
    cols = cols or ["config", "backend", "mode", "p50_ms", "floor_ms", "ratio_to_floor", "peak_extra_mib", "bw_tbps"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)
