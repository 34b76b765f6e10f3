#!/usr/bin/env bash
# The whole-run checks of `GRPOCoreTrainer` on one GPU, at the Qwen2.5-0.5B shape (benchmark_trl_step.py's model,
# seeded random weights): 20 optimizer steps, 5 generations of 8 x 8 completions of 128 tokens, micro-batches of 8,
# accumulation 2. Each step's rows append to RESULTS (a Parquet file); the runs' records go under RECORDS.
#   rep   the reproducible switch: a run (`ours` beside it), the same run again, a replay of the first with its
#         configuration and one with another accumulation (1 micro-batch a step); the diffs
#   more  the default run twice (`ours` beside the first), two reproducible runs with layer digests, one with the
#         sampler's log-probs; the diffs
# The switch's cost: a part's steps against the other's; the recorder's: `ours_rec` against `ours` beside it.
# Usage: bash benchmarks/verify_trl_run.sh rep|more RECORDS RESULTS [--tiny]   (--tiny: the CPU's small model)
set -uo pipefail
part=${1:?PART: rep or more}
records=${2:?RECORDS: a folder}
results=${3:?RESULTS: a Parquet file}
shift 3
mkdir -p "$records"
bench=(python3 benchmarks/benchmark_trl_step.py --models 0.5b --steps 20 --completion-length 128 --num-iterations 1
       --out "$results")
[ "${1:-}" = "--tiny" ] && bench=(python3 benchmarks/benchmark_trl_step.py --tiny --out "$results")
model=$([ "${1:-}" = "--tiny" ] && echo tiny || echo 0.5b)
whole=$([ "$model" = tiny ] && echo 8 || echo 16)  # one micro-batch a step: the generation batch over the same steps
diff() { echo "== python3 -m harness diff $1 $2"; python3 -m harness diff "$records/$1/$model" "$records/$2/$model"
         echo "== exit code $?"; }
run() { echo "== ${bench[*]} $*"; "${bench[@]}" "$@" 2>&1 | grep -v -e "it/s\]" -e "FutureWarning" -e "warnings.warn"; }
case "$part" in
  rep)
    run --trainers ours,ours_rec --reproducible --record-dir "$records/rep1"
    run --trainers ours_rec --reproducible --record-dir "$records/rep2"
    diff rep1 rep2
    run --trainers ours_rec --reproducible --replay-from "$records/rep1" --record-dir "$records/replay"
    diff rep1 replay
    run --trainers ours_rec --reproducible --replay-from "$records/rep1" --record-dir "$records/replay_ga1" \
      --per-device "$whole" --grad-accum 1
    diff rep1 replay_ga1
    ;;
  more)
    run --trainers ours,ours_rec --record-dir "$records/default1"
    run --trainers ours_rec --record-dir "$records/default2"
    diff default1 default2
    run --trainers ours_rec --reproducible --record-layers --record-dir "$records/layers1"
    run --trainers ours_rec --reproducible --record-layers --record-dir "$records/layers2"
    diff layers1 layers2
    run --trainers ours_rec --reproducible --record-sampler --record-dir "$records/sampler"
    ;;
  *) echo "PART: expected rep or more, got $part" >&2; exit 2 ;;
esac
