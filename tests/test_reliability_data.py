"""Issue 47, items 8 and 13: hostile replies, damaged outputs and hostile data files are one record's error or one
line, never a traceback or a lost job; a huge training record is cut before it is tokenized.

Item 8 runs `regenerate` against a fake OpenAI server on 127.0.0.1 (port 0, daemon thread, bounded loops, shut down
at the end of each test), as tests/test_regenerate.py does.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from draftsmith.cli import main as cli_main
from draftsmith.data import DataError, load_conversations, mask_from_offsets, render_with_segments
from draftsmith.data import tokenize as tokenize_mod
from draftsmith.data.conversations import iter_prompts
from draftsmith.data.regenerate import RegenerateError, ServerBackend, made_from, regenerate
from draftsmith.data.tokenize import tokenize_conversations

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "targets" / "sharegpt-llama-19m"
DEEP = b"[" * 100_000 + b"]" * 100_000  # valid JSON that json.loads cannot read (RecursionError)
TRICKLE_SECONDS = 0.15  # between two bytes of a trickled reply
TIMEOUT = 0.6  # --timeout of the trickle test: a whole trickled reply takes 10 s or more


def _reply(content: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]}).encode()


class HostileServer:
    """An OpenAI-compatible chat endpoint answering "reply to Q", except for questions naming a hostile reply:
    SURROGATE (valid JSON holding a lone surrogate), DEEP (an array nested 100,000 deep), TRICKLE_BODY (a
    whole, valid reply whose body comes a byte every TRICKLE_SECONDS) and TRICKLE_HEAD (status line and headers
    trickled too). "<name> ONCE" is hostile on its first request only. Every request is counted."""

    def __init__(self):
        self.seen: Counter = Counter()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def send(self, body: bytes, code: int = 200):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def trickle(self, raw: bytes):
                try:
                    for i in range(len(raw)):  # bounded: the reply's own length
                        self.wfile.write(raw[i: i + 1])
                        self.wfile.flush()
                        time.sleep(TRICKLE_SECONDS)
                except OSError:  # the client gave up and closed the connection
                    pass

            def do_GET(self):
                self.send(json.dumps({"data": [{"id": "hostile-model"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                question = body["messages"][-1]["content"]
                with server.lock:
                    server.seen[question] += 1
                    first = server.seen[question] == 1
                name = question.removesuffix(" ONCE")
                hostile = name != question and first or name == question
                answer = _reply(f"reply to {question}")
                if hostile and name == "SURROGATE":
                    return self.send(b'{"choices": [{"message": {"role": "assistant", "content": "x\\ud800y"}}]}')
                if hostile and name == "DEEP":
                    return self.send(DEEP)
                if hostile and name == "TRICKLE_BODY":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    return self.trickle(answer)
                if hostile and name == "TRICKLE_HEAD":
                    head = (f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(answer)}\r\n\r\n").encode()
                    return self.trickle(head + answer)
                self.send(answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    s = HostileServer()
    yield s
    s.close()


def asked(path: Path, *questions: str) -> Path:
    """A JSONL file of records of one question each."""
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q},
                                                          {"from": "gpt", "value": "old"}]}) + "\n"
                            for q in questions))
    return path


def outputs(folder: Path) -> dict[str, list[dict]]:
    """Each output file's rows; reading the bytes as strict UTF-8 checks that every line was written whole."""
    return {name: [json.loads(line) for line in (folder / f"{name}.jsonl").read_bytes().decode("utf-8").splitlines()]
            for name in ("regenerated", "errors", "skipped")}


# --------------------------------------------------------------------------- item 8: regenerate


def test_a_reply_holding_a_lone_surrogate_is_that_records_error_and_the_job_goes_on(server, tmp_path):
    """Before: the answer "x\\ud800y" could not be written as UTF-8, so the job stopped with a traceback and the
    answers in flight were lost; a server that always answered so meant no rerun ever got past that record."""
    data = asked(tmp_path / "in.jsonl", "a", "SURROGATE", "b", "SURROGATE ONCE", "c")
    lines = []
    backend = ServerBackend(server.url, None, 16, 0.0, retries=1, backoff=0.01, concurrency=3)
    counts = regenerate(str(data), tmp_path / "out", backend, log=lines.append)
    assert counts == {"records": 5, "regenerated": 4, "errors": 1, "skipped": 0} and "adds up" in lines[-1]
    out = outputs(tmp_path / "out")
    assert {r["index"]: r["conversations"][-1]["content"] for r in out["regenerated"]} == {
        0: "reply to a", 2: "reply to b", 3: "reply to SURROGATE ONCE", 4: "reply to c"}
    (error,) = out["errors"]
    assert error["index"] == 1 and "surrogate" in error["error"] and "\n" not in error["error"]
    assert server.seen["SURROGATE"] == 2 and server.seen["SURROGATE ONCE"] == 2  # retried like a broken reply


def test_an_input_record_holding_a_lone_surrogate_is_skipped_not_the_jobs_end(server, tmp_path):
    """Before: a user turn "\\ud800" (valid JSON in the input) was sent, answered, and then could not be written:
    the job stopped with a traceback."""
    data = tmp_path / "in.jsonl"
    data.write_text('{"conversations": [{"from": "human", "value": "q\\ud800"}, {"from": "gpt", "value": "o"}]}\n'
                    '{"conversations": [{"from": "human", "value": "fine"}, {"from": "gpt", "value": "o"}]}\n'
                    '{"\\udc80": 1}\n')
    counts = regenerate(str(data), tmp_path / "out", ServerBackend(server.url, None, 16, 0.0, retries=0),
                        log=lambda *a: None)
    assert counts == {"records": 3, "regenerated": 1, "errors": 0, "skipped": 2}
    skipped = {r["index"]: r["reason"] for r in outputs(tmp_path / "out")["skipped"]}
    assert "surrogate" in skipped[0] and sorted(skipped) == [0, 2]
    assert not any("\ud800" in q for q in server.seen)  # never asked


def test_a_reply_nested_100000_deep_is_that_records_error_and_the_job_goes_on(server, tmp_path):
    """Before: json.loads raised RecursionError, which no handler caught: a 55-line traceback and the job lost."""
    data = asked(tmp_path / "in.jsonl", "a", "DEEP", "DEEP ONCE", "b")
    counts = regenerate(str(data), tmp_path / "out", ServerBackend(server.url, None, 16, 0.0, retries=1,
                                                                   backoff=0.01, concurrency=2),
                        log=lambda *a: None)
    assert counts == {"records": 4, "regenerated": 3, "errors": 1, "skipped": 0}
    (error,) = outputs(tmp_path / "out")["errors"]
    assert error["index"] == 1 and "nested too deeply" in error["error"] and len(error["error"]) < 400
    assert server.seen["DEEP"] == 2 and server.seen["DEEP ONCE"] == 2


def test_a_reply_nested_100000_deep_through_the_cli_is_not_a_traceback(server, tmp_path, capsys):
    data = asked(tmp_path / "in.jsonl", "DEEP", "a")
    code = cli_main(["regenerate", "--data", str(data), "--out", str(tmp_path / "out"), "--server", server.url,
                     "--retries", "0"])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err
    assert "1 regenerated, 1 errors" in captured.out


def test_a_trickled_reply_is_timed_out_as_a_whole_request(server, tmp_path):
    """Before: --timeout bounded each socket read, so a byte every TRICKLE_SECONDS was never timed out (a whole
    trickled reply took 10-20 s and was then taken as the answer)."""
    data = asked(tmp_path / "in.jsonl", "a", "TRICKLE_BODY", "TRICKLE_HEAD", "TRICKLE_BODY ONCE", "b")
    backend = ServerBackend(server.url, None, 16, 0.0, retries=1, timeout=TIMEOUT, backoff=0.01, concurrency=5)
    start = time.monotonic()
    counts = regenerate(str(data), tmp_path / "out", backend, log=lambda *a: None)
    took = time.monotonic() - start
    assert counts == {"records": 5, "regenerated": 3, "errors": 2, "skipped": 0}
    errors = {r["index"]: r["error"] for r in outputs(tmp_path / "out")["errors"]}
    assert sorted(errors) == [1, 2] and all("--timeout" in e for e in errors.values())
    assert server.seen["TRICKLE_BODY"] == 2 and server.seen["TRICKLE_HEAD"] == 2  # retried
    assert took < 6 * TIMEOUT + 2  # two attempts of TIMEOUT each, with room for a loaded machine


def test_the_request_deadline_does_not_cut_a_prompt_reply(server, tmp_path):
    data = asked(tmp_path / "in.jsonl", *[f"q{i}" for i in range(6)])
    backend = ServerBackend(server.url, None, 16, 0.0, retries=0, timeout=5.0, concurrency=3)
    assert regenerate(str(data), tmp_path / "out", backend, log=lambda *a: None)["regenerated"] == 6


@pytest.mark.parametrize("damaged", [b"not json at all", b"[1, 2]", b'{"index": "3"}', b'{"no index": 1}', DEEP,
                                     b'{"index": 1, "x": "\xff"}'])
def test_a_damaged_line_in_an_existing_output_is_one_line_naming_file_and_line(server, tmp_path, capsys, damaged):
    """Before: the resume path's json.loads raised on the damaged line (JSONDecodeError, TypeError, KeyError,
    RecursionError: a traceback naming neither file nor line), or took a string as an index."""
    data = asked(tmp_path / "in.jsonl", "a", "b", "c", "d")
    folder = tmp_path / "out"
    folder.mkdir()
    backend = ServerBackend(server.url, None, 16, 0.0, retries=0)
    (folder / "regenerate.json").write_text(json.dumps(made_from(str(data), backend, "auto", "train", None, None)))
    good = json.dumps({"index": 0, "conversations": [{"role": "user", "content": "a"},
                                                    {"role": "assistant", "content": "x"}]}).encode()
    path = folder / "regenerated.jsonl"
    path.write_bytes(good + b"\n" + damaged + b"\n" + good.replace(b'"index": 0', b'"index": 2') + b"\n")
    with pytest.raises(RegenerateError) as refused:
        regenerate(str(data), folder, backend, log=lambda *a: None)
    message = str(refused.value)
    assert f"{path}:2:" in message and "\n" not in message and len(message) < 400
    assert not server.seen  # nothing asked
    code = cli_main(["regenerate", "--data", str(data), "--out", str(folder), "--server", server.url,
                     "--max-new-tokens", "16"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{path}:2:" in err


# --------------------------------------------------------------------------- item 13: data reading


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def record(user: str, reply: str) -> bytes:
    return json.dumps({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]}).encode()


UNREADABLE = {  # a record line the reader cannot use -> what its reason says
    "deep": (DEEP, "nested too deeply"),
    "deep object": (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
    "lone surrogate": (b'{"conversations": [{"from": "human", "value": "q\\ud800"}, {"from": "gpt", "value": "a"}]}',
                       "surrogate"),
}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_an_unreadable_jsonl_record_is_skipped_or_one_line_naming_file_and_line(tmp_path, kind):
    """Before: a line nested 100,000 deep was a RecursionError traceback even with data.on_malformed=skip, and a
    lone surrogate passed the reader and broke the tokenizer (TypeError) later."""
    line, reason = UNREADABLE[kind]
    path = write_lines(tmp_path / "train.jsonl", [record("a", "b"), line, record("c", "d")])
    convs, report = load_conversations(str(path), on_malformed="skip")
    assert [c[0]["content"] for c in convs] == ["a", "c"]
    assert sum(report.skipped.values()) == 1 and reason in next(iter(report.skipped))
    with pytest.raises(DataError) as refused:
        load_conversations(str(path), on_malformed="error")
    message = str(refused.value)
    assert message.startswith(f"{path}:2: ") and reason in message and "\n" not in message and len(message) < 400


@pytest.mark.parametrize("kind", ["deep", "deep object", "not utf-8", "lone surrogate"])
def test_an_unreadable_record_in_a_json_list_is_skipped_or_one_line_naming_it(tmp_path, kind):
    """Before: a JSON list (sharegpt format) holding a record nested 100,000 deep was a RecursionError traceback,
    and one holding bytes that are not UTF-8 a UnicodeDecodeError traceback, whatever data.on_malformed said."""
    bad = {"deep": DEEP, "deep object": UNREADABLE["deep object"][0],
           "not utf-8": b'{"conversations": [{"from": "human", "value": "q\xff\xfe"}, {"from": "gpt", "value": "a"}]}',
           "lone surrogate": UNREADABLE["lone surrogate"][0]}[kind]
    path = tmp_path / "train.json"
    path.write_bytes(b"[" + record("a", "b") + b",\n " + bad + b",\n " + record("c", "d") + b"]")
    convs, report = load_conversations(str(path), format="sharegpt", on_malformed="skip")
    assert [c[0]["content"] for c in convs] == ["a", "c"] and sum(report.skipped.values()) == 1
    assert report.records_read == 3 and not report.truncated_tail
    with pytest.raises(DataError) as refused:
        load_conversations(str(path), format="sharegpt", on_malformed="error")
    message = str(refused.value)
    assert message.startswith(f"{path}:record 1: ") and "\n" not in message and len(message) < 400


def test_a_json_list_cut_short_inside_a_deep_record_is_a_cut_tail(tmp_path):
    path = tmp_path / "train.json"
    path.write_bytes(b"[" + record("a", "b") + b", " + DEEP[: len(DEEP) // 2 + 10])
    convs, report = load_conversations(str(path), format="sharegpt", on_malformed="skip")
    assert len(convs) == 1 and report.truncated_tail and report.tail_bytes_skipped == len(DEEP) // 2 + 10


def test_eval_prompts_share_the_reader_so_an_unreadable_prompt_is_that_records_reason(tmp_path):
    """inference/eval.py reads its prompt file through conversations.iter_prompts (`_first_user_turns`), so a deep
    line there is one record's reason, which eval skips (--skip-malformed) or stops on with its line."""
    path = write_lines(tmp_path / "prompts.jsonl", [b'{"prompt": "one"}', DEEP, b'{"prompt": "t\\udfffwo"}',
                                                   b'{"turns": ["three"]}'])
    got = list(iter_prompts(path))
    assert [(where, text) for where, text, _ in got] == [(f"{path}:1", "one"), (f"{path}:2", None),
                                                         (f"{path}:3", None), (f"{path}:4", "three")]
    assert "nested too deeply" in got[1][2] and "surrogate" in got[2][2]


# --------------------------------------------------------------------------- item 13: tokenizing a long record


@pytest.fixture(scope="module")
def fixture_tokenizer():
    if not FIXTURE.is_dir():
        from conftest import missing_fixture_reason

        pytest.skip(missing_fixture_reason("fixture target", FIXTURE))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(FIXTURE))


class Recording:
    """The tokenizer, recording the length of every text it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, texts, **kwargs):
        self.lengths.extend(len(t) for t in ([texts] if isinstance(texts, str) else texts))
        return self.tokenizer(texts, **kwargs)


def whole_then_truncated(tokenizer, messages, max_length: int, on_long: str):
    """What tokenizing the whole record and then truncating gives: (ids, mask), or None when dropped."""
    text, segments = render_with_segments(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask = enc["input_ids"], mask_from_offsets([tuple(o) for o in enc["offset_mapping"]], segments, len(text))
    if len(ids) > max_length:
        if on_long == "drop":
            return None
        ids, mask = ids[:max_length], mask[:max_length]
    return (ids, mask) if any(mask) else None


def test_a_2mb_record_is_cut_before_tokenizing_when_truncating(fixture_tokenizer):
    """Before: the whole rendered record went to the tokenizer (a 36 MB record took 6.4 GB for 2,048 kept
    tokens). Now the tokenizer sees a few characters per kept token, and the kept tokens are the same."""
    max_length = 512
    words = [f"w{i % 97}ord" for i in range(360_000)]
    messages = [{"role": "user", "content": "Summarise this: " + " ".join(words)},  # about 2.3 MB
                {"role": "assistant", "content": "Short."}]
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    tok = Recording(fixture_tokenizer)
    start = time.monotonic()
    samples, report = tokenize_conversations(tok, [short, messages, short], max_length, "truncate", progress=False)
    took = time.monotonic() - start
    assert sum(len(m["content"]) for m in messages) > 2_000_000
    assert max(tok.lengths) <= max_length * 64, "the tokenizer was handed the whole record"
    assert sum(tok.lengths) <= 3 * max_length * 64
    assert took < 5  # rendering 2 MB three times; tokenizing it whole took 10 s
    assert (report.kept, report.truncated, report.dropped_empty) == (2, 0, 1)  # no reply token in the first 512
    messages[1:1] = [{"role": "assistant", "content": "First reply."}]  # a reply inside the kept tokens
    messages[0]["content"] = "Q"
    messages.insert(2, {"role": "user", "content": " ".join(words)})
    tok.lengths.clear()
    samples, report = tokenize_conversations(tok, [messages], max_length, "truncate", progress=False)
    assert max(tok.lengths) <= max_length * 64 and (report.kept, report.truncated) == (1, 1)
    shorter = [dict(m) for m in messages]  # the same record with its long turn at 100,000 characters, tokenized whole
    shorter[2]["content"] = shorter[2]["content"][:100_000]
    want = whole_then_truncated(fixture_tokenizer, shorter, max_length, "truncate")
    assert (samples[0].input_ids, samples[0].loss_mask) == want


def test_a_long_record_with_drop_is_not_tokenized_whole_either(fixture_tokenizer):
    max_length = 256
    messages = [{"role": "user", "content": "x " * 1_000_000}, {"role": "assistant", "content": "y"}]
    tok = Recording(fixture_tokenizer)
    samples, report = tokenize_conversations(tok, [messages], max_length, "drop", progress=False)
    assert samples == [] and report.dropped_long == 1 and max(tok.lengths) <= max_length * 64


def _random_text(rng: random.Random, n_words: int) -> str:
    pieces = ["the", "quick", "fox", "Ünïcödé", "日本語の文", "😀🚀", "def f(x):\n    return x", "\n\n", "  ",
              "12345",
              "3.14159", "https://example.com/a?b=c", "—", "\t", "word,", "(paren)", "a" * 40, " " * 17, "-" * 33,
              "<|end|>", "naïve", "Ωμέγα", "\u2028", "'quoted'"]
    return "".join(rng.choice(pieces) + rng.choice([" ", "", " ", "\n"]) for _ in range(n_words))


@pytest.fixture(scope="module")
def normal_records(fixture_tokenizer):
    """Normal records, short and far past the cut, of one to four turns, each with its whole rendered text, its
    reply spans and its whole tokenization (ids, offsets)."""
    rng = random.Random(47)
    records = []
    for _ in range(40):
        turns = rng.randint(1, 4)
        messages = [{"role": "user" if k % 2 == 0 else "assistant",
                     "content": _random_text(rng, rng.choice([3, 30, 200, 1000, 2500]))} for k in range(2 * turns)]
        text, segments = render_with_segments(fixture_tokenizer, messages)
        enc = fixture_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        records.append((messages, text, segments, enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]))
    return records


def _whole(record, max_length: int, on_long: str):
    _, text, segments, ids, offsets = record
    mask = mask_from_offsets(offsets, segments, len(text))
    if len(ids) > max_length:
        if on_long == "drop":
            return None
        ids, mask = ids[:max_length], mask[:max_length]
    return (ids, mask) if any(mask) else None


@pytest.mark.parametrize("on_long", ["truncate", "drop"])
def test_cutting_before_tokenizing_equals_tokenizing_whole_then_truncating(fixture_tokenizer, normal_records,
                                                                           on_long):
    """For normal records, short and far past the cut, many turns, the cut anywhere (inside a user turn, a reply,
    the template's markers): the samples are those of tokenizing each record whole and then truncating."""
    kept = 0
    for max_length in (16, 100, 700):
        tok = Recording(fixture_tokenizer)
        samples, report = tokenize_conversations(tok, [r[0] for r in normal_records], max_length, on_long,
                                                 progress=False)
        want = [w for w in (_whole(r, max_length, on_long) for r in normal_records) if w]
        assert [(s.input_ids, s.loss_mask) for s in samples] == want, max_length
        longer = sum(len(r[3]) > max_length for r in normal_records)
        if on_long == "drop":
            assert report.dropped_long == longer > 0
        else:
            assert report.truncated + report.dropped_empty >= longer > 0
        kept += len(samples)
        assert max(tok.lengths) <= max_length * 64  # every record cut once, none re-cut
        assert sum(len(r[1]) > max(tok.lengths) for r in normal_records) >= 5  # records reach far past the cut
    assert kept >= (15 if on_long == "truncate" else 5)


def test_a_record_of_tokens_longer_than_the_bound_is_recut_until_safe(fixture_tokenizer, monkeypatch):
    """A record whose tokens are longer than the bound assumes (here the bound is lowered to 1 character a token)
    is tokenized again with longer cuts, so the result is still that of the whole record."""
    monkeypatch.setattr(tokenize_mod, "_CHARS_PER_TOKEN", 1)
    rng = random.Random(3)
    convs = [[{"role": "user", "content": _random_text(rng, 5)},
              {"role": "assistant", "content": _random_text(rng, n)}] for n in (3, 20, 400, 400, 1000)]
    for on_long in ("truncate", "drop"):
        tok = Recording(fixture_tokenizer)
        samples, _ = tokenize_conversations(tok, convs, 120, on_long, progress=False)
        want = [w for w in (whole_then_truncated(fixture_tokenizer, c, 120, on_long) for c in convs) if w]
        assert [(s.input_ids, s.loss_mask) for s in samples] == want
        assert len(samples) >= (5 if on_long == "truncate" else 1)
        assert len(tok.lengths) > len(convs)  # some were tokenized again with a longer cut
