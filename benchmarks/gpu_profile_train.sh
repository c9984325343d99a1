#!/usr/bin/env bash
# Where a real `draftsmith train` step spends its time on one lent GPU (benchmarks/profile_train.py), in one call of
# at most BUDGET seconds (default 540): each of RUNS trains alone, a process of its own, and records PROFILE_ACTIVE
# steady steps under torch.profiler after SKIP steps (compilations and the time probes).
#
#   RUNS: NAME=RECIPE[,ARG...] separated by spaces, each ARG a recipe override, a flag of profile_train.py (--tf32)
#   or env:VAR=VALUE for that run alone (env:DRAFTSMITH_CUDNN_ATTENTION=1: torch's own attention backends). The
#   default: the shipped EAGLE-3 recipe on issue 27's data (the first 2,500 ShareGPT records, draft vocabulary
#   8,192), the same without training.compile_drafter, and DSpark's fixture recipe on the target's own answers
#   (.gpu/regenerated.jsonl.xz), with float32 products in TF32 too.
#
#   OUT=$OUT bash benchmarks/gpu_profile_train.sh       # carry .gpu .whl
#
# Writes into $OUT: gpu.txt, each run's profile.json as NAME.json, and profiles.tar.xz (each run's profile.json,
# device.txt, cpu.txt and log, under NAME/): the machine returns at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/local}"
BUDGET="${BUDGET:-540}"
PER_TOKEN="data.path=.devdata/sharegpt_train.jsonl,data.max_samples=2500,model.draft_vocab_size=8192"
RUNS="${RUNS:-eagle3=recipes/eagle3_fixture.yaml,$PER_TOKEN eagle3_eager=recipes/eagle3_fixture.yaml,$PER_TOKEN,\
training.compile_drafter=false dspark=recipes/dspark_fixture.yaml dspark_tf32=recipes/dspark_fixture.yaml,--tf32}"
WORK="${WORK:-/tmp/profile-train-$$}"
mkdir -p "$OUT" "$WORK" .devdata/regenerated
OUT="$(cd "$OUT" && pwd)"
source benchmarks/device_inputs.sh
device_python_env
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}"
[ -d .fixture/sharegpt-llama-19m ] || xz -dc .gpu/fixture.tar.xz | tar -x
[ -f .devdata/sharegpt_train.jsonl ] || xz -dc .gpu/sharegpt_train.jsonl.xz > .devdata/sharegpt_train.jsonl
REGEN=.devdata/regenerated/regenerated.jsonl
[ -f "$REGEN" ] || xz -dc .gpu/regenerated.jsonl.xz > "$REGEN"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo cpu) > "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$OUT/gpu.txt"
for run in $RUNS; do
  name="${run%%=*}"
  IFS=',' read -r -a items <<< "${run#*=}"
  spec=() envs=()
  for item in "${items[@]}"; do
    if [[ $item == env:* ]]; then envs+=("${item#env:}"); else spec+=("$item"); fi
  done
  left=$(( BUDGET - SECONDS - 5 ))
  [ "$left" -gt 30 ] || { echo "$name: no time left" | tee -a "$OUT/gpu.txt"; continue; }
  start=$SECONDS
  mkdir -p "$WORK/$name"
  env "${envs[@]}" timeout "$left" python3 -m benchmarks.profile_train --out "$WORK/$name" --skip "${SKIP:-60}" \
    --active "${PROFILE_ACTIVE:-5}" "${spec[@]}" training.log_every=20 > "$WORK/$name/run.log" 2>&1
  echo "$name: rc $? in $(( SECONDS - start )) s" | tee -a "$OUT/gpu.txt"
  cp "$WORK/$name/profile.json" "$OUT/$name.json" 2>/dev/null
  tail -c 600 "$WORK/$name/run.log"
done
(cd "$WORK" && tar -cJf "$OUT/profiles.tar.xz" --exclude=run -- *)
