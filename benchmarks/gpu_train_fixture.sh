#!/usr/bin/env bash
# Train a drafter for the fixture target on the ShareGPT records it was trained on, export it for the engines,
# and smoke-test it in the runtime on a few MT-bench prompts.
#
#   METHOD=eagle3|mtp|dflash bash benchmarks/gpu_train_fixture.sh [key=value ...]   (e.g. training.max_minutes=6.0)
#
# Inputs: `python -m benchmarks.prepare_fixture_data`. Writes into $OUT (default benchmarks/results/local).
# On the lent GPU machine files over 16 MiB do not come back from $OUT: the 5-layer DFlash drafter of the fixture
# is 16.4 MiB in bf16, so evaluate it in the same call (benchmarks/runtime_benchmark.py or draftsmith eval).
set -euo pipefail
cd "$(dirname "$0")/.."
METHOD="${METHOD:-eagle3}"
case "$METHOD" in
  eagle3) FORMAT=sglang ;;
  mtp) FORMAT=mtp ;;
  dflash) FORMAT=dflash ;;
  *) echo "METHOD must be eagle3, mtp or dflash, not '$METHOD'" >&2; exit 2 ;;
esac
source benchmarks/device_inputs.sh
device_python_env
export TQDM_MININTERVAL=20
OUT="${OUT:-benchmarks/results/local}"
RUN="runs/$METHOD-fixture"
mkdir -p "$OUT"
[ -f .devdata/sharegpt_train.jsonl ] || xz -dk .devdata/sharegpt_train.jsonl.xz
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) > "$OUT/gpu.txt"
python3 -m draftsmith.cli train recipes/eagle3_fixture.yaml model.method="$METHOD" output_dir="$RUN" \
  data.path=.devdata/sharegpt_train.jsonl "$@" 2>&1 \
  | tee "$OUT/train.log" | grep -v "it/s]" || true
cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl"
python3 -m draftsmith.cli export "$RUN" --format "$FORMAT" --out "$OUT/$METHOD" --overwrite
K=3
timeout "${SMOKE_TIMEOUT:-120}" python3 -m draftsmith.cli eval --target .fixture/sharegpt-llama-19m --dataset .devdata/question.jsonl \
  --num-prompts 10 --max-new-tokens 128 --out "$OUT/smoke" \
  --speculative-config "{\"method\":\"$METHOD\",\"model\":\"$OUT/$METHOD\",\"num_speculative_tokens\":$K}" \
  2>&1 | tail -8 || echo "smoke eval failed or timed out"
