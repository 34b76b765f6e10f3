"""Instructions per element of the deterministic row kernel's loops, compiled for sm_90 without a GPU.

    python benchmarks/sass_row_kernel.py --dtype bf16 --rows shifted

Compiles `triton/canonical.py`'s `_row_kernel` as `row_stats` launches it for rows of a whole chunk or more (tiles of
128, chunks of 4096 columns, 4 warps; SUM_PAIRS off, which `row_stats` turns on for aligned fp32 rows) with
`triton.compile` for an sm_90 target, disassembles it with the `cuobjdump` that Triton ships, and prints each loop's
instructions, per element (a thread's share of a chunk) and by opcode, with the registers. `--rows`: `aligned`
(every row starts on a 16-byte boundary: V = 131072), `shifted` (rows at every offset: V = 50257, a branch per
offset), `plain` (the data itself off a boundary: plain loads). The loop counts are static: the bound an
instruction-issue-limited kernel runs at, about 16 instructions per element for bf16 rows at the H200's bandwidth
(8 elements per SM and cycle at 1.98 GHz, 4 warp instructions per SM and cycle).

    python benchmarks/sass_row_kernel.py --merge 1187 [--merge-tiles 8192]

`--merge TILES`: the merge kernel instead, in the blocks `merge_lse` takes for rows of TILES tile statistics, and the
warp instructions it issues per row (its loop once per block of the row; `--merge-tiles`: `MERGE_TILES` set to that).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo_core.triton import canonical as K  # noqa: E402

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")


def compile_sm90(fn, signature: dict, constexprs: dict, divisible: list[str], warps: int):
    """`fn` compiled for sm_90: `signature`'s argument types, the rest constexprs, `divisible` marked 16-divisible."""
    names = list(fn.arg_names)
    src = ASTSource(fn=fn, signature={n: signature.get(n, "constexpr") for n in names},
                    constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, enable_fp_fusion=False))


def compile_row_kernel(dtype: str, rows: str, entropy: bool):
    vec = 16 // (2 if dtype in ("bf16", "fp16") else 4)
    shifts = {"aligned": 1, "shifted": vec, "plain": 0}[rows]
    signature = dict(x_ptr=f"*{dtype}", r_ptr=f"*{dtype}", ids_ptr="*i64", mask_ptr="*i1", sel_ptr="*fp32",
                     stats_ptr="*fp32", N="i32", V="i32", stride_x="i32", stride_r="i32", lo="i32", tiles="i32",
                     plane="i32", inv="fp32", period_x="i32", period_r="i32")
    constexprs = dict(SCALE=False, W=128, LOG2W=7, NT=K.CHUNK // 128, NT_TAIL=K.TAIL_CHUNK // 128, SUM_PAIRS=False,
                      ENTROPY=entropy, VEC_X=vec, VEC_R=vec, SHIFTS_X=shifts, SHIFTS_R=shifts, SHARED=not entropy)
    divisible = ["ids_ptr", "mask_ptr", "sel_ptr", "stats_ptr"] + (["x_ptr", "r_ptr"] if rows != "plain" else [])
    divisible += ["V", "stride_x", "stride_r"] if rows == "aligned" else []
    return compile_sm90(K._ROW[0], signature, constexprs, divisible, K.ROW_WARPS)


def compile_merge_kernel(rows: int, bt: int, chunks: int):
    signature = dict(stats_ptr="*fp32", mask_ptr="*i1", lse_ptr="*fp32", ent_ptr="*fp32", sel_ptr="*fp32", N="i32",
                     tiles="i32", plane="i32")
    constexprs = dict(ROWS=rows, BT=bt, LOG2BT=K._log2(bt), CHUNKS=chunks, LOG2C=K._log2(chunks), ENTROPY=False,
                      LOGP=True)
    return compile_sm90(K._merge_kernel, signature, constexprs, [n for n in signature if n.endswith("_ptr")],
                        K.NUM_WARPS)


def cuobjdump(kernel, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def disassemble(kernel) -> list[tuple[int, str, str]]:
    return [(int(a, 16), op.split(".")[0], rest) for a, op, rest in _INSTR.findall(cuobjdump(kernel, "-sass"))]


def loops(instrs: list[tuple[int, str, str]]):
    """Each loop's start address and opcodes (a backward branch closes a loop)."""
    for addr, op, rest in instrs:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            yield int(target.group(1), 16), [o for a, o, _ in instrs if int(target.group(1), 16) <= a <= addr]


def registers(kernel) -> str:
    return " ".join(line.strip() for line in cuobjdump(kernel, "-res-usage").splitlines() if "REG" in line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--rows", choices=("aligned", "shifted", "plain"), default="shifted")
    p.add_argument("--entropy", action="store_true")
    p.add_argument("--merge", type=int, metavar="TILES", help="the merge kernel, for rows of TILES statistics")
    p.add_argument("--merge-tiles", type=int, help="MERGE_TILES for --merge")
    args = p.parse_args()
    if args.merge:
        if args.merge_tiles:
            K.MERGE_TILES = args.merge_tiles
        rows, bt, chunks = K.merge_blocks(1 << 20, args.merge)
        kernel = compile_merge_kernel(rows, bt, chunks)
        instrs = disassemble(kernel)
        body = max((loop for _, loop in loops(instrs)), key=len)  # over a row's blocks
        per_row = ((-(-args.merge // bt) - 1) * len(body) + len(instrs)) * K.NUM_WARPS / rows
        print(f"merge kernel, rows of {args.merge} tiles, triton {triton.__version__}: ROWS={rows} BT={bt} "
              f"CHUNKS={chunks}, {len(instrs)} instructions, its loop {len(body)}; {per_row:.0f} warp instructions "
              f"per row; {registers(kernel)}")
        return
    kernel = compile_row_kernel(args.dtype, args.rows, args.entropy)
    instrs = disassemble(kernel)
    per_thread = K.CHUNK // (32 * K.ROW_WARPS)  # elements a thread holds of a chunk
    print(f"{args.dtype} {args.rows} rows, triton {triton.__version__}: {len(instrs)} instructions; "
          f"{registers(kernel)}")
    for start, loop in loops(instrs):
        if len(loop) > 100:
            top = ", ".join(f"{o} {n}" for o, n in collections.Counter(loop).most_common(8))
            print(f"  loop {start:#07x}: {len(loop)} instructions, {len(loop) / per_thread:.1f} per element ({top})")


if __name__ == "__main__":
    main()
