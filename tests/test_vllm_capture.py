"""collect.engine vllm (data/vllm_capture.py) without vLLM: the id mapping, the file reader, the retrying capture over
a fake engine, the lock wait, the HTTP client against a fake OpenAI server, the printed serve line and the recipe.
The real engine is tested in tests/interop."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import shlex
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.config import RecipeError, recipe_from_dict
from draftsmith.data.store import StoreError
from draftsmith.data.vllm_capture import (
    CPU_CONNECTOR,
    CPU_CONNECTOR_MODULE,
    INSTALL_HINT,
    METHOD,
    STOCK_CONNECTOR,
    LocalVllm,
    RequestFailed,
    VllmCapture,
    VllmLayers,
    VllmServer,
    _locked,
    probe,
    read_states,
    serve_command,
    speculative_config,
    wait_unlocked,
)

H = 4  # hidden size of every hand-made state
LAYERS = VllmLayers((5, 2, 5), 8)  # aux ids repeated and unsorted, N = 8: vLLM is asked for [2, 5, 8]
MINIMAL = {"model": {"target": "t"}, "data": {"path": "sharegpt"}, "output_dir": "out"}


def layer_state(layer: int, prompt: list[int]) -> torch.Tensor:
    """(S, H): the state of capture id `layer` over `prompt`, its values naming the id, the token and the channel."""
    return layer * 100 + torch.tensor(prompt, dtype=torch.float32)[:, None] + torch.arange(H) / 8


def write_request_file(path: Path, prompt: list[int], ids: list[int], *, tokens: list[int] | None = None) -> str:
    """What vLLM's connector leaves for one request: {hidden_states (S, n_ids, H), token_ids (S,) int64} and the
    `.lock` it held while writing."""
    states = torch.stack([layer_state(k, prompt) for k in ids], dim=1)
    tokens = prompt if tokens is None else tokens
    save_file({"hidden_states": states, "token_ids": torch.tensor(tokens, dtype=torch.int64)}, str(path))
    Path(str(path) + ".lock").touch()
    return str(path)


def one_line_store_error(fn, *args, **kwargs) -> str:
    with pytest.raises(StoreError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------- VllmLayers


def test_layers_requested_sorted_unique_with_last():
    assert LAYERS.requested == [2, 5, 8]
    assert VllmLayers((3, 1), 4).requested == [1, 3, 4]
    assert VllmLayers((4, 0, 4), 4).requested == [0, 4]  # N asked for as an aux id too: one slot


def test_layers_split_back_to_recipe_order():
    # the file's slots are ids [2, 5, 8]; each value is 10 * id + position
    states = torch.tensor([[[20.0, 20.0], [50.0, 50.0], [80.0, 80.0]],
                           [[21.0, 21.0], [51.0, 51.0], [81.0, 81.0]]])
    aux, last = LAYERS.split(states)
    assert aux.tolist() == [[50.0, 50.0, 20.0, 20.0, 50.0, 50.0], [51.0, 51.0, 21.0, 21.0, 51.0, 51.0]]  # 5, 2, 5
    assert last.tolist() == [[80.0, 80.0], [81.0, 81.0]]


# --------------------------------------------------------------------------- read_states

PROMPT = [3, 1, 4, 1, 5]


def test_read_states_good_file(tmp_path):
    path = write_request_file(tmp_path / "r.safetensors", PROMPT, LAYERS.requested)
    states = read_states(path, PROMPT, 3, H)
    assert states.shape == (5, 3, H) and states.dtype == torch.float32
    assert torch.equal(states[:, 1], layer_state(5, PROMPT))


class _Marker:
    """Unpickling it makes a folder: proof that a reader unpickled."""

    def __init__(self, folder: str):
        self.folder = folder

    def __reduce__(self):
        return os.mkdir, (self.folder,)


def _truncated(path: Path):
    write_request_file(path, PROMPT, LAYERS.requested)
    data = path.read_bytes()
    path.write_bytes(data[:-7])


def _save(path: Path, **tensors):
    save_file(tensors, str(path))


GOOD = layer_state(2, PROMPT)[:, None].expand(5, 3, H).contiguous()
TOKENS = torch.tensor(PROMPT, dtype=torch.int64)
BAD_FILES = {
    "missing": (lambda p: None, "missing"),
    "truncated": (_truncated, "truncated"),
    "cut_in_header": (lambda p: p.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"hidden"), "truncated"),
    "wrong_n_ids": (lambda p: _save(p, hidden_states=GOOD[:, :2].contiguous(), token_ids=TOKENS), "expected (5, 3, 4)"),
    "wrong_hidden": (lambda p: _save(p, hidden_states=torch.zeros(5, 3, H + 1), token_ids=TOKENS), "expected (5, 3, 4)"),
    "other_tokens": (lambda p: _save(p, hidden_states=GOOD, token_ids=TOKENS.flip(0)), "other tokens"),
    "fewer_tokens": (lambda p: _save(p, hidden_states=GOOD[:4].contiguous(), token_ids=TOKENS[:4]), "expected (5, 3, 4)"),
    "nan": (lambda p: _save(p, hidden_states=GOOD.index_fill(0, torch.tensor([2]), float("nan")), token_ids=TOKENS),
            "non-finite"),
    "inf": (lambda p: _save(p, hidden_states=GOOD.index_fill(2, torch.tensor([1]), float("inf")), token_ids=TOKENS),
            "non-finite"),
    "integer": (lambda p: _save(p, hidden_states=GOOD.to(torch.int32), token_ids=TOKENS), "not a float type"),
    "no_token_ids": (lambda p: _save(p, hidden_states=GOOD), "not hidden_states and token_ids"),
    "no_hidden_states": (lambda p: _save(p, token_ids=TOKENS), "not hidden_states and token_ids"),
    "fp8_without_scales": (lambda p: _save(p, hidden_states=GOOD.to(torch.float8_e4m3fn), token_ids=TOKENS),
                           "without hidden_states_scales"),
    "fp8_bad_scales": (lambda p: _save(p, hidden_states=GOOD.to(torch.float8_e4m3fn), token_ids=TOKENS,
                                       hidden_states_scales=torch.ones(5, 1)), "hidden_states_scales is (5, 1)"),
    "torch_save_pickle": (lambda p: torch.save({"hidden_states": _Marker(str(p) + ".unpickled")}, p), "unreadable"),
    "plain_pickle": (lambda p: p.write_bytes(pickle.dumps({"hidden_states": _Marker(str(p) + ".unpickled")})),
                     "unreadable"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_read_states_bad_file_names_it(tmp_path, case):
    make, says = BAD_FILES[case]
    path = tmp_path / "r.safetensors"
    make(path)
    with pytest.raises(RequestFailed) as info:
        read_states(str(path), PROMPT, 3, H)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and says in message, message
    assert "\n" not in message
    assert not Path(str(path) + ".unpickled").exists()  # safetensors only: nothing was unpickled


def test_read_states_fp8_is_dequantized(tmp_path):
    torch.manual_seed(0)
    states = torch.randn(5, 3, H) * torch.tensor([0.01, 1.0, 30.0, 500.0, 2.0])[:, None, None]  # per-token scales
    scales = states.abs().amax(dim=(1, 2), keepdim=True) / 448  # (S, 1, 1): the token's amax lands on fp8's max
    quantized = (states / scales).to(torch.float8_e4m3fn)
    _save(tmp_path / "r.safetensors", hidden_states=quantized, token_ids=TOKENS, hidden_states_scales=scales)
    out = read_states(str(tmp_path / "r.safetensors"), PROMPT, 3, H)
    assert out.dtype == torch.float32 and out.shape == (5, 3, H)
    # e4m3 rounds to 3 mantissa bits: half an ulp is 2^-4 relative for normals, 2^-10 of the scale for subnormals
    assert ((out - states).abs() <= states.abs() * 2**-4 + scales * 2**-10 + 1e-12).all()
    assert not torch.allclose(out, quantized.float())  # scaled back, not the raw fp8 values
    assert torch.allclose(out.abs().amax(dim=(1, 2)), states.abs().amax(dim=(1, 2)))  # 448 is exact in e4m3


# --------------------------------------------------------------------------- VllmCapture with a fake engine


class FakeEngine:
    """`run(prompts)` as LocalVllm/VllmServer have it: a staged file per prompt, like vLLM's connector writes.
    `fail[tuple(prompt)]`: how many times that prompt fails first; `bad`: fail with a file of other tokens instead
    of a reply without a path."""

    def __init__(self, staging: Path, ids: list[int], fail: dict | None = None, bad: bool = False):
        self.staging, self.ids, self.fail, self.bad = staging, ids, dict(fail or {}), bad
        self.calls: list[list[list[int]]] = []
        staging.mkdir(exist_ok=True)

    def run(self, prompts):
        self.calls.append([list(p) for p in prompts])
        out = []
        for prompt in prompts:
            path = self.staging / f"req-{len(self.calls)}-{len(out)}.safetensors"
            if self.fail.get(tuple(prompt), 0) > 0:
                self.fail[tuple(prompt)] -= 1
                if self.bad:
                    out.append(write_request_file(path, prompt, self.ids, tokens=[t + 1 for t in prompt]))
                else:
                    out.append(RequestFailed("fake: the reply holds no kv_transfer_params.hidden_states_path"))
            else:
                out.append(write_request_file(path, prompt, self.ids))
        return out


def rms_norm() -> torch.nn.RMSNorm:
    norm = torch.nn.RMSNorm(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, -1.0, 2.0, 3.0]))
    return norm


def normed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * weight


ROWS = [[11, 12, 13, 14, 15], [21, 22, 23]]


def padded_batch():
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.zeros(2, 5, dtype=torch.long)
    for r, row in enumerate(ROWS):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    return ids, mask


def test_capture_maps_rows_back(tmp_path):
    engine = FakeEngine(tmp_path / "staging", LAYERS.requested)
    norm = rms_norm()
    capture = VllmCapture(engine, LAYERS, norm, H, backoff=0, log=lambda _: None)
    ids, mask = padded_batch()
    out = capture.capture(ids, mask, [5, 2, 5])  # as store.capture_samples calls it
    assert out.aux_hidden.shape == (2, 5, 3 * H) and out.last_hidden.shape == (2, 5, H)
    assert engine.calls == [ROWS]  # each prompt without its padding
    for r, row in enumerate(ROWS):
        n = len(row)
        want_aux = torch.cat([layer_state(5, row), layer_state(2, row), layer_state(5, row)], dim=-1)
        torch.testing.assert_close(out.aux_hidden[r, :n], want_aux)
        torch.testing.assert_close(out.last_hidden[r, :n], normed(layer_state(8, row), norm.weight.detach()))
        assert not out.aux_hidden[r, n:].any() and not out.last_hidden[r, n:].any()  # zero past the row
    assert capture.errors == 0
    assert list(engine.staging.iterdir()) == []  # files and their .lock deleted once read
    with pytest.raises(StoreError, match=r"set up for aux layers \[5, 2, 5\], asked for \[2, 5\]"):
        capture.capture(ids, mask, [2, 5])


def test_capture_retries_a_failed_request(tmp_path):
    logs = []
    engine = FakeEngine(tmp_path / "staging", LAYERS.requested, fail={tuple(ROWS[1]): 1})
    capture = VllmCapture(engine, LAYERS, rms_norm(), H, backoff=0, log=logs.append)
    out = capture.capture(*padded_batch(), LAYERS.aux_layer_ids)
    assert engine.calls == [ROWS, [ROWS[1]]]  # only the failed prompt is sent again
    assert capture.errors == 1 and len(logs) == 1 and "retrying" in logs[0]
    torch.testing.assert_close(out.aux_hidden[1, :3, H:2 * H], layer_state(2, ROWS[1]))
    assert list(engine.staging.iterdir()) == []


@pytest.mark.parametrize("bad", [False, True], ids=["no_path", "bad_file"])
def test_capture_stops_after_retries(tmp_path, bad):
    engine = FakeEngine(tmp_path / "staging", LAYERS.requested, fail={tuple(ROWS[0]): 99}, bad=bad)
    capture = VllmCapture(engine, LAYERS, rms_norm(), H, retries=2, backoff=0, log=lambda _: None)
    message = one_line_store_error(capture.capture, *padded_batch())
    assert "1 request(s) still failed after 2 retries" in message and "run collect again" in message
    assert ("other tokens" if bad else "hidden_states_path") in message
    assert len(engine.calls) == 3 and capture.errors == 3  # the first try and 2 retries, each counted
    assert list(engine.staging.iterdir()) == []  # bad files are deleted too


def test_capture_waits_for_the_connector_lock(tmp_path):
    """A file whose lock is still held (being written) is read once released, not before."""
    staging = tmp_path / "staging"
    engine = FakeEngine(staging, LAYERS.requested)
    held = []

    def run(prompts):
        paths = FakeEngine.run(engine, prompts)
        fd = os.open(paths[0] + ".lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(time.monotonic())
        threading.Timer(0.2, lambda: os.close(fd)).start()  # closing releases the lock
        return paths

    engine.run = run
    start = time.monotonic()
    VllmCapture(engine, LAYERS, rms_norm(), H, backoff=0, log=lambda _: None).capture(*padded_batch())
    assert time.monotonic() - start >= 0.15 and held


# --------------------------------------------------------------------------- wait_unlocked


def hold_lock(lock: Path, seconds: float) -> threading.Thread:
    """Another open file description holds LOCK_EX on `lock` for `seconds`, as the connector does while writing."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def release():
        time.sleep(seconds)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def test_wait_unlocked_without_lock_returns_at_once(tmp_path):
    start = time.monotonic()
    wait_unlocked(str(tmp_path / "r.safetensors"), seconds=5)
    assert time.monotonic() - start < 0.05
    (tmp_path / "r.safetensors.lock").touch()  # a lock file nobody holds: written
    wait_unlocked(str(tmp_path / "r.safetensors"), seconds=5)
    assert not _locked(str(tmp_path / "r.safetensors"))


def test_wait_unlocked_waits_for_the_writer(tmp_path):
    path = str(tmp_path / "r.safetensors")
    thread = hold_lock(Path(path + ".lock"), 0.2)
    assert _locked(path)
    start = time.monotonic()
    wait_unlocked(path, seconds=5)
    elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 2, elapsed
    thread.join()
    assert not _locked(path)


def test_wait_unlocked_gives_up_after_timeout(tmp_path):
    path = str(tmp_path / "r.safetensors")
    thread = hold_lock(Path(path + ".lock"), 0.5)
    start = time.monotonic()
    with pytest.raises(RequestFailed, match="still being written") as info:
        wait_unlocked(path, seconds=0.2)
    assert 0.15 <= time.monotonic() - start < 0.45
    assert str(info.value).startswith(path)
    thread.join()


# --------------------------------------------------------------------------- VllmServer against a fake server


class FakeOpenAI(BaseHTTPRequestHandler):
    """vLLM's OpenAI server as collect sees it: /v1/models, and /v1/completions whose reply names the file its
    connector wrote. `self.server.mode`: good, no_path, other_tokens, http_error, trickle."""

    protocol_version = "HTTP/1.0"
    timeout = 10  # a stuck client cannot hold a handler thread forever

    def log_message(self, *args):
        pass

    def reply(self, body: dict, status: int = 200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/v1/models":
            return self.reply({"object": "error", "message": "not found"}, 404)
        self.reply({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": root, "parent": None,
             "max_model_len": 4096, "permission": []} for name, root in self.server.models]})

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append((self.path, body))
        if self.path != "/v1/completions":
            return self.reply({"object": "error", "message": "not found"}, 404)
        prompt = body["prompt"]
        if server.mode == "http_error":
            return self.reply({"object": "error", "message": "This model's maximum context length is 4",
                               "type": "BadRequestError", "param": None, "code": 400}, 400)
        if server.mode == "trickle":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(17):  # a byte every 0.3 s for about 5 s
                if server.stop.wait(0.3):
                    return
                try:
                    self.wfile.write(b" ")
                except OSError:  # the client hung up
                    return
            return
        params = None
        if server.mode != "no_path":
            path = server.files / f"req-{len(server.requests)}.safetensors"
            params = {"hidden_states_path": write_request_file(path, prompt, server.ids)}  # as the connector would
        seen = prompt if server.mode != "other_tokens" else [*prompt[:-1], 999]
        self.reply({
            "id": f"cmpl-{len(server.requests)}", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": "!", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "prompt_logprobs": None, "prompt_token_ids": seen, "token_ids": [0]}],
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 1, "completion_tokens": 1},
            "kv_transfer_params": params})


@pytest.fixture
def fake_server(tmp_path):
    """start(models=[(id, root)], mode=...) -> the server's url; every server is shut down after the test."""
    servers = []

    def start(models, mode="good"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
        server.daemon_threads = True
        server.models, server.mode, server.ids = models, mode, LAYERS.requested
        server.requests, server.stop = [], threading.Event()
        server.files = tmp_path / f"server-{len(servers)}"
        server.files.mkdir()
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server

    yield start
    for server in servers:
        server.stop.set()
        server.shutdown()
        server.server_close()


def test_server_accepts_the_target_by_root(fake_server, tmp_path):
    target = str(tmp_path / "models" / "llama")
    url, server = fake_server([("other", "/models/other"), ("my-llama", target)])
    client = VllmServer(url, target + "/", concurrency=2, timeout=10)  # the same path, spelled otherwise
    assert client.model == "my-llama" and client.base == url + "/v1"
    assert VllmServer(url + "/v1/", "my-llama").model == "my-llama"  # by id, the url with /v1
    paths = client.run([[1, 2, 3], [4, 5]])
    assert all(isinstance(p, str) for p in paths), paths
    assert read_states(paths[1], [4, 5], 3, H).shape == (2, 3, H)
    sent = sorted((body["prompt"], body["model"], body["max_tokens"]) for _, body in server.requests)
    assert sent == [([1, 2, 3], "my-llama", 1), ([4, 5], "my-llama", 1)]


def test_server_of_another_model_is_refused(fake_server):
    url, _ = fake_server([("other", "/models/other")])
    message = one_line_store_error(VllmServer, url, "meta-llama/Llama-3.1-8B-Instruct")
    assert "/models/other" in message and "meta-llama/Llama-3.1-8B-Instruct" in message


def test_no_server_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    message = one_line_store_error(VllmServer, f"http://127.0.0.1:{port}", "t", timeout=2)
    assert "cannot list the server's models" in message


@pytest.mark.parametrize("mode, says", [
    ("no_path", f"does not run the {METHOD} method"),
    ("other_tokens", "tokenized another prompt"),
    ("http_error", "HTTP 400"),
])
def test_server_bad_reply_is_a_failed_request(fake_server, mode, says):
    url, _ = fake_server([("t", "t")], mode)
    (result,) = VllmServer(url, "t", timeout=10).run([[1, 2, 3]])
    assert isinstance(result, RequestFailed) and says in str(result), result


def test_server_trickling_reply_is_cut_off(fake_server):
    url, server = fake_server([("t", "t")], "trickle")
    client = VllmServer(url, "t", timeout=1.0)
    start = time.monotonic()
    (result,) = client.run([[1, 2, 3]])
    elapsed = time.monotonic() - start
    assert isinstance(result, RequestFailed) and "no whole reply within 1 s" in str(result), result
    assert elapsed < 3, elapsed


def test_probe_refuses_a_server_without_the_method(fake_server, tmp_path):
    url, server = fake_server([("t", "t")], "no_path")
    message = one_line_store_error(probe, VllmServer(url, "t", timeout=10), LAYERS, H, [1, 2, 3])
    assert "cannot capture for this recipe" in message and METHOD in message
    assert len(server.requests) == 1
    server.mode = "good"
    probe(VllmServer(url, "t", timeout=10), LAYERS, H, [1, 2, 3])  # passes, and leaves no file behind
    assert list(server.files.iterdir()) == []
    message = one_line_store_error(probe, VllmServer(url, "t", timeout=10), VllmLayers((1,), 8), H, [1, 2, 3])
    assert "expected (3, 2, 4)" in message  # the server captures other layers than the recipe's


def test_collect_wiring_client_mode(fake_server, tmp_path):
    """train/collect.py's _vllm_capture in client mode: the serve line is logged, the server probed, then captured."""
    from draftsmith.train.collect import _vllm_capture

    url, server = fake_server([("served", "org/target")])
    recipe = recipe_from_dict({**MINIMAL, "model": {"target": "org/target"},
                               "collect": {"engine": "vllm", "vllm": {"url": url, "timeout": 10, "retries": 0}}})
    target = SimpleNamespace(num_layers=8, hidden_size=H, final_norm=rms_norm())
    logs = []
    capture = _vllm_capture(recipe, target, [5, 2, 5], [SimpleNamespace(input_ids=ROWS[0])], tmp_path / "store",
                            logs.append)
    assert any("vllm serve org/target" in line and "[2, 5, 8]" in line for line in logs), logs
    assert server.requests[0][1]["prompt"] == ROWS[0]  # the probe
    out = capture.capture(*padded_batch(), [5, 2, 5])
    torch.testing.assert_close(out.aux_hidden[1, :3, :H], layer_state(5, ROWS[1]))
    assert list(server.files.iterdir()) == []


# --------------------------------------------------------------------------- the printed serve line


def parse_serve(line: str) -> tuple[list[str], dict, dict]:
    args = shlex.split(line)
    return (args, json.loads(args[args.index("--speculative-config") + 1]),
            json.loads(args[args.index("--kv-transfer-config") + 1]))


def test_serve_command_single_device():
    line = serve_command("meta-llama/Llama-3.1-8B-Instruct", LAYERS, "/tmp/hs")
    args, spec, kv = parse_serve(line)
    assert args[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert "--no-enable-chunked-prefill" in args and "--no-enable-prefix-caching" in args
    assert "--tensor-parallel-size" not in args and "--data-parallel-size" not in args
    assert spec == speculative_config(LAYERS)
    assert spec["method"] == METHOD and spec["draft_model_config"]["hf_config"][
        "eagle_aux_hidden_state_layer_ids"] == [2, 5, 8]
    assert kv["kv_connector"] == STOCK_CONNECTOR and kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/tmp/hs"}
    assert "kv_connector_module_path" not in kv


@pytest.mark.parametrize("tp, dp", [(4, 1), (1, 2), (4, 2)])
def test_serve_command_parallel_flags_only_when_more_than_one(tp, dp):
    args, _, _ = parse_serve(serve_command("t", LAYERS, "/tmp/hs", tp, dp))
    assert (args[args.index("--tensor-parallel-size") + 1] == str(tp)) if tp > 1 else "--tensor-parallel-size" not in args
    assert (args[args.index("--data-parallel-size") + 1] == str(dp)) if dp > 1 else "--data-parallel-size" not in args


def test_serve_command_on_cpu_names_draftsmiths_connector():
    _, _, kv = parse_serve(serve_command("t", LAYERS, "/tmp/hs", on_cpu=True))
    assert kv["kv_connector"] == CPU_CONNECTOR and kv["kv_connector_module_path"] == CPU_CONNECTOR_MODULE


# --------------------------------------------------------------------------- the recipe and a missing vLLM


def test_recipe_collect_vllm_section():
    recipe = recipe_from_dict({**MINIMAL, "collect": {"engine": "vllm", "vllm": {"tensor_parallel_size": 2}}})
    assert recipe.collect.engine == "vllm" and recipe.collect.vllm.tensor_parallel_size == 2
    assert recipe.collect.vllm.url is None and recipe.collect.vllm.retries == 3
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({**MINIMAL, "collect": {"engine": "vllm", "vllm": {"tensor_paralel_size": 2}}})
    assert "collect.vllm.tensor_paralel_size" in str(info.value) and "\n" not in str(info.value)


def test_without_vllm_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable, even where vLLM is installed
    staging = tmp_path / "staging"
    assert one_line_store_error(LocalVllm, "t", LAYERS, staging) == INSTALL_HINT
    assert not staging.exists()  # nothing touched before the import
    from draftsmith.train.collect import _vllm_capture

    recipe = recipe_from_dict({**MINIMAL, "collect": {"engine": "vllm"}})
    target = SimpleNamespace(num_layers=8, hidden_size=H, final_norm=rms_norm())
    assert one_line_store_error(_vllm_capture, recipe, target, [5, 2, 5], [SimpleNamespace(input_ids=[1, 2])],
                                tmp_path / "store", lambda _: None) == INSTALL_HINT
    assert not (tmp_path / "store").exists()
