#!/usr/bin/env bash
# DSpark against DFlash and EAGLE-3 on the fixture target (issue 24's measurement), in two calls of the lent GPU
# machine, the second while the first's machine is still warm (it keeps /tmp):
#
#   STAGE=train   the target's own greedy answers to the first turns of its training records (`draftsmith
#                 regenerate`, REGEN_SECONDS at most; an earlier call's .gpu/regenerated.jsonl.xz is used instead
#                 when it travels), then METHODS (default dspark dflash eagle3), each with recipes/<m>_fixture.yaml,
#                 trained side by side on the one GPU for MINUTES (6.0) each, then a first look: `draftsmith eval`
#                 at QUICK_KS over QUICK_PROMPTS prompts, temperature 0
#   STAGE=eval    `draftsmith eval` of the trained drafters next to n-gram and DSpark with its confidence cut
#                 (CONFIDENCE, 0.5) at k = KS (1..7), temperature 0 over PROMPTS_T0 (all 80) MT-bench first
#                 turns, then temperature 1 at KS_T1 over PROMPTS_T1 prompts; float32, EVAL_BATCH requests at a
#                 time (tokens/s and speedups are at that concurrency); NGRAM=0 leaves n-gram out, T1=0 the
#                 temperature-1 pass
# METHODS may name any methods with a recipes/<m>_fixture.yaml (METHODS="eagle eagle3": EAGLE-1 against EAGLE-3),
# and variants as NAME=METHOD with their overrides in NAME_EXTRA (upper case): METHODS="dspark dspark_gated=dspark"
# DSPARK_GATED_EXTRA="dspark.markov_head=gated" trains both, each into its own folder, evaluated side by side.
# CUT names the run DSpark's confidence cut is evaluated on (dspark).
#
# Inputs, in the git-ignored .gpu/ folder (name .gpu in the call's carry list):
#   .gpu/fixture.tar.xz            tar -cf - .fixture | xz -1 > .gpu/fixture.tar.xz (benchmarks/prepare_fixture_data.py
#                                  lays out .fixture/ and .devdata/)
#   .gpu/sharegpt_train.jsonl.xz   .devdata/sharegpt_train.jsonl.xz: ShareGPT records 0..16786
#   .gpu/question.jsonl            the 80 MT-bench questions
# Writes into $OUT (default benchmarks/results/local): logs, metrics, eval.json/eval.txt and the PNGs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/local}"
STAGE="${STAGE:-train}"
BUDGET="${BUDGET:-580}"  # seconds for the whole script
METHODS="${METHODS:-dspark dflash eagle3}"
RUNS=/tmp/dspark-bench  # the trained drafters, kept on the warm machine between the two calls
mkdir -p "$OUT" .devdata
source benchmarks/device_inputs.sh
device_python_env
export TQDM_MININTERVAL=30
[ -d .fixture/sharegpt-llama-19m ] || xz -dc .gpu/fixture.tar.xz | tar -x
[ -f .devdata/question.jsonl ] || cp .gpu/question.jsonl .devdata/
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo cpu) > "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$OUT/gpu.txt"
TARGET=.fixture/sharegpt-llama-19m
left() { echo $(( BUDGET - SECONDS )); }
method_of() { local run=$1; echo "${run#*=}"; }  # "dspark_gated=dspark" -> dspark; "eagle3" -> eagle3

configs() {  # the --speculative-config flags of the drafters trained, n-gram, and DSpark with its confidence cut
  for run in $METHODS; do
    printf -- '--speculative-config\n{"method":"%s","model":"%s/%s"}\n' "$(method_of "$run")" "$RUNS" "${run%%=*}"
  done
  [ "${NGRAM:-1}" = 0 ] || printf -- '--speculative-config\n{"method":"ngram","prompt_lookup_max":4,"prompt_lookup_min":1}\n'
  local cut="${CUT:-dspark}"
  case " ${METHODS//=/ } " in *" $cut "*)
    printf -- '--speculative-config\n{"method":"dspark","model":"%s/%s","confidence_threshold":%s}\n' \
      "$RUNS" "$cut" "${CONFIDENCE:-0.5}" ;;
  esac
}

evaluate() {  # evaluate NAME [eval flags...]: one `draftsmith eval` of every config into $OUT/NAME*
  local name=$1; shift
  mapfile -t flags < <(configs)
  timeout "$(left)" python3 -m draftsmith.cli eval --target $TARGET --dataset mt_bench=.devdata/question.jsonl \
    --max-new-tokens 256 --dtype float32 --batch-size "${EVAL_BATCH:-16}" --out "/tmp/$name" "${flags[@]}" "$@" 2>&1 \
    | grep -v "Loading weights" | tail -40 | tee "$OUT/$name.log"
  cp "/tmp/$name/eval.json" "$OUT/$name.json" 2>/dev/null
  cp "/tmp/$name/eval.txt" "$OUT/$name.txt" 2>/dev/null
  for png in /tmp/$name/*.png; do [ -f "$png" ] && cp "$png" "$OUT/${name}_$(basename "$png")"; done
}

case "$STAGE" in
  train)
    mkdir -p .devdata/regenerated
    if [ -f .gpu/regenerated.jsonl.xz ]; then
      xz -dc .gpu/regenerated.jsonl.xz > .devdata/regenerated/regenerated.jsonl
    else
      [ -f .devdata/sharegpt_train.jsonl ] || xz -dc .gpu/sharegpt_train.jsonl.xz > .devdata/sharegpt_train.jsonl
      start=$SECONDS
      timeout "${REGEN_SECONDS:-100}" python3 -m draftsmith.cli regenerate --data .devdata/sharegpt_train.jsonl \
        --target $TARGET --out /tmp/regen --max-turns 1 --max-new-tokens 256 --batch-size "${REGEN_BATCH:-256}" \
        --dtype "${REGEN_DTYPE:-bfloat16}" ${REGEN_EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "Loading weights" \
        | grep . | tail -3 | tee "$OUT/regenerate.log"
      cp /tmp/regen/regenerated.jsonl .devdata/regenerated/regenerated.jsonl
      echo "regenerate: $(( SECONDS - start )) s, $(wc -l < .devdata/regenerated/regenerated.jsonl) records" \
        | tee -a "$OUT/regenerate.log"
      xz -T0 -3 -c .devdata/regenerated/regenerated.jsonl > "$OUT/regenerated.jsonl.xz"
    fi
    rm -rf "$RUNS"
    for run in $METHODS; do
      m="${run%%=*}"
      extra_var="${m^^}_EXTRA"  # DSPARK_EXTRA, DFLASH_EXTRA, EAGLE3_EXTRA: overrides of that run only
      python3 -m draftsmith.cli train "recipes/$(method_of "$run")_fixture.yaml" \
        data.path=.devdata/regenerated/regenerated.jsonl training.max_minutes="${MINUTES:-6.0}" output_dir="$RUNS/$m" \
        ${EXTRA:-} ${!extra_var:-} > "$OUT/train_$m.log" 2>&1 &
    done
    wait
    for run in $METHODS; do
      m="${run%%=*}"
      echo "== $m"; grep -E "time budget|done:|Error|error" "$OUT/train_$m.log" | tail -4
      cp "$RUNS/$m/metrics.jsonl" "$OUT/${m}_metrics.jsonl" 2>/dev/null
    done
    evaluate quick_t0 --num-speculative-tokens ${QUICK_KS:-5} --num-prompts "${QUICK_PROMPTS:-40}"
    ;;
  eval)
    [ -d "$RUNS" ] || { echo "no trained drafters in $RUNS: the machine was given back since STAGE=train" >&2; exit 3; }
    evaluate eval_t0 --num-speculative-tokens ${KS:-1 2 3 4 5 6 7} ${PROMPTS_T0:+--num-prompts $PROMPTS_T0}
    [ "${T1:-1}" = 0 ] || evaluate eval_t1 --num-speculative-tokens ${KS_T1:-1 3 5 7} --num-prompts "${PROMPTS_T1:-40}" \
      --temperature 1 --seed 0
    ;;
  *) echo "STAGE must be train or eval, not '$STAGE'" >&2; exit 2 ;;
esac
ls -la "$OUT"
