#!/usr/bin/env bash
# One-call GPU check (what `make gpu-check` runs on the H200): build graphfp8._C for sm_90, run
# the CUDA tests, the benchmarks, a training comparison and a profile; logs, JSON and a summary
# land in $OUT (packed into $OUT/results.tgz next to summary.md).
#   GPU_STEPS  which steps to run (default: "tests kernels eager block train profile"; also
#              stack (the TransformerLayer stack, FP8 vs bf16), kernels-ab, tests-first, ddp)
#   AB_BASE    the commit that kernels-ab compares with (default 30328b1; without the git
#              history, carry the .ab-base/ that `scripts/bench_before_after.sh --prepare` wrote)
#   PYTEST_ARGS extra pytest arguments for the CUDA tests
#   FIRST_TESTS tests that the tests-first step runs verbosely before the rest
set -uo pipefail
OUT=${OUT:-build/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
STEPS=${GPU_STEPS:-"tests kernels eager block train profile"}
status=0

# Wheels carried in .whl/ (nvtx, torchao): the device machine has no package index.
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
} > "$OUT/summary.md" 2>&1

echo "== build" | tee -a "$OUT/summary.md"
t0=$(date +%s)
if ! $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -50 "$OUT/build.log"; echo "BUILD FAILED" | tee -a "$OUT/summary.md"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.md"
$PY -c "import graphfp8.ops as o; assert o.built_with_cuda(), 'CUDA kernels missing'" || exit 1

for step in $STEPS; do
  echo "== $step" | tee -a "$OUT/summary.md"
  case $step in
    tests)
      $PY -m pytest -q -m cuda -p no:cacheprovider ${PYTEST_ARGS:-} tests > "$OUT/tests_gpu.log" 2>&1
      rc=$?; tail -25 "$OUT/tests_gpu.log"; tail -1 "$OUT/tests_gpu.log" >> "$OUT/summary.md"
      [ $rc -eq 0 ] || status=1 ;;
    ddp)  # data parallel: 1 vs all GPUs of the machine, FP8 + graphs, the GPU default preset
      n=$($PY -c "import torch; print(torch.cuda.device_count())")
      procs_list=1; [ "$n" -gt 1 ] && procs_list="1 $n"
      for procs in $procs_list; do
        $PY -m torch.distributed.run --standalone --nproc_per_node=$procs -m graphfp8.train \
          --ddp --preset ${TRAIN_PRESET:-100m} --steps ${DDP_STEPS:-100} --out "$OUT/ddp$procs" \
          > "$OUT/ddp$procs.log" 2>&1 || status=1
        echo "-- $procs GPU(s)" | tee -a "$OUT/summary.md"
        grep -A3 "final loss" "$OUT/ddp$procs.log" | tee -a "$OUT/summary.md"
        grep "across" "$OUT/ddp$procs.log" | tee -a "$OUT/summary.md"
      done ;;
    tests-first)  # one file first, verbose, so a crash names its test
      $PY -m pytest -v -m cuda -p no:cacheprovider ${FIRST_TESTS:-tests/ops} > "$OUT/tests_first.log" 2>&1
      rc=$?; tail -5 "$OUT/tests_first.log" | tee -a "$OUT/summary.md"; [ $rc -eq 0 ] || status=1 ;;
    train)  # the issue-6 comparison on the GPU default preset
      $PY -m graphfp8.train --compare ${TRAIN_RUNS:-bf16:eager,bf16:graphs,fp8:eager,fp8:graphs} \
        --preset ${TRAIN_PRESET:-100m} --steps ${TRAIN_STEPS:-300} --out "$OUT/train" \
        > "$OUT/train.log" 2>&1 || status=1
      tail -8 "$OUT/train.log" | tee -a "$OUT/summary.md" ;;
    profile)
      $PY -m graphfp8.training.profile --out "$OUT/profile" > "$OUT/profile.log" 2>&1 || status=1
      grep -v USDT "$OUT/profile.log" | head -40 | tee -a "$OUT/summary.md" ;;
    kernels-ab)  # kernel benchmark and kernel outputs (bit for bit): AB_BASE vs this tree
      bash scripts/bench_before_after.sh "${AB_BASE:-30328b1}" > "$OUT/kernels_ab.log" 2>&1 \
        || { status=1; tail -30 "$OUT/kernels_ab.log"; }
      grep -v "^wrote\|kernel output digests" "$OUT/kernels_ab.log" >> "$OUT/summary.md" ;;
    kernels|eager|block|stack)
      $PY -m graphfp8.bench "$step" --json "$OUT/bench_$step.json" > /tmp/bench_$step.log 2>&1 \
        || { status=1; tail -30 /tmp/bench_$step.log; }
      grep -v '^wrote' /tmp/bench_$step.log >> "$OUT/summary.md" ;;
    *)
      echo "unknown step $step"; status=1 ;;
  esac
done
cat "$OUT/summary.md"
# At most 8 files come back from the device machine: pack everything into one archive.
tar czf /tmp/gpu_results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -not -name summary.md -delete \
  && mv /tmp/gpu_results.tgz "$OUT/results.tgz"
exit $status
