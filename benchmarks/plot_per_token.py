"""PNG of benchmarks/per_token.py's learning curves: tau at k=5 (T=0) against training tokens, one line per curve
run (draftsmith's curve configs, each speculators variant), and every other run's last scored checkpoint as a
point. A run stopped by its call's deadline (`"partial": true`) is drawn dashed or hollow and labelled "partial";
runs from several calls (`per_token.py --merge` / `merge`) are drawn alike, the title names the calls.

    python -m benchmarks.plot_per_token benchmarks/results/.../per_token.json   # writes per_token.png beside it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def scored(run: dict) -> list[dict]:
    return [p for p in run["points"] if (p.get("tau") or {}).get("5") is not None]


def is_partial(run: dict) -> bool:
    """Stopped short of its plan, or its last checkpoint not scored (as per_token.summarize reads it)."""
    points = scored(run)
    return bool(run.get("partial", run.get("stopped_at_deadline"))) or bool(
        points and points[-1]["step"] != run["points"][-1]["step"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("per_token_json", type=Path, help="per_token.py's JSON (the PNG is written beside it)")
    path = parser.parse_args(argv).per_token_json
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    partial = {r["name"]: is_partial(r) for r in result["runs"]}
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in result["summary"]["curves"].items():
        if curve:
            label = name + (" (partial)" if partial.get(name) else "")
            ax.plot([p["tokens"] / 1e6 for p in curve], [p["tau_k5"] for p in curve], marker="o", label=label,
                    linestyle="--" if partial.get(name) else "-")
    ends = [run for run in result["runs"] if not run["curve"] and scored(run)]
    colors = plt.get_cmap("tab20")
    for n, run in enumerate(ends):
        final = scored(run)[-1]
        hollow = partial.get(run["name"])
        color = colors(n % 20)
        # in the legend, not written beside the point: end points of one budget sit on top of each other
        style = (dict(marker="o", facecolors="none", edgecolors=color) if hollow
                 else dict(marker="x+^sv"[n // 20 % 5], color=color))  # tab20's colours, then the next marker
        ax.scatter(final["tokens"] / 1e6, final["tau"]["5"], **style,
                   label=run["name"] + (f" (partial, step {final['step']})" if hollow else ""))
    calls = len(result.get("calls") or [result])
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("mean acceptance length, k=5, T=0")
    ax.set_title(f"EAGLE-3 on the fixture target: draftsmith vs speculators ({result['hardware']}, "
                 f"{calls} call{'s' if calls > 1 else ''})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
