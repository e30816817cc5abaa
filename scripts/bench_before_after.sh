#!/usr/bin/env bash
# Kernel benchmark before/after, in one call on the GPU machine: builds a base commit of graphfp8
# in a temp dir and the current tree, runs `python -m benchmarks kernels --json` for both
# (rounds in ABBA order, so drift of the machine hits both sides alike), checks that every
# kernel's outputs are bit-identical (scripts/kernel_digest.py), and prints the before/after
# table of scripts/ab_compare.py (same kernels, same shapes, ratio after/before).
#
#   scripts/bench_before_after.sh [BASE]            BASE: a commit, default 30328b1
#   scripts/bench_before_after.sh --prepare [BASE]  here, with the git history: writes BASE's
#       sources to .ab-base/ (git-ignored); a machine without the history (the GPU machine gets
#       the working tree only) uses them: carry ".ab-base" with the call.
#
# Env: OUT (results, default build/out), AB_ROUNDS (rounds per side, default 2), PYTHON,
# AB_BENCH_ARGS (extra arguments of the benchmark, e.g. "--quick --device cpu" for a CPU dry run).
# Writes $OUT/kernels_ab.md (the report), the JSON of every round and both digests; exits 1 when
# a kernel's outputs differ or a build fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-build/out}
ROUNDS=${AB_ROUNDS:-2}
SOURCES="csrc graphfp8 setup.py setup.cfg pyproject.toml"
# BASE's sources, with its benchmarks/ when it has one (older commits kept them in graphfp8/bench).
sources_of() { echo "$SOURCES$(git cat-file -e "$1:benchmarks" 2>/dev/null && echo " benchmarks")"; }

if [ "${1:-}" = "--prepare" ]; then
  base=${2:-30328b1}
  rm -rf .ab-base && mkdir -p .ab-base
  git archive "$base" $(sources_of "$base") | tar -x -C .ab-base || exit 1
  git rev-parse "$base" > .ab-base/COMMIT
  echo "wrote .ab-base/ ($(cat .ab-base/COMMIT)); carry \".ab-base\" to the GPU machine"
  exit 0
fi
base=${1:-30328b1}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
tmp=$(mktemp -d /tmp/graphfp8-ab.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# The base sources: from git when the history is here, else from a prepared .ab-base/.
if git rev-parse --verify -q "$base^{commit}" > /dev/null 2>&1; then
  git archive "$base" $(sources_of "$base") | tar -x -C "$tmp" || exit 1
  commit=$(git rev-parse "$base")
elif [ -f .ab-base/COMMIT ] && [[ "$(cat .ab-base/COMMIT)" == "$base"* ]]; then
  cp -r .ab-base/. "$tmp"/
  commit=$(cat .ab-base/COMMIT)
else
  echo "no sources of $base: run 'scripts/bench_before_after.sh --prepare $base' where the git"
  echo "history is, and carry .ab-base"
  exit 1
fi
echo "== base $commit vs the working tree"

build() {  # build DIR LOG
  (cd "$1" && $PY setup.py -q build_ext --inplace > "$2" 2>&1) || { tail -30 "$2"; return 1; }
}
t0=$(date +%s)
build "$tmp" "$OUT/ab_build_before.log" || { echo "BASE BUILD FAILED"; exit 1; }
build "$ROOT" "$OUT/ab_build_after.log" || { echo "BUILD FAILED"; exit 1; }
echo "built both in $(( $(date +%s) - t0 )) s"

side_dir() { if [ "$1" = before ]; then echo "$tmp"; else echo "$ROOT"; fi; }
run_side() {  # run_side SIDE ROUND: one kernel benchmark of that build, in its own tree
  local dir bench=benchmarks; dir=$(side_dir "$1")
  [ -d "$dir/benchmarks" ] || bench=graphfp8.bench  # a base from before benchmarks/ moved out
  (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" $PY -m $bench kernels \
    ${AB_BENCH_ARGS:-} --json "$OUT/ab_kernels_$1$2.json" > "$OUT/ab_kernels_$1$2.log" 2>&1) \
    || { tail -30 "$OUT/ab_kernels_$1$2.log"; return 1; }
}
status=0
for side in before after; do  # the same digest script under each build
  dir=$(side_dir $side)
  device=cpu; [[ "${AB_BENCH_ARGS:-}" == *cpu* ]] || device=cuda
  (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" $PY "$ROOT/scripts/kernel_digest.py" \
    --device $device --json "$OUT/ab_digest_$side.json") || status=1
done
before=() after=()
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    run_side $side $r || status=1
    if [ $side = before ]; then before+=("$OUT/ab_kernels_before$r.json");
    else after+=("$OUT/ab_kernels_after$r.json"); fi
  done
done
$PY scripts/ab_compare.py --before "${before[@]}" --after "${after[@]}" \
  --digests "$OUT/ab_digest_before.json" "$OUT/ab_digest_after.json" --md "$OUT/kernels_ab.md" \
  || status=1
exit $status
