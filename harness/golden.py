"""The golden set: one Parquet table per scenario plus MANIFEST.json in one folder (`golden/canonical`), verified
before it is believed.

The manifest names every file with its SHA-256 and contract fingerprint, the platform that recorded the set and its
provenance (math version included). `verify_golden` checks, in this order, and raises `TableError` naming the first
check that fails: `manifest` (present, JSON, the expected keys), `file list` (exactly the folder's files), `sha256`
(each file's bytes), each file's table (`readable`, `schema`, `fields`, `unique keys`, `fingerprint`, `digest`,
`value vs bits`), then `scenario` (one scenario, the file's name), `topology` (tp1xdp1 only), `fingerprint` (the
manifest's), `platform` and `math_version` (the manifest's, and the math version this code computes).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from pathlib import Path

import pandas as pd

from grpo_core.contract import MATH_VERSION

from .diff import SINGLE
from .record import TableError, read_table, write_table

MANIFEST = "MANIFEST.json"
PLATFORM = re.compile(r"cpu|cuda-[a-z0-9-]+")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise TableError("manifest", f"{folder} holds golden files but no {MANIFEST}")
    try:
        m = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise TableError("manifest", f"{path} is not JSON") from None
    entries = m.get("files") if isinstance(m, dict) else None
    if not (isinstance(entries, dict) and isinstance(m.get("platform"), str) and isinstance(m.get("provenance"), dict)
            and all(isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("fingerprint"), str)
                    for e in entries.values())):
        raise TableError("manifest", f"{path}: expected the keys files (name -> sha256, fingerprint), platform and "
                                     f"provenance")
    return m


def verify_golden(folder: Path) -> tuple[pd.DataFrame, dict[str, dict]] | None:
    """The golden rows and each scenario's recorded provenance, or None when `folder` holds no golden at all."""
    files = sorted(p.name for p in folder.glob("*.parquet")) if folder.is_dir() else []
    if not files and not (folder / MANIFEST).exists():
        return None
    m = read_manifest(folder)
    listed = m["files"]
    if sorted(listed) != files:
        raise TableError("file list", f"{folder}/{MANIFEST} lists {len(listed)} files, the folder holds {len(files)} "
                                      f"(not listed: {sorted(set(files) - set(listed))}, absent: "
                                      f"{sorted(set(listed) - set(files))})")
    platform, math = m["platform"], m["provenance"].get("math_version")
    if not PLATFORM.fullmatch(platform):
        raise TableError("platform", f"{MANIFEST}: expected a platform cpu or cuda-<device>, got {platform!r}")
    for name in files:
        if sha256(folder / name) != listed[name]["sha256"]:
            raise TableError("sha256", f"{name}: its bytes do not match the hash in {MANIFEST}")
    if math != MATH_VERSION:
        raise TableError("math_version", f"{MANIFEST}: the set was recorded with math {math!r}, this code computes "
                                         f"{MATH_VERSION!r}")
    frames, provenance = [], {}
    for name in files:
        df, meta = read_table(folder / name)
        scenario = Path(name).stem
        if df["scenario"].unique().tolist() != [scenario]:
            raise TableError("scenario", f"{name}: expected rows of scenario {scenario} only, got "
                                         f"{sorted(df['scenario'].unique())}")
        if set(df["topology"]) != {SINGLE}:
            raise TableError("topology", f"{name}: expected {SINGLE} rows only, got {sorted(set(df['topology']))}")
        if set(df["fingerprint"]) != {listed[name]["fingerprint"]}:
            raise TableError("fingerprint", f"{name}: contract fingerprint {sorted(set(df['fingerprint']))}, "
                                            f"{MANIFEST} says {listed[name]['fingerprint']}")
        if meta.get("platform") != platform:
            raise TableError("platform", f"{name}: recorded on {meta.get('platform')!r}, {MANIFEST} says {platform!r}")
        recorded = meta.get("provenance") or {}
        if recorded.get("math_version") != math:
            raise TableError("math_version", f"{name}: recorded with math {recorded.get('math_version')!r}, "
                                             f"{MANIFEST} says {math!r}")
        frames.append(df)
        provenance[scenario] = recorded
    return pd.concat(frames, ignore_index=True), provenance


PORTABLE = "portable: the canonical math, the same bits on every CPU and GPU"
TENSOR_CORES = ("per GPU architecture ({arch}): the fused linear scenarios with the Triton kernels, whose logits, dH "
                "and dW come from the tensor cores (grpo_core/triton/matmul.py); no CPU computes them")


def write_goldens(folder: Path, rows: pd.DataFrame, *, provenance: dict, platform: str, command: str,
                  keep_others: bool, bits: str = PORTABLE) -> None:
    """Writes one table per scenario of `rows` and the manifest. With `keep_others`, the set's files of other
    scenarios stay, with their manifest entries (the caller has verified the set and its platform); without, they go.
    `bits`: where the set's bits hold (the manifest says it)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = set(rows["scenario"])
    kept = read_manifest(folder)["files"] if keep_others else {}
    files = {n: e for n, e in kept.items() if Path(n).stem not in names}
    for stale in folder.glob("*.parquet"):
        if stale.name not in files:
            stale.unlink()
    for name, part in rows.groupby("scenario"):
        path = folder / f"{name}.parquet"
        write_table(part.to_dict("records"), path, {"provenance": provenance, "platform": platform})
        files[path.name] = {"sha256": sha256(path), "fingerprint": part["fingerprint"].iloc[0]}
    manifest = {"bits": bits, "platform": platform, "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "command": command, "provenance": provenance, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
