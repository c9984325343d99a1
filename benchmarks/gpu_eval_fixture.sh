#!/usr/bin/env bash
# The drafter comparison on the fixture target, in one call of the lent GPU machine: the GPU tests, then every
# trained drafter and n-gram lookup side by side on the 80 MT-bench first turns (temperature 0, 256 new tokens,
# k = 1, 3, 5, 7 and DFlash's block length 15), the Llama-3.1-8B-shaped decode benchmark, then temperature 1 for
# the runtime issue while time is left. Suffix runs at vLLM's default length cap, its tree depth 24.
# `draftsmith eval` saves eval.json after every config, so a run cut short keeps what it measured.
#
#   bash benchmarks/gpu_eval_fixture.sh   # inputs: .fixture/ and the exported drafters in .devdata/, or their
#                                         # xz tarballs in .devdata/final/ (benchmarks/README.md)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/local}"
BUDGET="${BUDGET:-560}"  # seconds for the whole script
mkdir -p "$OUT"
source benchmarks/device_inputs.sh
device_python_env
unpack_fixture_inputs
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) > "$OUT/gpu_tests.log"

place_shared_fixtures  # the GPU tests read the fixture where tests/conftest.py looks
[ -n "${SKIP_GPU_TESTS:-}" ] || timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -5 | tee -a "$OUT/gpu_tests.log"

TARGET=.fixture/sharegpt-llama-19m
EAGLE3=.devdata/eagle3_run1 MTP=.devdata/mtp_run1 DFLASH=.devdata/dflash_run1/dflash
left() { echo $(( BUDGET - SECONDS )); }
timeout "$(left)" python3 -m draftsmith.cli eval --target $TARGET --dataset mt_bench=.devdata/question.jsonl \
  --dtype bfloat16 --max-new-tokens 256 --num-speculative-tokens 1 3 5 7 --out "$OUT/eval_t0" \
  --speculative-config "{\"method\":\"mtp\",\"model\":\"$MTP\"}" \
  --speculative-config "{\"method\":\"dflash\",\"model\":\"$DFLASH\"}" \
  --speculative-config "{\"method\":\"dflash\",\"model\":\"$DFLASH\",\"num_speculative_tokens\":15}" \
  --speculative-config "{\"method\":\"eagle3\",\"model\":\"$EAGLE3\"}" \
  --speculative-config '{"method":"ngram","prompt_lookup_max":4,"prompt_lookup_min":1}' \
  --speculative-config '{"method":"suffix","num_speculative_tokens":24}' ${EXTRA_EVAL_ARGS:-} 2>&1 \
  | grep -v "Loading weights" | tail -30
[ "$(left)" -gt 60 ] && timeout "$(( $(left) < 150 ? $(left) : 150 ))" \
  python3 -m benchmarks.decode_8b_shape --out "$OUT/decode_8b_shape.json" 2>&1 | tail -4
[ "$(left)" -gt 40 ] && timeout "$(left)" python3 -m draftsmith.cli eval --target $TARGET \
  --dataset mt_bench=.devdata/question.jsonl --dtype bfloat16 --max-new-tokens 256 --temperature 1 --seed 0 \
  --num-speculative-tokens 1 2 3 4 5 6 7 --out "$OUT/eval_t1" \
  --speculative-config "{\"method\":\"eagle3\",\"model\":\"$EAGLE3\"}" \
  --speculative-config '{"method":"ngram","prompt_lookup_max":4,"prompt_lookup_min":1,"num_speculative_tokens":3}' \
  --speculative-config '{"method":"suffix","num_speculative_tokens":24}' ${EXTRA_EVAL_ARGS:-} 2>&1 \
  | grep -v "Loading weights" | tail -16
ls -la "$OUT" "$OUT"/eval_t* 2>/dev/null
