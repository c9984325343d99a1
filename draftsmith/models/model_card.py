"""The README.md model card that ships with every export: Hub metadata up top, then how to serve the drafter.

The card is written for someone who found the drafter on the Hub: what it is, which target it belongs to, the
aux-layer ids spelled out in each engine's convention (the most common silent failure), commands that work as
pasted, the latest measured acceptance and the recipe that produced it.

`eval.json` (written by `draftsmith eval`) is read tolerantly. The shape this module renders best:

    {"num_speculative_tokens": 3, "temperature": 0.0, "max_new_tokens": 256,
     "results": [{"dataset": "mt_bench", "num_drafts": ..., "num_draft_tokens": ...,
                  "num_accepted_tokens": ..., "num_accepted_tokens_per_pos": [...]}]}

`results` may also be a dict keyed by dataset, a record may give `mean_acceptance_length`,
`draft_acceptance_rate` and `per_position_acceptance_rate` instead of the vLLM counters, and the settings may sit
in each record. Anything else is shown verbatim as JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

# owner/name, as the Hub spells repository ids; local files are recognised by their extension or a leading ./ or /
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_FILE_SUFFIXES = {".json", ".jsonl", ".parquet", ".arrow", ".csv", ".tsv", ".txt", ".gz", ".zst", ".yaml", ".yml"}


def looks_like_hub_id(ref: str) -> bool:
    """True for `owner/name` that is not a local path; the Hub rejects cards whose base_model is a path."""
    if not isinstance(ref, str) or not _HUB_ID.fullmatch(ref):
        return False
    return Path(ref).suffix.lower() not in _FILE_SUFFIXES and not Path(ref).exists()


def hub_datasets(recipe_text: str | None) -> list[str]:
    """Hub dataset ids named by the recipe's `data.path` (a string or a list of strings)."""
    if not recipe_text:
        return []
    try:
        recipe = yaml.safe_load(recipe_text)
    except yaml.YAMLError:
        return []  # the recipe is still shown verbatim; only the metadata loses its datasets
    data = recipe.get("data") if isinstance(recipe, dict) else None
    paths = data.get("path") if isinstance(data, dict) else None
    paths = [paths] if isinstance(paths, str) else paths if isinstance(paths, list) else []
    return [p for p in paths if looks_like_hub_id(p)]


def _acceptance(record: Mapping[str, Any]) -> tuple[float, float | None, list[float]] | None:
    """(mean acceptance length, draft acceptance rate, per-position rates) with vLLM's definitions."""
    drafts = record.get("num_drafts")
    if isinstance(drafts, (int, float)) and drafts > 0 and "num_accepted_tokens" in record:
        accepted = record["num_accepted_tokens"]
        draft_tokens = record.get("num_draft_tokens")
        rate = accepted / draft_tokens if draft_tokens else None
        per_pos = [n / drafts for n in record.get("num_accepted_tokens_per_pos") or []]
        return 1 + accepted / drafts, rate, per_pos
    tau = record.get("mean_acceptance_length")
    if isinstance(tau, (int, float)):
        per_pos = record.get("per_position_acceptance_rate") or record.get("per_position_acceptance") or []
        return float(tau), record.get("draft_acceptance_rate"), [float(p) for p in per_pos]
    return None


def acceptance_table(eval_result: Mapping[str, Any]) -> str | None:
    """A Markdown table of acceptance per dataset, or None when the result has no recognisable record."""
    settings = {k: eval_result.get(k) for k in ("num_speculative_tokens", "temperature", "max_new_tokens")}
    records = eval_result.get("results", eval_result.get("datasets"))
    if records is None:
        records = [eval_result]
    elif isinstance(records, Mapping):
        records = [{"dataset": name, **rec} for name, rec in records.items() if isinstance(rec, Mapping)]
    rows = []
    for rec in records if isinstance(records, list) else []:
        if not isinstance(rec, Mapping):
            continue
        rec = {**{k: v for k, v in settings.items() if v is not None}, **rec, **(rec.get("metrics") or {})}
        acc = _acceptance(rec)
        if acc is None:
            continue
        tau, rate, per_pos = acc
        cells = [
            str(rec.get("dataset", "")),
            str(rec.get("num_speculative_tokens", "")),
            str(rec.get("temperature", "")),
            str(rec.get("max_new_tokens", "")),
            f"{tau:.3f}",
            "" if rate is None else f"{rate:.1%}",
            ", ".join(f"{p:.3f}" for p in per_pos),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return None
    head = (
        "| dataset | num_speculative_tokens | temperature | max_new_tokens | mean acceptance length "
        "| draft acceptance rate | per-position acceptance |\n|---|---|---|---|---|---|---|"
    )
    return head + "\n" + "\n".join(rows)


def _fenced(text: str, lang: str) -> str:
    fence = "~~~~" if "```" in text else "```"
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


SERVING_HEADING = "## Serving"


def serving_section(serve_commands: Mapping[str, str]) -> str:
    """The "## Serving" section: one fenced command per engine, pasteable as is."""
    return f"{SERVING_HEADING}\n\n" + "\n\n".join(
        f"{engine}:\n\n{_fenced(cmd, 'bash')}" for engine, cmd in serve_commands.items()
    )


def replace_serving_section(card: str, serve_commands: Mapping[str, str]) -> str | None:
    """`card` with its Serving section rebuilt from `serve_commands` (e.g. naming the Hub repo instead of the local
    folder), or None when the card has no such section."""
    start = card.find(f"\n{SERVING_HEADING}\n")
    if start < 0:
        return None
    end = card.find("\n## ", start + len(SERVING_HEADING) + 2)
    rest = card[end:] if end >= 0 else "\n"
    return card[: start + 1] + serving_section(serve_commands) + ("\n" + rest if end >= 0 else rest)


def render_model_card(
    *,
    target: str,
    method: str,
    tags: Sequence[str],
    summary: Mapping[str, Any],
    aux_layer_ids: Sequence[tuple[str, str, list[int]]],
    serve_commands: Mapping[str, str],
    recipe_text: str | None = None,
    eval_result: Mapping[str, Any] | None = None,
    version: str = "",
) -> str:
    """README.md text: YAML front matter (base_model, library_name, tags, datasets) and the body.

    `aux_layer_ids` rows are (convention, config key, ids); `serve_commands` maps an engine name to a shell command.
    """
    meta: dict[str, Any] = {}
    if looks_like_hub_id(target):
        meta["base_model"] = target
    meta["library_name"] = "draftsmith"
    meta["tags"] = list(tags)
    datasets = hub_datasets(recipe_text)
    if datasets:
        meta["datasets"] = datasets
    front = yaml.safe_dump(meta, sort_keys=False, default_flow_style=False).strip()

    trained_with = f"draftsmith {version}" if version else "draftsmith"
    parts = [
        f"---\n{front}\n---",
        f"# {method} drafter for {target}",
        f"Draft model ({method}) for speculative decoding with the target `{target}`, trained with {trained_with}. "
        "It proposes tokens that the target verifies, so the output is the target's own; it only makes decoding "
        "faster and cannot generate on its own. Serve it next to the target, in the engine of your choice.",
        "## Model\n\n" + "\n".join(f"- {k}: `{v}`" for k, v in summary.items()),
        "## Aux hidden-state layers\n\n"
        "The drafter reads hidden states from these target layers. Engines number them differently, and a wrong "
        "number only shows as low acceptance, so both forms are in `config.json`:\n\n"
        "| convention | config key | ids |\n|---|---|---|\n"
        + "\n".join(f"| {conv} | `{key}` | `{list(ids)}` |" for conv, key, ids in aux_layer_ids),
        serving_section(serve_commands),
    ]
    if eval_result:
        table = acceptance_table(eval_result)
        body = table if table else _fenced(json.dumps(eval_result, indent=2), "json")
        parts.append(
            "## Acceptance\n\nLatest `draftsmith eval` (mean acceptance length counts the bonus token, "
            "as vLLM reports it):\n\n" + body
        )
    if recipe_text and recipe_text.strip():
        parts.append("## Training recipe\n\n" + _fenced(recipe_text, "yaml"))
    return "\n\n".join(parts) + "\n"
