"""The target model: aux hidden-state capture for training and a cached forward for the runtime.

`TargetModel` wraps any Hugging Face causal LM. Training only needs `capture()`, which runs the stock transformers
forward with hooks. The runtime needs `step()`: a forward over a preallocated `KVCache` that can be rolled back past
rejected draft tokens and that returns the aux features of exactly the positions it ran. That forward is driven
here and written per family in `draftsmith/models/targets/` (Llama, Mistral, Qwen2/3, Qwen3-MoE, GPT-OSS, Gemma 4)
on top of the model's own modules (projections, norms, MLP, rotary embedding), so it does not depend on
transformers' cache classes, whose API changes between releases. Any other causal LM runs through its own forward
over transformers' cache (`targets/generic.py`): exact, slower, one request at a time.

Aux-layer convention (DESIGN.md §3): capture id k is the residual stream *entering* decoder layer k, i.e.
Hugging Face `output_hidden_states[k]`; id 0 is the embedding output, id L the last layer's output before the
final norm.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith import device as dev
from draftsmith.kernels.attention import attend  # noqa: F401 - re-exported: the method models import it from here
from draftsmith.models.targets import DENSE_MODEL_TYPES, family_for, unsupported_reason
from draftsmith.models.targets.base import StepState, TargetError, config_attribute, layer_recorder, step_masks
from draftsmith.models.targets.generic import TransformersForward

SUPPORTED_STEP_MODEL_TYPES = DENSE_MODEL_TYPES  # the Llama-shaped dense families (their MTP blocks run too)
COMPILE_ENV = "DRAFTSMITH_COMPILE"  # "1": fuse the graphed step's decoder layers with torch.compile
CACHE_GRANULE = 1024  # pooled caches grow in these steps
MAX_GRAPHED_TOKENS = 64  # wider steps (prefill) run eagerly: one graph per prompt length would not pay off


@dataclass
class CapturedStates:
    aux_hidden: torch.Tensor  # (B, S, n_aux*H) residual stream entering each aux layer, concatenated
    last_hidden: torch.Tensor  # (B, S, H) final-normed hidden state: lm_head(last_hidden) = target logits


@dataclass
class StepOutput:
    logits: torch.Tensor  # (B, T, V) float32, for the last `logits_to_keep` positions (all when None)
    aux_hidden: torch.Tensor | None  # (B, T, n_aux*H) for all T positions, None when not asked for


def sliding_window_of(config) -> int | None:
    """The attention window of a dense target's sliding-window layers, which the runtime attends past (so it bounds
    the context), or None when every layer attends fully: Qwen2/3 list `layer_types` (and `use_sliding_window`),
    Mistral sets `sliding_window` for every layer. Other families apply their windows exactly (their adapter in
    models/targets, or transformers' own forward): None."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "model_type", "") not in SUPPORTED_STEP_MODEL_TYPES:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if hasattr(config, "use_sliding_window"):
        return int(window) if config.use_sliding_window else None
    return int(window)


def context_length_of(config) -> int | None:
    """Tokens one request may hold in draftsmith's runtime, prompt and output together: the target's
    max_position_embeddings, or its sliding window when that is smaller (the runtime attends to the whole context,
    which is sliding-window attention only inside the window); None when the config states neither. The one context
    limit of the runtime: generate, eval, regenerate and `SpeculativeGenerator` all read it from here."""
    limits = [n for n in (getattr(config, "max_position_embeddings", None), sliding_window_of(config)) if n]
    return min(int(n) for n in limits) if limits else None


def _context_words(config) -> str:
    """The context named in a message, with why when the sliding window sets it."""
    context, window = context_length_of(config), sliding_window_of(config)
    why = (f" (it uses sliding-window attention ({window} tokens), which draftsmith's runtime matches only inside "
           "the window)" if window is not None and window == context else "")
    return f"the target's context of {context} tokens{why}"


def prompt_overflow(prompt_length: int, max_new_tokens: int, config) -> str | None:
    """Why a prompt cannot be served within the target's context, or None when it can.

    vLLM's rule for max_model_len: the prompt and every token it may generate fit, prompt + max_new_tokens <=
    context. Drafts need no room of their own: the runtime verifies only the drafts that fit, as vLLM's scheduler
    trims them (`SpeculativeGenerator`)."""
    context = context_length_of(config)
    if context is None or prompt_length + max_new_tokens <= context:
        return None
    return (f"a prompt of {prompt_length} tokens plus max_new_tokens {max_new_tokens} exceeds "
            f"{_context_words(config)}")


def max_speculative_tokens(config) -> int | None:
    """The largest num_speculative_tokens the target's context can ever verify, or None (no limit known): a step
    of the shortest request holds its one prompt token, its first output token, k drafts and the bonus token, and
    vLLM keeps a request, bonus token included, within the context."""
    context = context_length_of(config)
    return None if context is None else context - 3


def check_num_speculative_tokens(num_speculative_tokens: int, config) -> None:
    """Refuse a k that the target's context could never verify (the method's own limit, a DFlash block say, is
    its proposer factory's to check)."""
    limit = max_speculative_tokens(config)
    if limit is not None and num_speculative_tokens > limit:
        raise TargetError(f"speculative config: num_speculative_tokens={num_speculative_tokens} can never be "
                          f"verified within {_context_words(config)} (a step holds k + 3 tokens at least): use "
                          f"num_speculative_tokens <= {max(limit, 0)}")


class KVCache:
    """Preallocated keys and values of every target layer; positions `[0, length)` are valid.

    Rolling back is setting `length`: rejected positions are simply overwritten by the next step.
    """

    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, max_length, dtype, device):
        shape = (num_layers, batch_size, num_kv_heads, max_length, head_dim)
        # Zeros, not empty: steps that attend over the whole cache mask unwritten slots, and a masked slot
        # holding NaN garbage would still poison the output (0 * NaN = NaN).
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, kv, T_max, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.max_length = max_length

    def rollback(self, length: int) -> None:
        """Forget every position >= `length`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        self.length = length


def decoder_stack(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """(the module holding a causal LM's decoder layers, the layers): `model.model.layers` (Llama and most; a
    multimodal model's `model.language_model.layers`), else the one list of num_hidden_layers modules in its base
    model (`gpt_neox.layers`, `transformer.h`, ...); None when there is none."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    if isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return inner, inner.layers
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    lists = [m for m in model.base_model.children() if isinstance(m, nn.ModuleList) and len(m) == count]
    return (model.base_model, lists[0]) if len(lists) == 1 else None


class TargetModel:
    def __init__(self, model: nn.Module, name_or_path: str = "", compile_layers: bool | None = None):
        """`compile_layers`: run the decoder layers of graphed steps through one torch.compile'd function (fewer,
        fused kernels: what a launch-bound step needs); None reads DRAFTSMITH_COMPILE (default off)."""
        stack = decoder_stack(model)
        if stack is None:
            raise TargetError(
                f"{name_or_path or type(model).__name__}: draftsmith needs a causal LM whose decoder layers it can "
                "find: `model.model.layers`, or one list of num_hidden_layers modules in its base model"
            )
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.config = model.config.get_text_config()  # a multimodal model's (Gemma 4's) text model serves
        self._decoder, layers = stack
        self.name_or_path = name_or_path or getattr(self.config, "_name_or_path", "")
        self.layers = layers
        self.num_layers = len(self.layers)
        self.hidden_size = self.config.hidden_size
        self.vocab_size = self.config.vocab_size
        self.head_dim = config_attribute(self.config, "head_dim") or self.hidden_size // self.config.num_attention_heads
        self.num_heads = self.config.num_attention_heads
        self.num_kv_heads = config_attribute(self.config, "num_key_value_heads") or self.num_heads
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.family = family_for(model)  # the runtime's adapter (models/targets), None: transformers' own forward
        self._generic = TransformersForward(model, layers) if self.family is None else None
        self._graphs_on = dev.graphs_supported(self.device) and self.family is not None and self.family.graphs
        self._graphs = dev.GraphPool()  # (T, aux ids, logits_to_keep, cache id, tree or not) -> graph of the step
        self._pooled: dict[int, KVCache] = {}  # batch size -> reusable cache (CUDA only)
        if compile_layers is None:
            compile_layers = os.environ.get(COMPILE_ENV, "0") == "1"
        self._compiled_layer = self._compile_layers() if compile_layers else None

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "auto", device: str | torch.device | None = None,
                        attn_implementation: str = "sdpa", compile_layers: bool | None = None) -> "TargetModel":
        from safetensors import SafetensorError, safe_open
        from transformers import AutoModelForCausalLM

        device = dev.get_device(device) if not isinstance(device, torch.device) else device
        torch_dtype = dev.resolve_dtype(dtype, device)
        if Path(path).is_dir() and (Path(path) / "config.json").is_file():  # before transformers allocates sizes
            mismatch = _shape_mismatch(path)  # the config makes, and prints its table of every mismatch
            if mismatch:
                raise TargetError(mismatch)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch_dtype, attn_implementation=attn_implementation
            )
        except (OSError, ValueError, SafetensorError) as e:  # one line for the user, naming the file at fault
            if isinstance(e, SafetensorError) and Path(path).is_dir():  # transformers does not say which shard
                for shard in sorted(Path(path).glob("*.safetensors")):
                    try:
                        with safe_open(str(shard), framework="pt"):
                            pass
                    except (SafetensorError, OSError) as bad:
                        raise TargetError(f"{shard}: corrupt or truncated safetensors file ({bad}): download the "
                                          "target again") from e
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise TargetError(f"cannot load target model from {path}: {first}") from e
        except RuntimeError as e:  # transformers' size-mismatch report: a table, then this
            if "mismatched_sizes" not in str(e):
                raise
            raise TargetError(_shape_mismatch(path) or f"cannot load target model from {path}: its weights' shapes "
                              "differ from what its config.json makes") from None
        return cls(model.to(device), name_or_path=str(path), compile_layers=compile_layers)

    @classmethod
    def head_and_embeddings(cls, path: str | Path, dtype: str = "auto", device: str | torch.device | None = None
                            ) -> "TargetModel":
        """The target without its decoder layers: every weight on the meta device (no memory) except the input
        embeddings, the final norm and the head, read from its safetensors files. What training from a hidden-state
        store needs (token embeddings, the teacher's head), and capture through vLLM (which hands over the last state
        before the final norm); any call that runs the layers fails."""
        import json

        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        from draftsmith.models.checkpoint import inside

        device = dev.get_device(device) if not isinstance(device, torch.device) else device
        torch_dtype = dev.resolve_dtype(dtype, device)
        config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        names = {module: name for name, module in model.named_modules()}
        wanted = {f"{names[model.get_input_embeddings()]}.weight": model.get_input_embeddings(),
                  f"{names[model.get_output_embeddings()]}.weight": model.get_output_embeddings()}
        norm = getattr((decoder_stack(model) or (None,))[0], "norm", None)
        if isinstance(getattr(norm, "weight", None), torch.Tensor):
            wanted[f"{names[norm]}.weight"] = norm
        index = _target_file(path, "model.safetensors.index.json")
        weight_map = json.loads(index.read_text())["weight_map"] if index is not None else {
            key: "model.safetensors" for key in wanted}
        for key, module in wanted.items():
            if key not in weight_map and getattr(config, "tie_word_embeddings", False):
                continue  # a tied head: shares the embedding below
            if key in weight_map:  # a name the index gives: only ever a file of the target's own folder
                inside(Path(path), weight_map[key], f"{index}: weight_map[{key!r}]", TargetError)
            shard = _target_file(path, weight_map[key]) if key in weight_map else None
            if shard is None:
                raise TargetError(f"{path}: no weight {key} in its safetensors files")
            with safe_open(str(shard), framework="pt") as f:
                module.weight = nn.Parameter(f.get_tensor(key).to(device, torch_dtype), requires_grad=False)
        if getattr(config, "tie_word_embeddings", False):
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        target = cls(model.eval(), name_or_path=str(path), compile_layers=False)
        target.device, target.dtype = device, torch_dtype
        return target

    @classmethod
    def sharded(cls, path: str | Path, mesh, dtype: str = "auto", device: str | torch.device | None = None,
                attn_implementation: str = "sdpa") -> "TargetModel":
        """The frozen target with its decoder layers sharded over the processes of `mesh` (FSDP2, forward only;
        distributed.shard_frozen_layers): built on the meta device, sharded, then each process reads only its
        part of the safetensors files (torch.distributed.checkpoint's Hugging Face reader). The embeddings, the
        final norm and the head stay whole on every process. Every process must run each forward together."""
        import json

        import torch.distributed.checkpoint as dcp
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        from draftsmith import distributed

        device = dev.get_device(device) if not isinstance(device, torch.device) else device
        torch_dtype = dev.resolve_dtype(dtype, device)
        config = AutoConfig.from_pretrained(str(path))
        with init_empty_weights(include_buffers=False):  # weights on meta, buffers (rotary tables) computed
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation)
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        stack = decoder_stack(model)
        if stack is None:
            raise TargetError(f"{path}: training.shard_target needs a causal LM whose decoder layers it can find")
        base, layers = stack
        whole = [m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings(),
                                    getattr(base, "norm", None))
                 if isinstance(getattr(m, "weight", None), nn.Parameter)]
        distributed.shard_frozen_layers(model, layers, base, whole, mesh)
        model.to_empty(device=device)
        for name, value in buffers.items():
            owner, _, attribute = name.rpartition(".")
            getattr(model.get_submodule(owner), attribute).copy_(value)
        index = _target_file(path, "model.safetensors.index.json")
        if index is not None:
            stored = set(json.loads(index.read_text())["weight_map"])
            folder = index.parent
        else:
            from safetensors import safe_open

            single = _target_file(path, "model.safetensors")
            if single is None:
                raise TargetError(f"{path}: no model.safetensors or model.safetensors.index.json")
            with safe_open(str(single), framework="pt") as f:
                stored = set(f.keys())
            folder = single.parent
        state = model.state_dict()
        tied = getattr(config, "tie_word_embeddings", False)
        head = next(name for name, p in model.named_parameters() if p is model.get_output_embeddings().weight)
        missing = sorted(k for k in state if k not in stored and not (tied and k == head))
        if missing:
            raise TargetError(f"{path}: training.shard_target reads weights by their names in the safetensors files, "
                              f"and {len(missing)} of the model's (first {missing[0]}) are not there: this target "
                              "family is not supported sharded; set training.shard_target=false")
        dcp.load({k: v for k, v in state.items() if k in stored},
                 storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
        if tied:
            model.tie_weights()
        return cls(model.eval(), name_or_path=str(path), compile_layers=False)

    # ---- pieces the drafters share -------------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return self._decoder.norm

    def check_drafter_fits(self, source, label: str, vocab_size: int, hidden_size: int, num_layers: int | None = None,
                           error: type[Exception] = ValueError) -> None:
        """Refuse a drafter trained for another target: its vocabulary, hidden size (and, for MTP, depth) must be
        this target's. `label` names the drafter in the message, `error` is the caller's error type."""
        names = ("vocab", "hidden size", "layers")
        trained = (vocab_size, hidden_size, num_layers)
        mine = (self.vocab_size, self.hidden_size, self.num_layers if num_layers is not None else None)
        if trained == mine:
            return

        def described(values):
            parts = [f"{v} {n}" if n == "layers" else f"{n} {v}" for n, v in zip(names, values) if v is not None]
            return ", ".join(parts[:-1]) + " and " + parts[-1]

        raise error(f"{source}: {label} was trained for a target with {described(trained)}; "
                    f"this target has {described(mine)}")

    def check_aux_layer_ids(self, aux_layer_ids) -> list[int]:
        ids = [int(i) for i in aux_layer_ids]
        bad = [i for i in ids if not 0 <= i <= self.num_layers]
        if bad:
            raise TargetError(
                f"aux layer ids {bad} are outside 0..{self.num_layers} for this {self.num_layers}-layer target "
                "(id k = the residual stream entering decoder layer k)"
            )
        return ids

    # ---- training: capture with the stock forward ----------------------------------------------
    @torch.no_grad()
    def capture(self, input_ids, attention_mask=None, aux_layer_ids=None, position_ids=None) -> CapturedStates:
        """Aux features and the final-normed last hidden state, without computing any vocabulary logits.

        `position_ids` restarting at 0 inside a row, with no attention_mask, mark samples packed into that row:
        transformers then keeps each sample's attention to itself (its packed-sequence mask).

        Hooks record the input of each aux layer (and the last layer's output for id L), so only the requested
        layers are kept, not all L+1 hidden states.
        """
        if aux_layer_ids is None:  # each method names its own (its config's), in the capture convention
            raise TypeError("TargetModel.capture needs aux_layer_ids: the capture ids of the method's config")
        ids = self.check_aux_layer_ids(aux_layer_ids)
        recorded: dict[int, torch.Tensor] = {}
        handles = [layer_recorder(self.layers, i, recorded) for i in set(ids)]
        try:
            out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                        use_cache=False)
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([recorded[i] for i in ids], dim=-1)  # (B, S, n_aux*H)
        return CapturedStates(aux_hidden=aux, last_hidden=out.last_hidden_state)

    # ---- runtime: cached forward ---------------------------------------------------------------
    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty cache. On CUDA the cache of each batch size is pooled (reset and reused while it is long
        enough, grown in steps of CACHE_GRANULE), so graphs captured on it stay valid across requests; a
        TargetModel therefore serves one live request per batch size at a time. Its slots are not positions (a
        draft tree takes a slot per node): a request is held to the context by `prompt_overflow`. A target served
        through transformers' own forward gets transformers' cache behind the same interface."""
        self._check_step_support()
        if self._generic is not None:
            return self._generic.new_cache(batch_size, max_length)
        layers, heads, head_dim = self.family.cache_shape()
        if not self._graphs_on:
            return KVCache(layers, batch_size, heads, head_dim, max_length, self.dtype, self.device)
        cache = self._pooled.get(batch_size)
        if cache is None or cache.max_length < max_length:
            length = -(-max_length // CACHE_GRANULE) * CACHE_GRANULE
            self._graphs.clear()  # graphs point at the old cache's memory
            cache = self._pooled[batch_size] = KVCache(layers, batch_size, heads, head_dim, length, self.dtype,
                                                       self.device)
        cache.length = 0
        return cache

    def _compile_layers(self):
        """The dense family's decoder layer of the shape-static step (`LlamaFamily.static_layer`) compiled once for
        every layer (weights are its arguments, so all layers share one compilation per step width), and each
        layer's weights in the order it takes them, q/k/v and gate/up merged (`LlamaFamily.merge_weights`: this
        moves the weights, so graphs that another TargetModel of the same model recorded before are stale)."""
        model_type = getattr(self.config, "model_type", "")
        if model_type not in SUPPORTED_STEP_MODEL_TYPES:
            raise TargetError(f"{COMPILE_ENV}=1 compiles the dense layers of {SUPPORTED_STEP_MODEL_TYPES} targets, "
                              f"not '{model_type}': unset it")
        if getattr(self.config, "hidden_act", "silu") != "silu":
            raise TargetError(f"{COMPILE_ENV}=1 supports SiLU MLPs, not {self.config.hidden_act!r}")
        self._layer_weights = self.family.merge_weights()
        self._layer_step = self.family.static_layer  # uncompiled: the same math, for tests and debugging
        return torch.compile(self._layer_step, fullgraph=True)

    def _check_step_support(self):
        """Refuse, in one line naming the family, a target the runtime cannot serve exactly; note once that a
        target without an adapter runs through transformers' own forward."""
        reason = unsupported_reason(self.config)
        if reason is not None:
            raise TargetError(f"draftsmith's runtime cannot serve this '{self.config.model_type}' target exactly: "
                              f"{reason}")
        if self._generic is not None:
            self._generic.note_once()

    def check_positions(self, positions: int) -> None:
        """Refuse a request that reaches `positions` positions past a sliding window: the runtime's forward attends
        to the whole context, which equals sliding-window attention only while every position is inside the window."""
        window = sliding_window_of(self.config)
        if window is not None and positions > window:
            raise TargetError(
                f"{self.name_or_path or 'the target'} uses sliding-window attention ({window} tokens); draftsmith's "
                f"runtime attends to the whole context, which is the same only up to {window} positions, and this "
                f"request needs {positions} (prompt + max_new_tokens + drafts): shorten it")

    @torch.no_grad()
    def step(self, input_ids, cache: KVCache, aux_layer_ids=None, logits_to_keep=None,
             attention_mask=None, position_ids=None) -> StepOutput:
        """Run `input_ids` (B, T) at positions cache.length.. over the cache, append their K/V, advance the cache.

        `attention_mask` (B or 1, 1, T, cache.length+T), True = may attend, replaces the causal mask (draft trees);
        `position_ids` (B, T) replaces the consecutive positions.
        """
        self._check_step_support()
        batch, num_new = input_ids.shape
        start = cache.length
        end = start + num_new
        if end > cache.max_length:
            raise ValueError(f"KV cache overflow: {end} positions > max_length {cache.max_length}")
        if position_ids is None:  # consecutive positions: slot end = positions (batches with holes: new_cache)
            self.check_positions(end)
        aux_ids = tuple(self.check_aux_layer_ids(aux_layer_ids)) if aux_layer_ids is not None else ()
        if self._generic is not None:  # transformers' own forward advances its cache
            logits, aux = self._generic.step(input_ids, cache, aux_ids, logits_to_keep, attention_mask, position_ids)
            return StepOutput(logits=logits, aux_hidden=aux)
        if (self._graphs_on and batch == 1 and num_new <= MAX_GRAPHED_TOKENS and cache is self._pooled.get(batch)
                and (attention_mask is None) == (position_ids is None)):  # plain steps, or one request's tree
            logits, aux = self._graphed_step(input_ids, cache, aux_ids, logits_to_keep, attention_mask, position_ids)
        else:
            if position_ids is None:
                position_ids = torch.arange(start, end, device=self.device).unsqueeze(0).expand(batch, -1)
            if attention_mask is None and num_new > 1:
                key_pos = torch.arange(end, device=self.device)
                query_pos = torch.arange(start, end, device=self.device)
                attention_mask = (key_pos[None, :] <= query_pos[:, None])[None, None]  # (1, 1, T, end)
            logits, aux = self._layers_forward(input_ids, position_ids, cache, start, end, attention_mask, aux_ids,
                                               logits_to_keep)
        cache.length = end
        return StepOutput(logits=logits, aux_hidden=aux)

    def _layers_forward(self, input_ids, position_ids, cache, start, end, attention_mask, aux_ids, logits_to_keep,
                        slots=None):
        """The decoder stack over the cache, each layer as the target's family runs it (models/targets). With
        `start`/`end` None the step is shape-static (for CUDA graphs): K/V are scattered at `slots` (default: the
        positions) and every query attends over the whole cache, masked by position (or by `attention_mask`
        (1, 1, T, T_max) for a tree), so stale entries past the current length (rejected drafts) are never seen."""
        family = self.family
        wanted = set(aux_ids)
        recorded: dict[int, torch.Tensor] = {}
        if start is None:
            if attention_mask is None:
                key_pos = torch.arange(cache.max_length, device=self.device)
                attention_mask = (key_pos[None, None, :] <= position_ids[:, :, None])[:, None]  # (B, 1, T, T_max)
            if slots is None:
                slots = position_ids[0]  # (T,) rows share positions (B == 1)
        state = StepState(cache, start, end, slots, position_ids,
                          masks=step_masks(attention_mask, position_ids, end, family.windows))
        hidden = family.embed(input_ids, state)  # (B, T, H)
        for i in range(self.num_layers):
            if i in wanted:
                recorded[i] = hidden
            if start is None and self._compiled_layer is not None:
                hidden = self._compiled_layer(hidden, *state.rotary, attention_mask, slots, cache.keys[i],
                                              cache.values[i], self._layer_weights[i])
            else:
                hidden = family.layer(i, hidden, state)
        if self.num_layers in wanted:
            recorded[self.num_layers] = hidden

        kept = hidden if logits_to_keep is None else hidden[:, -logits_to_keep:]
        logits = family.logits(kept).float()  # (B, T_kept, V)
        aux = torch.cat([recorded[i] for i in aux_ids], dim=-1) if aux_ids else None
        return logits, aux

    # ---- CUDA graphs for fixed-shape steps -----------------------------------------------------
    def _graphed_step(self, input_ids, cache, aux_ids, logits_to_keep, tree_mask=None, tree_positions=None):
        """Replay a captured graph of the static step for this (T, aux ids, logits_to_keep, tree or not) on the
        pooled cache.

        Only the inputs change between replays (token ids, positions; for a draft tree also its mask, widened to
        the whole cache, and the consecutive slots it writes), so decode and verify steps of a fixed width cost
        one graph launch instead of hundreds of kernel launches."""
        num_new = input_ids.shape[1]
        start, end = cache.length, cache.length + num_new
        tree = tree_mask is not None
        key = (num_new, aux_ids, logits_to_keep, id(cache), tree)
        inputs = [input_ids, tree_positions if tree else torch.arange(start, end, device=self.device)[None]]
        if tree:
            full = torch.zeros(1, 1, num_new, cache.max_length, dtype=torch.bool, device=self.device)
            full[..., :end] = tree_mask
            inputs += [full, torch.arange(start, end, device=self.device)]

        def run(ids, positions, mask=None, slots=None):
            return self._layers_forward(ids, positions, cache, None, None, mask, aux_ids, logits_to_keep, slots=slots)

        try:
            logits, aux = self._graphs.run(key, run, *inputs)
        except Exception as e:  # noqa: BLE001 - a compiler failure must not end the generation
            if self._compiled_layer is None:
                raise
            # torch.compile fails on some stacks (a missing or mismatched Triton, say); the compile happens in the
            # first, untimed run of a new graph, before anything is recorded, so the module path can take over.
            warnings.warn(f"{COMPILE_ENV}: torch.compile of the decoder layers failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); continuing without it", stacklevel=3)
            self._compiled_layer = None
            logits, aux = self._graphs.run(key, run, *inputs)
        return logits.clone(), aux.clone() if aux is not None else None


def load_target_tokenizer(target: str, label: str, error: type[ValueError] = ValueError):
    """The target's tokenizer from a local model folder or a Hugging Face repo id (resolved by transformers, from its
    cache first). A missing folder, a config.json that is no JSON object, or a failed load is one line of `error`
    naming `label` (the recipe key or option that gave the target) and the path, not transformers' traceback."""
    from transformers import AutoTokenizer

    from draftsmith.models.checkpoint import CheckpointError, read_json
    from draftsmith.models.drafter_config import hub_unreachable
    from draftsmith.models.model_card import looks_like_hub_id

    path = Path(target).expanduser()
    if path.exists():
        config = path / "config.json"
        if not config.is_file():
            raise error(f"{label} {target}: no config.json there (expected a Hugging Face model folder)")
        try:
            parsed = read_json(config)
        except CheckpointError as e:
            raise error(f"{label}: {e}: fix the file or download the model again") from None
        if not isinstance(parsed, dict):
            raise error(f"{label}: {config}: expected a JSON object, got {type(parsed).__name__}")
    elif not looks_like_hub_id(target):
        raise error(f"{label} {target}: no such folder, and not a Hugging Face repo id (ORG/NAME)")
    elif (unreachable := hub_unreachable(target)) is not None:  # fail at once, not after minutes of retries
        raise error(f"{label} {unreachable}")
    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as e:
        raise error(f"{label} {target}: cannot load the tokenizer: {str(e).splitlines()[0]}") from None


def _shape_mismatch(path: str | Path) -> str | None:
    """The first weight whose shape in the safetensors files differs from the one config.json makes (read from the
    files' headers and a model built on the meta device), as one line; None where none is found."""
    import json

    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # a check only: whatever it cannot read (another family, an odd index) is left to transformers
        index = _target_file(path, "model.safetensors.index.json")
        files = ([index.parent / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
                 if index is not None else [f for f in [_target_file(path, "model.safetensors")] if f is not None])
        files = [f for f in files if f.resolve().is_relative_to(Path(path).resolve()) and f.is_file()]
        with init_empty_weights():
            expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(str(path))).state_dict().items()}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    stored = tuple(f.get_slice(name).get_shape())
                    if name in expected and expected[name] != stored:
                        return (f"{file}: {name} has shape {stored}, but {Path(file).parent / 'config.json'} "
                                f"makes it {expected[name]}: the config does not describe these weights")
    except Exception:  # noqa: BLE001
        return None
    return None


def _target_file(path: str | Path, filename: str) -> Path | None:
    """One file of the target: in its local folder, or fetched alone from the Hugging Face Hub; None if absent."""
    if Path(path).is_dir():
        local = Path(path) / filename
        return local if local.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(str(path), filename))
    except EntryNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - one line naming the target
        raise TargetError(f"cannot load {filename} of the target {path}: {str(e).splitlines()[0] if str(e) else e}"
                          ) from e
