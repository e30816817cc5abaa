#!/usr/bin/env bash
# One-call GPU check (what `make gpu-check` runs on the H200): build graphfp8._C for sm_90, run
# the CUDA tests, the benchmarks, a training comparison and a profile; logs, JSON and a summary
# land in $OUT: summary.md and results.tgz (every log and JSON), both rewritten after every step so
# that a call stopped at its time limit still brings back what finished.
#   GPU_STEPS  which steps to run (default: "tests kernels eager block attention step host memory
#              train train-step compile profile profile-step"; also stack (the
#              TransformerLayer stack, FP8 vs bf16), step-nodebug (bench step with the graphs'
#              debug mode off), train-e4m3, kernels-ab, tests-first, ddp,
#              train-scaling, train-gap: issue 27's paired FP8-vs-bf16 table over GAP_SEEDS for
#              GAP_VARIANTS, GAP_STEPS steps; issue 22's: opcount (kernels per TransformerLayer
#              microbatch from the captured ops), variants (each kernel switch off and on
#              in one run), tests-switched (the CUDA suite with every switch on), block-switched,
#              stack-switched, step-switched (those benchmarks with every switch on),
#              issue 33's: train-attn (FP8 attention's validation loss against bf16 and FP8,
#              ATTN_SEEDS, ATTN_STEPS, ATTN_MICROBATCHES, ATTN_PRESETS, ATTN_HEADS), deterministic
#              (--deterministic run twice: same bits, and its tokens/s cost, bf16 attention; with
#              --fp8-attention refused; DET_STEPS),
#              train-scaling-fused (delayed vs current scaling on the fused path); issue 23's: glu
#              (SwiGLU LayerNormMLP vs bf16 and TE), train-llama (the llama-100m preset, bf16 vs
#              FP8 graphed; LLAMA_ARGS adds e.g. --pack), hf (a 100M HF Llama: FP8 + graphs via
#              g8.from_hf vs HF bf16 eager / compile); issue 33's: ncu (Nsight Compute counters of
#              the norm backward, GELU/GLU casts and amax passes: scripts/ncu_kernels.py),
#              kern-ab2 (= kern-ab; < 3 min: the CUDA tests of the DBIAS_IN_KERNEL, NORM_BWD_STAGED,
#              NORM_BWD_PARAM_IN_KERNEL and ROPE_PARTS_BWD switches, their variants rows, census and
#              bench step off / on / on with a 1 KiB cuBLASLt workspace, ncu of the norm backward);
#              issue 32's: te (TransformerEngine's documentation examples on graphfp8.te, tests/te's
#              CUDA tests), hf-users (the hf step's model under HF Trainer: HF bf16 against
#              g8.from_hf(recipe=) FP8 eager and graphs="layers", tokens/s; generate() new tokens/s:
#              HF bf16 against graphfp8's layers in bf16 and FP8; the hf step runs it too);
#              issue 41's: glu-v2 (the SwiGLU kernels of GLU_V2 / GLU_V2_DIV: CUDA tests,
#              `benchmarks glu-v2`, ncu per version);
#              issue 31's: shard (sharded masters at world size 1 with NCCL: the CUDA tests of
#              tests/sharding, graphfp8-train --ddp --shard --deterministic eager == step graph,
#              tokens/s against unsharded (100m preset), the bytes-per-parameter table, ~2 min))
#   SWITCHES   the environment of the *-switched steps (default: every issue-22 switch and issue 41's
#              NORM_FWD_TRANSPOSE on)
#   WITH_TE    1 (default): install TransformerEngine from a carried .te/ (a copy of
#              ../shared/te: docs/benchmarking.md, "TransformerEngine") for the benchmarks' TE
#              columns; the tests never see it
#   AB_BASE    the commit that kernels-ab compares with (default 30328b1; without the git
#              history, carry the .ab-base/ that `scripts/bench_before_after.sh --prepare` wrote)
#   PYTEST_ARGS extra pytest arguments for the CUDA tests
#   FIRST_TESTS tests that the tests-first step runs verbosely before the rest
#   TESTS_TIMEOUT_S the tests step's limit (default 420 s), so a hang leaves time for the rest
#   TRAIN_RUNS, TRAIN_PRESET, TRAIN_DATA, TRAIN_STEPS  the train step (default bf16:graphs,fp8:graphs,
#               100m, stdlib, 300: validation loss of FP8 vs bf16 on held-out text, tokens/s)
#   step multi_gpu (issue 34): sharded FP8 training on every GPU of the machine (nvidia-h200-x2/x4/x8;
#               also at 1): scripts/multi_gpu.sh (its MULTI_GPU_* settings there; <= MULTI_GPU_BUDGET_S,
#               500 s) -> $RES/multi_gpu.md and multi_gpu.json (docs/sharding.md, "Multi-GPU measurement")
#   step blockwise (issue 42): Float8BlockScaling on the GPU: scripts/probe_blockwise_mm.py (what
#               torch's scaled_mm takes for 1x128 / 128x128 scales -> blockwise_mm_probe.json),
#               the blockwise CUDA tests (the emulation and torch's scaled_mm path; the fused
#               quantize kernels against their twin and the CPU kernel, the weight cache; the
#               blockwise graph tests again with GRAPHFP8_BLOCKWISE_KERNELS=fused; the norm and
#               the activation writing the tiles: their CUDA tests and variants rows),
#               scripts/bench_blockwise.py (Llama-3.2-1B block, 3 repeats with spread: bf16,
#               delayed, blockwise with torch quantizers, fused kernels, fused + weight cache)
#               and, with BLOCK_TRAIN_STEPS > 0, 100m delayed vs blockwise losses
#   step blockquant (issue 42): the staged blockwise quantize kernel (GRAPHFP8_BLOCK_QUANTIZE_STAGED,
#               off by default): its CUDA tests, the fused-quantizer and blockwise graph CUDA
#               tests with it on, then both kernels timed in one process against a bf16 copy
#               at the MLP's shapes (benchmarks/variants.py's block_quantize_rows; ~2 min)
#   step blockprof (issue 42): scripts/profile_blockwise.py (the blockwise quantize kernel alone
#               at the MLP's 4 operand shapes as a fraction of copy, then per-kernel time of the
#               SwiGLU MLP at BLOCKPROF_SHAPES (1b,8b: Llama-3.2-1B and Llama-3-8B): graphfp8
#               delayed, blockwise with GRAPHFP8_BLOCKWISE_GLU_KERNEL off and on ("blockwise+glu"),
#               TE Float8BlockScaling graphed) and bench_blockwise's delayed / blockwise-fused-cache
#               / blockwise-glu-kernel rows with the TE MLP peers (WITH_TE=1), at the 1B block
#               and, with BLOCKPROF_8B=1 (the default), the 8B block (seq 8192; fewer iterations)
#   step generate (issue 32): generate()'s rows of bench hf-users alone, with kernels per new
#               token and GPU busy (one call under torch.profiler)
#   step carried-casts (issue 39): what the carried recipe's weight casts on every
#               microbatch cost against casting on each step's first of 4 (100m preset, Llama 1B
#               and 8B blocks; eager and graphed; ms per microbatch and the ratio)
#   step speed41 (issue 41): python -m benchmarks speed - llama-100m, llama-1b (4 layers,
#               B2 x S4096), llama-8b (2 layers, B1 x S8192), whole training steps: bf16
#               torch.compile (the baseline) vs graphfp8 bf16 vs FP8 layer graphs (and FP8 with
#               --stage-batches at llama-100m), 3 repeats each, ratios with their spread, model
#               TFLOP/s, the floor fraction (ceilings calibrated first), GPU busy, kernel table;
#               SPEED_ROWS=llama-1b,llama-8b runs those rows only (benchmarks/speed.py);
#               ~3-4 min on one H200 (limit SPEED_TIMEOUT_S, 360 s)
#   step rows33 (issue 33): the table's tokens/s rows (bf16 vs FP8 at 100m, llama-100m, 300m;
#               current / delayed; --fp8-stats 10 / without), ROWS_PRESETS, ROWS_STEPS (100)
#   step fsdp-graph (issue 40): FSDP2 inside make_graphed_microbatch and make_graphed_step at
#               world size 1 with NCCL: the CUDA tests of tests/sharding/test_fsdp2_cuda.py -k
#               "microbatch_graph or step_graph or transposed" (graph == eager FSDP2 bit for bit,
#               fsdp_sync="last" too; the gathered FP8 weights' transposes counted) and bench
#               fsdp-graph (4 TransformerLayers h4096, FP8 weights, B1 x S4096: eager FSDP2 vs its
#               microbatch graph vs the unsharded graph; then the FSDP2 step graph vs the
#               unsharded step graph, tokens/s over 3 interleaved repeats: target within 3%; rows
#               for fsdp_sync="last" and reshard_after_forward=False, notes/PERF.md predicts them)
#   step fsdp-layers (issue 40): FSDP2 layers in make_graphed_callables at world size 1 with
#               NCCL: the CUDA tests of tests/sharding/test_fsdp2_cuda.py -k layer_graphs (a CUDA
#               graph pair per layer == eager FSDP2 bit for bit, with recompute inside them and
#               with fsdp_sync="last" and FSDP2's explicit prefetch too), then graphfp8-train --ddp
#               --fsdp --fp8-weights --deterministic (8 steps of 100m): --graphs layers and layers
#               --recompute full vs none, and --graphs layers vs none with --fsdp-sync last
#               --fsdp-prefetch: losses and validation losses equal
#   step kern41 (issue 41 item 4): the CUDA tests of the kern41 switches (KERN41_SWITCHES,
#               default NORM_FWD_TRANSPOSE ROPE_CAST_BWD), the `benchmarks variants` rows of
#               NORM_FWD_TRANSPOSE (ROPE_CAST_BWD has none: it is a layer path), then the 100m step
#               graph (graphfp8-train --compare fp8:step --deterministic, synthetic data) with each
#               switch off / on, one process per run, interleaved, KERN41_REPEATS (3) x
#               KERN41_STEPS (100): tokens/s on / off and the final loss bit for bit
#               (scripts/switch_ab.py); ~10 min (tests ~1, variants ~1.5, 12 runs ~40 s each)
#   step normv2 (issue 41 cut 4): the v2 norm backward (GRAPHFP8_NORM_BWD_V2): the CUDA tests of
#               tests/ops/test_norm_bwd_v2.py and test_norm_bwd_batched.py (bit for bit against
#               the batched and the original kernel), the `benchmarks variants` rows of
#               NORM_BWD_V2 (RMSNorm / LayerNorm backward +- dresidual at 4096x2048, 8192x2048,
#               8192x4096, off / on, ratios to copy), then ncu of the norm backwards with it off
#               and on (scripts/ncu_kernels.py --only norm_bwd); ~4 min
#   step quality-block (issue 42): the quality rows - validation loss of bf16, delayed and
#               blockwise FP8 (paired per seed, one process per preset: scripts/train_gap.py) on
#               real text (--data stdlib) for QB_PRESETS (100m llama-100m), QB_STEPS (300) x
#               QB_MICROBATCHES (2), QB_SEEDS (0), QB_VARIANTS (bf16,delayed,blockwise; also
#               blockwise_fp8w, current); the blockwise GEMM as BLOCK_GEMM (scaled_mm); ~2 min
#   step shard-block (issue 42): sharded blockwise FP8 weights at world size 1 with NCCL: the CUDA
#               tests of tests/sharding/test_sharded_blockwise.py (the captured step holds no
#               all-reduce), then graphfp8-train --ddp --fp8-weights --scaling blockwise --graphs
#               step unsharded and --shard, tokens/s sharded / unsharded (target >= 0.97;
#               SHARD_BLOCK_STEPS, 60; ~1.5 min)
#   step recompute (issue 40): bench recompute (Llama-3-8B block shapes: activation memory and
#               graphed step time of selective / full recompute against none) and bench
#               memory-plan (the planner's peak against graphfp8-train's at N=1)
#   step big (issue 40): the largest model the planner fits on one H200, trained: python -m
#               benchmarks.largest_model (graphfp8-train --preset llama-8b --layers L, L from the
#               planner: 26, 6.72B parameters; FP8 weights, full recompute, per-layer graphs, B1 x
#               S8192, 5 steps of 2 microbatches, synthetic data) -> $RES/big.json: peak
#               allocated / reserved, tokens/s and plan/measured; then the step graph's deepest
#               (--graphs step: 24 layers, 6.29B; its capture's undo copy in host memory) ->
#               $RES/big_step.json; ~3-4 min
#   step attn-quality (issue 41 item 5): FP8 attention's validation loss against FP8 without it,
#               paired per seed (scripts/train_gap.py, one process per preset): delayed, fp8_attn
#               (as shipped: E5M2 backward) and fp8_attn_e4m3 (DelayedScaling(fp8_dpa_e4m3_bwd):
#               the attention's backward in E4M3) for AQ_PRESETS (100m llama-100m), AQ_STEPS
#               (1000) x 1 microbatch, AQ_SEEDS (0,1), --heads AQ_HEADS (8: head_dim 128, cuDNN's
#               FP8 backward on Hopper takes no other); ~3-4 min (notes/FP8_ATTENTION.md)
#   step wgrad-accum (issue 41 item 4): the CUDA tests of fuse_wgrad_accumulation (the cuBLASLt
#               GEMM with beta = 1 against _scaled_mm + main_grad, in a CUDA graph, the layers
#               and graphs), then python -m benchmarks wgrad-accum (wgrad + add vs the fused
#               GEMM at Llama 1B / 8B shapes, SwiGLU LayerNormMLP graphed; 3 repeats, spread)
#   step grad-fill (issue 41, notes/PERF.md "Gradient accumulation at Llama shapes"): the CUDA
#               tests of tests/ops/test_grad_fold_op.py (the grad_fold_ kernel against torch's
#               copy_ / add_ bit for bit, its flag read at graph replay) and
#               tests/graphs/test_grad_fold.py (the -0.0 fill in a CUDA graph, a TransformerLayer
#               graphed == eager, GRAPHFP8_GRAD_FILL_ONE_PASS and GRAPHFP8_GRAD_FOLD_COPY_FIRST off
#               and on), then python -m benchmarks grad-fill (FP8 layer graphs at the llama-1b /
#               llama-8b speed rows, the default, one-pass fill and copy-first runs captured in
#               one process, 6 rotating windows: tokens/s against the default, the gradient
#               accumulation family's kernel ms) and the variants table (its GRAD_FILL_ONE_PASS
#               and GRAD_FOLD_COPY_FIRST rows at one layer's weights); ~3 min. With them the CUDA
#               tests of GRAPHFP8_WGRAD_INTO_GRAD (tests/ops/test_gemm_into.py: cuBLASLt's FP8
#               GEMM into bf16 .grad with device alpha/beta against its twin and in a CUDA graph;
#               tests/graphs/test_wgrad_into_grad.py: layer graphs == eager on CUDA) and its row
#               wgrad-into-grad of the benchmark
set -uo pipefail
OUT=${OUT:-build/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RES=$(mktemp -d /tmp/gpu_results.XXXXXX)  # everything the steps write; packed after each step
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
STEPS=${GPU_STEPS:-"tests kernels eager block attention step host memory train train-step compile profile profile-step"}
status=0
SWITCHES=${SWITCHES:-"GRAPHFP8_CURRENT_FUSED=1 GRAPHFP8_NORM_BWD_BATCHED=1 GRAPHFP8_PAIRED_QUANTIZE=1 GRAPHFP8_NORM_FWD_TRANSPOSE=1"}

# Wheels carried in .whl/ (nvtx, torchao, nvidia-cudnn-frontend for FP8 attention): the device
# machine has no package index.
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
} > "$RES/summary.md" 2>&1

# The CUDA suite passed with the default kernel switches (no GRAPHFP8_ override): write the set
# for tests/data/gpu_verified_switches.json (scripts/switch_defaults.py; copy it there to land a
# changed default).
record_switches() {
  local names overrides
  names=$($PY -c "from graphfp8.ops import switches as s; print('|'.join([*s.SWITCHES, *s.ENV_DEFAULTS]))")
  overrides=$(env | grep -E "^GRAPHFP8_($names)=" | tr '\n' ' ')
  echo "switch defaults: $($PY scripts/switch_defaults.py)${overrides:+ (overridden: $overrides)}" >> "$RES/summary.md"
  if [ "$1" -eq 0 ] && [ -z "$overrides" ]; then
    $PY scripts/switch_defaults.py --record "$RES/gpu_verified_switches.json" --note "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1): $2" >> "$RES/summary.md"
  fi
}

find_ncu() {  # Nsight Compute's command line, or nothing
  command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1
}

ncu_sections() {  # --section S for each S given
  local s; for s in "$@"; do printf -- ' --section %s' "$s"; done
}

pack() {  # at most 8 files come back from the device machine: summary.md + one archive
  cp "$RES/summary.md" "$OUT/summary.md"
  tar czf "$OUT/results.tgz.tmp" -C "$RES" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
}

echo "== build" | tee -a "$RES/summary.md"
t0=$(date +%s)
if ! $PY setup.py -q build_ext --inplace > "$RES/build.log" 2>&1; then
  tail -50 "$RES/build.log"; echo "BUILD FAILED" | tee -a "$RES/summary.md"; pack; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s" | tee -a "$RES/summary.md"
$PY -c "import graphfp8.ops as o; assert o.built_with_cuda(), 'CUDA kernels missing'" \
  || { echo "CUDA KERNELS MISSING" >> "$RES/summary.md"; pack; exit 1; }
TE_ENV=""
if [ "${WITH_TE:-1}" = 1 ] && [ -f .te/install_te.sh ]; then
  if TE_SKIP_SMOKE=1 TE_SAVE_DIR=/tmp/te_save bash .te/install_te.sh > "$RES/install_te.log" 2>&1; then
    TE_ENV=/tmp/te_site/te_env.sh; echo "TransformerEngine installed (benchmark peer)" >> "$RES/summary.md"
  else
    echo "TransformerEngine install failed: no TE columns (install_te.log)" >> "$RES/summary.md"
  fi
fi
with_te() {  # a benchmark with TE importable; the tests run without it
  if [ -n "$TE_ENV" ]; then ( . "$TE_ENV"; "$@" ); else "$@"; fi
}
pack

for step in $STEPS; do
  echo "== $step ($(date -u +%H:%M:%S))" | tee -a "$RES/summary.md"
  case $step in
    tests)
      timeout "${TESTS_TIMEOUT_S:-420}" $PY -m pytest -q -m cuda -p no:cacheprovider --durations=15 \
        ${PYTEST_ARGS:-} tests > "$RES/tests_gpu.log" 2>&1
      rc=$?; tail -25 "$RES/tests_gpu.log"; tail -1 "$RES/tests_gpu.log" >> "$RES/summary.md"
      record_switches $rc "$(tail -1 "$RES/tests_gpu.log")"
      [ $rc -eq 0 ] || status=1 ;;
    tests-switched)  # issue 22: the CUDA suite again with every new kernel switched on
      env $SWITCHES timeout "${TESTS_TIMEOUT_S:-420}" $PY -m pytest -q -m cuda -p no:cacheprovider \
        ${PYTEST_ARGS:-} tests > "$RES/tests_gpu_switched.log" 2>&1
      rc=$?; tail -25 "$RES/tests_gpu_switched.log"
      tail -1 "$RES/tests_gpu_switched.log" >> "$RES/summary.md"; [ $rc -eq 0 ] || status=1 ;;
    block-switched|stack-switched|step-switched)  # the benchmark with every switch on
      b=${step%-switched}
      with_te env $SWITCHES $PY -m benchmarks "$b" --json "$RES/bench_${b}_switched.json" \
        > /tmp/bench_${b}_switched.log 2>&1 || { status=1; tail -30 /tmp/bench_${b}_switched.log; }
      grep -v '^wrote' /tmp/bench_${b}_switched.log >> "$RES/summary.md" ;;
    train-scaling-fused)  # issue 22: current scaling's fused path against delayed scaling
      for run in delayed current; do
        GRAPHFP8_CURRENT_FUSED=1 $PY -m graphfp8.training --compare fp8:layers --scaling $run \
          --preset ${TRAIN_PRESET:-100m} --steps ${TRAIN_SCALING_STEPS:-200} \
          --out "$RES/train_scaling_fused_$run" > "$RES/train_scaling_fused_$run.log" 2>&1 \
          || status=1
        echo "-- $run (GRAPHFP8_CURRENT_FUSED=1)" | tee -a "$RES/summary.md"
        sed -n '/^ *run /,/^wrote/p' "$RES/train_scaling_fused_$run.log" | grep -v '^wrote' \
          | tee -a "$RES/summary.md"
      done ;;
    ddp)  # data parallel: 1 vs all GPUs of the machine, FP8 + graphs, the GPU default preset
      n=$($PY -c "import torch; print(torch.cuda.device_count())")
      procs_list=1; [ "$n" -gt 1 ] && procs_list="1 $n"
      for procs in $procs_list; do
        $PY -m torch.distributed.run --standalone --nproc_per_node=$procs -m graphfp8.training \
          --ddp --preset ${TRAIN_PRESET:-100m} --steps ${DDP_STEPS:-100} --out "$RES/ddp$procs" \
          > "$RES/ddp$procs.log" 2>&1 || status=1
        echo "-- $procs GPU(s)" | tee -a "$RES/summary.md"
        grep -A3 "^ *run " "$RES/ddp$procs.log" | tee -a "$RES/summary.md"
        grep "across" "$RES/ddp$procs.log" | tee -a "$RES/summary.md"
      done ;;
    shard)  # issue 31: sharded masters at world size 1 with NCCL (one GPU; torchrun for the CLI)
      $PY -m pytest -q -m cuda -p no:cacheprovider tests/sharding > "$RES/shard_tests.log" 2>&1 \
        || status=1
      tail -1 "$RES/shard_tests.log" | tee -a "$RES/summary.md"
      TR="$PY -m torch.distributed.run --standalone --nproc_per_node=1 -m graphfp8.training --ddp \
        --fp8-weights --preset ${TRAIN_PRESET:-100m} --eval-every 1000 --val-batches 2"
      # --deterministic: on the GPU cuDNN's bf16 attention backward differs run to run; its
      # deterministic path gave the same bits run to run on the H200 (2026-12-01, call 2)
      $TR --shard --compare fp8:none,fp8:step --steps 8 --deterministic --out "$RES/shard_modes" \
        > "$RES/shard_modes.log" 2>&1 || status=1
      for flag in "" --shard; do  # tokens/s and memory: unsharded, then sharded, step graphs
        $TR $flag --graphs step --steps ${SHARD_STEPS:-120} --out "$RES/shard_speed$flag" \
          > "$RES/shard_speed$flag.log" 2>&1 || status=1
      done
      $PY scripts/shard_report.py "$RES" > "$RES/shard_report.log" 2>&1 || status=1
      grep "^shard" "$RES/shard_report.log" | tee -a "$RES/summary.md"
      $PY -c 'import json, sys; from benchmarks.memory_shard import run
json.dump(run("cuda"), open(sys.argv[1], "w"), default=str)' "$RES/memory_shard.json" \
        > "$RES/memory_shard.log" 2>&1 || status=1
      grep "^|\|^###" "$RES/memory_shard.log" | tee -a "$RES/summary.md" ;;
    tests-first)  # one file first, verbose, so a crash names its test
      $PY -m pytest -v -m cuda -p no:cacheprovider ${FIRST_TESTS:-tests/ops} > "$RES/tests_first.log" 2>&1
      rc=$?; tail -5 "$RES/tests_first.log" | tee -a "$RES/summary.md"; [ $rc -eq 0 ] || status=1 ;;
    train)  # issue 17: bf16 vs FP8 (graphs) on held-out real text; validation loss and tokens/s
      $PY -m graphfp8.training --compare ${TRAIN_RUNS:-bf16:graphs,fp8:graphs} \
        --preset ${TRAIN_PRESET:-100m} --data ${TRAIN_DATA:-stdlib} --steps ${TRAIN_STEPS:-300} \
        --out "$RES/train" > "$RES/train.log" 2>&1 || status=1
      tail -8 "$RES/train.log" | tee -a "$RES/summary.md" ;;
    train-llama)  # issue 23: Llama blocks (RMSNorm, GQA, SwiGLU, no bias), bf16 vs FP8 graphed
      $PY -m graphfp8.training --compare ${TRAIN_RUNS:-bf16:graphs,fp8:graphs} --preset llama-100m \
        --data ${TRAIN_DATA:-stdlib} --steps ${TRAIN_STEPS:-300} ${LLAMA_ARGS:-} \
        --out "$RES/train_llama" > "$RES/train_llama.log" 2>&1 || status=1
      tail -8 "$RES/train_llama.log" | tee -a "$RES/summary.md" ;;
    train-gap)  # issue 27: FP8 vs bf16 validation loss over seeds (paired), the report's cost,
      # and the numerics report of the first GAP_STATS_STEPS steps (recorded == true amax)
      $PY scripts/train_gap.py --out "$RES/train_gap" --variants ${GAP_VARIANTS:-bf16,delayed,current,stats} \
        --seeds ${GAP_SEEDS:-0,1,2} --steps ${GAP_STEPS:-300} --preset ${TRAIN_PRESET:-100m} \
        --stats-steps ${GAP_STATS_STEPS:-20} > "$RES/train_gap.log" 2>&1 || status=1
      rm -rf "$RES"/train_gap/*/
      sed -n '/validation loss against/,/^worst/p' "$RES/train_gap.log" | tee -a "$RES/summary.md" ;;
    train-attn)  # issue 33: FP8 attention's training quality, paired over seeds: bf16, FP8, FP8 +
      # FP8 attention (validation loss and tokens/s; --heads 8: cuDNN's FP8 backward on Hopper takes
      # head_dim 128 only). Default 1000 steps x 1 microbatch, 2 seeds, both presets: ~4-5 min
      for preset in ${ATTN_PRESETS:-100m llama-100m}; do
        $PY scripts/train_gap.py --out "$RES/train_attn_$preset" --variants bf16,delayed,fp8_attn \
          --seeds ${ATTN_SEEDS:-0,1} --steps ${ATTN_STEPS:-1000} --microbatches ${ATTN_MICROBATCHES:-1} \
          --val-batches ${ATTN_VAL_BATCHES:-16} --preset "$preset" --heads ${ATTN_HEADS:-8} ${ATTN_ARGS:-} > "$RES/train_attn_$preset.log" 2>&1 \
          || { status=1; tail -20 "$RES/train_attn_$preset.log"; }
        rm -rf "$RES"/train_attn_"$preset"/*/
        echo "-- $preset" | tee -a "$RES/summary.md"
        sed -n '/validation loss against/,$p' "$RES/train_attn_$preset.log" | tee -a "$RES/summary.md"
      done ;;
    attn-quality)  # issue 41 item 5: FP8 attention as shipped and with its E4M3 backward, paired
      # against FP8 without FP8 attention (notes/FP8_ATTENTION.md)
      for preset in ${AQ_PRESETS:-100m llama-100m}; do
        $PY scripts/train_gap.py --out "$RES/attn_quality_$preset" \
          --variants delayed,fp8_attn,fp8_attn_e4m3 --seeds ${AQ_SEEDS:-0,1} \
          --steps ${AQ_STEPS:-1000} --microbatches 1 --val-batches 16 --preset "$preset" \
          --heads ${AQ_HEADS:-8} > "$RES/attn_quality_$preset.log" 2>&1 \
          || { status=1; tail -20 "$RES/attn_quality_$preset.log"; }
        rm -rf "$RES"/attn_quality_"$preset"/*/
        echo "-- $preset" | tee -a "$RES/summary.md"
        sed -n '/against FP8 without/,$p' "$RES/attn_quality_$preset.log" | tee -a "$RES/summary.md"
      done ;;
    deterministic)  # issue 33: --deterministic twice gives the same bits (graphs and eager; bf16
      # attention at the preset's heads), and its cost in tokens/s; with FP8 attention (--heads 8)
      # it must refuse before training (graphfp8/ops/cudnn_determinism.py)
      $PY -m graphfp8.training --preset ${DET_PRESET:-100m} --fp8-attention --heads ${ATTN_HEADS:-8} \
        --deterministic --steps 1 --out "$RES/det_refused" > "$RES/det_refused.log" 2>&1
      rc=$?
      if [ $rc = 2 ] && grep -q "run to run on the H200" "$RES/det_refused.log"; then
        echo "--deterministic --fp8-attention: refused before training (ok)" | tee -a "$RES/summary.md"
      else
        status=1; echo "--deterministic --fp8-attention: NOT refused (rc $rc)" | tee -a "$RES/summary.md"
        tail -5 "$RES/det_refused.log"
      fi
      args="--compare fp8:graphs,fp8:eager --preset ${DET_PRESET:-100m} --steps ${DET_STEPS:-50}
        --eval-every 25 --val-batches 8"  # bf16 attention only: FP8 attention is refused above
      for run in det1 det2 base; do
        det="--deterministic"; [ $run = base ] && det=""
        $PY -m graphfp8.training $args $det --out "$RES/det_off_$run" > "$RES/det_off_$run.log" 2>&1 \
          || { status=1; tail -20 "$RES/det_off_$run.log"; }
      done
      echo "-- FP8 attention off: --deterministic run twice" | tee -a "$RES/summary.md"
      $PY scripts/same_bits.py "$RES/det_off_det1/summary.json" "$RES/det_off_det2/summary.json" \
        --baseline "$RES/det_off_base/summary.json" 2>&1 | tee -a "$RES/summary.md" || status=1 ;;
    rows33)  # issue 33's table, tokens/s: bf16 vs FP8 (layer graphs) per preset in one process,
      # then 100m FP8 with current scaling and with --fp8-stats 10 (one process each: ratios to
      # the FP8 run of the first preset's process); synthetic data (tokens/s only), ROWS_STEPS
      for preset in ${ROWS_PRESETS:-100m llama-100m 300m}; do
        $PY -m graphfp8.training --compare bf16:graphs,fp8:graphs --preset "$preset" --data synthetic \
          --val-fraction 0 --steps ${ROWS_STEPS:-100} --out "$RES/rows_$preset" \
          > "$RES/rows_$preset.log" 2>&1 || { status=1; tail -20 "$RES/rows_$preset.log"; }
        echo "-- $preset" | tee -a "$RES/summary.md"
        grep -A3 "^ *run " "$RES/rows_$preset.log" | tee -a "$RES/summary.md"
      done
      for v in "--scaling current" "--fp8-stats 10"; do
        name=$(echo "$v" | tr -d ' -')
        $PY -m graphfp8.training --compare fp8:graphs $v --preset 100m --data synthetic \
          --val-fraction 0 --steps ${ROWS_STEPS:-100} --out "$RES/rows_$name" \
          > "$RES/rows_$name.log" 2>&1 || { status=1; tail -20 "$RES/rows_$name.log"; }
        echo "-- 100m fp8:graphs $v" | tee -a "$RES/summary.md"
        grep -A2 "^ *run " "$RES/rows_$name.log" | tee -a "$RES/summary.md"
      done ;;
    kern41)  # issue 41 item 4: tests and kernel rows of each kern41 switch, then the 100m step
      # graph off / on, interleaved repeats, one process each (switches load with the extension)
      timeout 240 $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_norm_fwd_transpose.py \
        tests/ops/test_rope_cast.py tests/modules/test_rope_cast_layer.py \
        > "$RES/kern41_tests.log" 2>&1 || status=1
      grep -E "^FAILED|passed|failed|Timeout" "$RES/kern41_tests.log" | tail -12 | tee -a "$RES/summary.md"
      timeout 150 $PY -m benchmarks variants --json "$RES/kern41_variants.json" 2>&1 | grep -v '^wrote' \
        | grep -E "^#|^\| (switch|---|NORM_FWD_TRANSPOSE)" | tee -a "$RES/summary.md" || status=1
      for sw in ${KERN41_SWITCHES:-NORM_FWD_TRANSPOSE ROPE_CAST_BWD}; do
        off=""; on=""
        for rep in $(seq "${KERN41_REPEATS:-3}"); do
          for v in 0 1; do
            d="$RES/kern41_${sw}_${v}_$rep"
            env "GRAPHFP8_$sw=$v" timeout 150 $PY -m graphfp8.training --compare fp8:step --preset 100m \
              --data synthetic --val-fraction 0 --deterministic --steps "${KERN41_STEPS:-100}" \
              --out "$d" > "$d.log" 2>&1 || { status=1; tail -20 "$d.log"; }
            if [ $v = 0 ]; then off="$off $d"; else on="$on $d"; fi
          done
        done
        $PY scripts/switch_ab.py --switch "$sw" --off $off --on $on 2>&1 | tee -a "$RES/summary.md" \
          || status=1
      done ;;
    normv2)  # issue 41 cut 4: the v2 norm backward's tests, variants rows, ncu off / on
      timeout 240 $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_norm_bwd_v2.py \
        tests/ops/test_norm_bwd_batched.py > "$RES/normv2_tests.log" 2>&1 || status=1
      grep -E "^FAILED|passed|failed|Timeout" "$RES/normv2_tests.log" | tail -12 | tee -a "$RES/summary.md"
      timeout 150 $PY -m benchmarks variants --json "$RES/normv2_variants.json" 2>&1 | grep -v '^wrote' \
        | grep -E "^#|^\| (switch|---|NORM_BWD_(V2|BATCHED))" | tee -a "$RES/summary.md" || status=1
      NCU=$(find_ncu)
      if [ -n "$NCU" ]; then
        secs=$(ncu_sections SpeedOfLight MemoryWorkloadAnalysis Occupancy LaunchStats SchedulerStats WarpStateStats)
        for v in 0 1; do
          env GRAPHFP8_NORM_BWD_V2=$v timeout 120 "$NCU" --profile-from-start off --clock-control none $secs \
            --csv --page details $PY scripts/ncu_kernels.py run --only norm_bwd > "$RES/normv2_ncu_$v.csv" \
            2> "$RES/normv2_ncu_run_$v.log" || status=1
          echo "-- ncu of the norm backwards, GRAPHFP8_NORM_BWD_V2=$v" | tee -a "$RES/summary.md"
          $PY scripts/ncu_kernels.py summary "$RES/normv2_ncu_$v.csv" 2>&1 | tee -a "$RES/summary.md" || status=1
        done
      fi ;;
    speed41)  # issue 41: compiles ~1.5-2 min (3 torch.compile'd models), captures ~1.5 min
      # (layer and step graphs), timing + profiles ~30 s, calibration ~10 s: ~4-5 min (timeout 8)
      timeout "${SPEED_TIMEOUT_S:-480}" $PY -m benchmarks speed --json "$RES/bench_speed41.json" \
        > "$RES/speed41.log" 2>&1 || { status=1; tail -30 "$RES/speed41.log"; }
      grep "^|\|^###" "$RES/speed41.log" | tee -a "$RES/summary.md" ;;
    train-e4m3)  # the train step's FP8 run with E4M3 gradients too (against HYBRID's E5M2)
      $PY -m graphfp8.training --compare fp8:graphs --fp8-format E4M3 --preset ${TRAIN_PRESET:-100m} \
        --data ${TRAIN_DATA:-stdlib} --steps ${TRAIN_STEPS:-300} --out "$RES/train_e4m3" \
        > "$RES/train_e4m3.log" 2>&1 || status=1
      tail -4 "$RES/train_e4m3.log" | tee -a "$RES/summary.md" ;;
    train-step)  # issue 15: per-layer graphs vs the whole step as one graph, small and 100m
      for preset in ${TRAIN_STEP_PRESETS:-small 100m}; do
        $PY -m graphfp8.training --compare fp8:layers,fp8:step --preset "$preset" \
          --steps ${TRAIN_STEP_STEPS:-200} --out "$RES/train_step_$preset" \
          > "$RES/train_step_$preset.log" 2>&1 || status=1
        echo "-- $preset" | tee -a "$RES/summary.md"
        grep -A2 "^ *run " "$RES/train_step_$preset.log" | tee -a "$RES/summary.md"
      done ;;
    compile)  # torch.compile: its CUDA tests, then training with and without --compile
      $PY -m pytest -v -m cuda -p no:cacheprovider tests/test_compile.py > "$RES/tests_compile.log" 2>&1
      rc=$?; tail -1 "$RES/tests_compile.log" | tee -a "$RES/summary.md"; [ $rc -eq 0 ] || status=1
      for mode in off on; do
        flag=""; [ $mode = on ] && flag=--compile
        $PY -m graphfp8.training --compare ${COMPILE_RUNS:-bf16:eager,fp8:eager,fp8:graphs} $flag \
          --preset ${TRAIN_PRESET:-100m} --steps ${COMPILE_STEPS:-100} --out "$RES/compile_$mode" \
          > "$RES/compile_$mode.log" 2>&1 || status=1
        echo "-- --compile $mode" | tee -a "$RES/summary.md"
        sed -n '/^ *run /,/^wrote/p' "$RES/compile_$mode.log" | grep -v '^wrote' | tee -a "$RES/summary.md"
      done ;;
    blockwise)  # issue 42: probe, CUDA tests (both GEMM paths), block speed, 100m quality
      $PY scripts/probe_blockwise_mm.py --out "$RES/blockwise_mm_probe.json" \
        > "$RES/blockwise_probe.log" 2>&1 || status=1
      tail -3 "$RES/blockwise_probe.log" | tee -a "$RES/summary.md"
      # The graph tests run the emulation (their fixture); the scaled_mm tests pick their path.
      timeout 300 $PY -m pytest -q -m cuda -p no:cacheprovider \
        tests/ops/test_blockwise.py tests/graphs/test_blockwise_graphs.py \
        tests/modules/test_blockwise_primary.py tests/graphs/test_blockwise_primary_graphs.py \
        tests/test_numerics_blockwise.py > "$RES/tests_blockwise.log" 2>&1 || status=1
      echo "-- blockwise CUDA tests: $(tail -1 "$RES/tests_blockwise.log")" | tee -a "$RES/summary.md"
      # The fused quantize kernels (default-off on CUDA) and the weight cache, then the graph
      # tests with the fused kernels on: what turning GRAPHFP8_BLOCKWISE_KERNELS on needs.
      GRAPHFP8_BLOCKWISE_KERNELS=fused timeout 450 $PY -m pytest -q -m cuda -p no:cacheprovider \
        tests/ops/test_blockwise_fused.py tests/modules/test_blockwise_cache.py \
        tests/graphs/test_blockwise_graphs.py > "$RES/tests_blockwise_fused.log" 2>&1 || status=1
      echo "-- blockwise fused-kernel CUDA tests: $(tail -1 "$RES/tests_blockwise_fused.log")" \
        | tee -a "$RES/summary.md"
      # The norm and the GELU / SwiGLU / GeGLU writing the blockwise tiles (GRAPHFP8_BLOCKWISE_NORM
      # and GRAPHFP8_BLOCKWISE_ACT, default off: the kernels against the CUDA norm / activation
      # kernel + quantizer, captured) and the per-block statistics kernel (the numerics
      # report's, gated by its flag), then the layers with the switches on (issue 42).
      timeout 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_blockwise_norm.py \
        tests/ops/test_blockwise_act.py tests/ops/test_blockwise_stats_kernel.py \
        tests/modules/test_blockwise_norm_layers.py tests/modules/test_blockwise_act_layers.py \
        > "$RES/tests_blockwise_norm.log" 2>&1 || status=1
      echo "-- blockwise norm + act + stats CUDA tests: $(tail -1 "$RES/tests_blockwise_norm.log")" \
        | tee -a "$RES/summary.md"
      # GRAPHFP8_BLOCKWISE_GLU_KERNEL (default off): the bf16 activation kernels against their
      # CPU twins and the per-tensor / blockwise activation kernels, vector and scalar paths,
      # captured; the layers with the switch on, graphed == eager (the emulated GEMM).
      timeout 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_mlp_act.py \
        tests/modules/test_blockwise_plain_layers.py > "$RES/tests_blockwise_glu.log" 2>&1 \
        || status=1
      echo "-- blockwise GLU kernel CUDA tests: $(tail -1 "$RES/tests_blockwise_glu.log")" \
        | tee -a "$RES/summary.md"
      # Their speed off / on: the variants rows BLOCKWISE_NORM and BLOCKWISE_ACT (~1.5 min).
      timeout 150 $PY -m benchmarks variants --json "$RES/blockwise_variants.json" 2>&1 \
        | grep -v '^wrote' | grep -E "^#|^\| (switch|---|BLOCKWISE_)" | tee -a "$RES/summary.md" \
        || status=1
      # The operand layouts of the three GEMMs against this torch's own (meta) scaled_mm checks.
      $PY -m pytest -q -p no:cacheprovider tests/modules/test_blockwise_layouts.py \
        >> "$RES/tests_blockwise.log" 2>&1 || status=1
      echo "-- blockwise layouts: $(tail -1 "$RES/tests_blockwise.log")" | tee -a "$RES/summary.md"
      # with_te: the MLP rows' TE Float8BlockScaling peers need TE's environment
      with_te env GRAPHFP8_BLOCKWISE_GEMM=${BLOCK_GEMM:-scaled_mm} $PY scripts/bench_blockwise.py \
        --json "$RES/bench_blockwise.json" > "$RES/bench_blockwise.log" 2>&1 || status=1
      tee -a "$RES/summary.md" < "$RES/bench_blockwise.log"
      if [ "${BLOCK_TRAIN_STEPS:-300}" -gt 0 ]; then
        for run in delayed blockwise; do
          GRAPHFP8_BLOCKWISE_GEMM=${BLOCK_GEMM:-scaled_mm} $PY -m graphfp8.training --compare fp8:layers \
            --scaling $run --preset ${TRAIN_PRESET:-100m} --steps ${BLOCK_TRAIN_STEPS:-300} \
            --out "$RES/train_block_$run" > "$RES/train_block_$run.log" 2>&1 || status=1
          echo "-- $run" | tee -a "$RES/summary.md"
          sed -n '/^ *run /,/^wrote/p' "$RES/train_block_$run.log" | grep -v '^wrote' \
            | tee -a "$RES/summary.md"
        done
      fi ;;
    blockquant)  # issue 42: the staged quantize kernel: exact, then timed against the default
      timeout 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_blockwise_staged.py \
        > "$RES/tests_blockquant.log" 2>&1 || status=1
      echo "-- staged quantize CUDA tests: $(tail -1 "$RES/tests_blockquant.log")" | tee -a "$RES/summary.md"
      GRAPHFP8_BLOCK_QUANTIZE_STAGED=1 GRAPHFP8_BLOCKWISE_KERNELS=fused timeout 450 $PY -m pytest \
        -q -m cuda -p no:cacheprovider tests/ops/test_blockwise_fused.py \
        tests/graphs/test_blockwise_graphs.py > "$RES/tests_blockquant_on.log" 2>&1 || status=1
      echo "-- fused blockwise CUDA tests, staged on: $(tail -1 "$RES/tests_blockquant_on.log")" \
        | tee -a "$RES/summary.md"
      $PY -c "from benchmarks.variants import block_quantize_rows as r, block_quantize_table as t
t(r('cuda'), 'cuda')" > "$RES/blockquant_speed.log" 2>&1 || status=1
      tee -a "$RES/summary.md" < "$RES/blockquant_speed.log" ;;
    blockprof)  # issue 42: per-kernel time of the SwiGLU MLP, delayed vs blockwise vs TE's
      with_te env GRAPHFP8_BLOCKWISE_GEMM=${BLOCK_GEMM:-scaled_mm} $PY scripts/profile_blockwise.py \
        --shapes ${BLOCKPROF_SHAPES:-1b,8b} --json "$RES/profile_blockwise.json" \
        > "$RES/profile_blockwise.log" 2>&1 || status=1
      grep "^##" "$RES/profile_blockwise.log" | tee -a "$RES/summary.md"
      block_rows=delayed,blockwise-fused-cache,blockwise-glu-kernel
      with_te env GRAPHFP8_BLOCKWISE_GEMM=${BLOCK_GEMM:-scaled_mm} $PY scripts/bench_blockwise.py \
        --rows $block_rows --json "$RES/bench_blockwise_te.json" \
        > "$RES/bench_blockwise_te.log" 2>&1 || status=1
      tee -a "$RES/summary.md" < "$RES/bench_blockwise_te.log"
      if [ "${BLOCKPROF_8B:-1}" = 1 ]; then
        with_te env GRAPHFP8_BLOCKWISE_GEMM=${BLOCK_GEMM:-scaled_mm} $PY scripts/bench_blockwise.py \
          --hidden 4096 --ffn 14336 --seq 8192 --iters 4 --repeats 2 --rows $block_rows \
          --json "$RES/bench_blockwise_te_8b.json" > "$RES/bench_blockwise_te_8b.log" 2>&1 || status=1
        tee -a "$RES/summary.md" < "$RES/bench_blockwise_te_8b.log"
      fi ;;
    quality-block)  # issue 42: blockwise vs delayed vs bf16 validation loss, paired per seed
      for preset in ${QB_PRESETS:-100m llama-100m}; do
        GRAPHFP8_BLOCKWISE_GEMM=${BLOCK_GEMM:-scaled_mm} $PY scripts/train_gap.py \
          --out "$RES/quality_block_$preset" --variants ${QB_VARIANTS:-bf16,delayed,blockwise} \
          --seeds ${QB_SEEDS:-0} --steps ${QB_STEPS:-300} --microbatches ${QB_MICROBATCHES:-2} \
          --preset "$preset" --data stdlib > "$RES/quality_block_$preset.log" 2>&1 \
          || { status=1; tail -20 "$RES/quality_block_$preset.log"; }
        rm -rf "$RES"/quality_block_"$preset"/*/
        echo "-- quality-block $preset" | tee -a "$RES/summary.md"
        sed -n '/validation loss against/,$p' "$RES/quality_block_$preset.log" | tee -a "$RES/summary.md"
      done ;;
    shard-block)  # issue 42: sharded blockwise FP8 weights at N=1 (NCCL): no all-reduce, speed
      GRAPHFP8_BLOCKWISE_GEMM=${BLOCK_GEMM:-scaled_mm} $PY -m pytest -q -m cuda -p no:cacheprovider \
        tests/sharding/test_sharded_blockwise.py > "$RES/shard_block_tests.log" 2>&1 || status=1
      echo "-- shard-block CUDA tests: $(tail -1 "$RES/shard_block_tests.log")" | tee -a "$RES/summary.md"
      for flag in "" --shard; do
        GRAPHFP8_BLOCKWISE_GEMM=${BLOCK_GEMM:-scaled_mm} $PY -m torch.distributed.run --standalone \
          --nproc_per_node=1 -m graphfp8.training --ddp --fp8-weights --scaling blockwise $flag \
          --preset ${TRAIN_PRESET:-100m} --graphs step --steps ${SHARD_BLOCK_STEPS:-60} \
          --eval-every 1000 --val-batches 2 --out "$RES/shard_block$flag" \
          > "$RES/shard_block$flag.log" 2>&1 || status=1
      done
      $PY - "$RES" <<'PYEOF' 2>&1 | tee -a "$RES/summary.md" || status=1
import json, sys
runs = [json.load(open(f"{sys.argv[1]}/shard_block{f}/summary.json"))["runs"][0] for f in ("", "--shard")]
rate = [r["tokens_per_s"] for r in runs]
print(f"shard-block: unsharded {rate[0]:.0f} tokens/s, sharded {rate[1]:.0f} ({rate[1] / rate[0]:.3f}x), "
      f"final loss {runs[0]['final_loss']:.4f} / {runs[1]['final_loss']:.4f}")
PYEOF
      ;;
    train-scaling)  # issue 16: DelayedScaling vs Float8CurrentScaling vs FP8 primary weights
      for run in delayed current fp8w; do
        case $run in fp8w) extra="--fp8-weights" ;; *) extra="--scaling $run" ;; esac
        $PY -m graphfp8.training --compare fp8:layers $extra \
          --preset ${TRAIN_PRESET:-100m} --steps ${TRAIN_SCALING_STEPS:-200} \
          --out "$RES/train_scaling_$run" > "$RES/train_scaling_$run.log" 2>&1 || status=1
        echo "-- $run" | tee -a "$RES/summary.md"
        sed -n '/^ *run /,/^wrote/p' "$RES/train_scaling_$run.log" | grep -v '^wrote' \
          | tee -a "$RES/summary.md"
      done ;;
    profile)
      $PY -m graphfp8.training.step_profile --out "$RES/profile" > "$RES/profile.log" 2>&1 || status=1
      grep -v USDT "$RES/profile.log" | head -40 | tee -a "$RES/summary.md" ;;
    profile-step)  # the 100m preset with the whole step as one graph
      $PY -m graphfp8.training.step_profile --graphs step --out "$RES/profile" \
        > "$RES/profile_step.log" 2>&1 || status=1
      grep -v USDT "$RES/profile_step.log" | head -40 | tee -a "$RES/summary.md" ;;
    kernels-ab)  # kernel benchmark and kernel outputs (bit for bit): AB_BASE vs this tree
      OUT=$RES bash scripts/bench_before_after.sh "${AB_BASE:-30328b1}" > "$RES/kernels_ab.log" 2>&1 \
        || { status=1; tail -30 "$RES/kernels_ab.log"; }
      grep -v "^wrote\|kernel output digests" "$RES/kernels_ab.log" >> "$RES/summary.md" ;;
    memory)  # issue 19: the report (bf16 beside FP8, one layer and a stack), then the table
      for what in ${MEMORY_WHAT:-report table}; do
        flag=$([ $what = table ] && echo --table)
        $PY -m benchmarks memory $flag --json "$RES/bench_memory_$what.json" \
          > /tmp/bench_memory_$what.log 2>&1 || { status=1; tail -30 /tmp/bench_memory_$what.log; }
        grep -v '^wrote' /tmp/bench_memory_$what.log >> "$RES/summary.md"
      done ;;
    wgrad-accum)  # issue 41 item 4: fuse_wgrad_accumulation's CUDA tests, then its benchmark
      $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_gemm_accumulate.py \
        tests/modules/test_fuse_wgrad.py tests/graphs/test_fuse_wgrad_graphs.py \
        > "$RES/tests_wgrad_accum.log" 2>&1 || status=1
      tail -15 "$RES/tests_wgrad_accum.log"; tail -1 "$RES/tests_wgrad_accum.log" >> "$RES/summary.md"
      $PY -m benchmarks wgrad-accum --json "$RES/bench_wgrad_accum.json" \
        > /tmp/bench_wgrad_accum.log 2>&1 || { status=1; tail -30 /tmp/bench_wgrad_accum.log; }
      grep -v '^wrote' /tmp/bench_wgrad_accum.log >> "$RES/summary.md" ;;
    grad-fill)  # issue 41: the one-pass -0.0 fill of the layer graphs' .grad buffers
      timeout 120 $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_grad_fold_op.py \
        tests/graphs/test_grad_fold.py tests/ops/test_op_registry.py tests/ops/test_gemm_into.py \
        tests/graphs/test_wgrad_into_grad.py > "$RES/tests_grad_fill.log" 2>&1 || status=1
      tail -15 "$RES/tests_grad_fill.log"; tail -1 "$RES/tests_grad_fill.log" >> "$RES/summary.md"
      timeout 240 $PY -m benchmarks grad-fill --json "$RES/bench_grad_fill.json" \
        > /tmp/bench_grad_fill.log 2>&1 || { status=1; tail -30 /tmp/bench_grad_fill.log; }
      grep -v '^wrote' /tmp/bench_grad_fill.log >> "$RES/summary.md"
      timeout 100 $PY -m benchmarks variants --json "$RES/grad_fill_variants.json" 2>&1 \
        | grep -v '^wrote' | grep -E "^###|^\| (switch|---|GRAD_F)" >> "$RES/summary.md" ;;
    glu)  # issue 23: SwiGLU LayerNormMLP FP8 graphed vs bf16 graphed and TE, the GLU kernels
      with_te $PY -m benchmarks glu --json "$RES/bench_glu.json" > /tmp/bench_glu.log 2>&1 \
        || { status=1; tail -30 /tmp/bench_glu.log; }
      grep -v '^wrote' /tmp/bench_glu.log >> "$RES/summary.md" ;;
    step-nodebug)  # issue 26: does the CUDA graphs' debug mode (graphs/backends.py) cost launch time?
      GRAPHFP8_GRAPH_DEBUG=0 $PY -m benchmarks step --json "$RES/bench_step_nodebug.json" \
        > /tmp/bench_step_nodebug.log 2>&1 || { status=1; tail -30 /tmp/bench_step_nodebug.log; }
      grep -v '^wrote' /tmp/bench_step_nodebug.log >> "$RES/summary.md" ;;
    kern-ab|kern-ab2)  # issue 33: the CUDA tests of every kern switch (DBIAS_IN_KERNEL,
      # NORM_BWD_STAGED, NORM_BWD_PARAM_IN_KERNEL, ROPE_PARTS_BWD), their variants rows, census and
      # bench step with them off / on, ncu of the norm backward with them on; each under a limit
      KERN_SW="GRAPHFP8_DBIAS_IN_KERNEL=1 GRAPHFP8_NORM_BWD_STAGED=1 GRAPHFP8_NORM_BWD_PARAM_IN_KERNEL=1 GRAPHFP8_ROPE_PARTS_BWD=1"
      timeout 120 $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_dbias_in_kernel.py \
        tests/ops/test_norm_bwd_batched.py tests/ops/test_rope_fp8.py > "$RES/kern2_tests.log" 2>&1 || status=1
      grep -E "^FAILED|passed|failed|Timeout" "$RES/kern2_tests.log" | tail -12 | tee -a "$RES/summary.md"
      timeout 150 $PY -m benchmarks variants --json "$RES/kern2_variants.json" 2>&1 \
        | grep -v '^wrote' | grep -E "^#|^\| (switch|---|DBIAS|NORM_BWD_(STAGED|PARAM))" >> "$RES/summary.md" || status=1
      # ws1: switches on and cuBLASLt's workspace at 1 KiB (no split-K): are _scaled_mm's memsets
      # cuBLASLt's split-K workspace zeroing (notes/PERF.md), and what do they cost?
      for sw in off on ws1; do
        e=""; [ $sw = on ] && e=$KERN_SW; [ $sw = ws1 ] && e="$KERN_SW CUBLASLT_WORKSPACE_SIZE=1"
        env $e timeout 90 $PY -m benchmarks census --json "$RES/kern2_census_$sw.json" > /tmp/kern2_census_$sw.log 2>&1 || status=1
        env $e timeout 90 $PY -m benchmarks step --json "$RES/kern2_step_$sw.json" > /tmp/kern2_step_$sw.log 2>&1 || status=1
        echo "-- switches $sw" >> "$RES/summary.md"
        grep -v '^wrote' /tmp/kern2_census_$sw.log | grep -E "^#|^\| (op|---|total|KERNEL|MEMSET|MEMCPY|Memset)" >> "$RES/summary.md"
        grep -E "^\| (peer|---|fp8 step|bf16 step)" /tmp/kern2_step_$sw.log | head -6 >> "$RES/summary.md"
      done
      NCU=$(find_ncu)
      if [ -n "$NCU" ]; then
        secs=$(ncu_sections SpeedOfLight Occupancy LaunchStats SchedulerStats WarpStateStats)
        env $KERN_SW timeout 90 "$NCU" --profile-from-start off --clock-control none $secs --csv --page details \
          $PY scripts/ncu_kernels.py run --only layernorm_bwd > /tmp/kern2_ncu.csv 2> "$RES/kern2_ncu_run.log" || status=1
        $PY scripts/ncu_kernels.py summary /tmp/kern2_ncu.csv > "$RES/kern2_ncu_summary.md" 2>&1 || status=1
        tee -a "$RES/summary.md" < "$RES/kern2_ncu_summary.md"
      fi ;;
    glu-v2)  # issue 41 cut 3 (~2-3 min): the CUDA tests of GLU_V2 / GLU_V2_DIV (bit for bit against
      # the first kernels), `benchmarks glu-v2` at Llama shapes, ncu of the SwiGLU casts per version
      $PY -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_glu_v2.py tests/ops/test_glu.py \
        tests/modules/test_glu_mlp.py > "$RES/glu_v2_tests.log" 2>&1 || status=1
      tail -1 "$RES/glu_v2_tests.log" | tee -a "$RES/summary.md"
      timeout 150 $PY -m benchmarks glu-v2 --json "$RES/bench_glu_v2.json" > "$RES/bench_glu_v2.log" 2>&1 \
        || { status=1; tail -20 "$RES/bench_glu_v2.log"; }
      grep "^|\|^###" "$RES/bench_glu_v2.log" | tee -a "$RES/summary.md"
      NCU=$(find_ncu)
      if [ -n "$NCU" ]; then
        secs=$(ncu_sections SpeedOfLight MemoryWorkloadAnalysis Occupancy LaunchStats SchedulerStats WarpStateStats)
        for v in "0 0" "1 0" "1 1"; do set -- $v
          env GRAPHFP8_GLU_V2=$1 GRAPHFP8_GLU_V2_DIV=$2 timeout 90 "$NCU" --profile-from-start off \
            --clock-control none $secs --csv --page details $PY scripts/ncu_kernels.py run --only glu \
            > /tmp/glu_ncu.csv 2> "$RES/glu_v2_ncu_run_$1$2.log" || status=1
          echo "-- ncu, GLU_V2=$1 GLU_V2_DIV=$2" | tee -a "$RES/summary.md"
          $PY scripts/ncu_kernels.py summary /tmp/glu_ncu.csv 2>&1 | tee "$RES/glu_v2_ncu_$1$2.md" \
            | tee -a "$RES/summary.md"
        done
      fi ;;
    ncu)  # issue 33: Nsight Compute counters of the kernels it names (scripts/ncu_kernels.py);
      # NCU_ENV: an environment for the profiled run (e.g. a kernel switch), NCU_SECTIONS: sections
      NCU=$(find_ncu)
      if [ -z "$NCU" ]; then echo "ncu not found" | tee -a "$RES/summary.md"; status=1; else
        secs=$(ncu_sections ${NCU_SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis Occupancy LaunchStats SchedulerStats WarpStateStats})
        env ${NCU_ENV:-} timeout 240 "$NCU" --profile-from-start off --clock-control none $secs --csv --page details \
          $PY scripts/ncu_kernels.py run > "$RES/ncu_details.csv" 2> "$RES/ncu_run.log" || status=1
        grep "^call\|^switches" "$RES/ncu_run.log" | tee -a "$RES/summary.md"
        $PY scripts/ncu_kernels.py summary "$RES/ncu_details.csv" > "$RES/ncu_summary.md" 2>&1 || status=1
        tee -a "$RES/summary.md" < "$RES/ncu_summary.md"; tail -5 "$RES/ncu_run.log"
      fi ;;
    kernels|variants|opcount|census|eager|block|attention|step|host|stack|hf|hf-users|carried-casts)  # hf: issue 23's Llama
      with_te $PY -m benchmarks "$step" --json "$RES/bench_$step.json" > /tmp/bench_$step.log 2>&1 \
        || { status=1; tail -30 /tmp/bench_$step.log; }
      grep -v '^wrote' /tmp/bench_$step.log >> "$RES/summary.md" ;;
    generate)  # issue 32's generate() rows alone (bench hf-users without Trainer): new tokens/s,
      # then kernels per new token and GPU busy of one profiled call of 16 tokens, HF bf16 /
      # graphfp8 bf16 / FP8 (not yet run on a GPU: its first try profiled 128 tokens with host
      # op events and ran past 200 s; now CUDA activity only)
      $PY -c 'import json, sys
from benchmarks.hf_model import FULL
from benchmarks.hf_users import generate_rows
from benchmarks.common import print_table
rows = generate_rows(FULL, "cuda", False, profile_new=16)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
base = rows["HF bf16 generate"]["tokens_per_s"]
print_table("generate() with a KV cache, greedy", ["peer", "new tokens/s", "/ HF bf16",
            "kernels per new token", "GPU busy"], [[n, r["tokens_per_s"], r["tokens_per_s"] / base,
            r["kernels_per_new_token"], r["busy_fraction"]] for n, r in rows.items()])' \
        "$RES/generate.json" > "$RES/generate.log" 2>&1 || { status=1; tail -20 "$RES/generate.log"; }
      grep "^|\|^###" "$RES/generate.log" | tee -a "$RES/summary.md" ;;
    te)  # issue 32: TE's documentation examples on graphfp8.te at TE's sizes (only the imports
         # changed: tests/te/te_examples.py), then the CUDA variants of tests/te and of LoRA
      $PY -m tests.te.te_examples --device cuda --json "$RES/te_examples.json" \
        > "$RES/te_examples.log" 2>&1 || status=1
      grep "^te example" "$RES/te_examples.log" | tee -a "$RES/summary.md"
      $PY -m pytest -q -m cuda -p no:cacheprovider tests/te tests/test_lora.py \
        > "$RES/te_tests.log" 2>&1 || status=1
      tail -1 "$RES/te_tests.log" | tee -a "$RES/summary.md" ;;
    multi_gpu)  # issue 34: scripts/multi_gpu.sh (correctness, speed at N and 1, profile, peers, fit)
      RES=$RES PY=$PY bash scripts/multi_gpu.sh > "$RES/multi_gpu.log" 2>&1 || status=1
      grep "^multi_gpu\|: rc \|skipped" "$RES/multi_gpu.log" | tail -20
      cat "$RES/multi_gpu.md" >> "$RES/summary.md" 2>/dev/null \
        || { echo "multi_gpu: no tables (multi_gpu.log)" | tee -a "$RES/summary.md"; tail -20 "$RES/multi_gpu.log"; } ;;
    recompute)  # issue 40: targets full <= 0.25 memory at <= 1.35x time, selective <= 1.1x
      for b in recompute memory-plan; do
        $PY -m benchmarks "$b" --json "$RES/bench_$b.json" > "/tmp/bench_$b.log" 2>&1 \
          || { status=1; tail -30 "/tmp/bench_$b.log"; }
        grep -v '^wrote' "/tmp/bench_$b.log" >> "$RES/summary.md"
      done ;;
    big)  # issue 40 target: the largest model trained on one H200 >= 6B (4.08B before)
      $PY -m benchmarks.largest_model --out "$RES/big" > "$RES/big.log" 2>&1 \
        || { status=1; tail -30 "$RES/big.log"; }
      cp "$RES/big/big.json" "$RES/big.json" 2>/dev/null
      grep "^###\|^| peak\|^graphfp8-train" "$RES/big.log" | tee -a "$RES/summary.md"
      # the step graph's deepest (its capture copy in host memory): 24 layers, 6.29B
      $PY -m benchmarks.largest_model --graphs step --out "$RES/big_step" > "$RES/big_step.log" \
        2>&1 || { status=1; tail -30 "$RES/big_step.log"; }
      cp "$RES/big_step/big.json" "$RES/big_step.json" 2>/dev/null
      grep "^###\|^| peak\|^graphfp8-train" "$RES/big_step.log" | tee -a "$RES/summary.md" ;;
    fsdp-graph)  # issue 40: FSDP2 inside make_graphed_microbatch at world size 1 (NCCL)
      $PY -m pytest -q -m cuda -p no:cacheprovider tests/sharding/test_fsdp2_cuda.py \
        -k "microbatch_graph or step_graph or transposed" > "$RES/fsdp_graph_tests.log" 2>&1 \
        || status=1
      tail -1 "$RES/fsdp_graph_tests.log" | tee -a "$RES/summary.md"
      $PY -m benchmarks fsdp-graph --json "$RES/bench_fsdp_graph.json" > /tmp/bench_fsdp_graph.log \
        2>&1 || { status=1; tail -30 /tmp/bench_fsdp_graph.log; }
      grep -v '^wrote' /tmp/bench_fsdp_graph.log | grep -v Warning | grep -v "output = self" \
        >> "$RES/summary.md" ;;
    fsdp-layers)  # issue 40: FSDP2 layers in make_graphed_callables at world size 1 (NCCL)
      $PY -m pytest -q -m cuda -p no:cacheprovider tests/sharding/test_fsdp2_cuda.py \
        -k layer_graphs > "$RES/fsdp_layers_tests.log" 2>&1 || status=1
      tail -1 "$RES/fsdp_layers_tests.log" | tee -a "$RES/summary.md"
      TR="$PY -m torch.distributed.run --standalone --nproc_per_node=1 -m graphfp8.training --ddp \
        --fsdp --fp8-weights --preset ${TRAIN_PRESET:-100m} --eval-every 1000 --val-batches 2 \
        --steps 8 --deterministic"
      for mode in none layers layers-full none-last layers-last; do
        extra=""; [ $mode = layers-full ] && extra="--recompute full"
        [ ${mode#*-} = last ] && extra="--fsdp-sync last --fsdp-prefetch"
        $TR --graphs ${mode%-*} $extra --out "$RES/fsdp_layers_$mode" \
          > "$RES/fsdp_layers_$mode.log" 2>&1 || status=1
      done
      $PY -c 'import json, sys
def run(m):
    return json.load(open(f"{sys.argv[1]}/fsdp_layers_{m}/summary.json"))["runs"][0]
ok = True
for ref, mode, what in (("none", "layers", "--graphs layers"),
                        ("none", "layers-full", "--graphs layers --recompute full"),
                        ("none-last", "layers-last",
                         "--graphs layers --fsdp-sync last --fsdp-prefetch")):
    same = all(run(ref)[k] == run(mode)[k] for k in ("losses", "val_losses"))
    print(f"fsdp-layers: {what} losses and val_losses == --graphs none ({ref}): {same}")
    ok = ok and same
sys.exit(0 if ok else 1)' "$RES" | tee -a "$RES/summary.md" || status=1 ;;
    *)
      echo "unknown step $step"; status=1 ;;
  esac
  pack
done
echo "== done ($(date -u +%H:%M:%S))" >> "$RES/summary.md"
pack
cat "$RES/summary.md"
exit $status
