"""What a sweep means for deployment: per-dataset tables, plots against k, and the setting to serve.

Input is `run_sweep`'s dict (eval.py). Recommendation rule, per dataset: the highest measured speedup over plain
decoding wins; speedups within `tie_tolerance` (relative) of the best are ties, and ties go to the smaller k,
because a shorter proposal costs less draft compute and degrades more gently when the workload drifts. Plain
decoding takes part as k = 0 at speedup 1.0, so when no config is measurably faster the advice is to serve
without speculation. Only configs vLLM can serve are recommended (a faster draftsmith-only one is mentioned).
The advice is printed as the `--speculative-config` JSON vLLM takes, with the settings that were measured (for
a drafter, the path the user gave).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftsmith.inference.eval import format_table, series_key
from draftsmith.models import registry

SPEEDUP_TIE_TOLERANCE = 0.01  # timing noise between runs of one config is about 1% on a quiet GPU
VLLM_KEY_ORDER = ("method", "model", "num_speculative_tokens")  # then the method's own keys, as measured
# draftsmith's own keys, never recommended to vLLM: the EAGLE-2 dynamic tree, the hybrid, and the methods' own
# runtime keys (DSpark's confidence_threshold)
NOT_IN_VLLM = frozenset({"dynamic_tree", "suffix_hybrid",
                         *(key for spec in registry.SPECS for key in spec.runtime_keys)})


def dataset_result(sweep: Mapping[str, Any], name: str) -> dict[str, Any]:
    """One dataset's slice of a sweep, shaped like a `run_eval` result."""
    info = sweep["datasets"][name]
    return {"baseline": info["baseline"], "num_prompts": info["num_prompts"],
            "results": [r for r in sweep["results"] if r["dataset"] == name]}


def vllm_speculative_config(spec_config: Mapping[str, Any]) -> str:
    """The JSON string for vLLM's `--speculative-config` (method, model, k first; the rest as measured)."""
    ordered = {k: spec_config[k] for k in VLLM_KEY_ORDER if k in spec_config}
    ordered.update((k, v) for k, v in spec_config.items() if k not in ordered)
    return json.dumps(ordered)


def recommend(result: Mapping[str, Any], tie_tolerance: float = SPEEDUP_TIE_TOLERANCE) -> dict[str, Any]:
    """The setting to deploy for one dataset (`run_eval` shape); `method` None means plain decoding."""
    if not 0 <= tie_tolerance < 1:
        raise ValueError(f"tie tolerance must be in [0, 1), got {tie_tolerance}")
    plain = {"spec_config": None, "num_speculative_tokens": 0, "speedup": 1.0}
    timed = [r for r in result["results"] if math.isfinite(r.get("speedup", math.nan))]
    candidates = [plain] + [r for r in timed if _servable(r)]
    best = max(c["speedup"] for c in candidates)
    tied = [c for c in candidates if c["speedup"] >= best * (1 - tie_tolerance)]
    choice = min(tied, key=lambda c: (c["num_speculative_tokens"], -c["speedup"]))  # min() keeps the first on ties
    fastest = max(timed, key=lambda c: c["speedup"], default=None)
    if fastest is not None and fastest["speedup"] > choice["speedup"] and not _servable(fastest):
        note = {"draftsmith_only_faster": _brief(fastest)}  # e.g. a dynamic tree, faster here than any chain
    else:
        note = {}
    if choice is plain:
        servable = max(candidates[1:], key=lambda c: c["speedup"], default=None)
        return {"method": None, "num_speculative_tokens": 0, "speedup": 1.0, "tie_tolerance": tie_tolerance,
                "fastest_config": None if servable is None else _brief(servable), **note}
    return {
        "method": choice["method"],
        "label": choice.get("label", choice["method"]),
        "num_speculative_tokens": choice["num_speculative_tokens"],
        "speedup": choice["speedup"],
        "tokens_per_second": choice["tokens_per_second"],
        "mean_acceptance_length": choice["metrics"]["mean_acceptance_length"],
        "spec_config": choice["spec_config"],
        "vllm_speculative_config": vllm_speculative_config(choice["spec_config"]),
        "tie_tolerance": tie_tolerance,
        **note,
    }


def _servable(row: Mapping[str, Any]) -> bool:
    return not NOT_IN_VLLM & row["spec_config"].keys()


def _brief(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"label": row.get("label", row["method"]), "num_speculative_tokens": row["num_speculative_tokens"],
            "speedup": row["speedup"]}


def add_recommendations(sweep: dict[str, Any], tie_tolerance: float = SPEEDUP_TIE_TOLERANCE) -> dict[str, Any]:
    """Store `recommend` for every dataset under sweep["recommendations"]; returns the sweep."""
    sweep["recommendations"] = {name: recommend(dataset_result(sweep, name), tie_tolerance)
                                for name in sweep["datasets"]}
    return sweep


def recommendation_lines(name: str, rec: Mapping[str, Any], target: str | None = None) -> list[str]:
    if rec["method"] is None:
        fastest = rec["fastest_config"]
        why = "no vLLM-servable config was measured" if fastest is None else (
            f"the fastest config, {fastest['label']} k={fastest['num_speculative_tokens']}, reached "
            f"{fastest['speedup']:.2f}x" + (f", not more than {rec['tie_tolerance']:.0%} faster than plain"
                                             if fastest["speedup"] > 1 else ""))
        return [f"recommended for {name}: plain decoding, no --speculative-config ({why})", *_faster_note(rec)]
    tau = rec["mean_acceptance_length"]
    head = (f"recommended for {name}: {rec['label']} k={rec['num_speculative_tokens']} "
            f"({rec['speedup']:.2f}x over plain decoding"
            + ("" if tau is None else f", mean acceptance length {tau:.2f}") + ")")
    flag = f"--speculative-config {shlex.quote(rec['vllm_speculative_config'])}"
    return [head, f"  vllm serve {shlex.quote(target)} {flag}" if target else f"  {flag}", *_faster_note(rec)]


def _faster_note(rec: Mapping[str, Any]) -> list[str]:
    faster = rec.get("draftsmith_only_faster")
    if faster is None:
        return []
    return [f"  (faster here but not servable by vLLM: {faster['label']} k={faster['num_speculative_tokens']}, "
            f"{faster['speedup']:.2f}x, draftsmith's runtime only)"]


def format_report(sweep: Mapping[str, Any], target: str | None = None, dtype: str | None = None) -> str:
    """Per dataset: a settings line, the table (recommended row starred), a note when outputs differ from plain
    decoding (what it means depends on `dtype`, e.g. "bfloat16"), and the recommendation."""
    recs = sweep.get("recommendations") or {}
    blocks = []
    for name, info in sweep["datasets"].items():
        rec = recs.get(name)
        result = dataset_result(sweep, name)
        mark = next((r for r in result["results"] if rec and r["spec_config"] == rec.get("spec_config")), None)
        batch = sweep.get("batch_size", 1)
        served = f", batches of {batch} (tok/s at that concurrency)" if batch > 1 else ""
        lines = [f"== {name}: {info['num_prompts']} prompts, {sweep['max_new_tokens']} new tokens, "
                 f"temperature {sweep['temperature']:g}{served} ==", format_table(result, mark)]
        differing = sum(1 for r in result["results"] if r.get("lossless_mismatches"))
        if differing:
            lines.append(mismatch_note(differing, dtype))
        if rec is not None:
            lines += recommendation_lines(name, rec, target)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def mismatch_note(configs: int, dtype: str | None) -> str:
    """What greedy outputs that differ from plain decoding mean: a bug in float32, rounding in half precision."""
    if dtype == "float32":
        return (f"WARNING: {configs} config(s) changed greedy outputs in float32, where speculative decoding must "
                "be exact: please report this with the command")
    return (f"note: {configs} config(s) differ from plain decoding in {dtype or 'this dtype'}: half-precision "
            "rounding changes with the number of tokens a step verifies, so near-ties flip; --dtype float32 "
            "checks losslessness exactly")


def _series(result: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by series (config minus k), each sorted by k; insertion order = the order configs were given."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in result["results"]:
        groups.setdefault(series_key(r["spec_config"]), []).append(r)
    return {key: sorted(rows, key=lambda r: r["num_speculative_tokens"]) for key, rows in groups.items()}


def _value(x: float | None) -> float:
    return math.nan if x is None else x  # matplotlib leaves a gap at NaN (no drafts: tau undefined)


def plot_dataset(result: Mapping[str, Any], title: str, path: str | Path,
                 recommended: Mapping[str, Any] | None = None) -> Path:
    """A 2x2 PNG against k, one line per series: mean acceptance length, tok/s (plain dashed), speedup (1.0
    dashed, the recommendation circled) and per-position acceptance (against the position, at each series'
    largest k: the rate at position i is the chance that the first i drafts were all accepted). Written
    atomically; no pyplot, so no global backend state (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 8), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_tau, ax_pos), (ax_tps, ax_speed) = fig.subplots(2, 2)
    base_tps = result["baseline"]["tokens_per_second"]
    for rows in _series(result).values():
        label = rows[0].get("label", rows[0]["method"])
        ks = [r["num_speculative_tokens"] for r in rows]
        line, = ax_tau.plot(ks, [_value(r["metrics"]["mean_acceptance_length"]) for r in rows], "o-", label=label)
        color = line.get_color()
        ax_tps.plot(ks, [r["tokens_per_second"] for r in rows], "o-", color=color, label=label)
        ax_speed.plot(ks, [r["speedup"] for r in rows], "o-", color=color, label=label)
        per_pos = [_value(p) for p in rows[-1]["metrics"]["per_position_acceptance"]]
        ax_pos.plot(range(1, len(per_pos) + 1), per_pos, "o-", color=color, label=f"{label} (k={ks[-1]})")
    ax_tps.axhline(base_tps, color="gray", linestyle="--", label="plain")
    ax_speed.axhline(1.0, color="gray", linestyle="--", label="plain")
    if recommended is not None and recommended.get("method") is not None:
        ax_speed.plot([recommended["num_speculative_tokens"]], [recommended["speedup"]], "o", markersize=14,
                      markerfacecolor="none", markeredgecolor="black", label="recommended")
    for ax, ylabel in ((ax_tau, "mean acceptance length"), (ax_tps, "tokens/s"),
                       (ax_speed, "speedup over plain decoding")):
        ax.set_xlabel("num_speculative_tokens (k)")
        ax.set_ylabel(ylabel)
    ax_pos.set_xlabel("draft position")
    ax_pos.set_ylabel("per-position acceptance")
    ax_pos.set_ylim(0, 1.02)
    for ax in (ax_tau, ax_pos, ax_tps, ax_speed):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # k and positions are whole numbers
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return _save_png_atomic(fig, Path(path))


def write_plots(sweep: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """One PNG per dataset, `eval_<dataset>.png` in `out_dir`."""
    recs = sweep.get("recommendations") or {}
    paths = []
    for name, info in sweep["datasets"].items():
        title = (f"{name}: {info['num_prompts']} prompts, {sweep['max_new_tokens']} new tokens, "
                 f"temperature {sweep['temperature']:g}")
        path = Path(out_dir) / f"eval_{_file_safe(name)}.png"
        paths.append(plot_dataset(dataset_result(sweep, name), title, path, recs.get(name)))
    return paths


def _file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "dataset"


def _save_png_atomic(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
