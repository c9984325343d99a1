#!/usr/bin/env bash
# Issue 27 in one call of the lent GPU machine: learning per token, draftsmith's EAGLE-3 ablations against the
# `speculators` trainer (benchmarks/per_token.py), every training a process of its own on the one GPU.
#
#   1. the target's float32 greedy answers to the MT-bench first turns (benchmarks/acceptance.py answers), beside
#   2. benchmarks/per_token.py: CONFIGS x SEEDS draftsmith runs of STEPS optimizer steps and the PEERS speculators
#      runs (2 epochs each), on the first RECORDS ShareGPT records, draft vocabulary 8,192, TTT 7; then every
#      final checkpoint and the learning-curve checkpoints scored at k = 1..7 (T=0)
#
# Inputs (name .gpu and .whl in the call's carry list):
#   .gpu/fixture.tar.xz            tar -cf - .fixture | xz -6 > .gpu/fixture.tar.xz
#   .gpu/sharegpt_train.jsonl.xz   ShareGPT records 0..16786 (the first RECORDS are used)
#   .gpu/question.jsonl            the 80 MT-bench questions
#   .whl/                          speculators 0.9.0 and what it needs that the machine lacks (datasets, dill,
#                                  multiprocess, hs-connectors, loguru, openai, pydantic-settings, ...)
# Writes into $OUT (default benchmarks/results/local): per_token.json, run.log, gpu.txt, logs.tar.xz.
# Make the PNG here afterwards: python benchmarks/plot_per_token.py OUT/per_token.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/local}"
BUDGET="${BUDGET:-585}"  # seconds for the whole script
RECORDS="${RECORDS:-2500}"
WORK="${WORK:-/tmp/per-token-$$}"
mkdir -p "$OUT" .devdata
source benchmarks/device_inputs.sh
device_python_env
# EXTRA_PYTHONPATH: packages put first (a CPU test on a machine the wheels of .whl/ do not fit)
export PYTHONPATH="${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$PYTHONPATH"
[ -d .fixture/sharegpt-llama-19m ] || xz -dc .gpu/fixture.tar.xz | tar -x
[ -f .devdata/sharegpt_train.jsonl ] || xz -dc .gpu/sharegpt_train.jsonl.xz > .devdata/sharegpt_train.jsonl
[ -f .devdata/question.jsonl ] || cp .gpu/question.jsonl .devdata/
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo cpu) > "$OUT/gpu.txt"
python3 -c "import torch, transformers, datasets, pyarrow, speculators.train.cli; from importlib.metadata import version
print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__,
  'pyarrow', pyarrow.__version__, 'speculators', version('speculators'))" >> "$OUT/gpu.txt" 2>&1 || SKIP_SPEC="--skip-speculators"
cat "$OUT/gpu.txt"
TARGET=.fixture/sharegpt-llama-19m
ANSWERS=.devdata/mtbench_greedy_fp32.json
mkdir -p "$WORK"
if [ ! -f "$ANSWERS" ]; then
  python3 benchmarks/acceptance.py answers --target $TARGET --dataset .devdata/question.jsonl \
    --max-new-tokens "${MAX_NEW_TOKENS:-256}" ${NUM_PROMPTS:+--num-prompts $NUM_PROMPTS} --out "$ANSWERS" \
    > "$WORK/answers.log" 2>&1 &
fi
timeout $(( BUDGET - SECONDS )) python3 benchmarks/per_token.py --recipe "${RECIPE:-recipes/eagle3_fixture.yaml}" \
  --work "$WORK" --out "$OUT/per_token.json" --answers "$ANSWERS" --deadline-seconds $(( BUDGET - SECONDS - 15 )) \
  --steps "${STEPS:-834}" --configs "${CONFIGS:-baseline,freeze_head,muon,speculators_like}" \
  --seeds "${SEEDS:-0,1}" --save-every "${SAVE_EVERY:-135}" --peers "${PEERS:-decay_to_0,default_lr}" \
  --spec-save-steps "${SPEC_SAVE_STEPS:-135,270,405,540,675,810}" --score-seconds "${SCORE_SECONDS:-90}" \
  ${SPEC_FLAGS:+--spec-flags "$SPEC_FLAGS"} ${SKIP_SPEC:-} \
  data.path=.devdata/sharegpt_train.jsonl data.max_samples="$RECORDS" model.draft_vocab_size=8192 ${EXTRA:-} \
  2>&1 | tee "$OUT/run.log"
wait
(cd "$WORK" && tar -cJf - --exclude='*.safetensors' --exclude='*.arrow' --exclude='*.pt' --exclude='*.npy' \
  --exclude='training_state' --exclude='hidden_states' *.log */*/curve.jsonl */*/*/trainer_state.json \
  */*/metrics.jsonl 2>/dev/null) > "$OUT/logs.tar.xz"
ls -la "$OUT"
