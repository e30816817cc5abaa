#!/usr/bin/env bash
# Issue 34 on every GPU of the machine (N = torch.cuda.device_count(); N = 1 runs too): the step
# `scaling` of scripts/gpu_check.sh (docs/sharding.md, "Multi-GPU measurement"). Parts, in order:
#   tests        the CUDA tests of tests/sharding (NCCL; on 2+ GPUs also at N = 2, 3 and all)
#   correctness  graphfp8-train --ddp [--shard] --fp8-weights --deterministic --check-replicas
#                --compare fp8:none,fp8:step per preset: weights identical on every rank after
#                every step, eager == step graph on every rank, sharded vs unsharded losses
#   speed        bench/scaling.py at N: ddp, shard, shard-fp8w x layers, step x presets (tokens/s,
#                peak and state bytes per parameter per GPU), then a profile of SCALING_PROFILE
#   speed1       the same runs on 1 GPU (the baselines of scaling efficiency), spread over the
#                GPUs as one process each (they run side by side; skipped at N = 1)
#   peers        bench/fsdp_peers.py at N: torch FSDP2 bf16 and torchao float8 with FSDP2
#   fit          bench/scaling_fit.py: the largest model that trains sharded with FP8 weights
# then scripts/scaling_report.py: $RES/scaling.md (the tables) and $RES/scaling.json.
# Every part runs under `timeout`; none starts after SCALING_BUDGET_S, so the call keeps its time.
# Estimated on H200s (from the 1-GPU calls: ~10 s per start-up, ~5-15 s per capture; compiling a
# peer ~30-60 s): tests 30 s, correctness 120 s, speed 150 s, speed1 70 s at N=2 (30 s at N=8),
# peers 120 s, fit <= 100 s: ~9.8 min at N=2, ~9 min at N=8. The budget (500 s: with the build a
# gpu_check call stays within 10 minutes) may leave the fit out; it then runs in a second call,
# SCALING_PARTS="peers fit" (fit measures its own reference run when speed_N.json is missing).
#   Usage: RES=DIR [PY=python3] bash scripts/scaling.sh
#   SCALING_PARTS ("tests correctness speed speed1 peers fit"), SCALING_BUDGET_S (500)
#   SCALING_CORR_PRESETS ("100m llama-100m"), SCALING_CORR_STEPS (50)
#   SCALING_PRESETS (100m,300m), SCALING_CONFIGS (ddp,shard,shard-fp8w), SCALING_MODES
#   (layers,step), SCALING_STEPS (20), SCALING_PROFILE (ddp:step,shard-fp8w:step, first preset)
#   SCALING_PEER_PRESETS (100m), SCALING_PEERS (fsdp2-bf16,torchao-fp8), SCALING_PEER_STEPS (15)
#   SCALING_FIT_BUDGET_S (70), SCALING_TRACE (0; 1 keeps rank 0's Chrome traces)
#   SCALING_CORR_ARGS, SCALING_ARGS, SCALING_PEER_ARGS: more arguments of graphfp8.train, of
#   bench.scaling and of bench.fsdp_peers (e.g. --batch 4)
#   SCALING_N: the ranks (default: the GPUs). A CPU smoke run of the script (gloo):
#   SCALING_N=2 SCALING_PARTS="correctness speed speed1 peers" SCALING_CORR_PRESETS=tiny
#   SCALING_PRESETS=tiny SCALING_PEER_PRESETS=tiny SCALING_CORR_STEPS=3 SCALING_STEPS=2
#   SCALING_PEER_STEPS=1 SCALING_CORR_ARGS="--batch 2 --seq-len 32" SCALING_ARGS="--batch 2
#   --seq-len 32" SCALING_PEER_ARGS="--batch 2 --seq-len 32 --no-compile" RES=/tmp/s bash ...
set -uo pipefail
PY=${PY:-python3}
: "${RES:?RES=DIR}"
D=$RES/scaling
mkdir -p "$D"
N=${SCALING_N:-$($PY -c "import torch; print(torch.cuda.device_count())")}
TR="$PY -m torch.distributed.run --standalone --nproc_per_node"
BUDGET=${SCALING_BUDGET_S:-500}
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

# bench/scaling.py's runs, at N and on 1 GPU alike
RUNS=(--presets "${SCALING_PRESETS:-100m,300m}" --configs "${SCALING_CONFIGS:-ddp,shard,shard-fp8w}"
      --modes "${SCALING_MODES:-layers,step}" --steps "${SCALING_STEPS:-20}")

echo "scaling: N=$N GPU(s), budget ${BUDGET} s" | tee "$D/times.txt"
for p in ${SCALING_PARTS:-tests correctness speed speed1 peers fit}; do
  case $p in
    tests)
      part 90 tests $PY -m pytest -q -m cuda -p no:cacheprovider tests/sharding ;;
    correctness)
      for preset in ${SCALING_CORR_PRESETS:-100m llama-100m}; do
        for flag in "" -shard; do
          part 150 "corr_$preset$flag" $TR "$N" -m graphfp8.train --ddp ${flag:+--shard} \
            --fp8-weights --deterministic --check-replicas --preset "$preset" \
            --compare fp8:none,fp8:step --steps "${SCALING_CORR_STEPS:-50}" --data synthetic \
            --val-fraction 0 --log-every 10 ${SCALING_CORR_ARGS:-} --out "$D/corr_$preset$flag"
        done
      done ;;
    speed)
      trace=(); [ "${SCALING_TRACE:-0}" = 1 ] && trace=(--trace "$D/traces")
      part 240 speed_N $TR "$N" -m graphfp8.bench.scaling "${RUNS[@]}" \
        --profile "${SCALING_PROFILE:-ddp:step,shard-fp8w:step}" \
        ${SCALING_ARGS:-} "${trace[@]}" --json "$D/speed_N.json" ;;
    speed1)  # one process per GPU, side by side: every N-th run each
      [ "$N" -gt 1 ] || continue
      left=$(( BUDGET - ($(date +%s) - START) )); limit=$(( left < 200 ? left : 200 ))
      [ "$limit" -ge 20 ] || { echo "speed_1: skipped (budget spent)" | tee -a "$D/times.txt"; continue; }
      t0=$(date +%s)
      for i in $(seq 0 $(( N - 1 ))); do
        CUDA_VISIBLE_DEVICES=$i timeout --kill-after=15 "$limit" $TR 1 -m graphfp8.bench.scaling \
          --part "$i/$N" "${RUNS[@]}" ${SCALING_ARGS:-} --json "$D/speed_1_part$i.json" \
          > "$D/speed_1_part$i.log" 2>&1 &
      done
      for pid in $(jobs -p); do wait "$pid" || status=1; done
      echo "speed_1: $N processes, $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$D/times.txt" ;;
    peers)
      part 200 peers $TR "$N" -m graphfp8.bench.fsdp_peers --presets "${SCALING_PEER_PRESETS:-100m}" \
        --peers "${SCALING_PEERS:-fsdp2-bf16,torchao-fp8}" --steps "${SCALING_PEER_STEPS:-15}" \
        ${SCALING_PEER_ARGS:-} --json "$D/peers_N.json" ;;
    fit)  # from speed_N.json's shard-fp8w:step run; a call without the speed part measures one
      fb=${SCALING_FIT_BUDGET_S:-70}
      [ -f "$D/speed_N.json" ] || part 120 fit_reference $TR "$N" -m graphfp8.bench.scaling \
        --presets 300m --configs shard-fp8w --modes step --steps 5 --json "$D/speed_N.json"
      part $(( fb + 100 )) fit $PY -m graphfp8.bench.scaling_fit "$D/speed_N.json" --nproc "$N" \
        --out "$D/fit" --budget-s "$fb" --attempt-s 90 ;;
    *)
      echo "scaling: unknown part $p"; status=1 ;;
  esac
done
$PY scripts/scaling_report.py "$D" > "$D/report.log" 2>&1 || status=1
cp "$D/scaling.md" "$D/scaling.json" "$RES/" 2>/dev/null
echo "scaling: $(( $(date +%s) - START )) s" | tee -a "$D/times.txt"
exit $status
