"""SGLang (0.5.23) against draftsmith's DSpark exports: `make interop-sglang` runs this folder in its own venv
(.venv-sglang), with DRAFTSMITH_INTEROP_SGLANG=1; `make test` leaves it out (tests/conftest.py). SGLang runs in a
subprocess per verify mode (sglang_dspark_job.py), so this process never imports it."""

import sys


def pytest_terminal_summary(terminalreporter):
    """One JSON line per (verify mode, export) after the last test: loaded or refused, and why."""
    import json

    module = next((m for m in list(sys.modules.values())
                   if (getattr(m, "__file__", None) or "").endswith("test_sglang_dspark.py")), None)
    rows = getattr(module, "MATRIX", None)
    if rows:
        terminalreporter.write_line("SGLANG DSPARK MATRIX")
        for row in rows:
            terminalreporter.write_line(json.dumps(row))
