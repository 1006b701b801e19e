#!/usr/bin/env bash
# The one-call GPU check: on a lent H200, in a single device call of at most 8 minutes,
#   1. record the machine (nvidia-smi, torch/triton versions),
#   2. build the CUDA extension with the machine's own torch (never pip-install torch there),
#   3. run the benchmarks at the fixed shapes of `python -m bench --preset gpu_check`,
#   4. run the CUDA tests (the pytest files that use CUDA tensors, without TRITON_INTERPRET),
#   5. run bench/cuda_smoke.py under compute-sanitizer memcheck (where the sanitizer works),
#   6. run the compile-time resource report (bench/resources.py) if it exists,
# each step boxed by `timeout` inside an overall budget so that no hang eats the call, and
# leave at most 8 files under $OUT (the device tool brings back no more):
#   gpu_check.log  results.json  results.csv  summary.md  latency_vs_batch.png
#   roofline_vs_vocab.png  resources.json  gpu_check.tar.gz (every log and output)
#
# On the device (from the repo root), naming the commit since .git may not travel:
#   SPECDEC_GIT_COMMIT=<sha> bash bench/gpu_check.sh
# Dry run here, without a GPU (skips the build and the sanitizer, quick CPU shapes):
#   OUT=/tmp/gpu_check DRY_RUN=1 PYTHON=.venv/bin/python bash bench/gpu_check.sh
set -u -o pipefail

: "${OUT:?set OUT to the folder that comes back}"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-450}   # seconds for everything; the call's limit is 480
DRY=${DRY_RUN:-0}
START=$(date +%s)
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${SPECDEC_GIT_COMMIT:-}" ] && command -v git >/dev/null && git rev-parse HEAD >/dev/null 2>&1; then
  SPECDEC_GIT_COMMIT=$(git rev-parse HEAD)
fi
export SPECDEC_GIT_COMMIT=${SPECDEC_GIT_COMMIT:-unknown}
declare -A STATUS

elapsed() { echo $(( $(date +%s) - START )); }

# step NAME BOX RESERVE CMD...: run CMD for at most BOX seconds, and never into the last
# RESERVE seconds of the budget (kept for the steps after it). Output goes to NAME.log in the
# stage folder; its tail is echoed into gpu_check.log.
step() {
  local name=$1 box=$2 reserve=$3
  shift 3
  local left=$(( BUDGET - $(elapsed) - reserve ))
  (( left < box )) && box=$left
  if (( box < 10 )); then
    echo "== $name: skipped, out of budget at $(elapsed)s"
    STATUS[$name]="skipped (budget)"
    return 0
  fi
  echo "== $name: start at $(elapsed)s, timeout ${box}s: $*"
  local t0
  t0=$(date +%s)
  timeout -k 10 "$box" "$@" > "$STAGE/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL_LINES:-40}" "$STAGE/$name.log"
  (( rc == 124 || rc == 137 )) && echo "== $name: TIMED OUT after ${box}s"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  STATUS[$name]=$rc
}

echo "gpu_check: $(date -u +%FT%TZ), commit $SPECDEC_GIT_COMMIT, budget ${BUDGET}s, dry run $DRY"

env_report() {
  nvidia-smi || echo "nvidia-smi: not available"
  nproc
  "$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, "SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1),
          "L2 MiB", round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
EOF
  command -v nvcc && nvcc --version | tail -n 2
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
}
export PY
export -f env_report
TAIL_LINES=30 step env 30 400 bash -c env_report

if [ "$DRY" = 1 ]; then
  echo "== build: skipped (dry run)"
  STATUS[build]="skipped (dry run)"
  BENCH_ARGS=(--device cpu --preset quick --ops chain,sample,compact,tree,mask)
  TEST_ARGS=(python_tests/test_bench.py)
  SMOKE_DEVICE=cpu
else
  # sm_90 only: the H200's own architecture; setup.py adds its -gencode flags as well.
  step build 200 230 env MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 "$PY" setup.py build_ext --inplace
  BENCH_ARGS=(--device cuda --preset gpu_check --ops chain,sample,compact,tree,mask)
  # The tests that run on CUDA tensors (the rest are CPU-only and run in CI): the whole
  # directory took over 150 s on the H200 run of 2026-11-29; these took 88 s there.
  TEST_ARGS=(python_tests/test_triton_chain.py python_tests/test_triton_sampling.py
             python_tests/test_triton_tree.py python_tests/test_triton_rng.py
             python_tests/test_tree_attention.py python_tests/test_kv_cache.py
             python_tests/test_graph_safety.py
             python_tests/test_adapter_flashinfer.py::test_on_cuda_tensors
             python_tests/test_adapter_sglang.py::test_on_cuda_tensors)
  SMOKE_DEVICE=cuda
fi

# Benchmarks first after the build: they are what this call is for. The harness stops
# starting new cases 40 s before its box ends, then writes the summary and the plots.
BENCH_BOX=200
BENCH_LEFT=$(( BUDGET - $(elapsed) - 130 ))
(( BENCH_LEFT < BENCH_BOX )) && BENCH_BOX=$BENCH_LEFT
step bench "$BENCH_BOX" 130 "$PY" -m bench "${BENCH_ARGS[@]}" --out "$STAGE/bench" \
  --time-budget $(( BENCH_BOX > 60 ? BENCH_BOX - 40 : 20 )) --no-progress

# Compiling kernel variants dominates the CUDA tests: spread them over 8 workers where
# pytest-xdist is installed (the H200 image has it).
XDIST=()
if [ "$DRY" != 1 ] && "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi
step pytest 150 70 "$PY" -m pytest "${TEST_ARGS[@]}" ${XDIST[@]+"${XDIST[@]}"} -q -rs -p no:cacheprovider \
  --junitxml "$STAGE/pytest.xml"

if [ "$DRY" != 1 ] && command -v compute-sanitizer >/dev/null; then
  step sanitizer 60 40 compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$PY" bench/cuda_smoke.py --device cuda
else
  step smoke 60 40 "$PY" bench/cuda_smoke.py --device "$SMOKE_DEVICE"
fi

if [ -f bench/resources.py ]; then
  # sm_90 only (the H200's; the sm_80 report is made offline): ~55 s for both on a cold cache.
  step resources 45 5 "$PY" bench/resources.py --arch 90 --out "$STAGE/resources.json"
else
  echo "== resources: bench/resources.py not present"
  STATUS[resources]="absent"
fi

echo "== summary at $(elapsed)s"
for name in env build bench pytest sanitizer smoke resources; do
  [ -n "${STATUS[$name]+x}" ] && echo "  $name: ${STATUS[$name]}"
done
for f in results.json results.csv summary.md latency_vs_batch.png roofline_vs_vocab.png; do
  [ -f "$STAGE/bench/$f" ] && cp "$STAGE/bench/$f" "$OUT/$f"
done
[ -f "$STAGE/resources.json" ] && cp "$STAGE/resources.json" "$OUT/resources.json"
cp "$OUT/gpu_check.log" "$STAGE/gpu_check.log" 2>/dev/null
tar -czf "$OUT/gpu_check.tar.gz" -C "$STAGE" . && echo "bundle: gpu_check.tar.gz ($(du -h "$OUT/gpu_check.tar.gz" | cut -f1))"
echo "gpu_check: done in $(elapsed)s"
