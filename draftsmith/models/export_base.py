"""The one sequence every export format runs (`FormatExport.write`); a format states only its own pieces.

    read    resolve the checkpoint, refuse an occupied --out, load its config.json and weights, parse the drafter
            config of the format's method (its target made absolute), read what the model card shows (training
            step, eval result, recipe)
    build   the format's own (`FormatExport.build`): config.json, the tensors under the format's names (a key map
            plus the few reshapes), the card's summary and layer-id rows, the serve commands, any extra file
    check   the format's contract on what was built (`FormatExport.check`, the check `push` runs too): a problem
            refuses the export before anything is written
    write   config.json, model.safetensors, README.md (the model card) and the extra files, all or nothing
            (checkpoint.write_export, which also refuses non-finite weights)

A format's `build` raises ExportError (or FormatNotApplicable, which `--format all` skips) for a checkpoint it
cannot take; `source.refuse(problems)` says so in the words every format uses. Warnings reach the result in this
order: the format's own, its check's, then what could not be read for the card.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.models.checkpoint import (
    CardInputs,
    ExportError,
    ExportResult,
    check_output_dir,
    config_for_export,
    draftsmith_version,
    load_checkpoint,
    read_card_inputs,
    resolve_checkpoint,
    write_export,
)
from draftsmith.models.drafter_config import is_int
from draftsmith.models.model_card import render_model_card
from draftsmith.models.target_files import target_tokenizer_fingerprint

Problems = tuple[list[str], list[str]]  # (problems, warnings) of a format's contract check


@dataclass
class ExportSource:
    """A checkpoint being exported, as the skeleton read it, handed to the format's `build`."""

    ckpt: Path  # the checkpoint folder
    out_dir: Path  # the folder being written (the serve commands name it)
    config: Any  # the method's drafter config dataclass; target_name_or_path made absolute
    state: dict[str, torch.Tensor]  # the weights in draftsmith's names, as trained (fp32 master weights)
    card: CardInputs  # training step, eval result, recipe text
    dtype: torch.dtype | None  # floating-point weights are written in it; None keeps the checkpoint's
    format_name: str  # how messages name the format ("native EAGLE-3")
    options: Mapping[str, Any] = field(default_factory=dict)  # the format's export options (speculators: verifier)

    @property
    def target(self) -> str:
        """The target as the card and the serve commands name it."""
        return self.config.target_name_or_path or "TARGET"

    @property
    def draft(self) -> str:
        """The drafter as the serve commands name it: the folder being written."""
        return str(self.out_dir)

    @property
    def step(self) -> int | None:
        return self.card.step

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """A weight in the export's dtype; integer and bool tensors (d2t, t2d, token orderings) as they are."""
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def tensors(self, key_map: Mapping[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, torch.Tensor]:
        """The weights under the format's names (`key_map`: {draftsmith name: format name}; a name outside it is
        kept as it is, for the check to refuse), cast, without the names in `drop`."""
        key_map = key_map or {}
        return {key_map.get(name, name): self.cast(t) for name, t in self.state.items() if name not in drop}

    def refuse(self, problems: list[str]) -> None:
        """Refuse the export when there are problems, naming them all."""
        if problems:
            raise ExportError(f"{self.ckpt}: refusing to export as {self.format_name}: " + "; ".join(problems))


@dataclass
class FormatFiles:
    """What a format makes of one checkpoint."""

    config: dict[str, Any]  # config.json
    tensors: dict[str, torch.Tensor]  # model.safetensors, under the format's names
    summary: dict[str, Any]  # the model card's summary rows ("training step" is added last)
    aux_layer_ids: list[tuple[str, str, list[int]]]  # the card's layer-id rows: (convention, config key, ids)
    serve_commands: dict[str, str]  # engine -> shell command, in the card and the result
    warnings: list[str] = field(default_factory=list)  # the format's own, before its check's
    extra_files: dict[str, Callable[[Path], None]] = field(default_factory=dict)  # name -> writer of that path
    card_target: str | None = None  # the target the card names, when not the checkpoint's (speculators' verifier)
    tags: Sequence[str] | None = None  # the card's tags, when not the format's


@dataclass(frozen=True)
class FormatExport:
    """A format's declared pieces: which checkpoints it takes, how it builds and checks its files, its card. Its
    `write` is the format's exporter (the `export` entry point of its spec's ExportFormat)."""

    name: str  # how messages name it ("native EAGLE-3")
    method: str  # the checkpoint method it exports
    config_class: type  # the method's drafter config (`from_dict`)
    title: str  # the method as the model card names it ("EAGLE-3")
    tags: Sequence[str]  # the model card's tags
    build: Callable[[ExportSource], FormatFiles]
    check: Callable[[dict[str, Any], dict[str, torch.Tensor]], Problems] | None = None
    options: tuple[str, ...] = ()  # the keyword options `write` takes beyond overwrite and dtype (`verifier`)

    def write(self, checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
              dtype: torch.dtype | None = torch.bfloat16, **options: Any) -> ExportResult:
        """Read, build, check and write this format's export of `checkpoint` into `out_dir`, all or nothing
        (module docstring). Floating-point weights are written in `dtype` (bf16 by default, as published drafters
        are; engines cast to the target's dtype anyway); None keeps the checkpoint's fp32 master weights."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise TypeError(f"{self.name} export: unexpected options {unknown} (it takes {list(self.options)})")
        out_dir = Path(out_dir)
        ckpt = resolve_checkpoint(checkpoint)
        check_output_dir(out_dir, overwrite, keep=(ckpt,))
        raw, state = load_checkpoint(ckpt)
        config = config_for_export(ckpt, raw, self.config_class, self.method, self.name)
        source = ExportSource(ckpt=ckpt, out_dir=out_dir, config=config, state=state, card=read_card_inputs(ckpt),
                              dtype=dtype, format_name=self.name, options=options)

        files = self.build(source)
        problems, check_warnings = self.check(files.config, files.tensors) if self.check is not None else ([], [])
        source.refuse(problems)

        step = source.step
        card = render_model_card(
            target=files.card_target or source.target, method=self.title,
            tags=files.tags if files.tags is not None else self.tags,
            summary={**files.summary, "training step": step if step is not None else "unknown"},
            aux_layer_ids=files.aux_layer_ids, serve_commands=files.serve_commands,
            recipe_text=source.card.recipe_text, eval_result=source.card.eval_result, version=draftsmith_version(),
        )
        warnings = [*files.warnings, *check_warnings, *source.card.warnings]
        return write_export(out_dir, ckpt, files.config, files.tensors, card, overwrite=overwrite,
                            warnings=warnings, serve_commands=files.serve_commands, extra_files=files.extra_files)


# ---- pieces several formats write and check the same way ----------------------------------------------------------
def key_problems(config: Mapping[str, Any], positive_ints: Sequence[str] = (), present: Sequence[str] = (),
                 prefix: str = "") -> list[str]:
    """What a config lacks of the keys its engines read: each of `positive_ints` a positive integer, each of
    `present` there at all. `prefix` is where they sit inside config.json ("transformer_layer_config"), "" for
    the top level."""
    where, key_at = (f"config {prefix}", f"config {prefix}.") if prefix else ("config", "config ")
    problems = []
    for key in positive_ints:
        if key not in config:
            problems.append(f"{where}: missing {key}")
        elif not is_int(config[key]) or config[key] <= 0:
            problems.append(f"{key_at}{key}: {config[key]!r}, expected a positive integer")
    return problems + [f"{where}: missing {key}" for key in present if key not in config]


def one_layer_llama_problems(config: Mapping[str, Any], positive_ints: Sequence[str], present: Sequence[str],
                             prefix: str = "") -> list[str]:
    """What keeps a one-layer Llama config (EAGLE-1's and EAGLE-3's draft layer, as one_layer_llama_json writes
    it) from building that layer: model_type llama, one layer, then `key_problems`."""
    key_at = f"config {prefix}." if prefix else "config "
    problems = []
    if config.get("model_type") != "llama":
        problems.append(f"{key_at}model_type: {config.get('model_type')!r}, expected 'llama'")
    if config.get("num_hidden_layers") != 1:
        problems.append(f"{key_at}num_hidden_layers: {config.get('num_hidden_layers')!r}, expected 1")
    return problems + key_problems(config, positive_ints, present, prefix)


def provenance(config: Any, method: str, step: int | None, **keys: Any) -> dict[str, Any]:
    """The `draftsmith` block of an export's config.json: version, method and target, the format's own `keys`,
    then the training step. Engines ignore it; import and push read it back."""
    return {
        "version": draftsmith_version(),
        "method": method,
        "target": config.target_name_or_path,
        "target_architectures": list(config.target_architectures),
        "target_model_type": config.target_model_type,
        **keys,
        # what eval and generate compare with their target's tokenizer (absent where it could not be read)
        **({"tokenizer": fingerprint} if (fingerprint := target_tokenizer_fingerprint(config.target_name_or_path))
           else {}),
        "step": step,
    }


def speculative_config(method: str, draft: str, num_speculative_tokens: int) -> str:
    """The `--speculative-config` JSON vLLM and draftsmith read, compact."""
    return json.dumps({"method": method, "model": draft, "num_speculative_tokens": num_speculative_tokens},
                      separators=(",", ":"))


def vllm_serve(target: str, method: str, draft: str, num_speculative_tokens: int) -> str:
    """`vllm serve TARGET --speculative-config {"method": ..., "model": DRAFT, ...}`, quoted for a shell."""
    spec = speculative_config(method, draft, num_speculative_tokens)
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"


def draftsmith_generate(target: str, method: str, draft: str, num_speculative_tokens: int) -> str:
    """The same speculative config run by draftsmith's runtime on one prompt, quoted for a shell."""
    spec = speculative_config(method, draft, num_speculative_tokens)
    return (f"draftsmith generate --target {shlex.quote(target)} --speculative-config {shlex.quote(spec)} "
            "--prompt 'Hello'")
