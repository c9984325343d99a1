"""What a drafter method tells the rest of draftsmith: one `DrafterSpec` per method folder, listed in registry.py.

The trainer, the exporter, the importer, `push`, the runtime's speculative-config parser and the CLI know a method
only through its spec, so adding a method is adding a folder (`models/<method>/`, with a `spec.py` declaring
`SPEC`) and its entry (import and `SPECS` line) in `registry.py`:

    section        the method's recipe section (schema and defaults, a `Section`), read as `<method>:` in a recipe
    check_recipe   the method's rules on a recipe (layer ids, block size, ...), run when the recipe is read, and
                   with the target's config.json before anything heavy, so a recipe that cannot export is refused
                   before training starts
    training       the class the trainer drives (`TrainingMethod`)
    proposer       the runtime's `Proposer` class, built with `from_config(spec_config, target)`
    formats        the export formats (`ExportFormat`): exporter, and where the layout can be read back, its
                   importer, the contract check `push` runs and the serve commands its card shows

Heavy parts (training, proposer, exporters, importers) are named as "module:attribute" entry points and imported
on first use (`resolve`): the registry stays cheap to import, so the recipe schema, the CLI's help and the
speculative-config parser do not load torch models they will not run, and a method folder may import what it
needs from the rest of the package without an import circle through the registry.

Layer ids: each method declares the convention it stores them in (`layer_convention`); `check_layer_ids` is the
one rule they all follow (DESIGN.md §3).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # annotations only: importing the registry does not load torch
    import torch

# Recipe sections are strict: an unknown key is an error (config.py names it, with a did-you-mean).
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=True)
DEFAULT_DRAFT_VOCAB_SIZE = 32000  # EAGLE-3's (the reference and SpecForge checkpoints): model.draft_vocab_size null

# Capture id k = the residual stream entering decoder layer k = HF output_hidden_states[k] (0 = the embedding
# output, L = the last layer's output before the final norm); output-of-layer id i = output of layer i = capture
# id i + 1 (DFlash's and DSpark's dflash_config.target_layer_ids, SGLang's EAGLE-3 ids).
LayerConvention = Literal["capture", "output"]


class Section(BaseModel):
    """A method's recipe section (`eagle3:`, `dflash:`, ...): strict, every key with a default."""

    model_config = STRICT


class TrainingMethod(Protocol):
    """What the trainer needs from a method (train/setup.py builds it as `cls(recipe, target)`, train/loop.py drives
    it).

    The trainer hands the method its features: `loss` reads the target's states for the layers in `aux_layer_ids`
    through `features` (train/features.py FeatureSource: online capture, a hidden-state store or the first epoch's
    cache, each checked for NaN and inf), never through the target's own capture, and returns the micro-batch's loss.
    """

    config: Any  # the drafter config dataclass, saved as the checkpoint's config.json (`to_dict()`, with "method")
    aux_layer_ids: list[int]  # capture ids of the target features the method reads (DESIGN.md §3)
    notes: list[str]  # lines the trainer logs once at the start (what the method chose and why)
    # Data-parallel runs: the trainer sets this to the mean over processes of a per-process count, for methods
    # that normalise their loss by the global batch's token count; None on one process.
    count_mean: Callable[[torch.Tensor], torch.Tensor] | None
    # The draft vocabulary's size the trainer builds d2t / t2d for and hands to build_drafter (model.draft_vocab_size,
    # or the method's default for it); None: the target's whole vocabulary.
    draft_vocab_size: int | None

    def flops_per_token(self, seq_len: int, loss_share: float = 1.0) -> dict[str, float]:
        """Model FLOP per trained token at this length, by term and "total" (train/flops.py), for MFU."""
        ...

    def build_drafter(self, d2t: torch.Tensor, t2d: torch.Tensor) -> torch.nn.Module:
        """A freshly initialised fp32 drafter on the target's device (d2t / t2d: the draft vocabulary maps)."""
        ...

    def apply_training_options(self, drafter: torch.nn.Module) -> None:
        """The recipe's training options for how the drafter computes in training (attention kernels, recomputation,
        compilation), applied to a built drafter from outside, once: the trainer calls it after `build_drafter`, and
        model code knows none of them (torchtitan's parallelize)."""
        ...

    def loss(self, drafter: torch.nn.Module, batch: dict[str, torch.Tensor], features: Callable[..., Any]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics of 0-dim tensors: `loss_i`, `acc_i`, `count_i` per draft position, `sim_accept_len`).
        `features(input_ids, attention_mask, aux_layer_ids, position_ids=None) -> CapturedStates` gives the
        target's states of the batch (models/target.py)."""
        ...


@dataclass(frozen=True)
class ExportFormat:
    """One on-disk layout a method exports to, and, where draftsmith can read it back, imports from."""

    name: str  # `draftsmith export --format NAME`
    layout: str  # the layout's name in import.json and push messages ("native-eagle3")
    help: str
    # "module:attribute" (checkpoint, out_dir, *, overwrite, dtype, **options) -> ExportResult: the `write` of the
    # format's FormatExport (models/export_base.py)
    export: str
    # Does a config.json have this layout? Pure dict checks (import and push call it on any folder).
    detect: Callable[[Mapping[str, Any]], bool] | None = None
    read: str | None = None  # "module:function" (folder, config, target or None) -> ImportedCheckpoint
    check: str | None = None  # "module:function" (config, tensors) -> (problems, warnings): push's contract check
    serve_commands: str | None = None  # "module:function" (config, draft ref) -> {engine: command}, for push
    options: tuple[str, ...] = ()  # export keyword options this format takes (`verifier`)


@dataclass(frozen=True)
class DrafterSpec:
    method: str  # model.method in a recipe, "method" in a checkpoint's config.json and in a speculative config
    title: str  # how messages and model cards name it ("EAGLE-3")
    section: type[Section]  # the `<method>:` recipe section
    training: str  # "module:Class" implementing TrainingMethod
    proposer: str  # "module:Class" with from_config(spec_config, target) -> Proposer
    formats: tuple[ExportFormat, ...]
    layer_convention: LayerConvention  # how the method's own config stores target layer ids
    # (recipe, target config or None) -> None; raises ValueError naming the key. With the target's config
    # (a dict of its config.json) the rules that depend on the target run too (layer ids in range, ...).
    check_recipe: Callable[[Any, Mapping[str, Any] | None], None] = lambda recipe, target: None
    # Other names engines give the method in a speculative config (vLLM's deepseek_mtp -> mtp)
    engine_aliases: tuple[str, ...] = ()
    # Engine methods that serve this method's drafter under their own name, told apart by the drafter's
    # config.json (one of `formats`' `detect`): vLLM serves Gemma 4's assistant as {"method": "mtp", "model": ...}.
    # A speculative config of such a method whose model this spec detects runs this spec's proposer.
    served_as: tuple[str, ...] = ()
    # reads out through its own draft vocabulary when model.draft_vocab_size asks (the method's draft_vocab_size)
    draft_vocab: bool = False
    scored_drafts: bool = False  # its drafts carry per-token scores: trees and probabilistic drafts
    model_required: bool = True  # a speculative config must name "model" (MTP falls back to the target's)
    packing: bool = False  # trains on packed rows (training.packing)
    frozen_head: bool = False  # can keep its draft head at the target's rows (training.train_draft_head=false)
    losses: tuple[str, ...] = ("soft_ce",)  # training.loss values it implements
    # Speculative-config keys of the method's own, which vLLM does not serve (`draftsmith eval` never recommends a
    # config using one): name -> its check, value -> the value kept (raises ValueError saying what is wrong)
    runtime_keys: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    # The one method whose folder this one extends (DSpark: DFlash's block drafter plus two heads), the only other
    # method folder its code may import; shared helpers live in models/, not in a method folder
    # (tests/test_registry.py checks the imports).
    builds_on: str | None = None

    def format(self, name: str) -> ExportFormat | None:
        return next((f for f in self.formats if f.name == name), None)


def resolve(entry_point: str) -> Any:
    """The object an entry point "package.module:attribute" names (imported on first use)."""
    module_name, _, attribute = entry_point.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def draft_vocab_size_for(requested: int | None, target_vocab_size: int) -> int:
    """model.draft_vocab_size, or when the recipe leaves it open the default that fits the target."""
    return requested if requested is not None else min(DEFAULT_DRAFT_VOCAB_SIZE, target_vocab_size)


def check_layer_ids(ids: Sequence[int], key: str, num_layers: int | None,
                    convention: LayerConvention = "capture") -> list[int]:
    """The one rule for target layer ids, whichever key holds them: a non-empty, strictly increasing list (engines
    concatenate the features in layer order) inside the target. Capture ids run 0..L, output-of-layer ids
    0..L-1; `num_layers` None checks the order only (the target is not known yet). Returns them as a list."""
    ids = list(ids)
    form = "capture ids: id k = the residual stream entering layer k" if convention == "capture" else \
        "output-of-layer ids: id i = the output of layer i"
    if not ids:
        raise ValueError(f"{key} is empty: list at least one layer id, or set it to null for the method's default")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"{key} {ids}: layer ids are integers ({form})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{key} {ids} repeats a layer: list each layer once, e.g. {sorted(set(ids))}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{key} {ids}: must be strictly increasing (engines concatenate the features in layer "
                         f"order): list the layers in increasing order, {sorted(ids)}")
    if ids[0] < 0:
        raise ValueError(f"{key} {ids}: ids count layers from 0 ({form})")
    if num_layers is not None:
        top = num_layers if convention == "capture" else num_layers - 1
        if ids[-1] > top:
            raise ValueError(f"{key} {ids}: id {ids[-1]} is outside 0..{top} for this {num_layers}-layer target "
                             f"({form})")
    return ids


def capture_from_output(ids: Sequence[int]) -> list[int]:
    """Output-of-layer ids -> capture ids (output of layer i = the stream entering layer i + 1)."""
    return [i + 1 for i in ids]


def output_from_capture(ids: Sequence[int]) -> list[int]:
    """Capture ids -> output-of-layer ids; capture id 0 (the embedding output) has no such form."""
    bad = [i for i in ids if i < 1]
    if bad:
        raise ValueError(f"aux layer id(s) {bad}: capture id 0 is the embedding output, which has no "
                         "output-of-layer form; use ids >= 1")
    return [i - 1 for i in ids]
