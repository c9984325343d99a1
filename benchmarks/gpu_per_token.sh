#!/usr/bin/env bash
# Issue 27 in device calls of the lent GPU machine: learning per token, draftsmith's EAGLE-3 ablations against the
# `speculators` trainer (benchmarks/per_token.py), every training a process of its own on the one GPU.
#
#   1. the target's float32 greedy answers to the MT-bench first turns (benchmarks/acceptance.py answers), beside
#   2. benchmarks/per_token.py: CONFIGS x SEEDS draftsmith runs of STEPS optimizer steps and the PEERS speculators
#      runs (2 epochs each), on the first RECORDS ShareGPT records, draft vocabulary 8,192, TTT 7; curve
#      checkpoints scored (k = 1..7, T=0) while the runs train, every run's last checkpoint after. A run stopped by
#      the deadline is scored at its last checkpoint and marked partial; MERGE (earlier calls' per_token.json,
#      space-separated) folds their runs into this call's JSON.
#
# The calls (results and the first attempt in benchmarks/results/per_token_h200/README.md):
#   call 1 (defaults): baseline and freeze_head (speculators' frozen head) at seeds 0 and 1, speculators default_lr
#     DRAFTSMITH_FLEX_ATTENTION=0 OUT=$OUT BUDGET=570 bash benchmarks/gpu_per_token.sh          (timeout_s 600)
#   call 2: CONFIGS=fh_constant,fh_muon_constant,fh_muon_wsd SKIP_SPEC=--skip-speculators MERGE=<call 1's JSON> ...
#   call 3 (equal time, one run alone): CONFIGS=fh_muon_wsd SEEDS=0 MAX_MINUTES=3.1 MAX_PARALLEL=1 ... BUDGET=380
#   (the README there lists each call's exact command; further ablations: more CONFIGS, MERGE the last JSON)
#   WARMUP_STEPS=N first trains the first config N steps, thrown away, so that the measured runs find the kernels
#   compiled (a fresh machine's first run otherwise pays 30-70 s of its 3.1 minutes: calls 5-11)
#   (speculators_like and packing train at half the speed of the others: one of them costs about two runs)
#
# Timing budget of call 1 (BUDGET=570 inside a 600 s call; the GPU is time-shared, so the number of runs decides):
#   ~25-40 s  this script's setup: wheels into /tmp/site, unpack the fixture and records, version and import check
#   then per_token.py, its clock from 0, deadline BUDGET - setup - 15 (about 515-530 s):
#     0-15 s    4 draftsmith runs start (tokenize 8 s, target load); the answers are written beside them
#     0-45 s    speculators' hidden states written (42 s in attempt 1); the peer starts at ~50 s and compiles
#               (~110 s train + ~35 s validation compile, on the CPU; 140 s for epoch 0 alone on an idle H200)
#     ~15-420 s draftsmith: 834 steps x ~7.5k tokens (6.26M) each. Measured per process: ~57k tokens/s alone, 23k
#               with 3 processes (results/full_6min_h200), 11.1k with 8 + 2 (attempt 1): the GPU's total grows only
#               ~1.4x from 1 to 8 processes. 5 processes: ~15-18k tokens/s each, so 350-420 s a run
#     ~380-450 s the peer's 2 epochs end (its ~60 s of steps alone, stretched by the sharing, then alone)
#     training deadline = per_token deadline - SCORE_SECONDS (60): ~455-470 s; anything still training is stopped
#     and scored at its last checkpoint (every SAVE_EVERY=139 steps: at most 138 steps lost), marked partial
#     scoring: curve points while training (one worker); after it, the finals (3 workers, ~10 s each, a speculators
#     checkpoint ~20 s with its import): ~30-50 s
#   margin: ~60 s in the estimate; if the draftsmith runs go at attempt 1's 11k tokens/s they reach ~step 620-700
#
# Inputs (name .gpu and .whl in the call's carry list):
#   .gpu/fixture.tar.xz            tar -cf - .fixture | xz -6 > .gpu/fixture.tar.xz
#   .gpu/sharegpt_train.jsonl.xz   ShareGPT records 0..16786 (the first RECORDS are used)
#   .gpu/question.jsonl            the 80 MT-bench questions
#   .whl/                          speculators 0.9.0 and what it needs that the machine lacks: datasets 5.1.0 (4.4.1
#                                  imports torchvision.io.VideoReader, gone from the machine's torchvision 0.26),
#                                  dill, multiprocess, hs-connectors, loguru, openai<3 (3.x imports httpx2, which
#                                  the machine lacks; 2.54.0 takes its httpx), pydantic-settings, ...
# Writes into $OUT (default benchmarks/results/local): per_token.json, run.log, gpu.txt, logs.tar.xz.
# Make the PNG here afterwards: python -m benchmarks.plot_per_token OUT/per_token.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/local}"
BUDGET="${BUDGET:-570}"  # seconds for the whole script
RECORDS="${RECORDS:-2500}"
WORK="${WORK:-/tmp/per-token-$$}"
# the rates above were measured with draftsmith's reference TTT attention; FlexAttention compiles in every process
export DRAFTSMITH_FLEX_ATTENTION="${DRAFTSMITH_FLEX_ATTENTION:-0}"
mkdir -p "$OUT" .devdata
source benchmarks/device_inputs.sh
device_python_env
# EXTRA_PYTHONPATH: packages put first (a CPU test on a machine the wheels of .whl/ do not fit)
export PYTHONPATH="${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$PYTHONPATH"
[ -d .fixture/sharegpt-llama-19m ] || xz -dc .gpu/fixture.tar.xz | tar -x
[ -f .devdata/sharegpt_train.jsonl ] || xz -dc .gpu/sharegpt_train.jsonl.xz > .devdata/sharegpt_train.jsonl
[ -f .devdata/question.jsonl ] || cp .gpu/question.jsonl .devdata/
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo cpu) > "$OUT/gpu.txt"
# The import check reads a torch-formatted row with torchvision imported, the path that failed in attempt 1.
python3 -c "import torch, transformers, datasets, pyarrow, fsspec, speculators.train.cli
from importlib.metadata import version
try:
    import torchvision
except ImportError:
    torchvision = None
datasets.Dataset.from_dict({'x': [[1, 2]]}).with_format('torch')[0]
print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__,
  'pyarrow', pyarrow.__version__, 'fsspec', fsspec.__version__,
  'torchvision', getattr(torchvision, '__version__', None), 'speculators', version('speculators'))" \
  >> "$OUT/gpu.txt" 2>&1 || SKIP_SPEC="--skip-speculators"
echo "DRAFTSMITH_FLEX_ATTENTION=$DRAFTSMITH_FLEX_ATTENTION setup ${SECONDS}s" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
TARGET=.fixture/sharegpt-llama-19m
ANSWERS=.devdata/mtbench_greedy_fp32.json
mkdir -p "$WORK"
if [ ! -f "$ANSWERS" ]; then
  python3 -m benchmarks.acceptance answers --target $TARGET --dataset .devdata/question.jsonl \
    --max-new-tokens "${MAX_NEW_TOKENS:-256}" ${NUM_PROMPTS:+--num-prompts $NUM_PROMPTS} --out "$ANSWERS" \
    > "$WORK/answers.log" 2>&1 &
fi
MERGE_FLAGS=()
for f in ${MERGE:-}; do MERGE_FLAGS+=(--merge "$f"); done
timeout $(( BUDGET - SECONDS )) python3 -m benchmarks.per_token --recipe "${RECIPE:-recipes/eagle3_fixture.yaml}" \
  --work "$WORK" --out "$OUT/per_token.json" --answers "$ANSWERS" --deadline-seconds $(( BUDGET - SECONDS - 15 )) \
  --steps "${STEPS:-834}" --configs "${CONFIGS:-baseline,freeze_head}" --seeds "${SEEDS:-0,1}" \
  ${MAX_MINUTES:+--max-minutes "$MAX_MINUTES"} --max-parallel "${MAX_PARALLEL:-0}" --curve-configs "${CURVE_CONFIGS:-baseline,freeze_head}" \
  --save-every "${SAVE_EVERY:-139}" --warmup-steps "${WARMUP_STEPS:-0}" --peers "${PEERS:-default_lr}" \
  --spec-save-steps "${SPEC_SAVE_STEPS:-139,278,417,556,695}" --score-seconds "${SCORE_SECONDS:-60}" \
  ${SPEC_FLAGS:+--spec-flags "$SPEC_FLAGS"} ${SKIP_SPEC:-} "${MERGE_FLAGS[@]}" \
  data.path=.devdata/sharegpt_train.jsonl data.max_samples="$RECORDS" model.draft_vocab_size=8192 ${EXTRA:-} \
  2>&1 | tee "$OUT/run.log"
wait
(cd "$WORK" && tar -cJf - --exclude='*.safetensors' --exclude='*.arrow' --exclude='*.pt' --exclude='*.npy' \
  --exclude='training_state' --exclude='hidden_states' *.log score*.jsonl */*/curve.jsonl \
  */*/*/trainer_state.json */*/metrics.jsonl 2>/dev/null) > "$OUT/logs.tar.xz"
ls -la "$OUT"
