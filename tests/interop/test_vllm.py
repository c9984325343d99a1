"""Every export and method in the real vLLM engine: its log shows the drafter's weights loaded, none missing or
unexpected; its greedy outputs equal vLLM's plain decoding and draftsmith's runtime token for token; and its
spec-decode counters (`num_drafts`, `num_draft_tokens`, `num_accepted_tokens`, per position) equal draftsmith's
`SpeculativeGenerator` on the same prompts and k, float32. draftsmith runs the *training checkpoint* the export was
made from, never the export itself: run on the export, both engines would draft from whatever layers, token or
tensors the export got wrong and still agree. The drafters are trained to accept (tests/conftest.py), so the
counters measure acceptance, not only rejection. Run with `make interop`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from vllm_engine import MATRIX, MAX_TOKENS, VllmError, load_problems, run_vllm

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.runtime.metrics import SpecDecodingMetrics

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
COUNTED: dict[str, tuple[dict, dict]] = {}  # check()'s name -> (vLLM's counters, draftsmith's), kept on failure too


def draftsmith_run(target, prompts, spec: dict, eos, max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], dict]:
    """(outputs, counters) of draftsmith's runtime with the vLLM speculative config `spec`."""
    config = parse_spec_config(spec, "cpu")
    generator = SpeculativeGenerator(target, build_proposer(config, target), config.num_speculative_tokens)
    total = SpecDecodingMetrics(config.num_speculative_tokens)
    outputs = []
    for prompt in prompts:
        result = generator.generate(torch.tensor([prompt]), max_tokens, eos)
        outputs.append(result.token_ids)
        total = total.merge(result.metrics)
    return outputs, {key: total.to_dict()[key] for key in COUNTERS}


def tau(counters: dict) -> float:
    return 1 + counters["num_accepted_tokens"] / counters["num_drafts"] if counters.get("num_drafts") else 1.0


@pytest.fixture(scope="module")
def plain_vllm(fixture_prompts):
    """vLLM's own plain greedy decoding of the prompts."""
    target, _, prompts, answers, _ = fixture_prompts
    outputs, _, _ = run_vllm(target.name_or_path, prompts, None)
    return outputs


def check(name, fixture_prompts, plain_vllm, spec: dict, *, checkpoint: Path | None, model=None,
          max_num_seqs=None, triton_interpreter: bool = False, max_tokens: int = MAX_TOKENS,
          our_method: str | None = None):
    """Run vLLM on `spec` (its "model" the export) and draftsmith on the same config with "model" the training
    `checkpoint` the export came from (None for model-free methods), and "method" `our_method` where draftsmith
    names the method otherwise (vLLM's "mtp" reads Gemma 4's assistant, draftsmith's "gemma4_mtp"); assert loading,
    outputs and counters; record a matrix row. `plain_vllm` is vLLM's plain decoding on the same runner
    (`triton_interpreter`: the V2 runner, vllm_job.use_triton_interpreter). Returns vLLM's counters, draftsmith's,
    and vLLM's log lines."""
    target, _, prompts, answers, eos = fixture_prompts
    started = time.time()
    outputs, counters, lines = run_vllm(target.name_or_path, prompts, spec if model is None else None,
                                        max_tokens=max_tokens, model=model, max_num_seqs=max_num_seqs,
                                        triton_interpreter=triton_interpreter)
    seconds = time.time() - started
    ours_spec = spec if checkpoint is None else {**spec, "model": str(checkpoint)}
    if our_method is not None:
        ours_spec = {**ours_spec, "method": our_method}
    ours, our_counters = draftsmith_run(target, prompts, ours_spec, eos, max_tokens)
    problems = load_problems(lines, drafter=checkpoint is not None)
    COUNTED[name] = ({k: counters.get(k) for k in COUNTERS}, our_counters)
    row = {"format or method": name, "loads": not problems, "outputs equal": outputs == plain_vllm == ours,
           "counters equal": {k: counters.get(k) for k in COUNTERS} == our_counters,
           "vLLM tau": round(tau(counters), 3), "draftsmith tau": round(tau(our_counters), 3),
           "CPU seconds": round(seconds, 1)}
    MATRIX.append(row)
    print(json.dumps(row))
    assert not problems, problems
    assert plain_vllm == answers  # vLLM's plain decoding is draftsmith's plain decoding, float32
    assert outputs == plain_vllm, "vLLM's speculative outputs differ from its plain decoding"
    assert ours == plain_vllm, "draftsmith's outputs differ from vLLM's plain decoding"
    assert {k: counters.get(k) for k in COUNTERS} == our_counters, (
        "vLLM's spec-decode counters differ from draftsmith's run of the training checkpoint")
    assert counters["num_accepted_tokens"] > 0, "the drafter accepted nothing in vLLM: the check would be empty"
    return counters, our_counters, lines


def test_the_load_check_needs_the_line_that_shows_the_drafter_loaded():
    """A log that says nothing about the drafter's weights once passed: only problem lines were searched for."""
    target_loaded = "INFO [default_loader.py:501] Loading weights took 0.05 seconds"
    drafter_starts = "INFO [cpu_model_runner.py:75] Loading drafter model..."
    drafter_loaded = "INFO [default_loader.py:501] Loading weights took 0.01 seconds"
    assert load_problems([target_loaded, drafter_starts, drafter_loaded], drafter=True) == []
    assert load_problems([target_loaded, drafter_starts], drafter=True)  # the target's line does not count
    assert load_problems([target_loaded], drafter=True)
    assert load_problems([], drafter=True)
    assert load_problems([target_loaded], drafter=False) == []  # n-gram, suffix: no drafter to load
    assert load_problems([target_loaded, drafter_starts, drafter_loaded,
                          "WARNING Some weights were not initialized: fc.weight"], drafter=True)
    # the V2 runner (DSpark's): the target's and then the drafter's load after its one "from scratch" line
    v2 = "INFO [cpu_worker.py:162] Using V2 Model Runner"
    v2_starts = "INFO [model_runner.py:392] Loading model from scratch..."
    assert load_problems([v2, v2_starts, target_loaded, drafter_loaded], drafter=True) == []
    assert load_problems([v2, v2_starts, target_loaded], drafter=True)  # the target's line alone
    assert load_problems([v2, target_loaded, drafter_loaded], drafter=True)  # loads before the runner's start


def test_eagle3_native_layout(fixture_prompts, plain_vllm, accepting_drafter, tmp_path):
    from draftsmith.models.eagle3.export import export_native_eagle3

    checkpoint = accepting_drafter("eagle3")
    export_native_eagle3(checkpoint, tmp_path / "native", dtype=None)
    check("eagle3, native (--format sglang)", fixture_prompts, plain_vllm,
          {"method": "eagle3", "model": str(tmp_path / "native"), "num_speculative_tokens": 3}, checkpoint=checkpoint)


def test_eagle3_speculators_layout_with_the_eagle31_norms(fixture_prompts, plain_vllm, accepting_drafter, tmp_path):
    """`vllm serve DIR` of the speculators layout: vLLM finds the target and k in its config, and computes the
    norm_before_fc / norm_before_residual / norm_output variants as draftsmith trained them."""
    from draftsmith.models.eagle3.speculators import export_speculators

    checkpoint = accepting_drafter("eagle3_norms")
    export_speculators(checkpoint, tmp_path / "speculators", dtype=None)
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert config["norm_before_fc"] and config["norm_before_residual"] and config["norm_output"]
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    check("eagle3, speculators layout (EAGLE 3.1 norms)", fixture_prompts, plain_vllm,
          {"method": "eagle3", "model": str(tmp_path / "speculators"), "num_speculative_tokens": k},
          checkpoint=checkpoint, model=str(tmp_path / "speculators"))


def test_dflash(fixture_prompts, plain_vllm, accepting_drafter, tmp_path):
    from draftsmith.models.dflash.export import export_dflash

    checkpoint = accepting_drafter("dflash")
    export_dflash(checkpoint, tmp_path / "dflash", dtype=None)
    check("dflash", fixture_prompts, plain_vllm,
          {"method": "dflash", "model": str(tmp_path / "dflash"), "num_speculative_tokens": 3}, checkpoint=checkpoint)


def test_ngram(fixture_prompts, plain_vllm):
    check("ngram", fixture_prompts, plain_vllm,
          {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
          checkpoint=None)


def test_mtp_on_a_target_without_native_mtp_weights_is_refused_by_vllm(fixture_prompts, accepting_drafter,
                                                                       tmp_path):
    """vLLM serves MTP only from a target's own MTP layers (DeepSeek-V3, GLM, Qwen3-Next): a dense Llama target
    has none, so draftsmith's MTP drafter for it runs in draftsmith's runtime only. The test records vLLM's
    refusal, so a vLLM that starts accepting it is noticed."""
    from draftsmith.models.mtp.export import export_mtp

    target, _, prompts, _, _ = fixture_prompts
    export_mtp(accepting_drafter("mtp"), tmp_path / "mtp", dtype=None)
    with pytest.raises(VllmError) as refused:
        run_vllm(target.name_or_path, prompts[:1],
                 {"method": "mtp", "model": str(tmp_path / "mtp"), "num_speculative_tokens": 3})
    MATRIX.append({"format or method": "mtp (dense Llama target)", "loads": False,
                   "refused by vLLM": str(refused.value)[:300]})
    print(json.dumps(MATRIX[-1]))


def test_mtp_native_deepseek_v3_layout(fixture_prompts, tmp_path):
    """MTP as vLLM serves it: a DeepSeek-V3 target (tiny, MLA + MoE) with one native MTP layer; draftsmith
    fine-tunes that layer (init_from_native) on the target's own answers and exports the native layout, which vLLM
    loads as `speculative_config.model` in place of the shipped layer. vLLM's CPU backend runs MLA only in
    bfloat16 (its AMX kernels), and draftsmith's runtime runs no MTP drafter over an MLA target, so this test
    asserts the load, vLLM's lossless outputs (against its own plain bf16 decoding) and that the drafter accepts;
    there are no draftsmith counters to compare."""
    import json as json_module

    from mla_target import write_deepseek_target

    from draftsmith.config import recipe_from_dict
    from draftsmith.models.mtp.export import export_mtp
    from draftsmith.train import train

    fixture_target, tokenizer, prompts, _, _ = fixture_prompts
    folder = write_deepseek_target(tmp_path / "deepseek-v3-tiny", Path(fixture_target.name_or_path))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # the trunk only
    eos = [model.config.eos_token_id]
    # the target's own greedy answers (transformers; draftsmith's runtime runs no MTP drafter over MLA)
    with torch.no_grad():
        answers = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                   for p in prompts]
    data = tmp_path / "own_answers.jsonl"
    with data.open("w") as f:
        for _ in range(8):
            for prompt, answer in zip(prompts, answers):
                f.write(json_module.dumps({"conversations": [
                    {"role": "user", "content": tokenizer.decode(prompt, skip_special_tokens=True).strip()},
                    {"role": "assistant", "content": tokenizer.decode([t for t in answer if t not in eos])}]}) + "\n")
    recipe = {"model": {"target": str(folder), "method": "mtp", "dtype": "float32"},
              "mtp": {"num_modules": 1, "num_depths": 1, "init_from_native": True},
              "data": {"path": str(data), "max_length": 512, "eval_samples": 0, "cache_dir": str(tmp_path / "c")},
              "training": {"max_steps": 40, "batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.05, "log_every": 1000,
                           "eval_every": 100000, "save_every": 100000, "mixed_precision": "no", "seed": 0},
              "output_dir": str(tmp_path / "run")}
    train(recipe_from_dict(recipe), log=lambda *a: None)
    export_mtp(tmp_path / "run", tmp_path / "mtp")  # bfloat16, the default

    plain, _, _ = run_vllm(str(folder), prompts, None, dtype="bfloat16")
    started = time.time()
    spec = {"method": "mtp", "model": str(tmp_path / "mtp"), "num_speculative_tokens": 1}
    outputs, counters, lines = run_vllm(str(folder), prompts, spec, dtype="bfloat16")
    seconds = time.time() - started
    problems = load_problems(lines, drafter=True)
    MATRIX.append({"format or method": "mtp, native DeepSeek-V3 layout (bf16)", "loads": not problems,
                   "outputs equal": outputs == plain, "counters equal":
                   "n/a (draftsmith's runtime runs no MTP drafter over MLA)",
                   "vLLM tau": round(tau(counters), 3), "CPU seconds": round(seconds, 1)})
    print(json.dumps(MATRIX[-1]))
    assert not problems, problems
    assert outputs == plain, "vLLM's MTP outputs differ from its plain decoding"
    assert counters["num_accepted_tokens"] > 0, "the MTP drafter accepted nothing in vLLM"


def test_negative_control_an_export_with_wrong_aux_ids_fails_the_check(fixture_prompts, plain_vllm,
                                                                     accepting_drafter, tmp_path):
    """An export that writes SGLang's output-convention aux ids under vLLM's capture key (the off-by-one this field
    is known for) still loads in vLLM and stays lossless, but vLLM drafts from other target layers. draftsmith's
    runtime run on that same export drafts from the same wrong layers and agrees with vLLM counter for counter:
    that is why check() runs draftsmith from the training checkpoint, and here it must fail on the counters.
    (On this 8-layer target neighbouring residual states are close: shifting every id by one layer the other way,
    [2, 4, 5] -> [3, 5, 6], changes no draft of this drafter, so the control first checks that its slip does.)"""
    from draftsmith.models.eagle3.export import export_native_eagle3

    target, _, prompts, _, eos = fixture_prompts
    checkpoint = accepting_drafter("eagle3")
    export_native_eagle3(checkpoint, tmp_path / "right", dtype=None)
    wrong = tmp_path / "wrong"
    shutil.copytree(tmp_path / "right", wrong)
    config = json.loads((wrong / "config.json").read_text())
    output_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # [1, 3, 4]; capture ids [2, 4, 5]
    config["eagle_aux_hidden_state_layer_ids"] = output_ids
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in output_ids]
    (wrong / "config.json").write_text(json.dumps(config))
    spec = {"method": "eagle3", "model": str(wrong), "num_speculative_tokens": 3}
    _, on_the_export = draftsmith_run(target, prompts, spec, eos)
    _, on_the_checkpoint = draftsmith_run(target, prompts, {**spec, "model": str(checkpoint)}, eos)
    assert on_the_export != on_the_checkpoint, "the wrong ids change no draft: this control would prove nothing"

    name = "negative control: eagle3 export with SGLang's aux ids under vLLM's key"
    with pytest.raises(AssertionError, match="counters differ from draftsmith's run of the training checkpoint"):
        check(name, fixture_prompts, plain_vllm, spec, checkpoint=checkpoint)
    assert COUNTED[name][0] == on_the_export  # what the check once compared: it passed
    MATRIX[-1]["check fails, as it must"] = True


def test_suffix(fixture_prompts, plain_vllm):
    """Suffix decoding (vLLM runs ArcticInference's trees: `make interop` installs arctic-inference; missing, this
    fails). Its global tree learns from earlier answers, so vLLM serves the prompts one at a time, as draftsmith
    does here: then both see the same earlier answers at every step, and the counters must agree exactly."""
    import arctic_inference  # noqa: F401

    check("suffix", fixture_prompts, plain_vllm, {"method": "suffix", "num_speculative_tokens": 6}, checkpoint=None,
          max_num_seqs=1)


def test_suffix_trees_draft_what_arcticinference_drafts():
    """draftsmith's suffix trie against ArcticInference's C++ tree (the one vLLM calls) on random sequences with
    few distinct tokens, so counts tie often: the same draft tokens and score for every context, also after a
    sequence is removed (the global tree's eviction)."""
    import random

    from arctic_inference.suffix_decoding._C import SuffixTree

    from draftsmith.inference.suffix import SPEC_FACTOR_EPS, SuffixTrie, path_score, speculate_path

    rng = random.Random(0)
    drafted = 0
    for _ in range(1500):
        depth, vocab = rng.choice([3, 4, 8, 24]), rng.choice([2, 3, 5, 10])
        theirs, ours = SuffixTree(depth), SuffixTrie(depth)
        sequences = [[rng.randrange(vocab) for _ in range(rng.randint(1, 80))] for _ in range(rng.randint(1, 4))]
        for seq_id, tokens in enumerate(sequences):
            theirs.extend(seq_id, tokens)
            ours.extend(seq_id, tokens)
        if len(sequences) > 1:
            gone = rng.randrange(len(sequences))
            theirs.remove(gone)
            ours.remove(gone)
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))][-depth:]
        k, factor, min_prob = rng.choice([1, 3, 6, 12]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.3])
        expected = theirs.speculate(context, k, factor, 0.0, min_prob, False)
        best = (0.0, [])
        for m in range(1, len(context)):  # SuffixProposer.draft's loop, on one trie
            node = ours.match(context[-m:])
            if node is None:
                break
            tokens, ratios = speculate_path(node, min(k, int(m * factor + SPEC_FACTOR_EPS)), min_prob)
            if tokens and path_score(ratios) >= best[0]:
                best = (path_score(ratios), tokens)
        assert (best[1], best[0]) == (list(expected.token_ids), expected.score), (sequences, context)
        drafted += bool(best[1])
    assert drafted > 1000  # most contexts draft something: the comparison is not of empty drafts
