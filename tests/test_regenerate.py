"""`draftsmith regenerate`: every record lands in exactly one output, turns are answered against the target's own
earlier turns, requests are retried, reruns resume, through a real HTTP server on 127.0.0.1 and the runtime."""

from __future__ import annotations

import argparse
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from draftsmith.cli import main as cli_main
from draftsmith.data.regenerate import (RegenerateError, RuntimeBackend, ServerBackend, add_regenerate_args,
                                       made_from, regenerate)

RECORDS = [
    {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "old x"},
                       {"from": "human", "value": "b"}, {"from": "gpt", "value": "old y"}]},
    {"conversations": [{"from": "human", "value": "FLAKY"}, {"from": "gpt", "value": "old"}]},
    {"conversations": [{"from": "human", "value": "ALWAYS_FAIL"}, {"from": "gpt", "value": "old"}]},
    {"conversations": "not a list"},
    {"conversations": [{"from": "human", "value": "only a question"}]},
    {"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "c"},
                       {"role": "assistant", "content": "old z"}]},
]


class ChatServer:
    """An OpenAI-compatible chat endpoint: answers "reply N to Q" (N = assistant turns it was shown), fails
    FLAKY's first request with 503 and ALWAYS_FAIL's always with 500, sends the broken reply of BROKEN to a question
    naming one (always, or to the first request only for "<name> ONCE"), and records every request.
    `models_reply` replaces the body of /v1/models."""

    def __init__(self, models_reply: bytes | None = None):
        self.requests: list[list[dict]] = []
        self.seen = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, code, raw, length=None):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw) if length is None else length))
                self.end_headers()
                self.wfile.write(raw)

            def reply(self, code, body):
                self.send(code, json.dumps(body).encode())

            def do_GET(self):
                if self.path == "/v1/models" and models_reply is not None:
                    return self.send(200, models_reply)
                self.reply(200, {"data": [{"id": "fixture-model"}]} if self.path == "/v1/models" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                messages = body["messages"]
                server.requests.append(messages)
                question = messages[-1]["content"]
                server.seen[question] += 1
                if question == "ALWAYS_FAIL" or (question == "FLAKY" and server.seen[question] == 1):
                    return self.reply(500 if question == "ALWAYS_FAIL" else 503, {"error": "busy"})
                broken = question.removesuffix(" ONCE")
                if broken in BROKEN and (broken == question or server.seen[question] == 1):
                    return self.send(200, *BROKEN[broken])
                n = sum(m["role"] == "assistant" for m in messages)
                self.reply(200, {"choices": [{"message": {"role": "assistant",
                                                          "content": f"reply {n} to {question}"}}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def _choice(message: dict, finish_reason: str) -> tuple[bytes]:
    return (json.dumps({"choices": [{"message": {"role": "assistant", **message},
                                     "finish_reason": finish_reason}]}).encode(),)


BROKEN = {  # question -> (the 200 reply's body, its Content-Length when it lies)
    "NOT_JSON": (b"<html><body>502 Bad Gateway</body></html>",),
    "CUT_SHORT": (b'{"choices": [{"mess', 400),
    "NO_FIELDS": (b'{"object": "chat.completion"}',),
    "NULL_CONTENT": _choice({"content": None, "tool_calls": [{"id": "c1", "type": "function"}]}, "tool_calls"),
    "EMPTY_CONTENT": _choice({"content": ""}, "stop"),
}


@pytest.fixture
def server():
    s = ChatServer()
    yield s
    s.close()


def write_records(path):
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def outputs(folder):
    return {name: [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
            for name in ("regenerated", "errors", "skipped")}


def test_every_record_lands_once_and_turns_build_on_the_targets_own(server, tmp_path):
    data = write_records(tmp_path / "in.jsonl")
    lines = []
    backend = ServerBackend(server.url, None, 64, 0.0, retries=2, backoff=0.01, concurrency=3)
    counts = regenerate(str(data), tmp_path / "out", backend, log=lines.append)
    assert counts == {"records": 6, "regenerated": 3, "errors": 1, "skipped": 2}
    assert "adds up" in lines[-1]
    out = outputs(tmp_path / "out")
    by_index = {r["index"]: r["conversations"] for r in out["regenerated"]}
    assert sorted(by_index) == [0, 1, 5]
    assert [m["content"] for m in by_index[0]] == ["a", "reply 0 to a", "b", "reply 1 to b"]
    assert by_index[1][-1]["content"] == "reply 0 to FLAKY" and server.seen["FLAKY"] == 2  # retried after a 503
    assert by_index[5][0] == {"role": "system", "content": "be brief"}
    second_turn = next(r for r in server.requests if r[-1]["content"] == "b")
    assert second_turn[1] == {"role": "assistant", "content": "reply 0 to a"}  # not the dataset's "old x"
    assert out["errors"] == [{"index": 2, "error": out["errors"][0]["error"]}]
    assert "HTTP 500" in out["errors"][0]["error"] and server.seen["ALWAYS_FAIL"] == 3  # 1 + 2 retries
    assert sorted((r["index"], r["reason"]) for r in out["skipped"])[1] == (4, "no assistant turn")
    from draftsmith.data.conversations import load_conversations

    trainable, _ = load_conversations(str(tmp_path / "out" / "regenerated.jsonl"))  # what data.path reads
    assert len(trainable) == 3


def test_a_rerun_resumes_and_redoes_only_what_is_missing(server, tmp_path):
    data = write_records(tmp_path / "in.jsonl")
    folder = tmp_path / "out"
    backend = ServerBackend(server.url, "fixture-model", 64, 0.0, retries=0, backoff=0.01)
    regenerate(str(data), folder, backend, log=lambda *a: None)
    asked = len(server.requests)
    assert regenerate(str(data), folder, backend, log=lambda *a: None)["records"] == 6
    assert len(server.requests) == asked  # nothing asked again
    path = folder / "regenerated.jsonl"
    text = path.read_text()
    path.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 1] + text.splitlines()[-1][:15])  # killed mid-line
    lost = json.loads(text.splitlines()[-1])["index"]
    counts = regenerate(str(data), folder, backend, log=lambda *a: None)
    assert counts["regenerated"] + counts["errors"] + counts["skipped"] == 6
    assert sorted(r["index"] for r in outputs(folder)["regenerated"]).count(lost) == 1
    assert len(server.requests) > asked


def test_an_unreachable_server_is_one_line_and_exit_2(tmp_path, capsys):
    data = write_records(tmp_path / "in.jsonl")
    code = cli_main(["regenerate", "--data", str(data), "--out", str(tmp_path / "o"), "--server",
                     "http://127.0.0.1:9", "--retries", "0"])
    assert code == 2
    assert "cannot list the models" in capsys.readouterr().err


def test_the_runtime_backend_answers_as_the_target_decodes(tmp_path, fixture_target_dir):
    from draftsmith.inference.generator import SpeculativeGenerator

    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[5]) + "\n")
    backend = RuntimeBackend(str(fixture_target_dir), "float32", 6, 0.0, batch_size=2)
    regenerate(str(data), tmp_path / "out", backend, log=lambda *a: None)
    regenerated = {r["index"]: r["conversations"] for r in outputs(tmp_path / "out")["regenerated"]}
    assert sorted(regenerated) == [0, 1]
    tok = backend.tokenizer
    for conv in regenerated.values():
        for k, message in enumerate(conv):
            if message["role"] != "assistant":
                continue
            ids = tok(tok.apply_chat_template(conv[:k], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"]
            alone = SpeculativeGenerator(backend.target, None, 0).generate(torch.tensor([ids]), 6, backend.eos)
            want = tok.decode([t for t in alone.token_ids if t not in backend.eos], skip_special_tokens=True)
            assert message["content"] == want and message["content"] != "old x"


def test_a_bad_runtime_target_is_one_line_and_exit_2(tmp_path, capsys):
    data = write_records(tmp_path / "in.jsonl")
    code = cli_main(["regenerate", "--data", str(data), "--out", str(tmp_path / "o"), "--target",
                     str(tmp_path / "no-such-model")])
    assert code == 2
    assert "--target" in (err := capsys.readouterr().err) and "no such folder" in err


def test_max_turns_keeps_the_first_assistant_turns_and_drops_the_rest(server, tmp_path):
    data = write_records(tmp_path / "in.jsonl")
    backend = ServerBackend(server.url, None, 64, 0.0, retries=2, backoff=0.01)
    regenerate(str(data), tmp_path / "out", backend, max_turns=1, log=lambda *a: None)
    by_index = {r["index"]: r["conversations"] for r in outputs(tmp_path / "out")["regenerated"]}
    assert [m["content"] for m in by_index[0]] == ["a", "reply 0 to a"]  # "b" and its answer dropped
    assert not any(r[-1]["content"] == "b" for r in server.requests)  # never asked
    assert [m["content"] for m in by_index[5]] == ["be brief", "c", "reply 0 to c"]


def test_the_runtime_backend_batches_by_length_and_fails_only_the_rows_past_the_context(tmp_path,
                                                                                        fixture_target_dir):
    from draftsmith.inference.generator import SpeculativeGenerator

    records = [{"conversations": [{"from": "human", "value": "word " * n}, {"from": "gpt", "value": "old"}]}
               for n in (40, 1, 4100, 12, 2)]  # index 2 is too long for the 4096-token context with 64 new tokens
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    backend = RuntimeBackend(str(fixture_target_dir), "float32", 64, 0.0, batch_size=2)
    batches = []
    generate_batch = backend.generator.generate_batch
    backend.generator.generate_batch = lambda prompts, *a: batches.append([len(p) for p in prompts]) or \
        generate_batch(prompts, *a)
    counts = regenerate(str(data), tmp_path / "out", backend, log=lambda *a: None)
    assert counts == {"records": 5, "regenerated": 4, "errors": 1, "skipped": 0}
    out = outputs(tmp_path / "out")
    assert out["errors"][0]["index"] == 2 and "exceeds the target's context of 4096" in out["errors"][0]["error"]
    assert [len(b) for b in batches] == [2, 2] and batches[0][-1] <= batches[1][0]  # shortest prompts together
    tok = backend.tokenizer
    for row in out["regenerated"]:  # batched rows decode as each alone
        conv = row["conversations"]
        ids = tok(tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        alone = SpeculativeGenerator(backend.target, None, 0).generate(torch.tensor([ids]), 64, backend.eos)
        assert conv[1]["content"] == tok.decode([t for t in alone.token_ids if t not in backend.eos],
                                                skip_special_tokens=True)


def test_a_rerun_resumes_over_answers_holding_unicode_line_separators(server, tmp_path):
    data = write_records(tmp_path / "in.jsonl")
    folder = tmp_path / "out"
    folder.mkdir()
    done = {"index": 0, "conversations": [{"role": "user", "content": "a"},
                                          {"role": "assistant", "content": "one\u2028two\x85three\u2029"}]}
    (folder / "regenerated.jsonl").write_text(json.dumps(done, ensure_ascii=False) + "\n", encoding="utf-8")
    backend = ServerBackend(server.url, "fixture-model", 64, 0.0, retries=2, backoff=0.01)
    (folder / "regenerate.json").write_text(json.dumps(made_from(str(data), backend, "auto", "train", None, None)))
    counts = regenerate(str(data), folder, backend, log=lambda *a: None)
    assert counts == {"records": 6, "regenerated": 3, "errors": 1, "skipped": 2}
    assert not any(r[-1]["content"] == "a" for r in server.requests)  # record 0 was not asked again


def asked(*questions):
    """Records of one question each, answered once."""
    return [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "old"}]} for q in questions]


def test_a_broken_reply_is_that_records_error_retried_and_the_job_goes_on(server, tmp_path):
    data = tmp_path / "in.jsonl"
    questions = ["NOT_JSON", "CUT_SHORT", "NO_FIELDS", "NOT_JSON ONCE", "CUT_SHORT ONCE", "NO_FIELDS ONCE", "fine"]
    data.write_text("".join(json.dumps(r) + "\n" for r in asked(*questions)))
    lines = []
    backend = ServerBackend(server.url, None, 64, 0.0, retries=1, backoff=0.01, concurrency=3)
    counts = regenerate(str(data), tmp_path / "out", backend, log=lines.append)
    assert counts == {"records": 7, "regenerated": 4, "errors": 3, "skipped": 0}  # the window in flight kept
    assert "adds up" in lines[-1]
    out = outputs(tmp_path / "out")
    errors = {r["index"]: r["error"] for r in out["errors"]}
    url = f"{server.url}/v1/chat/completions"
    assert errors[0].startswith(url) and "not JSON" in errors[0] and "502 Bad Gateway" in errors[0]
    assert errors[1].startswith(url) and "cut short" in errors[1]
    assert errors[2].startswith(url) and "choices[0].message" in errors[2]
    assert all(server.seen[q] == 2 for q in questions[:6])  # retried like a 5xx
    regenerated = {r["index"]: r["conversations"][-1]["content"] for r in out["regenerated"]}
    assert regenerated == {3: "reply 0 to NOT_JSON ONCE", 4: "reply 0 to CUT_SHORT ONCE",
                           5: "reply 0 to NO_FIELDS ONCE", 6: "reply 0 to fine"}


def test_an_answer_without_text_is_that_records_error(server, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in asked("NULL_CONTENT", "EMPTY_CONTENT", "fine")))
    lines = []
    backend = ServerBackend(server.url, None, 64, 0.0, retries=2, backoff=0.01)
    counts = regenerate(str(data), tmp_path / "out", backend, log=lines.append)
    assert counts == {"records": 3, "regenerated": 1, "errors": 2, "skipped": 0} and "adds up" in lines[-1]
    errors = {r["index"]: r["error"] for r in outputs(tmp_path / "out")["errors"]}
    assert "no text" in errors[0] and "tool call" in errors[0]
    assert "no text" in errors[1] and "'stop'" in errors[1]
    assert server.seen["NULL_CONTENT"] == 1  # a well-formed answer: asking again gives the same one


@pytest.mark.parametrize("flag, value", [("--retries", "-1"), ("--timeout", "0"), ("--timeout", "nan")])
def test_a_bad_server_flag_is_one_line_naming_it(server, tmp_path, capsys, flag, value):
    data = write_records(tmp_path / "in.jsonl")
    code = cli_main(["regenerate", "--data", str(data), "--out", str(tmp_path / "o"), "--server", server.url,
                     flag, value])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{flag} must be" in err
    assert not (tmp_path / "o").exists() and not server.requests


def test_a_models_list_that_is_not_json_is_one_line_naming_the_url(tmp_path, capsys):
    server = ChatServer(models_reply=b"<html>not found</html>")
    try:
        data = write_records(tmp_path / "in.jsonl")
        code = cli_main(["regenerate", "--data", str(data), "--out", str(tmp_path / "o"), "--server", server.url,
                         "--retries", "0"])
    finally:
        server.close()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"{server.url}/v1/models" in err and "not JSON" in err


def test_an_out_folder_resumes_only_from_what_it_was_made_from(server, tmp_path, capsys):
    data = write_records(tmp_path / "in.jsonl")
    folder = tmp_path / "out"
    backend = ServerBackend(server.url, None, 64, 0.0, retries=0, backoff=0.01)
    regenerate(str(data), folder, backend, log=lambda *a: None)
    written = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert json.loads(written["regenerate.json"])["max_turns"] is None
    asked_before = len(server.requests)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in reversed(RECORDS)))
    for flag, rerun in [
        ("--data", lambda: regenerate(str(other), folder, backend)),
        ("--max-turns", lambda: regenerate(str(data), folder, backend, max_turns=1)),
        ("--max-new-tokens", lambda: regenerate(str(data), folder, ServerBackend(server.url, None, 32, 0.0))),
        ("--temperature", lambda: regenerate(str(data), folder, ServerBackend(server.url, None, 64, 0.7))),
        ("--format", lambda: regenerate(str(data), folder, backend, format="jsonl")),
    ]:
        with pytest.raises(RegenerateError, match=f"{folder}: .*{flag} .* there, .* now") as refused:
            rerun()
        assert "\n" not in str(refused.value)
    capsys.readouterr()
    code = cli_main(["regenerate", "--data", str(data), "--out", str(folder), "--server", server.url,
                     "--max-turns", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--max-turns null there, 2 now" in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == written and len(server.requests) == asked_before
    same = tmp_path / "same.jsonl"
    same.write_bytes(data.read_bytes())  # the same input under another name resumes
    assert regenerate(str(same), folder, backend, log=lambda *a: None)["records"] == 6
    assert len(server.requests) == asked_before


def test_an_out_folder_with_records_but_no_record_of_its_input_is_refused(server, tmp_path):
    data = write_records(tmp_path / "in.jsonl")
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "skipped.jsonl").write_text(json.dumps({"index": 3, "where": "x", "reason": "y"}) + "\n")
    with pytest.raises(RegenerateError, match="no regenerate.json"):
        regenerate(str(data), folder, ServerBackend(server.url, None, 64, 0.0), log=lambda *a: None)
    assert not server.requests and sorted(p.name for p in folder.iterdir()) == ["skipped.jsonl"]


def test_every_regenerate_flag_has_help():
    parser = argparse.ArgumentParser()
    add_regenerate_args(parser)
    assert [a.option_strings for a in parser._actions if not a.help] == []
