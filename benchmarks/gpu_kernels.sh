#!/usr/bin/env bash
# Issue 28's kernels on one lent GPU, in one call of at most BUDGET seconds (default 420):
#
#   1. the GPU tests of the kernels against their plain-torch references (values and gradients, float32 and
#      bfloat16), TESTS (default: tests/test_ttt_flex.py's compiled FlexAttention TTT attention and training step,
#      tests/test_dflash_flex.py's DFlash/DSpark block attention and training steps, and tests/test_gpu.py's
#      blocked-reference training step); at most TEST_SECONDS (170);
#   2. benchmarks/train_8b_shape.py on the Llama-3.1-8B shape (random bf16 weights, TTT 7, draft vocabulary 32,000)
#      with the trainer's own choices of query block and loss chunk, RUNS (default: EAGLE-3 at 16 x 2048 and
#      4 x 8192, each with FlexAttention and with the plain-torch reference, side by side in one process), STEPS
#      optimizer steps a run (4, the first 2 untimed: they compile), in the time left.
#
# Inputs: the checkout, and the wheels of .whl/ (name .whl in the call's carry list: pydantic is not on the
# machine). Writes into $OUT (default benchmarks/results/local): gpu_tests.log and gpu_tests.xml,
# train_8b_shape.json and .log (every run's tokens/s, peak GiB, MFU against 790 TFLOP/s and the measured matmul
# rate, its attention kernel, query block and loss chunk), and gpu_kernels.json: the command, hardware, versions,
# the tests' outcome and the runs' figures, with flex / reference ratios at each shape.
#
#   OUT=$OUT bash benchmarks/gpu_kernels.sh
#   LOCAL=1 TINY=1 RUNS="eagle3+reference:256x2 eagle3:256x2" bash benchmarks/gpu_kernels.sh   # a CPU smoke run
#   OUT=$OUT TESTS=tests/test_dflash_flex.py RUNS="dflash+reference:2048x4 dflash+flex:2048x4 \
#     dflash+ckpt+reference:2048x16 dflash+ckpt+flex:2048x16" bash benchmarks/gpu_kernels.sh   # DFlash's block
#     attention: FlexAttention against the dense-mask reference (16 x 2048 fits only with dflash.checkpoint_layers)
#   OUT=$OUT FUSED_LOSS=1 BUDGET=570 bash benchmarks/gpu_kernels.sh   # the head losses' Triton kernel: its GPU
#     tests (tests/test_fused_head_loss_gpu.py), then EAGLE-3 (FlexAttention) at 16 x 2048 and 4 x 8192 and DFlash
#     (+ckpt) at 16 x 2048, each with and without +fusedloss side by side (gpu_kernels.json: fused_loss_vs_reference)
#   OUT=$OUT TESTS=tests/test_fused_head_loss_gpu.py RUNS="dspark+ckpt+reference:2048x16 \
#     dspark+ckpt+reference+fusedloss:2048x16" bash benchmarks/gpu_kernels.sh   # DSpark's loss kernel (CE + L1 with
#     the Markov bias); FIXTURE_SHAPE=1 runs the fixture target's shape instead of the 8B one, SKIP_TESTS=1 no tests
#   OUT=$OUT PROFILE=1 bash benchmarks/gpu_kernels.sh   # and after each run's timed steps one more step under the
#     torch profiler (not in its figures): $OUT/profile/profile_<run>.txt, the top 30 by self device time, and the
#     run's profile_top in train_8b_shape.json (its top 12 kernels, self ms, share of the step's device time, calls)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/local}"
BUDGET="${BUDGET:-420}"  # seconds for the whole script
if [ -n "${FUSED_LOSS:-}" ]; then  # the fused head loss against the plain-torch chunked loss
  RUNS="${RUNS:-eagle3+flex:2048x16 eagle3+flex+fusedloss:2048x16 eagle3+flex:8192x4 eagle3+flex+fusedloss:8192x4 \
dflash+ckpt:2048x16 dflash+ckpt+fusedloss:2048x16}"  # DFlash at 16 x 2048 fits only with +ckpt
  TESTS="${TESTS:-tests/test_fused_head_loss_gpu.py}"
fi
RUNS="${RUNS:-eagle3+reference:2048x16 eagle3+flex:2048x16 eagle3+flex:8192x4 eagle3+reference:8192x4}"
TESTS="${TESTS:-tests/test_ttt_flex.py tests/test_dflash_flex.py \
tests/test_gpu.py::test_blocked_ttt_attention_and_fused_loss_equal_the_reference_on_gpu}"
mkdir -p "$OUT"
source benchmarks/device_inputs.sh
[ -n "${LOCAL:-}" ] || device_python_env  # LOCAL=1: this machine's environment as it is
PYTHON="${PYTHON:-python3}"
left() { echo $(( BUDGET - SECONDS )); }
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}"

(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo cpu) \
  > "$OUT/gpu.txt"

start=$SECONDS
[ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_SECONDS:-170}" "$PYTHON" -m pytest -v -p no:cacheprovider -m gpu --durations=10 \
  --junitxml="$OUT/gpu_tests.xml" $TESTS 2>&1 \
  | grep -v "Warning\|warn(" | tail -60 | tee "$OUT/gpu_tests.log"  # -v: each result as it comes, kept if cut short
echo "gpu tests: $(( SECONDS - start )) s" | tee -a "$OUT/gpu_tests.log"

PROFILE_DIR=""
if [ "${PROFILE:-}" = 1 ]; then  # one more step of each run under the torch profiler
  PROFILE_DIR="$OUT/profile"
  mkdir -p "$PROFILE_DIR"
fi
start=$SECONDS
timeout "$(( $(left) - 15 ))" "$PYTHON" -m benchmarks.train_8b_shape --out "$OUT/train_8b_shape.json" --runs "$RUNS" \
  --steps "${STEPS:-4}" --warmup "${WARMUP:-2}" ${TINY:+--tiny} ${FIXTURE_SHAPE:+--fixture-shape} ${PROFILE_DIR:+--profile "$PROFILE_DIR"} 2>&1 \
  | grep -v "Warning\|warn(" \
  | tee "$OUT/train_8b_shape.log" | tail -30
echo "train_8b_shape: $(( SECONDS - start )) s" | tee -a "$OUT/train_8b_shape.log"

COMMAND="BUDGET=$BUDGET TESTS='$TESTS' RUNS='$RUNS' STEPS=${STEPS:-4} ${TINY:+TINY=1 }${FIXTURE_SHAPE:+FIXTURE_SHAPE=1 }${SKIP_TESTS:+SKIP_TESTS=1 }${FUSED_LOSS:+FUSED_LOSS=1 }"\
"${PROFILE_DIR:+PROFILE=1 }bash benchmarks/gpu_kernels.sh" \
  "$PYTHON" -m benchmarks.kernels_summary "$OUT"
ls -la "$OUT"
