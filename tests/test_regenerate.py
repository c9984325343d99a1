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
