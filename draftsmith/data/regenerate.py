"""`draftsmith regenerate`: replace a dataset's assistant turns with the target's own answers.

A drafter learns to predict the target, so it trains best on what the target itself writes. Each conversation is
regenerated turn by turn: the k-th assistant turn becomes the target's answer to the conversation so far, whose
earlier assistant turns are already the target's own. Two ways to run the target:

    --server URL   any OpenAI-compatible server (vLLM, SGLang): `/v1/chat/completions`, `--concurrency`
                   conversations at once, each request retried with exponential backoff on connection errors,
                   timeouts, 429 and 5xx (`--retries`)
    --target PATH  draftsmith's runtime, `--batch-size` conversations decoded together (taken from a window of
                   four batches sorted by prompt length, so a batch pads little)

`--max-turns N` keeps the first N assistant turns of each conversation and drops what follows them (a drafter
for a chat target learns most from first answers, and they cost the least to regenerate).

Outputs in `--out`: `regenerated.jsonl` ({"index", "conversations"}), `errors.jsonl` ({"index", "error"}) and
`skipped.jsonl` ({"index", "where", "reason"}: records with nothing to regenerate); every input record lands in
exactly one of them, and the closing line says the counts add up. A rerun resumes: records already in any of the
three files are not redone (a line cut short by a kill is dropped first).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftsmith.data.conversations import LoadReport, Message, iter_records, source_name

OUTPUTS = ("regenerated", "errors", "skipped")
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class RegenerateError(ValueError):
    """Bad arguments or a server that cannot be used at all; one line."""


class RequestFailed(Exception):
    """One conversation could not be regenerated (after retries); its message goes to errors.jsonl."""


def first_turns(messages: list[Message], max_turns: int | None) -> list[Message]:
    """The conversation up to and including its `max_turns`-th assistant turn (all of it for None)."""
    if max_turns is None:
        return messages
    seen = 0
    for i, message in enumerate(messages):
        seen += message["role"] == "assistant"
        if seen == max_turns:
            return messages[: i + 1]
    return messages


def regenerate_turns(messages: list[Message], answer: Callable[[list[Message]], str]) -> list[Message]:
    """The conversation with every assistant turn replaced by `answer(context)`, the context holding the turns
    before it (earlier assistant turns already regenerated). A trailing user turn stays unanswered."""
    out: list[Message] = []
    for message in messages:
        out.append({"role": "assistant", "content": answer(list(out))} if message["role"] == "assistant"
                   else dict(message))
    return out


# --------------------------------------------------------------------------- backends


class ServerBackend:
    """An OpenAI-compatible chat server. `url` is its base (http://host:port or .../v1)."""

    def __init__(self, url: str, model: str | None, max_tokens: int, temperature: float, retries: int = 3,
                 timeout: float = 600.0, backoff: float = 1.0, concurrency: int = 8):
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.max_tokens, self.temperature = max_tokens, temperature
        self.retries, self.timeout, self.backoff = retries, timeout, backoff
        self.concurrency = concurrency
        self.window = 4 * concurrency  # conversations handed to run() at once: enough to keep the server busy
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:200].replace("\n", " ")
                if e.code not in RETRY_STATUS or attempt == self.retries:
                    raise RequestFailed(f"HTTP {e.code} from {self.base + path}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
                    reason = getattr(e, "reason", e)
                    raise RequestFailed(f"{self.base + path}: {reason}") from None
            time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _first_model(self) -> str:
        try:
            models = self._request("/models").get("data") or []
        except RequestFailed as e:
            raise RegenerateError(f"--server: cannot list the models: {e}") from None
        if not models:
            raise RegenerateError(f"--server {self.base}: serves no model; pass --model")
        return models[0]["id"]

    def answer(self, context: list[Message]) -> str:
        reply = self._request("/chat/completions", {"model": self.model, "messages": context,
                                                    "max_tokens": self.max_tokens, "temperature": self.temperature})
        try:
            return reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RequestFailed(f"{self.base}/chat/completions: no choices[0].message.content in the reply") from None

    def run(self, conversations: list[list[Message]]) -> list[list[Message] | RequestFailed]:
        def one(messages):
            try:
                return regenerate_turns(messages, self.answer)
            except RequestFailed as e:
                return e

        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(one, conversations))


class RuntimeBackend:
    """draftsmith's runtime: the target decodes a batch of conversations' next assistant turns together."""

    def __init__(self, target: str, dtype: str, max_tokens: int, temperature: float, batch_size: int = 8,
                 seed: int = 0):
        from draftsmith.inference.eval import eos_token_ids
        from draftsmith.inference.generator import SpeculativeGenerator
        from draftsmith.inference.sampling import SamplingParams
        from draftsmith.models.target import TargetModel, load_target_tokenizer

        self.tokenizer = load_target_tokenizer(target, "--target", RegenerateError)
        if not getattr(self.tokenizer, "chat_template", None):
            raise RegenerateError(f"--target {target}: its tokenizer has no chat template to render turns with")
        self.target = TargetModel.from_pretrained(target, dtype=dtype)
        self.generator = SpeculativeGenerator(self.target, None, 0)
        self.eos = eos_token_ids(self.target, self.tokenizer)
        self.sampling = SamplingParams(temperature=temperature, seed=seed) if temperature > 0 else None
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.window = 4 * batch_size  # sorted by prompt length, then decoded batch_size at a time
        self.context = getattr(self.target.config, "max_position_embeddings", None)

    def run(self, conversations: list[list[Message]]) -> list[list[Message] | RequestFailed]:
        outs: list[list[Message]] = [[] for _ in conversations]
        pending = [list(m) for m in conversations]  # what is left of each conversation, in order
        failed: dict[int, RequestFailed] = {}
        while True:
            for row, rest in enumerate(pending):  # copy over the turns up to each one's next assistant turn
                while rest and rest[0]["role"] != "assistant":
                    outs[row].append(dict(rest.pop(0)))
            rows = [r for r, rest in enumerate(pending) if rest and r not in failed]
            if not rows:
                break
            prompts = {}
            for r in rows:
                rendered = self.tokenizer.apply_chat_template(outs[r], add_generation_prompt=True, tokenize=False)
                prompts[r] = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
                if self.context and len(prompts[r]) + self.max_tokens > self.context:
                    failed[r] = RequestFailed(f"a prompt of {len(prompts[r])} tokens plus --max-new-tokens "
                                              f"{self.max_tokens} exceeds the target's context of {self.context}")
            rows = sorted((r for r in rows if r not in failed), key=lambda r: len(prompts[r]))
            for start in range(0, len(rows), self.batch_size):
                batch = rows[start: start + self.batch_size]
                try:
                    results = self.generator.generate_batch([prompts[r] for r in batch], self.max_tokens, self.eos,
                                                            self.sampling)
                except (ValueError, RuntimeError) as e:
                    for r in batch:
                        failed[r] = RequestFailed(f"the runtime failed on this batch: {str(e).splitlines()[0]}")
                    continue
                for r, result in zip(batch, results):
                    ids = [t for t in result.token_ids if t not in self.eos]
                    outs[r].append({"role": "assistant",
                                    "content": self.tokenizer.decode(ids, skip_special_tokens=True)})
                    pending[r].pop(0)
        return [failed.get(r, outs[r]) for r in range(len(conversations))]


# --------------------------------------------------------------------------- the job


def _finished(folder: Path) -> dict[str, set[int]]:
    """Record indices already in each output file; a last line cut short (a kill mid-write) is dropped first."""
    done = {}
    for name in OUTPUTS:
        path = folder / f"{name}.jsonl"
        done[name] = set()
        if not path.is_file():
            continue
        raw = path.read_bytes()
        if raw and not raw.endswith(b"\n"):
            raw = raw[: raw.rfind(b"\n") + 1]
            path.write_bytes(raw)
        for line in raw.split(b"\n"):  # not str.splitlines: answers may hold U+2028 or U+0085, written raw
            if line.strip():
                done[name].add(json.loads(line)["index"])
    return done


def regenerate(data: str, out: Path, backend, *, format: str = "auto", split: str = "train",
               subset: str | None = None, limit: int | None = None, max_turns: int | None = None,
               log=print) -> dict[str, int]:
    """Regenerate every record of `data` into `out` (see the module docstring); returns the counts per file."""
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    done = _finished(out)
    already = set().union(*done.values())
    files = {name: (out / f"{name}.jsonl").open("a", encoding="utf-8") for name in OUTPUTS}
    counts = {name: len(ids) for name, ids in done.items()}

    def write(name: str, row: dict) -> None:
        files[name].write(json.dumps(row, ensure_ascii=False) + "\n")
        files[name].flush()
        counts[name] += 1

    def flush_chunk(chunk: list[tuple[int, list[Message]]]) -> None:
        for (index, _), result in zip(chunk, backend.run([m for _, m in chunk])):
            if isinstance(result, RequestFailed):
                write("errors", {"index": index, "error": str(result)})
            else:
                write("regenerated", {"index": index, "conversations": result})
        bar.update(len(chunk))

    report = LoadReport(source=source_name(data, format))
    total, chunk = 0, []
    try:
        with tqdm(desc="regenerate", unit="conv", initial=0) as bar:
            records: Iterable = iter_records(data, report, format, split, subset, 0, limit)
            for index, where, messages, reason in records:
                total += 1
                if index in already:
                    continue
                if messages is None:
                    write("skipped", {"index": index, "where": where, "reason": reason})
                    continue
                chunk.append((index, first_turns(messages, max_turns)))
                if len(chunk) >= backend.window:
                    flush_chunk(chunk)
                    chunk = []
            if chunk:
                flush_chunk(chunk)
    finally:
        for f in files.values():
            f.close()
    listed = sum(counts.values())
    log(f"regenerate: {total} records -> {counts['regenerated']} regenerated, {counts['errors']} errors, "
        f"{counts['skipped']} skipped ({'adds up' if listed == total else f'{listed} listed: does NOT add up'}); "
        f"{out}/regenerated.jsonl, errors.jsonl, skipped.jsonl")
    return {"records": total, **counts}


# --------------------------------------------------------------------------- command line


def add_regenerate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="conversations: JSONL, a folder of them, 'sharegpt' or a dataset id")
    p.add_argument("--out", required=True, type=Path, help="folder for regenerated/errors/skipped.jsonl (resumed)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--server", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    how.add_argument("--target", help="the target, run by draftsmith's runtime")
    p.add_argument("--model", default=None, help="--server: the model name to ask for (default: the first served)")
    p.add_argument("--concurrency", type=int, default=8, help="--server: conversations in flight")
    p.add_argument("--retries", type=int, default=3, help="--server: retries of a failed request")
    p.add_argument("--timeout", type=float, default=600.0, help="--server: seconds per request")
    p.add_argument("--batch-size", type=int, default=8, help="--target: conversations decoded together")
    p.add_argument("--dtype", default="auto", help="--target: auto, bfloat16, float16 or float32")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--max-turns", type=int, default=None,
                   help="regenerate the first N assistant turns of each conversation and drop the rest")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "sharegpt", "hf"])
    p.add_argument("--split", default="train")
    p.add_argument("--subset", default=None)
    p.add_argument("--limit", type=int, default=None, help="the first N records only")


def run_regenerate(args: argparse.Namespace) -> int:
    for name in ("concurrency", "batch_size", "max_new_tokens", "max_turns"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise RegenerateError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.server:
        backend = ServerBackend(args.server, args.model, args.max_new_tokens, args.temperature, args.retries,
                                args.timeout, concurrency=args.concurrency)
    else:
        backend = RuntimeBackend(args.target, args.dtype, args.max_new_tokens, args.temperature, args.batch_size)
    regenerate(args.data, args.out, backend, format=args.format, split=args.split, subset=args.subset,
               limit=args.limit, max_turns=args.max_turns)
    return 0
