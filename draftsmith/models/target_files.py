"""A target's files, read without loading the target and without the network: its folder, its config.json, its
input embedding. Exports and importers of several methods need these (speculators ships the embedding, EAGLE-1 and
EAGLE-3 imports size themselves by the target's config, native MTP exports copy its embedding and head).

`target` is what a recipe's model.target names: a local folder, or a Hub id looked up in the Hugging Face cache
only (`offline_folder`, `find_target_file`); nothing here downloads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.models.checkpoint import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, inside


def offline_folder(name_or_path: str | Path) -> Path | None:
    """A local checkpoint folder for a path or an already-downloaded Hub id (never downloads); None if neither."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_path), local_files_only=True))
    except Exception:  # noqa: BLE001 - not a Hub id, or not in the local cache: no native weights known
        return None


def find_target_file(target: str, filename: str) -> Path | None:
    """`filename` of the target: in its folder when `target` is a path, else in the Hugging Face cache (offline)."""
    if not target:
        return None
    if Path(target).is_dir():
        path = Path(target) / filename
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(target, filename)
    except Exception:  # not a repo id (a missing path, say): nothing cached under it
        return None
    return Path(found) if isinstance(found, str) else None


def read_target_config(target: str) -> dict[str, Any] | None:
    """The target's config.json as a dict (its `text_config` for multimodal targets), or None if not local."""
    path = find_target_file(target, CONFIG_FILE)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        return {"architectures": config.get("architectures"), **config["text_config"]}
    return config if isinstance(config, dict) else None


def load_target_embedding(target: str) -> tuple[torch.Tensor | None, str]:
    """(the target's input embedding, "") or (None, why not). Reads that one tensor, never the whole target."""
    from safetensors import SafetensorError, safe_open

    index_path = find_target_file(target, INDEX_FILE)
    if index_path is not None:
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            return None, f"{index_path}: unreadable safetensors index ({e})"
    else:
        single = find_target_file(target, WEIGHTS_FILE)
        if single is None:
            return None, f"target {target!r} has no safetensors weights in a local folder or the Hugging Face cache"
        try:
            with safe_open(str(single), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), WEIGHTS_FILE)
        except (SafetensorError, OSError) as e:
            return None, f"{single}: cannot read ({e})"
    # Llama/Qwen name it model.embed_tokens.weight; multimodal targets nest it deeper. Shortest match wins.
    names = [k for k in weight_map if k == "model.embed_tokens.weight"] or sorted(
        (k for k in weight_map if k.endswith("embed_tokens.weight")), key=len
    )
    if not names:
        return None, f"target {target!r}: no *embed_tokens.weight tensor among its weights"
    try:  # a name the index gives: only ever a file of the target's own folder
        inside(Path(target), weight_map[names[0]], f"{index_path}: weight_map[{names[0]!r}]", ValueError)
    except ValueError as e:
        return None, str(e)
    shard = find_target_file(target, weight_map[names[0]])
    if shard is None:
        return None, f"target {target!r}: shard {weight_map[names[0]]} is not available locally"
    try:
        with safe_open(str(shard), framework="pt") as f:
            return f.get_tensor(names[0]), ""
    except (SafetensorError, OSError) as e:
        return None, f"{shard}: cannot read {names[0]} ({e})"


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what a drafter's training depends on in a tokenizer: every token's id and the special ids.
    Two tokenizers of one vocabulary size but other ids (Llama-2 and Mistral, 32,000 each) differ here."""
    import hashlib

    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    body = json.dumps({"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]), "special": special},
                      ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()[:16]


def target_tokenizer_fingerprint(target: str) -> str | None:
    """The fingerprint of a target's tokenizer where it can be read without a download (a folder, or the Hugging
    Face cache), else None."""
    folder = offline_folder(target) if target else None
    if folder is None:
        return None
    try:
        from transformers import AutoTokenizer

        return tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(folder)))
    except Exception:  # noqa: BLE001 - no tokenizer there: nothing recorded
        return None
