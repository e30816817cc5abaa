#!/usr/bin/env bash
# Issue 34 on every GPU of the machine (N = torch.cuda.device_count(); N = 1 runs too): the step
# `multi_gpu` of scripts/gpu_check.sh (docs/sharding.md, "Multi-GPU measurement"). Parts, in order:
#   tests        the CUDA tests of tests/sharding (NCCL; on 2+ GPUs also at N = 2, 3 and all)
#   correctness  graphfp8-train --ddp [--shard] --fp8-weights --deterministic --check-replicas
#                --compare fp8:none,fp8:step per preset: weights identical on every rank after
#                every step, eager == step graph on every rank, sharded vs unsharded losses
#   speed        benchmarks/multi_gpu.py at N: ddp, shard, shard-fp8w x layers, step x presets (tokens/s,
#                peak and state bytes per parameter per GPU), then a profile of MULTI_GPU_PROFILE
#   speed1       the same runs on 1 GPU (the baselines of scaling efficiency), spread over the
#                GPUs as one process each (they run side by side; skipped at N = 1)
#   peers        benchmarks/fsdp_peers.py at N: torch FSDP2 bf16 and torchao float8 with FSDP2
#   fit          benchmarks/multi_gpu_fit.py: the largest model that trains sharded with FP8 weights
# then scripts/multi_gpu_report.py: $RES/multi_gpu.md (the tables) and $RES/multi_gpu.json.
# Every part runs under `timeout`; none starts after MULTI_GPU_BUDGET_S, so the call keeps its time.
# Estimated on H200s (from the 1-GPU calls: ~10 s per start-up, ~5-15 s per capture; compiling a
# peer ~30-60 s): tests 30 s, correctness 120 s, speed 150 s, speed1 70 s at N=2 (30 s at N=8),
# peers 120 s, fit <= 100 s: ~9.8 min at N=2, ~9 min at N=8. The budget (500 s: with the build a
# gpu_check call stays within 10 minutes) may leave the fit out; it then runs in a second call,
# MULTI_GPU_PARTS="peers fit" (fit measures its own reference run when speed_N.json is missing).
#   Usage: RES=DIR [PY=python3] bash scripts/multi_gpu.sh
#   MULTI_GPU_PARTS ("tests correctness speed speed1 peers fit"), MULTI_GPU_BUDGET_S (500)
#   MULTI_GPU_CORR_PRESETS ("100m llama-100m"), MULTI_GPU_CORR_STEPS (50)
#   MULTI_GPU_PRESETS (100m,300m), MULTI_GPU_CONFIGS (ddp,shard,shard-fp8w), MULTI_GPU_MODES
#   (layers,step), MULTI_GPU_STEPS (20), MULTI_GPU_PROFILE (ddp:step,shard-fp8w:step, first preset)
#   MULTI_GPU_PEER_PRESETS (100m), MULTI_GPU_PEERS (fsdp2-bf16,torchao-fp8), MULTI_GPU_PEER_STEPS (15)
#   MULTI_GPU_FIT_BUDGET_S (70), MULTI_GPU_TRACE (0; 1 keeps rank 0's Chrome traces)
#   MULTI_GPU_CORR_ARGS, MULTI_GPU_ARGS, MULTI_GPU_PEER_ARGS: more arguments of graphfp8.training, of
#   benchmarks.multi_gpu and of benchmarks.fsdp_peers (e.g. --batch 4)
#   MULTI_GPU_N: the ranks (default: the GPUs). A CPU smoke run of the script (gloo):
#   MULTI_GPU_N=2 MULTI_GPU_PARTS="correctness speed speed1 peers" MULTI_GPU_CORR_PRESETS=tiny
#   MULTI_GPU_PRESETS=tiny MULTI_GPU_PEER_PRESETS=tiny MULTI_GPU_CORR_STEPS=3 MULTI_GPU_STEPS=2
#   MULTI_GPU_PEER_STEPS=1 MULTI_GPU_CORR_ARGS="--batch 2 --seq-len 32" MULTI_GPU_ARGS="--batch 2
#   --seq-len 32" MULTI_GPU_PEER_ARGS="--batch 2 --seq-len 32 --no-compile" RES=/tmp/s bash ...
set -uo pipefail
PY=${PY:-python3}
: "${RES:?RES=DIR}"
D=$RES/multi_gpu
mkdir -p "$D"
N=${MULTI_GPU_N:-$($PY -c "import torch; print(torch.cuda.device_count())")}
TR="$PY -m torch.distributed.run --standalone --nproc_per_node"
BUDGET=${MULTI_GPU_BUDGET_S:-500}
START=$(date +%s)
status=0

# part LIMIT NAME CMD...: CMD under `timeout`, at most what is left of the budget; its output in
# $D/NAME.log, its time in $D/times.txt. Returns 124 without running when no time is left.
part() {
  local limit=$1 name=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped (budget spent)" | tee -a "$D/times.txt"; status=1; return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0; t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" > "$D/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc, $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$D/times.txt"
  [ $rc -eq 0 ] || { status=1; tail -4 "$D/$name.log"; }
  return $rc
}

# benchmarks/multi_gpu.py's runs, at N and on 1 GPU alike
RUNS=(--presets "${MULTI_GPU_PRESETS:-100m,300m}" --configs "${MULTI_GPU_CONFIGS:-ddp,shard,shard-fp8w}"
      --modes "${MULTI_GPU_MODES:-layers,step}" --steps "${MULTI_GPU_STEPS:-20}")

echo "multi_gpu: N=$N GPU(s), budget ${BUDGET} s" | tee "$D/times.txt"
for p in ${MULTI_GPU_PARTS:-tests correctness speed speed1 peers fit}; do
  case $p in
    tests)
      part 90 tests $PY -m pytest -q -m cuda -p no:cacheprovider tests/sharding ;;
    correctness)
      for preset in ${MULTI_GPU_CORR_PRESETS:-100m llama-100m}; do
        for flag in "" -shard; do
          part 150 "corr_$preset$flag" $TR "$N" -m graphfp8.training --ddp ${flag:+--shard} \
            --fp8-weights --deterministic --check-replicas --preset "$preset" \
            --compare fp8:none,fp8:step --steps "${MULTI_GPU_CORR_STEPS:-50}" --data synthetic \
            --val-fraction 0 --log-every 10 ${MULTI_GPU_CORR_ARGS:-} --out "$D/corr_$preset$flag"
        done
      done ;;
    speed)
      trace=(); [ "${MULTI_GPU_TRACE:-0}" = 1 ] && trace=(--trace "$D/traces")
      part 240 speed_N $TR "$N" -m benchmarks.multi_gpu "${RUNS[@]}" \
        --profile "${MULTI_GPU_PROFILE:-ddp:step,shard-fp8w:step}" \
        ${MULTI_GPU_ARGS:-} "${trace[@]}" --json "$D/speed_N.json" ;;
    speed1)  # one process per GPU, side by side: every N-th run each
      [ "$N" -gt 1 ] || continue
      left=$(( BUDGET - ($(date +%s) - START) )); limit=$(( left < 200 ? left : 200 ))
      [ "$limit" -ge 20 ] || { echo "speed_1: skipped (budget spent)" | tee -a "$D/times.txt"; continue; }
      t0=$(date +%s)
      for i in $(seq 0 $(( N - 1 ))); do
        CUDA_VISIBLE_DEVICES=$i timeout --kill-after=15 "$limit" $TR 1 -m benchmarks.multi_gpu \
          --part "$i/$N" "${RUNS[@]}" ${MULTI_GPU_ARGS:-} --json "$D/speed_1_part$i.json" \
          > "$D/speed_1_part$i.log" 2>&1 &
      done
      for pid in $(jobs -p); do wait "$pid" || status=1; done
      echo "speed_1: $N processes, $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$D/times.txt" ;;
    peers)
      part 200 peers $TR "$N" -m benchmarks.fsdp_peers --presets "${MULTI_GPU_PEER_PRESETS:-100m}" \
        --peers "${MULTI_GPU_PEERS:-fsdp2-bf16,torchao-fp8}" --steps "${MULTI_GPU_PEER_STEPS:-15}" \
        ${MULTI_GPU_PEER_ARGS:-} --json "$D/peers_N.json" ;;
    fit)  # from speed_N.json's shard-fp8w:step run; a call without the speed part measures one
      fb=${MULTI_GPU_FIT_BUDGET_S:-70}
      [ -f "$D/speed_N.json" ] || part 120 fit_reference $TR "$N" -m benchmarks.multi_gpu \
        --presets 300m --configs shard-fp8w --modes step --steps 5 --json "$D/speed_N.json"
      part $(( fb + 100 )) fit $PY -m benchmarks.multi_gpu_fit "$D/speed_N.json" --nproc "$N" \
        --out "$D/fit" --budget-s "$fb" --attempt-s 90 ;;
    *)
      echo "multi_gpu: unknown part $p"; status=1 ;;
  esac
done
$PY scripts/multi_gpu_report.py "$D" > "$D/report.log" 2>&1 || status=1
cp "$D/multi_gpu.md" "$D/multi_gpu.json" "$RES/" 2>/dev/null
echo "multi_gpu: $(( $(date +%s) - START )) s" | tee -a "$D/times.txt"
exit $status
