#!/usr/bin/env bash
# The drafter-quality issue's measurements on the fixture target, one stage per call of the lent GPU machine:
#
#   STAGE=ablation  benchmarks/ablate_eagle3.py: one change at a time at a fixed budget (MINUTES per run)
#   STAGE=peer      benchmarks/peer_eagle3.py: speculators and draftsmith on the same 2,500 records and time
#                   (speculators' fused Triton loss fails under its torch.compile with torch 2.11: "ListVariable
#                   is already tracked for mutation"; SPEC_FLAGS defaults to its eager loss, the same KL)
#   STAGE=regen     `draftsmith regenerate` of all 16,787 training records by the target (first REGEN_TURNS
#                   assistant turns, 256 new tokens, greedy), returned as $OUT/regenerated.jsonl.xz; then EAGLE-3
#                   on the dataset's answers against the target's own (MINUTES each, benchmarks/ablate_eagle3.py),
#                   and the DFLASH_VARIANTS on the regenerated data side by side for DFLASH_MINUTES, evaluated at k=5
#   STAGE=full      METHODS (default eagle3 dflash mtp), each with recipes/METHOD_fixture.yaml (or RECIPE), on all
#                   16,210 training samples for FULL_MINUTES each (run side by side on the one GPU), then
#                   `draftsmith eval` of them next to n-gram at temperature 0;
#                   DATA=regenerated trains on STAGE=regen's output, METHOD_EXTRA (e.g. DFLASH_EXTRA) overrides
#                   one method's recipe
#   STAGE=speed     EAGLE-3 training speed on the peer's data under SPEED_VARIANTS and an OLD_TREE's code, then
#                   draftsmith's side of the peer benchmark with the fastest for PEER_SECONDS (see the stage)
#   STAGE=variants  VARIANTS (space-separated, each a comma-joined list of key=value overrides of RECIPE, or of the
#                   recipe the item starts with: "recipes/eagle3_fixture.yaml,training.lr=1e-3") trained side by
#                   side on the regenerated data for FULL_MINUTES, then `draftsmith eval` at FULL_KS
#                   (EVAL_ARGS, e.g. "--batch-size 8", go to both stages' eval); EVAL_T1 (flags, e.g.
#                   "--num-prompts 40") adds an eval of the same drafters at temperature 1
#
# Inputs travel in the git-ignored .gpu/ folder (name it and .whl in the device call's carry list):
#   .gpu/fixture.tar.xz            tar -cf - .fixture | xz -6 > .gpu/fixture.tar.xz
#   .gpu/sharegpt_2500.jsonl.xz    the first 2,500 training records (ablation, peer)
#   .gpu/sharegpt_train.jsonl.xz   all 16,787 (full, regen)
#   .gpu/regenerated.jsonl.xz      STAGE=regen's output, for STAGE=full with DATA=regenerated
#   .gpu/mtbench_greedy_fp32.json, .gpu/mtbench_t1_fp32.json, .gpu/question.jsonl
#                                  benchmarks/acceptance.py answers ... (the target's float32 answers)
# Writes into $OUT (default benchmarks/results/local).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/local}"
STAGE="${STAGE:-peer}"
BUDGET="${BUDGET:-570}"  # seconds for the whole script
mkdir -p "$OUT" .devdata
source benchmarks/device_inputs.sh
device_python_env
export TQDM_MININTERVAL=30
[ -d .fixture/sharegpt-llama-19m ] || xz -dc .gpu/fixture.tar.xz | tar -x
cp -n .gpu/mtbench_*.json .gpu/question.jsonl .devdata/ 2>/dev/null
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true) > "$OUT/gpu.txt"
TARGET=.fixture/sharegpt-llama-19m
ANSWERS="--answers .devdata/mtbench_greedy_fp32.json --answers-t1 .devdata/mtbench_t1_fp32.json"
SHARED="data.path=.devdata/sharegpt_2500.jsonl data.max_samples=null model.draft_vocab_size=8192"
left() { echo $(( BUDGET - SECONDS )); }

case "$STAGE" in
  ablation)
    [ -f .devdata/sharegpt_2500.jsonl ] || xz -dc .gpu/sharegpt_2500.jsonl.xz > .devdata/sharegpt_2500.jsonl
    timeout "$(left)" python3 -m benchmarks.ablate_eagle3 --recipe "${RECIPE:-recipes/eagle3_fixture.yaml}" \
      --minutes "${MINUTES:-0.6}" $ANSWERS --out "$OUT/ablation.json" --runs-dir /tmp/ablation-$$ \
      --deadline-minutes "$(( ($(left) - 75) / 60 ))" ${ONLY:+--only "$ONLY"} $SHARED ${EXTRA:-} 2>&1 \
      | grep -v "it/s]\|s/it]\|Loading weights\|tokenize:" | tail -40
    ;;
  peer)
    python3 -c "import datasets, pyarrow, speculators.train.cli; print('datasets', datasets.__version__, 'pyarrow',
      pyarrow.__version__)" || { echo "speculators' dependencies do not import: carry them in .whl/" >&2; exit 3; }
    [ -f .devdata/sharegpt_2500.jsonl ] || xz -dc .gpu/sharegpt_2500.jsonl.xz > .devdata/sharegpt_2500.jsonl
    timeout "$(left)" python3 -m benchmarks.peer_eagle3 --recipe "${RECIPE:-recipes/eagle3_fixture.yaml}" \
      --work /tmp/peer-$$ $ANSWERS --out "$OUT/peer_eagle3.json" --spec-epochs "${SPEC_EPOCHS:-2}" \
      --spec-flags "${SPEC_FLAGS:---loss-implementation eager}" --deadline-seconds "$(( $(left) - 10 ))" \
      --runtime-ks "${RUNTIME_KS:-}" --runtime-temperatures "${RUNTIME_TEMPERATURES:-0,1}" \
      $SHARED ${EXTRA:-} 2>&1 | grep -v "it/s]\|s/it]\|Loading weights\|tokenize:" | tail -30
    cp /tmp/peer-$$/speculators_train.log /tmp/peer-$$/draftsmith_train.log "$OUT/" 2>/dev/null
    ;;
  regen)
    [ -f .devdata/sharegpt_train.jsonl ] || xz -dc .gpu/sharegpt_train.jsonl.xz > .devdata/sharegpt_train.jsonl
    if [ -f .gpu/regenerated.jsonl.xz ] && [ ! -d /tmp/regen ]; then  # resume an earlier call's regeneration
      mkdir -p /tmp/regen && xz -dc .gpu/regenerated.jsonl.xz > /tmp/regen/regenerated.jsonl
      cp .gpu/regenerate_errors.jsonl /tmp/regen/errors.jsonl 2>/dev/null
    fi
    start=$SECONDS
    timeout "${REGEN_SECONDS:-240}" python3 -m draftsmith.cli regenerate --data .devdata/sharegpt_train.jsonl \
      --target $TARGET --out /tmp/regen --max-turns "${REGEN_TURNS:-1}" --max-new-tokens 256 \
      --batch-size "${REGEN_BATCH:-256}" --dtype bfloat16 2>&1 | tr '\r' '\n' | grep -v "Loading weights" \
      | grep . | tail -3 | tee "$OUT/regenerate.log"
    echo "regenerate: $(( SECONDS - start )) s; $(wc -l < /tmp/regen/regenerated.jsonl) regenerated," \
      "$(wc -l < /tmp/regen/errors.jsonl) errors" | tee -a "$OUT/regenerate.log"
    cp /tmp/regen/errors.jsonl "$OUT/regenerate_errors.jsonl"
    mkdir -p .devdata/regenerated && cp /tmp/regen/regenerated.jsonl .devdata/regenerated/regenerated.jsonl
    xz -T0 -6 -c .devdata/regenerated/regenerated.jsonl > "$OUT/regenerated.jsonl.xz"
    timeout "$(left)" python3 -m benchmarks.ablate_eagle3 --recipe "${RECIPE:-recipes/eagle3_fixture.yaml}" \
      --minutes "${MINUTES:-1.0}" $ANSWERS --out "$OUT/ablation_data.json" --runs-dir /tmp/ablation-$$ \
      --only regenerated --candidate "regenerated=data.path=.devdata/regenerated/regenerated.jsonl" \
      data.path=.devdata/sharegpt_train.jsonl 2>&1 | grep -v "it/s]\|s/it]\|Loading weights\|tokenize:" | tail -6
    variants=(${DFLASH_VARIANTS:-})
    configs=()
    for i in "${!variants[@]}"; do
      [ "$(left)" -gt $(( ${DFLASH_MINUTES%.*} * 60 + 150 )) ] || { echo "no time left for the DFlash variants"; break; }
      python3 -m draftsmith.cli train "${RECIPE:-recipes/eagle3_fixture.yaml}" model.method=dflash \
        data.path=.devdata/regenerated/regenerated.jsonl training.max_minutes="${DFLASH_MINUTES:-1.5}" \
        output_dir=/tmp/dflash-$$/$i ${variants[$i]//,/ } > "$OUT/train_dflash_$i.log" 2>&1 &
      configs+=(--speculative-config "{\"method\":\"dflash\",\"model\":\"/tmp/dflash-$$/$i\"}")
    done
    wait
    for i in "${!variants[@]}"; do
      echo "dflash variant $i (${variants[$i]}):"; grep -E "time budget|done:|Error|error|eval" "$OUT/train_dflash_$i.log" | tail -3
    done
    [ ${#configs[@]} -gt 0 ] && timeout "$(left)" python3 -m draftsmith.cli eval --target $TARGET \
      --dataset mt_bench=.devdata/question.jsonl --max-new-tokens 256 --num-speculative-tokens 5 \
      --out "$OUT/eval_dflash" "${configs[@]}" 2>&1 | grep -v "Loading weights" | tail -8
    cp "$OUT"/eval_dflash/eval.json "$OUT/eval_dflash.json" 2>/dev/null; rm -rf "$OUT/eval_dflash"
    ;;
  full)
    [ -f .devdata/sharegpt_train.jsonl ] || xz -dc .gpu/sharegpt_train.jsonl.xz > .devdata/sharegpt_train.jsonl
    if [ -f .gpu/regenerated.jsonl.xz ] && [ ! -f .devdata/regenerated/regenerated.jsonl ]; then
      mkdir -p .devdata/regenerated && xz -dc .gpu/regenerated.jsonl.xz > .devdata/regenerated/regenerated.jsonl
    fi
    METHODS="${METHODS:-eagle3 dflash mtp}"
    data=(data.path=.devdata/sharegpt_train.jsonl)
    [ "${DATA:-dataset}" = regenerated ] && data=(data.path=.devdata/regenerated/regenerated.jsonl)
    for m in $METHODS; do
      extra_var="${m^^}_EXTRA"  # EAGLE3_EXTRA, DFLASH_EXTRA, MTP_EXTRA: overrides of that method's run only
      recipe="${RECIPE:-recipes/${m}_fixture.yaml}"  # each method's fixture recipe unless RECIPE is given
      python3 -m draftsmith.cli train "$recipe" model.method=$m "${data[@]}" \
        training.max_minutes="${FULL_MINUTES:-6.0}" output_dir=/tmp/full-$$/$m ${EXTRA:-} ${!extra_var:-} \
        > "$OUT/train_$m.log" 2>&1 &
    done
    wait
    for m in $METHODS; do
      grep -E "time budget|done:|Error|error" "$OUT/train_$m.log" | tail -4
      cp /tmp/full-$$/$m/metrics.jsonl "$OUT/${m}_metrics.jsonl" 2>/dev/null
    done
    configs=()
    for m in $METHODS; do configs+=(--speculative-config "{\"method\":\"$m\",\"model\":\"/tmp/full-$$/$m\"}"); done
    timeout "$(left)" python3 -m draftsmith.cli eval --target $TARGET --dataset mt_bench=.devdata/question.jsonl \
      --max-new-tokens 256 --num-speculative-tokens ${FULL_KS:-5} --out "$OUT/eval_full" "${configs[@]}" ${EVAL_ARGS:-} \
      --speculative-config '{"method":"ngram","prompt_lookup_max":4,"prompt_lookup_min":1}' 2>&1 \
      | grep -v "Loading weights" | tail -16
    cp "$OUT"/eval_full/eval.json "$OUT/eval_full.json" 2>/dev/null
    case " $METHODS " in *" eagle3 "*)
      timeout "$(left)" python3 -m benchmarks.acceptance sim --target $TARGET --answers .devdata/mtbench_greedy_fp32.json \
        --drafter eagle3=/tmp/full-$$/eagle3 --out "$OUT/sim_full_eagle3.json" 2>&1 | tail -2
      timeout "$(left)" python3 -m benchmarks.acceptance sim --target $TARGET --answers .devdata/mtbench_t1_fp32.json \
        --drafter eagle3=/tmp/full-$$/eagle3 --out "$OUT/sim_full_eagle3_t1.json" 2>&1 | tail -2 ;;
    esac
    ;;
  variants)
    if [ ! -f .devdata/regenerated/regenerated.jsonl ]; then
      mkdir -p .devdata/regenerated && xz -dc .gpu/regenerated.jsonl.xz > .devdata/regenerated/regenerated.jsonl
    fi
    variants=(${VARIANTS:?VARIANTS=\"a=1,b=2 c=3\": one run per space-separated item})
    configs=()
    recipes=()
    for i in "${!variants[@]}"; do
      overrides="${variants[$i]}"
      recipe="${RECIPE:-}"
      case "$overrides" in *.yaml*) recipe="${overrides%%.yaml*}.yaml"; overrides="${overrides#*.yaml}"; overrides="${overrides#,}" ;; esac
      recipes+=("${recipe:?RECIPE=recipes/....yaml, or a variant that starts with its recipe}")
      variants[$i]="$overrides"
      python3 -m draftsmith.cli train "$recipe" \
        data.path=.devdata/regenerated/regenerated.jsonl training.max_minutes="${FULL_MINUTES:-6.0}" \
        output_dir=/tmp/variants-$$/$i ${overrides//,/ } > "$OUT/train_variant_$i.log" 2>&1 &
    done
    wait
    for i in "${!variants[@]}"; do
      echo "variant $i (${recipes[$i]} ${variants[$i]}):"
      grep -E "time budget|done:|Error|error" "$OUT/train_variant_$i.log" | tail -3
      cp /tmp/variants-$$/$i/metrics.jsonl "$OUT/metrics_variant_$i.jsonl" 2>/dev/null
      method=$(python3 -c "import sys; from draftsmith.config import load_recipe as r
print(r(sys.argv[1], sys.argv[2:]).model.method)" "${recipes[$i]}" ${variants[$i]//,/ })
      configs+=(--speculative-config "{\"method\":\"$method\",\"model\":\"/tmp/variants-$$/$i\"}")
    done
    timeout "$(left)" python3 -m draftsmith.cli eval --target $TARGET --dataset mt_bench=.devdata/question.jsonl \
      --max-new-tokens 256 --num-speculative-tokens ${FULL_KS:-5} --out "$OUT/eval_variants" "${configs[@]}" \
      ${EVAL_ARGS:-} 2>&1 \
      | grep -v "Loading weights" | tail -12
    cp "$OUT"/eval_variants/eval.json "$OUT/eval_variants.json" 2>/dev/null; rm -rf "$OUT/eval_variants"
    if [ -n "${EVAL_T1:-}" ]; then  # the same drafters sampled at temperature 1 (EVAL_T1 = extra eval flags)
      timeout "$(left)" python3 -m draftsmith.cli eval --target $TARGET --dataset mt_bench=.devdata/question.jsonl \
        --max-new-tokens 256 --num-speculative-tokens ${FULL_KS:-5} --out "$OUT/eval_variants_t1" "${configs[@]}" \
        --temperature 1 --seed 0 ${EVAL_ARGS:-} ${EVAL_T1} 2>&1 | grep -v "Loading weights" | tail -12
      cp "$OUT"/eval_variants_t1/eval.json "$OUT/eval_variants_t1.json" 2>/dev/null; rm -rf "$OUT/eval_variants_t1"
    fi
    ;;
  speed)
    # EAGLE-3's training speed on the peer benchmark's data, one process at a time: the recipe as it is, under each
    # of SPEED_VARIANTS (space-separated, each comma-joined overrides), and the code of OLD_TREE (a `git archive
    # --prefix=old/` tarball in .gpu/) with its own recipe; SPEED_STEPS steps each. Then draftsmith's side of the
    # peer benchmark again with the fastest variant: PEER_SECONDS of training (speculators' measured loop) and the
    # simulated tau at T=0 and T=1 (benchmarks/acceptance.py, as peer_eagle3.py scores both trainers).
    [ -f .devdata/sharegpt_2500.jsonl ] || xz -dc .gpu/sharegpt_2500.jsonl.xz > .devdata/sharegpt_2500.jsonl
    steps="training.max_minutes=null training.max_steps=${SPEED_STEPS:-30} training.log_every=5"
    steps="$steps training.eval_every=100000 training.save_every=100000"
    rate() {  # median tokens/s of the logged windows after the first 10 steps
      python3 -c "import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"tokens_per_s\"' in l]
print(round(statistics.median(r['tokens_per_s'] for r in rows if r['step'] > 10)))" "$1"
    }
    names=(recipe) runs=("")
    for v in ${SPEED_VARIANTS:-}; do names+=("$v"); runs+=("${v//,/ }"); done
    : > "$OUT/speed.tsv"
    for i in "${!runs[@]}"; do
      python3 -m draftsmith.cli train recipes/eagle3_fixture.yaml $SHARED $steps output_dir=/tmp/speed-$$/$i \
        ${runs[$i]} > "$OUT/speed_$i.log" 2>&1
      printf '%s\t%s\n' "${names[$i]}" "$(rate /tmp/speed-$$/$i/metrics.jsonl)" | tee -a "$OUT/speed.tsv"
    done
    if [ -n "${OLD_TREE:-}" ]; then
      root=$PWD out=$(cd "$OUT" && pwd)
      rm -rf /tmp/old && tar -xJf ".gpu/$OLD_TREE" -C /tmp && ln -s "$root/.fixture" "$root/.devdata" /tmp/old/
      (cd /tmp/old && python3 -m draftsmith.cli train recipes/eagle3_fixture.yaml $SHARED $steps \
        output_dir=/tmp/speed-$$/old > "$out/speed_old.log" 2>&1)
      printf 'old %s\t%s\n' "$OLD_TREE" "$(rate /tmp/speed-$$/old/metrics.jsonl)" | tee -a "$OUT/speed.tsv"
    fi
    best=$(python3 -c "import sys
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1])][:len(sys.argv) - 2]
print(max(range(len(rows)), key=lambda i: float(rows[i][1] or 0)))" "$OUT/speed.tsv" "${runs[@]}")
    echo "fastest: ${names[$best]}" | tee -a "$OUT/speed.tsv"
    if [ -n "${PEER_SECONDS:-}" ]; then
      minutes=$(python3 -c "print(${PEER_SECONDS} / 60)")
      python3 -m draftsmith.cli train recipes/eagle3_fixture.yaml $SHARED training.max_minutes=$minutes \
        output_dir=/tmp/peer-side-$$ ${runs[$best]} > "$OUT/peer_side_train.log" 2>&1
      grep -E "time budget|done:" "$OUT/peer_side_train.log" | tail -3
      for t in greedy t1; do
        timeout "$(left)" python3 -m benchmarks.acceptance sim --target $TARGET --answers .devdata/mtbench_${t}_fp32.json \
          --drafter draftsmith=/tmp/peer-side-$$ --out "$OUT/peer_side_sim_$t.json" 2>&1 | tail -2
      done
    fi
    ;;
  *) echo "STAGE must be ablation, peer, regen, full, variants or speed, not '$STAGE'" >&2; exit 2 ;;
esac
ls -la "$OUT"
