"""`draftsmith collect RECIPE [key=value ...]` (or `accelerate launch -m draftsmith.collect RECIPE ...`): run the
target once over the recipe's prepared data and write its hidden states into the store `data.hidden_states_path`
names (data/store.py), so training reads them instead of running the target every epoch.

Each process takes a disjoint part of the samples (rank, rank + world, ...) and writes its own shards; the index is
merged at the end. A killed run resumes where it stopped: finished shards are kept, the unfinished one is redone.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith import device as dev
from draftsmith.config import Recipe, RecipeError, check_recipe_against_target


def collect(recipe: Recipe, log=print) -> Path:
    """Write the store data.hidden_states_path names (each process its share of the samples); returns its folder."""
    from accelerate import Accelerator

    from draftsmith.data import prepare_dataset
    from draftsmith.data.store import INDEX, HiddenStateStore, human_bytes, write_index
    from draftsmith.train.features import recipe_store_header
    from draftsmith.train.setup import load_tokenizer, method_class, target_config_dict

    if not recipe.data.hidden_states_path:
        raise RecipeError("collect needs data.hidden_states_path: the folder to write the hidden-state store into")
    folder = Path(recipe.data.hidden_states_path).expanduser()
    state = Accelerator()  # as the trainer starts it: reads the launcher's settings (ACCELERATE_USE_CPU too)
    log = log if state.is_main_process else (lambda *a, **k: None)
    tokenizer = load_tokenizer(recipe.model.target)
    check_recipe_against_target(recipe, target_config_dict(recipe.model.target))
    with state.main_process_first():
        data = prepare_dataset(recipe.data, tokenizer, log=log)
    samples = [*data.train, *data.eval]
    target = _load_target(recipe, state)
    method = method_class(recipe.model.method)(recipe, target)
    header = recipe_store_header(recipe, tokenizer, target, method, data, recipe.collect.dtype)
    if (folder / INDEX).is_file():
        HiddenStateStore(folder).check_matches(header)
        log(f"collect: {folder} already holds the complete store for this recipe: nothing to do")
        return folder
    _check_room(recipe, target, method.aux_layer_ids, samples, folder, state, log)
    _capture_share(recipe, target, method.aux_layer_ids, samples, folder, header, state, log)
    state.wait_for_everyone()
    if state.is_main_process:
        index = write_index(folder, header, len(samples), state.num_processes)
        log(f"collect: wrote {index['num_samples']} samples, {index['num_tokens']} tokens, "
            f"{human_bytes(index['bytes'])} in {len(index['shards'])} shards to {folder}")
    state.wait_for_everyone()
    return folder


def _load_target(recipe: Recipe, state):
    """The target as collect.engine runs it: whole here, or (vllm) only its final norm, head and embeddings."""
    from draftsmith.models.target import TargetModel

    if recipe.collect.engine != "vllm":
        return TargetModel.from_pretrained(recipe.model.target, dtype=recipe.model.dtype, device=state.device,
                                           attn_implementation=recipe.model.attn_implementation)
    if state.num_processes > 1:
        raise RecipeError("collect.engine vllm runs in one process (vLLM spreads the target over its own "
                          "tensor and data parallel workers): run draftsmith collect, not accelerate launch")
    # the layers run in vLLM; here only the final norm (and the head and embeddings the method reads)
    return TargetModel.head_and_embeddings(recipe.model.target, dtype=recipe.model.dtype, device="cpu")


def _check_room(recipe: Recipe, target, aux_layer_ids: list[int], samples, folder: Path, state, log) -> None:
    """Say what the store will hold, and refuse to start without the disk space this process's share needs."""
    from draftsmith.data.store import bytes_per_token, check_disk, human_bytes

    rank, world = state.process_index, state.num_processes
    per_token = bytes_per_token(target.config.hidden_size, len(aux_layer_ids), recipe.collect.dtype)
    tokens = sum(len(s.input_ids) for s in samples)
    log(f"collect: {len(samples)} samples, {tokens} tokens x {per_token} bytes per token ({len(aux_layer_ids)} "
        f"aux layers {aux_layer_ids} + the last hidden state, {recipe.collect.dtype}) = about "
        f"{human_bytes(tokens * per_token)} into {folder}" + (f", {world} processes" if world > 1 else ""))
    done = tokens_done(folder, rank)
    mine = sum(len(s.input_ids) for s in samples[rank::world])
    check_disk(folder, (mine - done) * per_token)


def _capture_share(recipe: Recipe, target, aux_layer_ids: list[int], samples, folder: Path, header: dict, state,
                   log) -> None:
    """This process's shards: through vLLM, or the target's own forward over samples rank, rank + world, ..."""
    from draftsmith.data.store import collect_rank

    options = dict(max_shard_bytes=recipe.collect.max_shard_bytes, dtype=recipe.collect.dtype,
                   batch_tokens=recipe.collect.batch_tokens, log=log)
    if recipe.collect.engine == "vllm":
        capture = _vllm_capture(recipe, target, aux_layer_ids, samples, folder, log)
        collect_rank(capture, aux_layer_ids, samples, folder, header, **options)
        if capture.errors:
            log(f"collect: {capture.errors} vLLM request(s) failed and were sent again")
        getattr(capture.engine, "close", lambda: None)()
    else:
        with dev.sdpa_without_cudnn():  # every batch has a new shape (device.py)
            collect_rank(target, aux_layer_ids, samples, folder, header, rank=state.process_index,
                         world=state.num_processes, **options)


def _vllm_capture(recipe: Recipe, target, aux_layer_ids: list[int], samples, folder: Path, log):
    """The capture through vLLM (data/vllm_capture.py): the engine started (in process) or found (client mode),
    checked with one request before the store's folder is touched."""
    from draftsmith.data.vllm_capture import STAGING, LocalVllm, VllmCapture, VllmLayers, VllmServer, probe, serve_command

    cfg = recipe.collect.vllm
    layers = VllmLayers(tuple(aux_layer_ids), target.num_layers)
    if cfg.url:
        log(f"collect: capturing through the vLLM server at {cfg.url}, layer ids {layers.requested}; it must run as: "
            + serve_command(recipe.model.target, layers, cfg.staging_path or "/tmp/draftsmith-hidden-states",
                            cfg.tensor_parallel_size, cfg.data_parallel_size))
        engine = VllmServer(cfg.url, recipe.model.target, concurrency=cfg.concurrency, timeout=cfg.timeout)
    else:
        staging = Path(cfg.staging_path).expanduser() if cfg.staging_path else folder / STAGING
        log(f"collect: starting vLLM in this process (tensor parallel {cfg.tensor_parallel_size}, data parallel "
            f"{cfg.data_parallel_size}), layer ids {layers.requested}")
        engine = LocalVllm(recipe.model.target, layers, staging, dtype=recipe.model.dtype,
                           tensor_parallel_size=cfg.tensor_parallel_size, data_parallel_size=cfg.data_parallel_size,
                           engine_args=cfg.engine_args)
    probe(engine, layers, target.hidden_size, samples[0].input_ids[:16])
    return VllmCapture(engine, layers, target.final_norm, target.hidden_size, retries=cfg.retries, log=log)


def tokens_done(folder: Path, rank: int) -> int:
    """Tokens this rank's finished shards already hold (a resumed run needs disk for the rest only)."""
    import json

    path = folder / f"progress-r{rank}.json"
    if not path.is_file():
        return 0
    return sum(length for shard in json.loads(path.read_text())["shards"] for _, _, length in shard["samples"])
