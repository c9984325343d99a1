"""`draftsmith regenerate`: replace a dataset's assistant turns with the target's own answers.

A drafter learns to predict the target, so it trains best on what the target itself writes. Each conversation is
regenerated turn by turn: the k-th assistant turn becomes the target's answer to the conversation so far, whose
earlier assistant turns are already the target's own. Two ways to run the target:

    --server URL   any OpenAI-compatible server (vLLM, SGLang): `/v1/chat/completions`, `--concurrency`
                   conversations at once, each request retried with exponential backoff on connection errors,
                   timeouts (`--timeout` bounds the whole request, from its start to its last byte), 429 and 5xx,
                   and on replies cut short, not JSON, nested too deeply to read, without their fields or whose
                   answer is not Unicode text (a lone surrogate) (`--retries`); an answer without text (a tool
                   call, a refusal) is an error for its record
    --target PATH  draftsmith's runtime, `--batch-size` conversations decoded together (taken from a window of
                   four batches sorted by prompt length, so a batch pads little)

`--max-turns N` keeps the first N assistant turns of each conversation and drops what follows them (a drafter
for a chat target learns most from first answers, and they cost the least to regenerate).

Outputs in `--out`: `regenerated.jsonl` ({"index", "conversations"}), `errors.jsonl` ({"index", "error"}) and
`skipped.jsonl` ({"index", "where", "reason"}: records with nothing to regenerate); every input record lands in
exactly one of them, and the closing line says the counts add up. A rerun resumes: records already in any of the
three files are not redone (a line cut short by a kill is dropped first; any other damaged line is refused with
its file and line). Records are matched by index, so
`regenerate.json` records what the folder is made from (the input's sha256, how it is read, the target, --max-turns,
--max-new-tokens, --temperature) and a rerun with anything else is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftsmith.data.conversations import LoadReport, Message, is_text, iter_records, resolve_source, source_name
from draftsmith.data.fetch import fetch_within

OUTPUTS = ("regenerated", "errors", "skipped")
MADE_FROM = "regenerate.json"  # what the output folder's records were made from; a rerun must match it
MADE_FROM_FLAGS = {"data": "--data", "data_sha256": "--data", "format": "--format", "split": "--split",
                   "subset": "--subset", "target": "--model/--target", "max_turns": "--max-turns",
                   "max_new_tokens": "--max-new-tokens", "temperature": "--temperature"}
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class RegenerateError(ValueError):
    """Bad arguments or a server that cannot be used at all; one line."""


class RequestFailed(Exception):
    """One conversation could not be regenerated (after retries); its message goes to errors.jsonl."""


class _BadReply(Exception):
    """Internal: a reply that is not what the endpoint promises (not JSON, fields missing); retried."""


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
        if retries < 0:
            raise RegenerateError(f"--retries must be >= 0, got {retries}")
        if not 0 < timeout < math.inf:
            raise RegenerateError(f"--timeout must be a positive number of seconds, got {timeout}")
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.max_tokens, self.temperature = max_tokens, temperature
        self.retries, self.timeout, self.backoff = retries, timeout, backoff
        self.concurrency = concurrency
        self.window = 4 * concurrency  # conversations handed to run() at once: enough to keep the server busy
        self.model = model or self._first_model()
        self.target_name = self.model  # what regenerate.json records as the target

    def _request(self, path: str, body: dict | None = None, read: Callable | None = None):
        """The JSON reply of `path`, passed through `read` (which raises _BadReply when a field is missing). A failed
        connection, a timeout (of the whole request), a 429 or 5xx, a reply cut short, not JSON or nested too deeply
        and a bad reply are retried with backoff; what still fails after --retries is a RequestFailed naming the
        URL."""
        url = self.base + path
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            try:
                raw = fetch_within(request, self.timeout, "--timeout")
                try:
                    reply = json.loads(raw)
                except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                    shown = raw[:100].decode(errors="replace").replace("\n", " ")
                    raise _BadReply(f"the reply is not JSON ({e}): {shown!r}") from None
                except RecursionError:  # valid JSON, but [[[[...]]]] deeper than json can read
                    raise _BadReply(f"the reply is JSON nested too deeply to read ({len(raw)} bytes, starting "
                                    f"{raw[:20].decode(errors='replace')!r})") from None
                return read(reply) if read else reply
            except urllib.error.HTTPError as e:
                detail = getattr(e, "body", b"").decode(errors="replace")[:200].replace("\n", " ")
                if e.code not in RETRY_STATUS or attempt == self.retries:
                    raise RequestFailed(f"HTTP {e.code} from {url}: {detail}") from None
            except http.client.IncompleteRead as e:
                if attempt == self.retries:
                    raise RequestFailed(f"{url}: the reply was cut short ({len(e.partial)} bytes of "
                                        f"{len(e.partial) + (e.expected or 0)})") from None
            except (OSError, http.client.HTTPException, _BadReply) as e:  # OSError: URLError, timeouts, resets
                if attempt == self.retries:
                    raise RequestFailed(f"{url}: {getattr(e, 'reason', e)}") from None
            time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _first_model(self) -> str:
        def ids(reply) -> list[str]:
            models = reply.get("data") if isinstance(reply, dict) else None
            if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                       for m in models):
                raise _BadReply("no data[].id list of models in the reply")
            return [m["id"] for m in models]

        try:
            models = self._request("/models", read=ids)
        except RequestFailed as e:
            raise RegenerateError(f"--server: cannot list the models: {e}") from None
        if not models:
            raise RegenerateError(f"--server {self.base}: serves no model; pass --model")
        return models[0]

    def answer(self, context: list[Message]) -> str:
        def first_choice(reply) -> dict:
            try:
                choice = reply["choices"][0]
                if isinstance(choice["message"], dict) and "content" in choice["message"]:
                    content = choice["message"]["content"]
                    if isinstance(content, str) and not is_text(content):  # valid JSON ("\ud800"), but no text:
                        # it could be neither written as UTF-8 nor tokenized
                        at = next(i for i, c in enumerate(content) if not is_text(c))
                        raise _BadReply(f"the answer is not Unicode text: a lone surrogate "
                                        f"{json.dumps(content[at])} at character {at}")
                    return choice
            except (KeyError, IndexError, TypeError):
                pass
            raise _BadReply("no choices[0].message.content in the reply")

        choice = self._request("/chat/completions", {"model": self.model, "messages": context,
                                                     "max_tokens": self.max_tokens, "temperature": self.temperature},
                               first_choice)
        message = choice["message"]
        if not isinstance(message["content"], str) or not message["content"]:
            # a well-formed answer, so not retried: at the same temperature the target says the same again
            why = ("a tool call" if message.get("tool_calls") else
                   f"a refusal: {str(message['refusal'])[:100]!r}" if message.get("refusal") else
                   f"content {json.dumps(message['content'])[:50]}, finish_reason {choice.get('finish_reason')!r}")
            raise RequestFailed(f"{self.base}/chat/completions: the answer holds no text ({why})")
        return message["content"]

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
        from draftsmith.models.target import TargetModel, load_target_tokenizer
        from draftsmith.runtime.sampling import SamplingParams

        self.target_name = target  # what regenerate.json records as the target
        self.tokenizer = load_target_tokenizer(target, "--target", RegenerateError)
        if not getattr(self.tokenizer, "chat_template", None):
            raise RegenerateError(f"--target {target}: its tokenizer has no chat template to render turns with")
        self.target = TargetModel.from_pretrained(target, dtype=dtype)
        self.generator = SpeculativeGenerator(self.target, None, 0)
        self.eos = eos_token_ids(self.target, self.tokenizer)
        self.sampling = SamplingParams(temperature=temperature, seed=seed) if temperature > 0 else None
        self.max_tokens, self.temperature, self.batch_size = max_tokens, temperature, batch_size
        self.window = 4 * batch_size  # sorted by prompt length, then decoded batch_size at a time

    def run(self, conversations: list[list[Message]]) -> list[list[Message] | RequestFailed]:
        from draftsmith.models.target import prompt_overflow

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
                overflow = prompt_overflow(len(prompts[r]), self.max_tokens, self.target.config)
                if overflow:  # the runtime's one context rule (models/target.py), as generate and eval apply it
                    failed[r] = RequestFailed(overflow)
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
    """Record indices already in each output file; a last line cut short (a kill mid-write) is dropped first. Any
    other line that is not a JSON object with an "index" is refused in one line naming its file and line: which
    record it held is unknown, so resuming would redo or lose one."""
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
        # not str.splitlines: answers may hold U+2028 or U+0085, written raw
        for lineno, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                why = None
            except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                row, why = None, f"not JSON ({str(e)[:100]})"
            except RecursionError:
                row, why = None, "JSON nested too deeply to read"
            index = row.get("index") if isinstance(row, dict) else None
            if why is None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
                why = "not a JSON object with an integer \"index\""
            if why is not None:
                raise RegenerateError(f"{path}:{lineno}: a damaged line, {why}: delete that line (its record is "
                                      "then regenerated again) or choose a new --out")
            done[name].add(index)
    return done


def _sha256_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def made_from(data: str, backend, format: str, split: str, subset: str | None, max_turns: int | None) -> dict:
    """What an output folder's records depend on: the input (the sha256 of its bytes where it is local files, its
    name where it is a dataset id), how it is read, the target and how it answers."""
    _, files = resolve_source(str(data), format)
    return {"data": str(data), "data_sha256": _sha256_files(files) if files else None, "format": format,
            "split": split, "subset": subset, "target": backend.target_name, "max_turns": max_turns,
            "max_new_tokens": backend.max_tokens, "temperature": backend.temperature}


def check_made_from(out: Path, want: dict) -> None:
    """Refuse to resume a folder whose records came from another input or settings: records are matched by index,
    so they would be skipped as done. A folder without records may be reused for anything."""
    if not any((out / f"{name}.jsonl").is_file() and (out / f"{name}.jsonl").stat().st_size for name in OUTPUTS):
        return
    path, fresh = out / MADE_FROM, f"choose a new --out or delete {out}"
    if not path.is_file():
        raise RegenerateError(f"{out}: holds records but no {MADE_FROM} saying what they were made from: {fresh}")
    try:
        there = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise RegenerateError(f"{path}: not valid JSON ({e}): {fresh}") from None
    if not isinstance(there, dict):
        raise RegenerateError(f"{path}: not a JSON object: {fresh}")

    def shown(key: str, made: dict) -> str:
        if key == "data_sha256":
            return f"{made.get('data')} (sha256 {str(made.get(key))[:12]})"
        return json.dumps(made.get(key))

    keys = [k for k in want if k != "data" or want["data_sha256"] is None]  # a local input is known by its bytes
    differ = [f"{MADE_FROM_FLAGS[k]} {shown(k, there)} there, {shown(k, want)} now" for k in keys
              if there.get(k) != want[k]]
    if differ:
        raise RegenerateError(f"{out}: made from another input ({'; '.join(differ)}; see {MADE_FROM}): resume it with "
                              f"those, or {fresh}")


def regenerate(data: str, out: Path, backend, *, format: str = "auto", split: str = "train",
               subset: str | None = None, limit: int | None = None, max_turns: int | None = None,
               log=print) -> dict[str, int]:
    """Regenerate every record of `data` into `out` (see the module docstring); returns the counts per file."""
    from tqdm.auto import tqdm

    from draftsmith.models.checkpoint import write_json_atomic

    want = made_from(data, backend, format, split, subset, max_turns)
    check_made_from(out, want)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(want, out / MADE_FROM)
    done = _finished(out)
    already = set().union(*done.values())
    files = {name: (out / f"{name}.jsonl").open("a", encoding="utf-8") for name in OUTPUTS}
    counts = {name: len(ids) for name, ids in done.items()}

    def write(name: str, row: dict) -> None:
        line = json.dumps(row, ensure_ascii=False)
        if not is_text(line):  # a lone surrogate (a record's key, say) cannot be written as UTF-8: \u escapes can
            line = json.dumps(row)
        files[name].write(line + "\n")
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
    p.add_argument("--timeout", type=float, default=600.0,
                   help="--server: seconds per request, from its start to its last byte")
    p.add_argument("--batch-size", type=int, default=8, help="--target: conversations decoded together")
    p.add_argument("--dtype", default="auto", help="--target: auto, bfloat16, float16 or float32")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="the longest answer, in tokens, per turn")
    p.add_argument("--max-turns", type=int, default=None,
                   help="regenerate the first N assistant turns of each conversation and drop the rest")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "sharegpt", "hf"],
                   help="how to read --data (auto: from the file name or content)")
    p.add_argument("--split", default="train", help="the split of a Hugging Face dataset --data")
    p.add_argument("--subset", default=None, help="the subset (configuration) of a Hugging Face dataset --data")
    p.add_argument("--limit", type=int, default=None, help="the first N records only")


def run_regenerate(args: argparse.Namespace) -> int:
    for name in ("concurrency", "batch_size", "max_new_tokens", "max_turns"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise RegenerateError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.temperature < math.inf:
        raise RegenerateError(f"--temperature must be >= 0, got {args.temperature}")
    if args.server:
        backend = ServerBackend(args.server, args.model, args.max_new_tokens, args.temperature, args.retries,
                                args.timeout, concurrency=args.concurrency)
    else:
        backend = RuntimeBackend(args.target, args.dtype, args.max_new_tokens, args.temperature, args.batch_size)
    regenerate(args.data, args.out, backend, format=args.format, split=args.split, subset=args.subset,
               limit=args.limit, max_turns=args.max_turns)
    return 0
