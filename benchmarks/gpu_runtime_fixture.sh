#!/usr/bin/env bash
# The runtime issue's measurements on the lent GPU machine, one stage per call (each fits the 10-minute limit):
#
#   STAGE=tests_8b  the GPU tests, then the Llama-3.1-8B-shaped decode benchmark (module path and
#                   DRAFTSMITH_COMPILE=1 side by side)
#   STAGE=t0 / t1   runtime_benchmark.py at temperature 0 / 1: plain, n-gram, suffix, EAGLE-3 chains k=1..7 and
#                   two dynamic trees, Hugging Face generate plain and prompt-lookup, fraction of the ideal speedup
#   STAGE=trees     the tree GPU tests, the EAGLE-3 dynamic trees in float32 against plain decoding (lossless?),
#                   then runtime_benchmark.py for the trees alone (or METHODS, e.g. "tree hybrid", at KS) at
#                   TEMPERATURES (default "0 1"), with Hugging Face generate at HF_TEMPERATURES (default 1; "" for
#                   none); BUDGET seconds in all. CHECKS=0 skips the tests and the float32 run.
#   STAGE=extras    the GPU tests of the graphed chains, then EAGLE-3 chains with sampled drafts
#                   (draft_sample_method probabilistic) beside greedy ones at temperature 1, and the suffix hybrid
#                   beside chains and suffix decoding at temperature 0 (RUNS: "name temperature methods..." runs,
#                   comma-separated; KS: the ks, default "1 3"; RUN_TIMEOUT: seconds per run, default 230)
#
# Inputs as for gpu_eval_fixture.sh: .fixture/ and .devdata/eagle3_run1, or their xz tarballs in .devdata/final/
# (benchmarks/README.md), .devdata/question.jsonl, and wheels in .whl/. Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/local}"
STAGE="${STAGE:?set STAGE=tests_8b, t0, t1, trees or extras}"
mkdir -p "$OUT"
source benchmarks/device_inputs.sh
device_python_env
unpack_fixture_inputs
TARGET=.fixture/sharegpt-llama-19m EAGLE3=.devdata/eagle3_run1

case "$STAGE" in
  tests_8b)
    (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) > "$OUT/gpu_tests.log"
    place_shared_fixtures
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --durations=10 tests/test_gpu.py 2>&1 \
      | tail -25 | tee -a "$OUT/gpu_tests.log"
    timeout "${DECODE_TIMEOUT:-330}" python3 -m benchmarks.decode_8b_shape --out "$OUT/decode_8b_shape.json" 2>&1 \
      | grep -v "Loading weights" | tail -12 | tee "$OUT/decode_8b_shape.log"
    ;;
  t0|t1)
    timeout "${RUN_TIMEOUT:-560}" python3 -m benchmarks.runtime_benchmark --target $TARGET --drafter $EAGLE3 \
      --dataset .devdata/question.jsonl --dtype bfloat16 --temperatures "${STAGE#t}" --out "$OUT" 2>&1 \
      | grep -v "Loading weights\|it/s\]" | tail -40 | tee "$OUT/runtime_${STAGE}.log"
    ;;
  trees)
    BUDGET="${BUDGET:-440}"
    left() { echo $(( BUDGET - SECONDS )); }
    place_shared_fixtures
    if [ "${CHECKS:-1}" != 0 ]; then
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k tree 2>&1 | tail -3 | tee "$OUT/trees.log"
      trees=(--speculative-config "{\"method\":\"eagle3\",\"model\":\"$EAGLE3\",\"num_speculative_tokens\":16,\"dynamic_tree\":{\"depth\":4,\"top_k\":4}}"
             --speculative-config "{\"method\":\"eagle3\",\"model\":\"$EAGLE3\",\"num_speculative_tokens\":48,\"dynamic_tree\":{\"depth\":6,\"top_k\":8}}")
      timeout 75 python3 -m draftsmith.cli eval --target $TARGET --dataset mt_bench=.devdata/question.jsonl \
        --num-prompts 12 --dtype float32 --max-new-tokens 256 --out "$OUT/tree_fp32" "${trees[@]}" 2>&1 \
        | grep -v "Loading weights\|it/s\]" | tail -8 | tee -a "$OUT/trees.log"
    fi
    timeout "$(left)" python3 -m benchmarks.runtime_benchmark --target $TARGET --drafter $EAGLE3 \
      --dataset .devdata/question.jsonl --dtype bfloat16 --methods ${METHODS:-tree} --ks ${KS:-1 2 3 4 5 6 7} --temperatures ${TEMPERATURES:-0 1} --hf-temperatures ${HF_TEMPERATURES-1} --hf-num-prompts 8 \
      --out "$OUT/trees_bf16" 2>&1 | grep -v "Loading weights\|it/s\]" | tail -24 | tee -a "$OUT/trees.log"
    ;;
  extras)
    place_shared_fixtures
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "${TESTS:-chain or host}" 2>&1 | tail -3 | tee "$OUT/extras.log"
    IFS=, read -ra runs <<< "${RUNS:-sampled 1 chain sampled_chain,hybrid 0 chain hybrid suffix}"
    for run in "${runs[@]}"; do
      set -- $run
      name=$1 temperature=$2; shift 2
      timeout "${RUN_TIMEOUT:-230}" python3 -m benchmarks.runtime_benchmark --target $TARGET --drafter $EAGLE3 \
        --dataset .devdata/question.jsonl --dtype bfloat16 --methods "$@" --ks ${KS:-1 3} \
        --temperatures "$temperature" --hf-temperatures --out "$OUT/$name" 2>&1 \
        | grep -v "Loading weights\|it/s\]" | tail -14 | tee -a "$OUT/extras.log"
    done
    ;;
  *) echo "unknown STAGE=$STAGE (tests_8b, t0, t1, trees or extras)" >&2; exit 2 ;;
esac
ls -la "$OUT"
