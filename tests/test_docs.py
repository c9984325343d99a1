"""The README and the pages under docs/ stay true to the code (issue 45, item 6).

Every shell command they show in a ```bash block that runs draftsmith (`draftsmith SUB ...`, `python -m
draftsmith...`, `accelerate launch ... -m draftsmith.train ...`) is parsed by that subcommand's own argparse parser
(nothing runs); every `section.key=value` override on it and every recipe key a page names in backticks is a key of
the recipe schema; every recipe file named exists; every relative link (and its #anchor) resolves; every `make`
target, `DRAFTSMITH_*` variable and repository path named exists. The README stays a front page (at most
README_MAX_LINES lines). Only parsers are built: nothing trains, and no model or data is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
README_MAX_LINES = 200

# Where a module run as `python -m` / `accelerate launch -m` lands among the subcommands (draftsmith/train/__main__.py,
# draftsmith/collect.py); `draftsmith` and `draftsmith.cli` take the subcommand as their first argument.
MODULE_COMMANDS = {"draftsmith.train": "train", "draftsmith.collect": "collect", "draftsmith": None,
                   "draftsmith.cli": None}
CONTROL = {"&&", "||", ";", "|", "&"}  # shell operators that end one command and start the next
FENCE = re.compile(r"^```(\S*)\s*$")
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")  # an inline code span (may run over a line break)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
OVERRIDE = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)+)=")
RECIPE_PATH = re.compile(r"recipes/[\w./-]*?\.yaml")
ENV_VAR = re.compile(r"\bDRAFTSMITH_[A-Z0-9_]+\b")
REPO_PATH = re.compile(r"^(?:draftsmith|tests|recipes|benchmarks|scripts)/[\w./-]*$")
PACKAGE_DIRS = {"data", "models", "train", "kernels", "inference", "runtime", "targets"}  # paths named from draftsmith/
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "safetensors", "md", "txt", "pt", "png", "sh", "jinja", "log"}


@dataclass(frozen=True)
class Shown:
    """A command a page shows: where, and its words as the shell would pass them."""

    page: str
    line: int
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)[:160]}"


def _rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def _split_fences(text: str) -> tuple[list[tuple[int, str, list[str]]], str]:
    """The fenced blocks of a page as (first line number, language, lines), and its prose with the blocks blanked
    (line numbers kept)."""
    blocks, prose, current = [], [], None
    for number, line in enumerate(text.split("\n"), 1):
        fence = FENCE.match(line)
        if current is None and fence:
            current = (number + 1, fence.group(1), [])
            prose.append("")
        elif current is not None and line.strip() == "```":
            blocks.append(current)
            current = None
            prose.append("")
        elif current is not None:
            current[2].append(line)
            prose.append("")
        else:
            prose.append(line)
    assert current is None, "a fenced block is left open"
    return blocks, "\n".join(prose)


def _shell_commands(first: int, lines: list[str]) -> Iterator[tuple[int, list[str]]]:
    """The commands of a bash block: backslash continuations joined, quotes left open carried over lines, comments
    dropped, split at the shell's control operators."""
    i = 0
    while i < len(lines):
        start, text = i, ""
        while i < len(lines):
            line = lines[i]
            i += 1
            if line.endswith("\\"):
                text += line[:-1] + " "
                continue
            text += line
            try:
                shlex.split(text, comments=True)
            except ValueError:  # a quoted argument runs on to the next line
                text += "\n"
                continue
            break
        words: list[str] = []
        for word in [*shlex.split(text, comments=True), ";"]:
            if word in CONTROL:
                if words:
                    yield first + start, words
                words = []
            else:
                words.append(word)


@cache
def _page(page: Path) -> tuple[list[tuple[int, str, list[str]]], str]:
    return _split_fences(page.read_text())


def _spans(page: Path) -> Iterator[tuple[int, str]]:
    """The inline code spans of a page's prose, with their line numbers, whitespace collapsed."""
    prose = _page(page)[1]
    for m in SPAN.finditer(prose):
        yield prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())


def _shown() -> list[Shown]:
    out = []
    for page in PAGES:
        for first, language, lines in _page(page)[0]:
            if language in ("bash", "sh", "shell", "console"):
                out += [Shown(_rel(page), line, tuple(words)) for line, words in _shell_commands(first, lines)]
    return out


@cache
def _accelerate_parser():
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser()


def _draftsmith_call(shown: Shown) -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) of a command that runs draftsmith, else None."""
    argv = list(shown.argv)
    module = None
    if argv[0] == "draftsmith":
        return (argv[1], argv[2:]) if len(argv) > 1 else ("", [])
    if argv[0] in ("python", "python3") and argv[1:2] == ["-m"] and argv[2].split(".")[0] == "draftsmith":
        module, args = argv[2], argv[3:]
    elif argv[:2] == ["accelerate", "launch"]:
        if "draftsmith" not in " ".join(argv):
            return None
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                ns = _accelerate_parser().parse_args(argv[2:])
            except SystemExit:
                pytest.fail(f"{shown}\n  accelerate launch does not parse it: {err.getvalue().strip()}")
        assert ns.module, f"{shown}\n  runs draftsmith without -m"
        module, args = ns.training_script, list(ns.training_script_args)
    else:
        return None
    assert module in MODULE_COMMANDS, f"{shown}\n  {module} is not a module that runs a draftsmith command"
    sub = MODULE_COMMANDS[module]
    return (sub, args) if sub else ((args[0], args[1:]) if args else ("", []))


SHOWN = _shown()
CALLS = [(shown, call) for shown in SHOWN if (call := _draftsmith_call(shown)) is not None]


@cache
def _parser(sub: str):
    from draftsmith.cli import build_parser

    return build_parser([sub])


def _subparser(sub: str) -> argparse.ArgumentParser:
    """The parser of `draftsmith SUB` itself, whose actions are that subcommand's flags."""
    (action,) = [a for a in _parser(sub)._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices[sub]


def _parse(sub: str, args: list[str]):
    """argparse's namespace for `draftsmith SUB ARGS`, or (None, its error message)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return _parser(sub).parse_args([sub, *args]), ""
        except SystemExit as e:
            return (e.code if e.code == 0 else None), err.getvalue().strip()


def _section(annotation) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


@cache
def _recipe_keys() -> frozenset[str]:
    """Every dotted key of the recipe schema (draftsmith.config.Recipe): 'model', 'model.target', 'collect.vllm.url'."""
    from draftsmith.config import Recipe

    keys: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            keys.add(prefix + name)
            section = _section(info.annotation)
            if section is not None:
                walk(section, prefix + name + ".")

    walk(Recipe, "")
    return frozenset(keys)


@cache
def _sections() -> frozenset[str]:
    return frozenset(k for k in _recipe_keys() if "." not in k and any(j.startswith(k + ".") for j in _recipe_keys()))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    prose = _page(page)[1]
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose, re.M)}


# ----------------------------------------------------------------------------- the commands


def test_the_pages_show_the_commands_they_are_about():
    """The extraction finds what the README promises: the train, export and eval commands, the accelerate launch,
    and every subcommand somewhere in the pages (so a broken extractor cannot pass by finding nothing)."""
    from draftsmith.cli import COMMANDS

    readme = {sub for shown, (sub, _) in CALLS if shown.page == "README.md"}
    assert {"train", "export", "generate", "eval"} <= readme, readme
    assert any(shown.argv[0] == "accelerate" for shown, _ in CALLS)
    shown_anywhere = {sub for _, (sub, _) in CALLS}
    inline = {span.split()[1] for page in PAGES for _, span in _spans(page)
              if span.startswith("draftsmith ") and len(span.split()) > 1}
    assert set(COMMANDS) <= shown_anywhere | inline, set(COMMANDS) - shown_anywhere - inline


@pytest.mark.parametrize("shown,call", CALLS, ids=[str(shown)[:60] for shown, _ in CALLS])
def test_every_shown_command_parses(shown, call):
    """(a) the subcommand exists, its --help renders, and its own parser accepts every flag and argument shown;
    (b) every dotted override is a recipe key; (c) every recipe file it names exists; JSON arguments are JSON."""
    from draftsmith.cli import COMMANDS

    sub, args = call
    if sub not in COMMANDS:
        pytest.fail(f"{shown}\n  no subcommand {sub!r} (draftsmith has {', '.join(COMMANDS)})")
    code, message = _parse(sub, ["--help"])
    assert code == 0, f"{shown}\n  `draftsmith {sub} --help` fails: {message}"
    ns, message = _parse(sub, args)
    assert ns is not None, f"{shown}\n  `draftsmith {sub}` does not accept it: {message}"
    for word in args:
        if (m := OVERRIDE.match(word)) and m.group(1) not in _recipe_keys():
            pytest.fail(f"{shown}\n  {m.group(1)} is not a recipe key (draftsmith.config.Recipe)")
        for path in RECIPE_PATH.findall(word):
            if not (REPO / path).is_file():
                pytest.fail(f"{shown}\n  {path} does not exist")
    for flag, value in zip(args, args[1:]):
        if flag == "--speculative-config":
            try:
                assert isinstance(json.loads(value).get("method"), str)
            except (ValueError, AttributeError, AssertionError):
                pytest.fail(f"{shown}\n  --speculative-config {value!r} is not a JSON object with a method")


def test_inline_commands_name_real_subcommands_and_flags():
    """A command quoted in running text (`draftsmith regenerate --max-turns 1`) names a subcommand, and flags that
    subcommand takes."""
    from draftsmith.cli import COMMANDS

    problems = []
    for page in PAGES:
        for line, span in _spans(page):
            words = span.split()
            if words[0] != "draftsmith" or len(words) < 2 or words[1].isupper():  # `draftsmith COMMAND`
                continue
            if words[1] not in COMMANDS:
                problems.append(f"{_rel(page)}:{line}: `{span}`: no subcommand {words[1]!r}")
                continue
            known = {o for a in _subparser(words[1])._actions for o in a.option_strings}
            problems += [f"{_rel(page)}:{line}: `{span}`: draftsmith {words[1]} has no {w}"
                         for w in words[2:] if w.startswith("--") and w.split("=")[0] not in known]
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- what the prose names


def test_recipe_keys_named_in_the_pages_exist():
    """(b) every `section.key` (or `section.key: value`, `section.key=value`) a page quotes is in the schema."""
    problems = []
    for page in PAGES:
        for line, span in _spans(page):
            m = re.match(r"^([a-z_]\w*(?:\.\w+)+)(?:\s*[:=]\s*.*)?$", span)
            if not m or any(c in span.split(":")[0] for c in "*{<"):
                continue
            key = m.group(1)
            if key.split(".")[0] not in _sections() or key.rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue  # e.g. `device.host_to_device`, `model.safetensors`
            if key not in _recipe_keys():
                problems.append(f"{_rel(page)}:{line}: `{span}`: {key} is not a recipe key")
    assert not problems, "\n".join(problems)


def test_recipe_files_named_in_the_pages_exist():
    """(c) every recipes/*.yaml path in a page, and every recipe named by its file name alone (the recipe table),
    exists."""
    recipes = {p.name for p in (REPO / "recipes").rglob("*.yaml")}
    problems = []
    for page in PAGES:
        text = page.read_text()
        problems += [f"{_rel(page)}: {path}" for path in RECIPE_PATH.findall(text) if not (REPO / path).is_file()]
        problems += [f"{_rel(page)}:{line}: `{span}`" for line, span in _spans(page)
                     if re.fullmatch(r"[\w-]+\.yaml", span) and span not in recipes]
    assert not problems, "no such recipe:\n" + "\n".join(problems)


def test_relative_links_resolve():
    """(d) every relative link points at a file or folder of the repository, and its #anchor at a heading."""
    problems = []
    for page in PAGES:
        prose = _page(page)[1]
        for m in LINK.finditer(prose):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            line = prose.count("\n", 0, m.start()) + 1
            if not where.exists():
                problems.append(f"{_rel(page)}:{line}: {target}: no such file")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                problems.append(f"{_rel(page)}:{line}: {target}: no heading #{anchor} in {where.name}")
    assert not problems, "\n".join(problems)


def test_make_targets_and_environment_variables_named_exist():
    """`make X` is a Makefile target; a DRAFTSMITH_* variable is read somewhere in the code."""
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    code = "\n".join(p.read_text() for d in ("draftsmith", "benchmarks", "tests", "scripts")
                     for p in (REPO / d).rglob("*") if p.suffix in (".py", ".sh"))
    problems = []
    for page in PAGES:
        text = page.read_text()
        named = [s.split()[1] for _, s in _spans(page) if s.startswith("make ") and len(s.split()) > 1]
        named += [s.argv[1] for s in SHOWN if s.page == _rel(page) and s.argv[0] == "make" and len(s.argv) > 1]
        problems += [f"{_rel(page)}: make {t}: no such target" for t in named if t not in targets]
        problems += [f"{_rel(page)}: {v} is read nowhere" for v in set(ENV_VAR.findall(text)) if v not in code]
    assert not problems, "\n".join(problems)


def test_repository_paths_named_exist():
    """A path a page quotes from the repository root (`draftsmith/train/flops.py`, `benchmarks/results/...`)
    exists: a moved file or folder updates the page that names it."""
    problems = []
    for page in PAGES:
        for line, span in _spans(page):
            path = span.split()[0].rstrip(",:;")
            if REPO_PATH.match(path) and not (REPO / path).exists():
                problems.append(f"{_rel(page)}:{line}: `{span}`: no {path}")
    assert not problems, "\n".join(problems)


def test_package_paths_named_exist():
    """A path a page quotes inside the package (`train/flops.py`, `targets/llama.py` for models/targets/,
    `models/spec.check_layer_ids` for a name in a module) exists."""
    problems = []
    for page in PAGES:
        for line, span in _spans(page):
            path = span.split()[0].rstrip(",:;")
            if path.split("/")[0] not in PACKAGE_DIRS or not re.fullmatch(r"[\w/.-]+", path):
                continue
            module = re.sub(r"\.[a-z_]\w*$", ".py", path) if not path.endswith((".py", "/")) else path
            if not any((base / p).exists() for base in (REPO / "draftsmith", REPO / "draftsmith" / "models")
                       for p in (path, module)):
                problems.append(f"{_rel(page)}:{line}: `{span}`: no draftsmith/{path}")
    assert not problems, "\n".join(problems)


def test_layout_names_what_exists():
    """The Layout block of docs/contributing.md lists files and folders that exist, and every package folder of
    draftsmith/."""
    blocks = [lines for _, language, lines in _page(REPO / "docs" / "contributing.md")[0]
              if language == "" and lines and lines[0] == "draftsmith/"]
    assert len(blocks) == 1, "docs/contributing.md has no Layout block starting with draftsmith/"
    listed = set()
    for row in blocks[0]:
        if m := re.match(r"^(\S+/)(?:\s{2,}|$)", row):
            listed.add(m.group(1).rstrip("/"))
        elif m := re.match(r"^  (\S+)\s{2,}", row):
            listed.add("draftsmith/" + m.group(1).rstrip("/"))
    missing = sorted(name for name in listed if not (REPO / name).exists())
    assert not missing, f"the Layout block lists what does not exist: {missing}"
    packages = {"draftsmith/" + p.parent.name for p in (REPO / "draftsmith").glob("*/__init__.py")}
    assert packages <= listed, f"the Layout block does not list {sorted(packages - listed)}"


def test_readme_is_a_front_page():
    """At most README_MAX_LINES lines, and every page of docs/ reachable from it."""
    text = README.read_text()
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines: move detail into docs/ (at most {README_MAX_LINES})"
    for page in sorted((REPO / "docs").rglob("*.md")):
        assert f"]({_rel(page)})" in text, f"README.md does not link {_rel(page)}"
