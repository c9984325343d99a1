"""benchmarks/ is a package: every module imports as `benchmarks.NAME` without touching sys.path, and run_info() (the
block every result's JSON starts with) has its keys. The benchmarks themselves need a GPU and measure, never assert:
none of them runs here."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MODULES = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")
RUN_INFO_KEYS = {"command", "git_commit", "git_dirty", "versions", "hardware", "gpu_count", "cpu", "cpus", "date"}
VERSION_KEYS = {"python", "draftsmith", "torch", "transformers", "accelerate", "triton", "vllm"}
PATH_EDIT = re.compile(r"sys\.path\s*(\.(insert|append|extend)\b|\+=|=[^=]|\[)|site\.addsitedir")

# Import every benchmark module, note the ones whose import changed sys.path, then take run_info().
CHECK = f"""
import importlib, sys
changed = []
for name in {MODULES!r}:
    before = list(sys.path)
    importlib.import_module("benchmarks." + name)
    if sys.path != before:
        changed.append(name)
from benchmarks.runinfo import run_info
result = {{"changed": changed, "info": run_info(), "package": sys.modules["benchmarks"].__file__}}
"""


def imported() -> dict:
    """CHECK's result: in this process where `benchmarks` already resolves to this checkout's (the suite started
    from the repository root, as `make test` starts it), else in a Python started there, as `python -m
    benchmarks.NAME` is."""
    spec = importlib.util.find_spec("benchmarks")
    if spec is not None and spec.origin and Path(spec.origin).resolve() == BENCHMARKS / "__init__.py":
        namespace: dict = {}
        exec(compile(CHECK, "<benchmarks import check>", "exec"), namespace)
        return namespace["result"]
    code = CHECK + "import json; print(json.dumps(result))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_benchmark_module_imports_as_a_package_module_and_run_info_has_its_keys():
    result = imported()
    assert Path(result["package"]).resolve() == BENCHMARKS / "__init__.py"
    assert result["changed"] == [], f"importing these changed sys.path: {result['changed']}"
    info = result["info"]
    assert RUN_INFO_KEYS <= info.keys(), RUN_INFO_KEYS - info.keys()
    assert VERSION_KEYS <= info["versions"].keys(), VERSION_KEYS - info["versions"].keys()
    assert info["versions"]["torch"] and info["versions"]["python"]
    assert isinstance(info["command"], str) and info["command"]
    assert info["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", info["git_commit"])
    assert info["git_dirty"] in (None, True, False)
    assert isinstance(info["hardware"], str) and info["hardware"]
    assert isinstance(info["gpu_count"], int) and info["gpu_count"] >= 0
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", info["date"])
    json.dumps(info)  # it goes into every result's JSON


def test_run_info_takes_the_commit_from_the_environment_without_git():
    """The lent GPU machine receives the checkout without .git: the commit comes from BENCHMARK_GIT_COMMIT."""
    code = ("import json, benchmarks.runinfo as r; r._git = lambda *a: None; "
            "print(json.dumps(r.git_state()))")
    env = {**os.environ, "BENCHMARK_GIT_COMMIT": "a" * 40, "BENCHMARK_GIT_DIRTY": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"git_commit": "a" * 40, "git_dirty": True}


def test_no_benchmark_edits_sys_path():
    offenders = []
    for path in sorted(BENCHMARKS.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        data = path.read_bytes()
        if b"sys.path.insert" in data or (path.suffix in (".py", ".sh")
                                          and PATH_EDIT.search(data.decode(errors="replace"))):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], f"sys.path edited in {offenders}: import benchmarks.* and run python -m benchmarks.NAME"


def test_every_results_folder_names_the_commit_that_produced_it():
    """Each results README's first paragraph after its title is `Produced by commit X (date)...`
    (benchmarks/README.md, 'Where results go')."""
    missing = []
    for readme in sorted((BENCHMARKS / "results").glob("*/README.md")):
        paragraphs = readme.read_text().split("\n\n")
        if not (paragraphs[0].startswith("# ") and len(paragraphs) > 1
                and re.match(r"Produced by commits? [0-9a-f]{7,40}\b", paragraphs[1])):
            missing.append(str(readme.relative_to(ROOT)))
    assert missing == [], f"no 'Produced by commit X (date)' paragraph under the title of {missing}"
