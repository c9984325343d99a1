"""`draftsmith regenerate`: every record lands in exactly one output, turns are answered against the target's own
earlier turns, requests are retried, reruns resume, through a real HTTP server on 127.0.0.1 and the runtime."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from draftsmith.cli import main as cli_main
from draftsmith.data.regenerate import RuntimeBackend, ServerBackend, regenerate

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
    FLAKY's first request with 503 and ALWAYS_FAIL's always with 500, and records every request."""

    def __init__(self):
        self.requests: list[list[dict]] = []
        self.seen = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, body):
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self.reply(200, {"data": [{"id": "fixture-model"}]} if self.path == "/v1/models" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                messages = body["messages"]
                server.requests.append(messages)
                question = messages[-1]["content"]
                server.seen[question] += 1
                if question == "ALWAYS_FAIL" or (question == "FLAKY" and server.seen[question] == 1):
                    return self.reply(500 if question == "ALWAYS_FAIL" else 503, {"error": "busy"})
                n = sum(m["role"] == "assistant" for m in messages)
                self.reply(200, {"choices": [{"message": {"role": "assistant",
                                                          "content": f"reply {n} to {question}"}}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


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
    counts = regenerate(str(data), folder, backend, log=lambda *a: None)
    assert counts == {"records": 6, "regenerated": 3, "errors": 1, "skipped": 2}
    assert not any(r[-1]["content"] == "a" for r in server.requests)  # record 0 was not asked again
