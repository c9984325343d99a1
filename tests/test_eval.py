"""The eval sweep and its report: config expansion, dataset names, the recommendation rule, the vLLM string,
and a tiny end-to-end sweep (random target, ngram + suffix) whose JSON, table and PNGs are checked."""

import json
from pathlib import Path

import pytest
import torch

from draftsmith.inference.eval import EvalError, expand_spec_configs, name_datasets, run_eval, run_sweep, write_eval_json
from draftsmith.inference.report import (
    add_recommendations,
    format_report,
    recommend,
    vllm_speculative_config,
    write_plots,
)
from draftsmith.inference.spec_config import SpecConfigError
from draftsmith.models.target import TargetModel

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def row(method, k, speedup, label=None, **spec):
    spec_config = {"method": method, "num_speculative_tokens": k, **spec}
    return {"method": method, "label": label or method, "num_speculative_tokens": k, "speedup": speedup,
            "tokens_per_second": 100 * speedup, "spec_config": spec_config,
            "metrics": {"mean_acceptance_length": 1 + k / 2}}


def pick(rows, tolerance=0.0):
    rec = recommend({"results": rows}, tie_tolerance=tolerance)
    return rec["method"], rec["num_speculative_tokens"]


def test_recommendation_takes_the_highest_speedup():
    rows = [row("ngram", 3, 1.50), row("eagle3", 5, 1.60, model="/d"), row("eagle3", 7, 1.605, model="/d")]
    assert pick(rows) == ("eagle3", 7)
    assert pick(rows, tolerance=0.01) == ("eagle3", 5)  # 1.60 is within 1% of 1.605: the smaller k wins


def test_recommendation_ties_go_to_the_smaller_k_then_the_order_given():
    assert pick([row("eagle3", 5, 2.0, model="/d"), row("ngram", 3, 2.0)]) == ("ngram", 3)
    assert pick([row("suffix", 3, 2.0), row("ngram", 3, 2.0)]) == ("suffix", 3)


def test_recommendation_is_plain_decoding_when_nothing_is_faster():
    assert pick([row("ngram", 1, 0.9), row("ngram", 3, 0.8)]) == (None, 0)
    assert pick([row("ngram", 1, 1.005)], tolerance=0.01) == (None, 0)  # within noise of plain decoding
    assert pick([row("ngram", 1, 1.005)]) == ("ngram", 1)
    assert pick([row("ngram", 1, float("nan"))]) == (None, 0)  # a config with no timing cannot be chosen
    lines = format_report({"datasets": {"d": {"num_prompts": 2, "baseline": {"tokens_per_second": 10.0}}},
                           "results": [], "max_new_tokens": 4, "temperature": 0.0,
                           "recommendations": {"d": recommend({"results": [row("ngram", 1, 0.5)]})}})
    assert "recommended for d: plain decoding" in lines


def test_recommendation_is_a_config_vllm_can_serve():
    tree = row("eagle3", 8, 2.5, model="/d", dynamic_tree={"depth": 3, "top_k": 2})
    rec = recommend({"results": [row("eagle3", 3, 2.0, model="/d"), tree]})
    assert (rec["method"], rec["num_speculative_tokens"]) == ("eagle3", 3)
    assert rec["draftsmith_only_faster"] == {"label": "eagle3", "num_speculative_tokens": 8, "speedup": 2.5}
    rec = recommend({"results": [row("ngram", 1, 0.9), tree]})
    assert rec["method"] is None and rec["fastest_config"]["speedup"] == 0.9
    text = format_report({
        "datasets": {"d": {"num_prompts": 1, "baseline": {"tokens_per_second": 10.0}}}, "results": [],
        "max_new_tokens": 4, "temperature": 0.0, "recommendations": {"d": rec}})
    assert "reached 0.90x" in text and "not servable by vLLM: eagle3 k=8, 2.50x" in text


def test_vllm_string_puts_method_model_and_k_first():
    rec = recommend({"results": [row("eagle3", 3, 2.0, model="/out/drafter")]})
    expected = '{"method": "eagle3", "model": "/out/drafter", "num_speculative_tokens": 3}'
    assert rec["vllm_speculative_config"] == expected
    assert json.loads(vllm_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_max": 4,
                                               "method": "ngram"})) == {"method": "ngram", "num_speculative_tokens": 2,
                                                                        "prompt_lookup_max": 4}


def test_configs_without_k_are_swept_and_configs_with_k_run_as_given():
    specs = expand_spec_configs(
        ['{"method": "ngram", "prompt_lookup_max": 2}', {"method": "suffix", "num_speculative_tokens": 4},
         {"method": "ngram", "prompt_lookup_max": 2, "num_speculative_tokens": 3}],  # a duplicate of the sweep's
        [1, 3], device_type="cpu")
    assert [(s.method, s.num_speculative_tokens) for s in specs] == [("ngram", 1), ("ngram", 3), ("suffix", 4)]
    assert [s.num_speculative_tokens for s in expand_spec_configs([{"method": "suffix"}], None, "cpu")] == [24]
    # A static tree's node count is its k: it runs as given, not swept.
    tree = {"method": "eagle3", "model": "/d", "speculative_token_tree": "[(0,), (1,), (0, 0)]"}
    assert [s.num_speculative_tokens for s in expand_spec_configs([tree], [1, 5], "cpu")] == [3]


@pytest.mark.parametrize(
    "configs, lengths, message",
    [
        (['{"method": "ngram"}', '{"method": "ngram", "prompt_lookup_maxx": 2}'], [1],
         r"unknown key 'prompt_lookup_maxx' \(did you mean 'prompt_lookup_max'\?\) \[--speculative-config #2\]"),
        (['{"method": "ngram"}'], None, "required .* --num-speculative-tokens"),
        (['{"method": "ngram"}'], [2, 0], "--num-speculative-tokens: need integers >= 1"),
    ],
)
def test_bad_configs_fail_with_one_clear_line(configs, lengths, message):
    with pytest.raises(SpecConfigError, match=message) as err:
        expand_spec_configs(configs, lengths, "cpu")
    assert "\n" not in str(err.value)


def test_dataset_names(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "question.jsonl").write_text("{}\n")
    (tmp_path / "code.jsonl").write_text("{}\n")
    names = name_datasets([str(tmp_path / "a/question.jsonl"), str(tmp_path / "b/question.jsonl"),
                           f"humaneval={tmp_path / 'code.jsonl'}"])
    assert list(names) == ["a/question", "b/question", "humaneval"]
    assert list(name_datasets([str(tmp_path / "code.jsonl")])) == ["code"]
    with pytest.raises(EvalError, match="missing.jsonl: file not found"):
        name_datasets([str(tmp_path / "code.jsonl"), str(tmp_path / "missing.jsonl")])
    with pytest.raises(EvalError, match="name 'x' is taken"):
        name_datasets([f"x={tmp_path / 'code.jsonl'}", f"x={tmp_path / 'a/question.jsonl'}"])


class NoTokenizer:
    eos_token_id = None  # the sweep only asks a tokenizer for its EOS id


def test_tiny_sweep_writes_json_table_and_plots(tiny_llama, tmp_path):
    from matplotlib.image import imread

    from draftsmith.models.model_card import acceptance_table

    model, _ = tiny_llama()
    target = TargetModel(model.float().eval())
    gen = torch.Generator().manual_seed(0)
    # Prompts that repeat themselves, so both proposers find matches.
    prompts = [(torch.randint(3, 256, (5,), generator=gen).tolist() * 3) for _ in range(3)]
    datasets = {"first": prompts[:2], "second": prompts[2:]}
    specs = expand_spec_configs(['{"method": "ngram", "prompt_lookup_max": 2}', '{"method": "suffix"}'],
                                [1, 2], device_type="cpu")
    seen = []  # what a long sweep could save after each config: (rows so far, complete flag)
    sweep = run_sweep(target, NoTokenizer(), datasets, specs, max_new_tokens=10, progress=False,
                      on_progress=lambda partial: seen.append((len(partial["results"]), partial["complete"])))
    assert seen == [(n, False) for n in range(1, 9)] and sweep["complete"] is True
    add_recommendations(sweep, tie_tolerance=0.0)

    assert [(r["dataset"], r["label"], r["num_speculative_tokens"]) for r in sweep["results"]] == [
        (d, m, k) for d in ("first", "second") for m in ("ngram", "suffix") for k in (1, 2)]
    assert all(r["lossless_mismatches"] == 0 for r in sweep["results"])  # greedy, float32: not one token differs
    assert {name: info["num_prompts"] for name, info in sweep["datasets"].items()} == {"first": 2, "second": 1}
    for name, rec in sweep["recommendations"].items():
        rows = [r for r in sweep["results"] if r["dataset"] == name]
        best = max(r["speedup"] for r in rows)
        if best > 1.0:  # the rule at tolerance 0: the fastest config, or plain decoding when none beats it
            assert rec["speedup"] == best and json.loads(rec["vllm_speculative_config"]) == rec["spec_config"]
        else:
            assert rec["method"] is None

    report = format_report(sweep, target="/models/t")
    lines = report.splitlines()
    assert lines[0] == "== first: 2 prompts, 10 new tokens, temperature 0 =="
    assert lines[1].split()[:2] == ["method", "k"]
    starred = [line for line in lines[4:8] if line.split()[0].endswith("*")]  # the 4 config rows of "first"
    assert len(starred) == (0 if sweep["recommendations"]["first"]["method"] is None else 1)
    assert "== second: 1 prompts" in report and report.count("recommended for ") == 2

    path = write_eval_json(sweep, tmp_path / "out" / "eval.json", target, argv=["draftsmith", "eval"])
    saved = json.loads(path.read_text())
    assert saved["recommendations"] == json.loads(json.dumps(sweep["recommendations"]))
    assert saved["command"] == "draftsmith eval" and len(saved["results"]) == 8
    card = acceptance_table(saved)  # the model card still renders the sweep, one row per dataset and k
    assert card is not None and len(card.splitlines()) == 2 + 8 and "| second | 2 |" in card

    plots = write_plots(sweep, tmp_path / "out")
    assert [p.name for p in plots] == ["eval_first.png", "eval_second.png"]
    for p in plots:
        assert p.read_bytes()[:8] == PNG_SIGNATURE
        assert imread(p).shape[:2] == (880, 1210)  # 11 x 8 inches at 110 dpi
    assert sorted(p.name for p in path.parent.iterdir()) == ["eval.json", "eval_first.png", "eval_second.png"]


def test_cli_rejects_a_bad_config_before_loading_anything(tmp_path, capsys, monkeypatch):
    from draftsmith.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the configs were checked")

    monkeypatch.setattr(TargetModel, "from_pretrained", no_loading)
    rc = main(["eval", "--target", str(tmp_path / "no-target"), "--device", "cpu",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
               "--speculative-config", '{"method": "suffix", "suffix_decoding_max_tree_dpth": 4}',
               "--dataset", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "suffix_decoding_max_tree_dpth" in err and "#2" in err
    assert not (tmp_path / "out").exists()


def test_cli_sweep_on_the_fixture(fixture_target_dir, mt_bench_path, tmp_path, capsys):
    from draftsmith.cli import main

    rc = main(["eval", "--target", str(fixture_target_dir), "--device", "cpu", "--dtype", "float32",
               "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}',
               "--num-speculative-tokens", "1", "2",
               "--dataset", f"mt={mt_bench_path}", "--dataset", f"again={mt_bench_path}",
               "--num-prompts", "1", "--max-new-tokens", "8", "--tie-tolerance", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert set(saved["recommendations"]) == {"mt", "again"} and len(saved["results"]) == 4
    assert (tmp_path / "eval.txt").read_text().strip() in out
    assert (tmp_path / "eval_mt.png").read_bytes()[:8] == PNG_SIGNATURE
    for name, rec in saved["recommendations"].items():
        if rec["method"] is not None:  # the exact string to paste into `vllm serve`
            assert f"--speculative-config '{rec['vllm_speculative_config']}'" in out


def test_sampled_eval_reports_temperature_and_skips_the_token_comparison(tiny_llama):
    from draftsmith.inference.eval import format_table, run_eval
    from draftsmith.runtime.sampling import SamplingParams

    model, _ = tiny_llama()
    target = TargetModel(model.float().eval())
    specs = expand_spec_configs([{"method": "suffix", "num_speculative_tokens": 2}], None, "cpu")
    result = run_eval(target, NoTokenizer(), [[5, 6, 7, 5, 6, 7]], specs, max_new_tokens=6, progress=False,
                      sampling=SamplingParams(temperature=1.0, seed=0))
    (r,) = result["results"]
    assert result["temperature"] == 1.0 and result["sampling"]["seed"] == 0
    assert "lossless_mismatches" not in r  # sampled outputs are compared in distribution (test_sampling), not here
    assert format_table(result).splitlines()[-1].split()[-1] == "n/a"


def test_report_explains_outputs_that_differ_from_plain_decoding():
    """Differing greedy outputs are a bug in float32 and rounding in bf16; the report says which, once."""
    def sweep(mismatches):
        r = {**row("eagle3", 3, 1.5), "dataset": "d", "lossless_mismatches": mismatches,
             "metrics": {"mean_acceptance_length": 2.0, "per_position_acceptance": [0.5, 0.3, 0.2]}}
        return {"datasets": {"d": {"num_prompts": 4, "baseline": {"tokens_per_second": 10.0}}}, "results": [r],
                "max_new_tokens": 8, "temperature": 0.0}

    clean = format_report(sweep(0), dtype="bfloat16")
    assert "note:" not in clean and "WARNING" not in clean
    bf16 = format_report(sweep(2), dtype="bfloat16")
    assert "note: 1 config(s) differ from plain decoding in bfloat16" in bf16 and "--dtype float32" in bf16
    assert "WARNING: 1 config(s) changed greedy outputs in float32" in format_report(sweep(2), dtype="float32")


def _hub_cache_repo(cache: Path, repo_id: str, files_from: Path) -> Path:
    """A Hugging Face cache entry for `repo_id` (refs/main -> one snapshot) holding copies of `files_from`."""
    import shutil

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(files_from, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo


@pytest.mark.slow
def test_generate_and_eval_take_hub_ids_for_the_target_and_the_drafter(fixture_target_dir, mt_bench_path, tmp_path):
    """The README's `--target meta-llama/...` used to fail with "no config.json there": Hub ids resolve through
    huggingface_hub as in `train`, here offline from its cache (issue 16, item 13)."""
    import os
    import subprocess
    import sys

    from test_export import make_checkpoint
    from transformers import AutoConfig

    from draftsmith.models.eagle3.config import Eagle3Config

    cache = tmp_path / "hub"
    _hub_cache_repo(cache, "org/chat-19m", fixture_target_dir)
    cfg = Eagle3Config.from_target(AutoConfig.from_pretrained(fixture_target_dir), 512,
                                   target_name_or_path="org/chat-19m")
    ckpt = make_checkpoint(tmp_path / "run", cfg)
    _hub_cache_repo(cache, "org/chat-19m-eagle3", ckpt)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    spec = '{"method": "eagle3", "model": "org/chat-19m-eagle3", "num_speculative_tokens": 2}'
    run = [sys.executable, "-m", "draftsmith.cli"]
    generated = subprocess.run([*run, "generate", "--target", "org/chat-19m", "--device", "cpu", "--prompt", "Hi",
                                "--max-new-tokens", "4", "--speculative-config", spec, "--json"],
                               env=env, capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert json.loads(generated.stdout)["metrics"]["num_drafts"] >= 1
    evaluated = subprocess.run([*run, "eval", "--target", "org/chat-19m", "--device", "cpu", "--dataset",
                                str(mt_bench_path), "--num-prompts", "1", "--max-new-tokens", "4",
                                "--speculative-config", spec, "--out", str(tmp_path / "eval")],
                               env=env, capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    missing = subprocess.run([*run, "generate", "--target", "org/not-cached", "--device", "cpu", "--prompt", "Hi"],
                             env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0, missing.stderr[-2000:]


def test_batched_eval_serves_prompts_together_and_compares_at_the_same_concurrency(tiny_llama, monkeypatch):
    """`eval --batch-size N`: the baseline and each config run N prompts per generate_batch call; outputs stay
    equal to plain decoding, and a batch's wall time counts once."""
    from draftsmith.inference import eval as eval_mod
    from draftsmith.inference.spec_config import parse_spec_config
    from draftsmith.models.target import TargetModel

    model, _ = tiny_llama()
    target = TargetModel(model.eval())
    calls = []
    real = eval_mod.SpeculativeGenerator.generate_batch

    def spy(self, prompts, *args, **kwargs):
        calls.append(len(prompts))
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(eval_mod.SpeculativeGenerator, "generate_batch", spy)

    class Tok:
        eos_token_id = None

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 5, 7, 4)]
    spec = parse_spec_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    result = run_eval(target, Tok(), prompts, [spec], max_new_tokens=12, progress=False, batch_size=2)
    assert result["batch_size"] == 2 and 0 < result["baseline"]["tokens"] <= 5 * 12
    # warm-up batch, then 2 + 2 + the odd prompt alone (generate() is a batch of one), for the baseline and ngram
    assert calls == [2, 2, 2, 1] * 2
    assert result["results"][0]["lossless_mismatches"] == 0


class CodePoints:
    """A tokenizer without chat template whose ids are the text's code points, so a prompt reads back exactly."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_prompt_sets_in_every_common_layout(tmp_path):
    """HumanEval's {"task_id", "prompt"} used to be refused for lacking 'conversations' (issue 25, item 11); MT-bench
    keeps its first turn, and a conversation needs no reply to be a prompt."""
    from draftsmith.inference.eval import load_prompts

    layouts = {
        "humaneval": [{"task_id": "HumanEval/0", "prompt": "def f(x):\n", "entry_point": "f"}],
        "mt_bench": [{"question_id": 81, "turns": ["first turn", "second turn"]}],
        "question": [{"question": "2 + 2?", "answer": "4"}],
        "alpaca": [{"instruction": "Translate.", "input": "bonjour", "output": "hello"},
                   {"instruction": "Say hi.", "input": "", "output": "hi"}],
        "conversation": [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hey"}]},
                         {"conversations": [{"from": "human", "value": "yo"}, {"from": "gpt", "value": "hi"}]}],
        "prompt_messages": [{"prompt": [{"role": "user", "content": "listed"}], "completion": []}],
    }
    read = {name: ["".join(map(chr, ids)) for ids in load_prompts(_jsonl(tmp_path / f"{name}.jsonl", records),
                                                                   CodePoints())]
            for name, records in layouts.items()}
    assert read == {"humaneval": ["def f(x):\n"], "mt_bench": ["first turn"], "question": ["2 + 2?"],
                    "alpaca": ["Translate.\n\nbonjour", "Say hi."], "conversation": ["hey", "yo"],
                    "prompt_messages": ["listed"]}


def test_a_record_that_is_no_prompt_names_its_file_line_and_evals_own_skip_flag(tmp_path):
    """A conversation without a user turn used to end in "no prompts to evaluate", naming neither file nor reason,
    and other bad records pointed at the recipe key data.on_malformed, which eval does not have."""
    from draftsmith.inference.eval import load_prompts

    no_user = {"conversations": [{"from": "gpt", "value": "I speak first"}]}
    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": "fine"}, "", no_user, {"text": "no prompt key"}, "{oops"])
    with pytest.raises(EvalError) as e:
        load_prompts(path, CodePoints())
    assert str(e.value) == (f"{path}:3: conversation has no user turn with text "
                            "(pass --skip-malformed to skip such records)")  # line 2 is blank: lines count from 1
    assert "data.on_malformed" not in str(e.value)

    assert ["".join(map(chr, ids)) for ids in load_prompts(path, CodePoints(), skip_malformed=True)] == ["fine"]
    only_bad = _jsonl(tmp_path / "bad.jsonl", [no_user, {"text": "no prompt key"}])
    with pytest.raises(EvalError, match=r"bad\.jsonl: no prompts \(skipped 1: conversation has no user turn"):
        load_prompts(only_bad, CodePoints(), skip_malformed=True)
    with pytest.raises(EvalError, match=r"bad\.jsonl:2: no prompt: expected a 'prompt', 'question', 'instruction' "
                                        r"or 'turns' key.*\(keys: text\)"):
        load_prompts(_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"text": "x"}]), CodePoints())


def test_cli_eval_names_a_bad_prompt_record_before_loading_the_target(fixture_target_dir, tmp_path, capsys,
                                                                     monkeypatch):
    from draftsmith.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the prompt files were checked")

    monkeypatch.setattr(TargetModel, "from_pretrained", no_loading)
    path = _jsonl(tmp_path / "HumanEval.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\n"}, {"id": 1}])
    rc = main(["eval", "--target", str(fixture_target_dir), "--device", "cpu", "--dataset", f"humaneval={path}",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"{path}:2: no prompt" in err and "--skip-malformed" in err


@pytest.mark.slow
def test_eval_leaves_the_drafters_rows_in_its_checkpoint_and_export_puts_them_in_the_card(
        fixture_target_dir, mt_bench_path, tmp_path, capsys):
    """The README promises an acceptance table in the model card; the exporters read eval.json from the checkpoint,
    but `draftsmith eval` wrote only to --out (issue 25, item 18b). Round trip: eval -> checkpoint -> export."""
    from test_export import make_checkpoint
    from transformers import AutoConfig

    from draftsmith.cli import main
    from draftsmith.models.eagle3.config import Eagle3Config

    cfg = Eagle3Config.from_target(AutoConfig.from_pretrained(fixture_target_dir), 512,
                                   target_name_or_path=str(fixture_target_dir))
    ckpt = make_checkpoint(tmp_path / "run", cfg)  # run/checkpoint-100 plus run/latest
    rc = main(["eval", "--target", str(fixture_target_dir), "--device", "cpu", "--dtype", "float32",
               "--speculative-config", json.dumps({"method": "eagle3", "model": str(tmp_path / "run")}),
               "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 2, "num_speculative_tokens": 2}',
               "--num-speculative-tokens", "1", "2", "--dataset", f"mt={mt_bench_path}", "--num-prompts", "1",
               "--max-new-tokens", "6", "--out", str(tmp_path / "eval")])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"wrote {(ckpt / 'eval.json').resolve()}" in out
    saved = json.loads((ckpt / "eval.json").read_text())
    assert [(r["method"], r["num_speculative_tokens"]) for r in saved["results"]] == [("eagle3", 1), ("eagle3", 2)]
    assert "recommendations" not in saved and saved["num_speculative_tokens"] in (1, 2)
    assert len(json.loads((tmp_path / "eval" / "eval.json").read_text())["results"]) == 3  # --out keeps them all

    rc = main(["export", str(tmp_path / "run"), "--format", "sglang", "--out", str(tmp_path / "export")])
    assert rc == 0, capsys.readouterr().err
    card = (tmp_path / "export" / "README.md").read_text()
    assert "## Acceptance" in card and "| dataset | num_speculative_tokens |" in card
    rows = [line for line in card.splitlines() if line.startswith("| mt |")]
    assert [row.split(" | ")[1] for row in rows] == ["1", "2"]


def test_eval_writes_no_eval_json_into_an_exported_drafter(tmp_path):
    """Only draftsmith training checkpoints get one: an export (config.json with "architectures") or a Hub id's
    cache folder is not ours to write into."""
    from draftsmith.inference.eval import drafter_eval_results, training_checkpoint

    ours = tmp_path / "ckpt"
    exported = tmp_path / "exported"
    for folder, config in ((ours, {"method": "eagle3"}), (exported, {"architectures": ["LlamaForCausalLMEagle3"]})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "model.safetensors").write_bytes(b"")
    assert training_checkpoint(str(ours)) == ours
    assert training_checkpoint(str(exported)) is None and training_checkpoint("org/drafter") is None

    def result_row(model, k, speedup):
        return {**row("eagle3", k, speedup, model=model), "dataset": "d"}

    sweep = {"max_new_tokens": 8, "temperature": 0.0, "datasets": {"d": {}}, "recommendations": {"d": {}},
             "results": [result_row(str(ours), 1, 1.2), result_row(str(exported), 1, 1.5),
                         result_row(str(ours), 3, 1.4), {**row("ngram", 2, 2.0), "dataset": "d"}]}
    assert drafter_eval_results(sweep) == {ours.resolve(): {
        "max_new_tokens": 8, "temperature": 0.0, "datasets": {"d": {}}, "num_speculative_tokens": 3,
        "results": [sweep["results"][0], sweep["results"][2]]}}


def _closed_port() -> int:
    """A local TCP port nothing listens on: connecting to it is refused at once, as an unreachable Hub."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_an_uncached_hub_target_fails_at_once_when_the_hub_cannot_be_reached(tmp_path):
    """Offline, `--target ORG/NAME` spent 92 to 114 s in huggingface_hub's retries before its error (issue 25, item
    18c); now one probe without retries, and one line. huggingface_hub logs every retry ("Retrying in 1s")."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HOME": str(tmp_path / "home")}
    env.pop("HF_HUB_OFFLINE", None)
    failed = subprocess.run([sys.executable, "-m", "draftsmith.cli", "generate", "--target", "org/not-cached",
                             "--device", "cpu", "--prompt", "Hi"], env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2 and "Retrying" not in failed.stderr, failed.stderr[-2000:]
    (line,) = failed.stderr.strip().splitlines()
    assert line.startswith("draftsmith generate: error: --target org/not-cached: not a local folder and not cached "
                           "locally, and the Hugging Face Hub cannot be reached (")
    assert "HF_HUB_OFFLINE=1" in line


def test_an_uncached_hub_drafter_is_probed_once_and_never_downloaded(tmp_path, monkeypatch):
    """The speculative config's `model` takes the same fast path: one HEAD request, no download attempt."""
    import huggingface_hub
    from huggingface_hub import constants

    from draftsmith.models.drafter_config import DrafterLoadError, hub_unreachable, local_folder

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    probes, downloads = [], []
    real_snapshot_download = huggingface_hub.snapshot_download

    def refused(url, **kwargs):
        probes.append(url)
        raise ConnectionError("[Errno 111] Connection refused")

    def snapshot_download(repo_id, **kwargs):
        downloads.append(kwargs.get("local_files_only", False))
        return real_snapshot_download(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", refused)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(DrafterLoadError, match=r"^org/drafter: not a local folder and not cached locally, and "
                                               r"the Hugging Face Hub cannot be reached \(\[Errno 111\] Connection"):
        local_folder("org/drafter")
    assert len(probes) == 1 and probes[0].endswith("/org/drafter/resolve/main/config.json")
    assert downloads == [True]  # the cache was looked at; nothing tried to download

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # offline mode: not even the probe
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in hub_unreachable("org/drafter") and len(probes) == 1
    assert hub_unreachable(str(tmp_path)) is None  # a local folder is never looked up


def test_a_full_disk_during_eval_keeps_the_results(fixture_target_dir, mt_bench_path, tmp_path, capsys,
                                                    monkeypatch):
    """Issue 47 item 12: a full disk was a traceback that lost every result eval had measured. The disk fills after
    the first configuration's eval.json: measuring goes on, the report is printed, the error is one line naming
    the file, and eval.json keeps what was saved before."""
    import errno

    from draftsmith.cli import main
    from draftsmith.models import checkpoint

    real, writes = checkpoint.write_json_atomic, []

    def fills_up(obj, path, *args, **kwargs):
        writes.append(path)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(obj, path, *args, **kwargs)

    import draftsmith.inference.eval as eval_mod

    monkeypatch.setattr(eval_mod, "write_json_atomic", fills_up)
    rc = main(["eval", "--target", str(fixture_target_dir), "--device", "cpu", "--dtype", "float32",
               "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}',
               "--num-speculative-tokens", "1", "2", "--dataset", f"mt={mt_bench_path}",
               "--num-prompts", "1", "--max-new-tokens", "8", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("draftsmith eval: error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in captured.err, captured.err[-2000:]
    assert "disk full" in errors[0] and "the results are in the report printed above" in errors[0]
    rows = [line.split() for line in captured.out.splitlines() if line.startswith("ngram")]
    assert [row[1] for row in rows] == ["1", "2"]  # both configurations measured and reported
    assert len(json.loads((tmp_path / "eval.json").read_text())["results"]) == 1  # saved before the disk filled
