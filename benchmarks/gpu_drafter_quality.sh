#!/usr/bin/env bash
# The drafter-quality issue's measurements on the fixture target, one stage per call of the lent GPU machine:
#
#   STAGE=ablation  benchmarks/ablate_eagle3.py: one change at a time at a fixed budget (MINUTES per run)
#   STAGE=peer      benchmarks/peer_eagle3.py: speculators and draftsmith on the same 2,500 records and time
#                   (speculators' fused Triton loss fails under its torch.compile with torch 2.11: "ListVariable
#                   is already tracked for mutation"; SPEC_FLAGS defaults to its eager loss, the same KL)
#   STAGE=full      METHODS (default eagle3 dflash mtp) on all 16,210 training samples for FULL_MINUTES each (run
#                   side by side on the one GPU), then `draftsmith eval` of them next to n-gram at temperature 0
#
# Inputs travel in the git-ignored .gpu/ folder (name it and .whl in the device call's carry list):
#   .gpu/fixture.tar.xz            tar -cf - .fixture | xz -6 > .gpu/fixture.tar.xz
#   .gpu/sharegpt_2500.jsonl.xz    the first 2,500 training records (ablation, peer)
#   .gpu/sharegpt_train.jsonl.xz   all 16,787 (full)
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
    timeout "$(left)" python3 benchmarks/ablate_eagle3.py --recipe "${RECIPE:-recipes/eagle3_fixture.yaml}" \
      --minutes "${MINUTES:-0.6}" $ANSWERS --out "$OUT/ablation.json" --runs-dir /tmp/ablation-$$ \
      --deadline-minutes "$(( ($(left) - 75) / 60 ))" ${ONLY:+--only "$ONLY"} $SHARED ${EXTRA:-} 2>&1 \
      | grep -v "it/s]\|s/it]\|Loading weights\|tokenize:" | tail -40
    ;;
  peer)
    python3 -c "import datasets, pyarrow, speculators.train.cli; print('datasets', datasets.__version__, 'pyarrow',
      pyarrow.__version__)" || { echo "speculators' dependencies do not import: carry them in .whl/" >&2; exit 3; }
    [ -f .devdata/sharegpt_2500.jsonl ] || xz -dc .gpu/sharegpt_2500.jsonl.xz > .devdata/sharegpt_2500.jsonl
    timeout "$(left)" python3 benchmarks/peer_eagle3.py --recipe "${RECIPE:-recipes/eagle3_fixture.yaml}" \
      --work /tmp/peer-$$ $ANSWERS --out "$OUT/peer_eagle3.json" --spec-epochs "${SPEC_EPOCHS:-2}" \
      --spec-flags "${SPEC_FLAGS:---loss-implementation eager}" --deadline-seconds "$(( $(left) - 10 ))" \
      --runtime-ks "${RUNTIME_KS:-}" --runtime-temperatures "${RUNTIME_TEMPERATURES:-0,1}" \
      $SHARED ${EXTRA:-} 2>&1 | grep -v "it/s]\|s/it]\|Loading weights\|tokenize:" | tail -30
    cp /tmp/peer-$$/speculators_train.log /tmp/peer-$$/draftsmith_train.log "$OUT/" 2>/dev/null
    ;;
  full)
    [ -f .devdata/sharegpt_train.jsonl ] || xz -dc .gpu/sharegpt_train.jsonl.xz > .devdata/sharegpt_train.jsonl
    METHODS="${METHODS:-eagle3 dflash mtp}"
    for m in $METHODS; do
      python3 -m draftsmith.cli train "${RECIPE:-recipes/eagle3_fixture.yaml}" model.method=$m \
        training.max_minutes="${FULL_MINUTES:-6.0}" output_dir=/tmp/full-$$/$m ${EXTRA:-} > "$OUT/train_$m.log" 2>&1 &
    done
    wait
    for m in $METHODS; do grep -E "time budget|done:|Error|error" "$OUT/train_$m.log" | tail -4; done
    case " $METHODS " in *" eagle3 "*)
      timeout "$(left)" python3 benchmarks/acceptance.py sim --target $TARGET --answers .devdata/mtbench_greedy_fp32.json \
        --drafter eagle3=/tmp/full-$$/eagle3 --out "$OUT/sim_full_eagle3.json" 2>&1 | tail -2 ;;
    esac
    configs=()
    for m in $METHODS; do configs+=(--speculative-config "{\"method\":\"$m\",\"model\":\"/tmp/full-$$/$m\"}"); done
    timeout "$(left)" python3 -m draftsmith.cli eval --target $TARGET --dataset mt_bench=.devdata/question.jsonl \
      --max-new-tokens 256 --num-speculative-tokens ${FULL_KS:-5} --out "$OUT/eval_full" "${configs[@]}" ${EVAL_ARGS:-} \
      --speculative-config '{"method":"ngram","prompt_lookup_max":4,"prompt_lookup_min":1}' 2>&1 \
      | grep -v "Loading weights" | tail -16
    cp "$OUT"/eval_full/eval.json "$OUT/eval_full.json" 2>/dev/null
    ;;
  *) echo "STAGE must be ablation, peer or full, not '$STAGE'" >&2; exit 2 ;;
esac
ls -la "$OUT"
