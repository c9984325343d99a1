"""PNG of benchmarks/per_token.py's learning curves: tau at k=5 (T=0) against training tokens, one line per curve
run (draftsmith's curve configs, each speculators variant), and every final checkpoint as a point.

    python benchmarks/plot_per_token.py benchmarks/results/.../per_token.json   # writes per_token.png beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(argv[0])
    result = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in result["summary"]["curves"].items():
        if curve:
            ax.plot([p["tokens"] / 1e6 for p in curve], [p["tau_k5"] for p in curve], marker="o", label=name)
    for run in result["runs"]:
        final = run["points"][-1] if run["points"] else {}
        if not run["curve"] and (final.get("tau") or {}).get("5") is not None:
            ax.scatter(final["tokens"] / 1e6, final["tau"]["5"], marker="x")
            ax.annotate(run["name"], (final["tokens"] / 1e6, final["tau"]["5"]), fontsize=6)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("mean acceptance length, k=5, T=0")
    ax.set_title(f"EAGLE-3 on the fixture target: draftsmith vs speculators ({result['hardware']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
