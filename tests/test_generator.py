"""SpeculativeGenerator: lossless against plain greedy, exact bookkeeping with a scripted proposer, and the
eval / CLI glue on the fixture target."""

import json

import pytest
import torch

from draftsmith.inference.eval import format_table, load_prompts, run_eval, write_eval_json
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.target import TargetModel
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, Proposal

AUX = (1, 3)


class ScriptedProposer:
    """Drafts the known greedy continuation, with a scripted defect per step:
    ("wrong", i) corrupts draft i; ("short", m) drafts only m tokens (PAD after); None drafts all correctly."""

    aux_layer_ids = AUX

    def __init__(self, reference, script, vocab_size):
        self.reference, self.script, self.vocab_size = reference, list(script), vocab_size
        self.requests, self.extended_tokens, self.extended_aux, self.expected_accepts = [], [], [], []

    def begin(self, prompt_ids, sampler=None):
        self.context, self.paired = prompt_ids[0].tolist(), 0

    def extend(self, token_ids, aux_hidden):
        self.context = self.context[: self.paired + 1] + token_ids[0].tolist()
        self.paired += token_ids.shape[1]
        self.extended_tokens += token_ids[0].tolist()
        self.extended_aux.append(aux_hidden)

    def propose(self, num_tokens):
        self.requests.append(num_tokens)
        n = len(self.context)
        drafts = (self.reference[n : n + num_tokens] + [0] * num_tokens)[:num_tokens]
        defect = self.script.pop(0) if self.script else None
        length, accepted = num_tokens, num_tokens
        if defect and defect[0] == "wrong" and defect[1] < num_tokens:
            drafts[defect[1]] = (drafts[defect[1]] + 1) % self.vocab_size
            accepted = defect[1]
        if defect and defect[0] == "short":
            length = accepted = min(defect[1], num_tokens)
            drafts[length:] = [PAD_DRAFT_TOKEN] * (num_tokens - length)
        self.expected_accepts.append(accepted)
        return Proposal(torch.tensor([drafts]), torch.tensor([length]))


@pytest.fixture
def tiny_target(tiny_llama):
    model, _ = tiny_llama()
    return TargetModel(model.float().eval())


def full_recompute_greedy(model, prompt, n):
    """The slow reference: no cache, argmax of a full forward per token."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, prompt.shape[1]:].tolist()


def test_plain_greedy_matches_full_recompute(tiny_target):
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    result = SpeculativeGenerator(tiny_target, None, 4).generate(prompt, 20)
    assert result.token_ids == full_recompute_greedy(tiny_target.model, prompt, 20)
    assert result.num_target_steps == 20 and result.metrics.num_drafts == 0


def test_scripted_drafts_are_verified_exactly(tiny_target):
    """Counting as vLLM does: every step asks for k drafts, the last one too, and the drafts it accepts past
    max_new_tokens are counted (the reference runs on past the end, so the last step's drafts are right)."""
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    max_new, k = 23, 4
    plain = SpeculativeGenerator(tiny_target, None, 0).generate(prompt, max_new + k).token_ids
    reference = prompt[0].tolist() + plain
    script = [None, ("wrong", 0), ("wrong", 2), ("short", 1), ("short", 0), None, ("wrong", 3), None]
    proposer = ScriptedProposer(reference, script, vocab_size=256)
    result = SpeculativeGenerator(tiny_target, proposer, k).generate(prompt, max_new)

    assert result.token_ids == plain[:max_new]
    accepts = proposer.expected_accepts
    assert proposer.requests == [k] * len(accepts)  # never fewer near the end
    # Each step commits accepted + 1 tokens, the last one as many as fit; 1 + 4+1 + 0+1 + 2+1 + 1+1 + 0+1 + 4+1 +
    # 3+1 = 22 after the 7th step, so the 8th (None: 4 accepted) passes max_new: 3 of its 4 count past the end.
    assert sum(a + 1 for a in accepts[:-1]) + 1 < max_new <= sum(a + 1 for a in accepts) + 1
    assert result.num_target_steps == 1 + len(accepts)
    assert result.metrics.num_accepted_tokens == sum(accepts) == 18
    assert result.metrics.num_drafts == len(accepts) - 1  # ("short", 0) drafted nothing: not a draft
    assert result.metrics.num_draft_tokens == k * len(accepts) - (k - 1) - k  # ("short", 1) and ("short", 0)


def test_extend_pairs_each_feature_with_the_next_token(tiny_target):
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = SpeculativeGenerator(tiny_target, None, 0).generate(prompt, 15).token_ids
    reference = prompt[0].tolist() + plain
    proposer = ScriptedProposer(reference, [("wrong", 1), None, ("short", 0), ("wrong", 0)], vocab_size=256)
    SpeculativeGenerator(tiny_target, proposer, 3).generate(prompt, 15)

    # token_ids of every extend, concatenated, are the sequence from position 1 on ...
    paired = len(proposer.extended_tokens)
    assert proposer.extended_tokens == reference[1 : paired + 1]
    # ... and aux row j is the target's feature at position j, the one that predicted token j + 1.
    aux = torch.cat(proposer.extended_aux, dim=1)  # (1, paired, 2H)
    expected = tiny_target.capture(torch.tensor([reference[:paired]]), aux_layer_ids=list(AUX)).aux_hidden
    torch.testing.assert_close(aux, expected, atol=1e-5, rtol=1e-5)


def test_eos_inside_an_accepted_block_ends_the_output(tiny_target):
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeGenerator(tiny_target, None, 0).generate(prompt, 30).token_ids
    eos = plain[6]
    stop = plain.index(eos)  # its first occurrence
    proposer = ScriptedProposer(prompt[0].tolist() + plain, [], vocab_size=256)  # perfect drafts, k = 4
    result = SpeculativeGenerator(tiny_target, proposer, 4).generate(prompt, 30, eos_token_ids={eos})
    assert result.token_ids == plain[: stop + 1]
    assert result.token_ids == SpeculativeGenerator(tiny_target, None, 0).generate(prompt, 30, {eos}).token_ids


def test_fixture_ngram_is_lossless_on_mt_bench(fixture_target_dir, mt_bench_path):
    """The must-have: in float32, n-gram speculation changes no token of plain greedy decoding."""
    from transformers import AutoTokenizer

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    prompts = load_prompts(mt_bench_path, tokenizer, limit=3)
    spec = parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                              "prompt_lookup_max": 3}, device_type="cpu")
    plain = SpeculativeGenerator(target, None, 0)
    speculative = SpeculativeGenerator(target, build_proposer(spec, target), spec.num_speculative_tokens)
    total_accepted = 0
    for ids in prompts:
        prompt = torch.tensor([ids])
        expected = plain.generate(prompt, 64, {6, 2})
        got = speculative.generate(prompt, 64, {6, 2})
        assert got.token_ids == expected.token_ids
        m = got.metrics
        assert m.num_drafts > 0 and 0 <= m.num_accepted_tokens <= m.num_draft_tokens <= 4 * m.num_drafts
        per_pos = m.num_accepted_tokens_per_pos
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and sum(per_pos) == m.num_accepted_tokens
        # every accepted draft saves a target step, but those of the last step past max_new_tokens (counted,
        # as vLLM counts them, never output)
        saved = expected.num_target_steps - got.num_target_steps
        assert m.num_accepted_tokens - m.num_spec_tokens <= saved <= m.num_accepted_tokens
        total_accepted += m.num_accepted_tokens
    assert total_accepted > 0  # the fixture repeats itself: prompt lookup must land some tokens


def test_run_eval_table_and_json(fixture_target_dir, mt_bench_path, tmp_path):
    from transformers import AutoTokenizer

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    prompts = load_prompts(mt_bench_path, tokenizer, limit=2)
    assert tokenizer.decode(prompts[0]).startswith("<s><|user|>\nCompose an engaging travel blog post")
    spec = parse_spec_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "cpu")
    result = run_eval(target, tokenizer, prompts, [spec], max_new_tokens=16, progress=False)
    (row,) = result["results"]
    assert row["lossless_mismatches"] == 0 and row["metrics"]["num_spec_tokens"] == 3
    assert result["baseline"]["tokens"] == row["tokens"] and row["speedup"] > 0
    table = format_table(result)
    assert table.splitlines()[0].split()[:3] == ["method", "k", "mean"] and "ngram" in table and "plain" in table
    path = write_eval_json(result, tmp_path / "out" / "eval.json", target, argv=["draftsmith", "eval"])
    saved = json.loads(path.read_text())
    assert saved["command"] == "draftsmith eval" and saved["dtype"] == "float32" and saved["max_new_tokens"] == 16
    assert set(saved["versions"]) == {"torch", "transformers", "draftsmith"}
    assert [p.name for p in path.parent.iterdir()] == ["eval.json"]  # no temporary file left behind


def test_load_prompts_reads_conversation_jsonl(tmp_path, fixture_target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    path = tmp_path / "c.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"hello {i}"}, {"from": "gpt", "value": "hi"}]}
            for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    prompts = load_prompts(path, tokenizer, limit=2)
    assert [tokenizer.decode(p) for p in prompts] == [f"<s><|user|>\nhello {i}<|end|>\n<|assistant|>\n" for i in (0, 1)]


def test_cli_generate_json_and_errors(fixture_target_dir, capsys):
    from draftsmith.cli import main

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    rc = main(["generate", "--target", str(fixture_target_dir), "--speculative-config", spec,
               "--prompt", "Tell me about the ocean.", "--max-new-tokens", "12", "--json", "--device", "cpu",
               "--dtype", "float32"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and 1 <= len(out["token_ids"]) <= 12 and isinstance(out["text"], str)
    assert out["metrics"]["num_spec_tokens"] == 3 and "mean_acceptance_length" in out["metrics"]

    rc = main(["generate", "--target", str(fixture_target_dir), "--speculative-config", '{"method": "ngram"}',
               "--prompt", "x", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "num_speculative_tokens" in err and len(err.strip().splitlines()) == 1

    rc = main(["eval", "--target", str(fixture_target_dir), "--speculative-config", spec,
               "--dataset", "/nonexistent/q.jsonl", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "/nonexistent/q.jsonl" in err and len(err.strip().splitlines()) == 1


def test_cli_version(capsys):
    """`draftsmith --version` prints the package version and exits 0, no command needed (issue 25, item 18a)."""
    import draftsmith
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"draftsmith {draftsmith.__version__}\n"


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_every_generate_and_eval_flag_has_help(command):
    """--max-new-tokens had none (issue 25, item 18d)."""
    from draftsmith.cli import build_parser

    parser = build_parser([command])
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    flags = [a for a in sub.choices[command]._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 8
    assert [a.option_strings[0] for a in flags if not (a.help or "").strip()] == []


def test_every_flag_of_every_command_has_help():
    """Every argument of every `draftsmith` sub-command has help text (argparse.SUPPRESS counts): quickstart's
    --max-new-tokens had none (issue 25, item 18e). Each command's arguments are added only when it is the one
    named, so the parser is built once per command."""
    import argparse

    from draftsmith.cli import COMMANDS, build_parser

    assert {"train", "collect", "export", "import", "push", "generate", "eval", "regenerate", "quickstart"} <= set(
        COMMANDS)
    missing = []
    for command in COMMANDS:
        parser = build_parser([command])
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        actions = [a for a in sub.choices[command]._actions if not isinstance(a, argparse._HelpAction)]
        assert actions, f"{command}: no arguments were added"
        missing += [f"{command} {(a.option_strings or [a.dest])[0]}" for a in actions if not (a.help or "").strip()]
    assert missing == [], f"arguments without help: {missing}"


def test_cli_generate_serves_several_prompts_as_one_batch(fixture_target_dir, capsys):
    """Repeated --prompt: one batch, one JSON line per prompt, each the output that prompt gets alone."""
    from draftsmith.cli import main

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    common = ["generate", "--target", str(fixture_target_dir), "--speculative-config", spec, "--max-new-tokens",
              "10", "--json", "--device", "cpu", "--dtype", "float32"]
    prompts = ["Tell me about the ocean.", "Hi", "Write a very short poem about autumn leaves and wind."]
    alone = []
    for prompt in prompts:
        assert main([*common, "--prompt", prompt]) == 0
        alone.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert main([*common, *[x for p in prompts for x in ("--prompt", p)]]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in rows] == alone and {r["batch_size"] for r in rows} == {3}


def test_cli_compile_flag_reaches_the_target(fixture_target_dir, capsys, monkeypatch):
    """`--compile` builds the target with its decoder layers compiled for graphed steps (DRAFTSMITH_COMPILE=1);
    without it the environment decides, and on the CPU (no graphs) the output is the same either way."""
    from draftsmith.cli import main
    from draftsmith.models.target import TargetModel

    built = []
    real_init = TargetModel.__init__
    monkeypatch.setattr(TargetModel, "__init__",
                        lambda self, *a, **kw: real_init(self, *a, **kw) or built.append(self))
    monkeypatch.delenv("DRAFTSMITH_COMPILE", raising=False)
    outputs = []
    for flags in ([], ["--compile"]):
        rc = main(["generate", "--target", str(fixture_target_dir), "--prompt", "Tell me about the ocean.",
                   "--max-new-tokens", "8", "--json", "--device", "cpu", "--dtype", "float32", *flags])
        assert rc == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert [t._compiled_layer is not None for t in built] == [False, True]
    assert outputs[0] == outputs[1]


def test_host_extend_ids_equal_the_device_ids(tiny_target):
    """A proposer with `extends_on_host` gets extend()'s ids built from the step's host copy: the same ids the
    device tensor holds, finished rows padded alike, so n-gram decodes the same either way."""
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 5 + [12]]
    plain = SpeculativeGenerator(tiny_target, None, 0).generate(torch.tensor([prompts[0]]), 24).token_ids
    eos = {plain[3]}  # row 0 stops early, row 1 (most likely) later: extend pads a finished row
    spec = parse_spec_config({"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                              "num_speculative_tokens": 3}, "cpu")
    seen, outputs = {}, {}
    for on_host in (False, True):
        proposer = build_proposer(spec, tiny_target)
        proposer.extends_on_host = on_host
        calls = seen[on_host] = []
        real_extend = proposer.extend
        proposer.extend = lambda ids, aux, real=real_extend, calls=calls: calls.append(ids.tolist()) or real(ids, aux)
        results = SpeculativeGenerator(tiny_target, proposer, 3).generate_batch(prompts, 24, eos_token_ids=eos)
        outputs[on_host] = [r.token_ids for r in results]
    assert seen[True] == seen[False] and len(seen[True]) > 3
    assert any(PAD_DRAFT_TOKEN in row for call in seen[True] for row in call), "no finished row was padded"
    assert outputs[True] == outputs[False]
