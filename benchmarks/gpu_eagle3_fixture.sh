#!/usr/bin/env bash
# The foundation issue's GPU measurement, part 1: train an EAGLE-3 drafter for the fixture target on the ShareGPT
# records it was trained on, export it for SGLang/vLLM, and smoke-test it in the runtime on a few MT-bench prompts.
# Inputs: `python benchmarks/prepare_fixture_data.py`. Writes into $OUT (default benchmarks/results/local).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then  # packages missing on the GPU machine travel as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
OUT="${OUT:-benchmarks/results/local}"
mkdir -p "$OUT"
[ -f .devdata/sharegpt_train.jsonl ] || xz -dk .devdata/sharegpt_train.jsonl.xz
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) > "$OUT/gpu.txt"
python3 -m draftsmith.cli train recipes/eagle3_fixture.yaml "$@" 2>&1 | tee "$OUT/train.log" | grep -v "it/s]" || true
cp runs/eagle3-fixture/metrics.jsonl "$OUT/metrics.jsonl"
python3 -m draftsmith.cli export runs/eagle3-fixture --format sglang --out "$OUT/eagle3" --overwrite
timeout 120 python3 -m draftsmith.cli eval --target .fixture/sharegpt-llama-19m --dataset .devdata/question.jsonl \
  --num-prompts 10 --max-new-tokens 128 --out "$OUT/smoke" \
  --speculative-config "{\"method\":\"eagle3\",\"model\":\"$OUT/eagle3\",\"num_speculative_tokens\":3}" \
  --speculative-config '{"method":"ngram","prompt_lookup_max":4,"prompt_lookup_min":1,"num_speculative_tokens":3}' \
  2>&1 | tail -20 || echo "smoke eval failed or timed out"
