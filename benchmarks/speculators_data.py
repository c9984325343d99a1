"""Offline EAGLE-3 training data for the `speculators` trainer (0.9.x), written with plain transformers (no vLLM).

`speculators train` reads a data folder laid out the way `speculators prepare-data` + `generate-offline-data`
leave it; its "file" hidden-states backend (hs_connectors.FileTransfer) then finds each sample's hidden states
by dataset row index. This script writes that folder from draftsmith's own tokenization, so both trainers see
the same token ids and loss masks::

    OUT/
      data-00000-of-00001.arrow, dataset_info.json, state.json
                                # a `datasets.Dataset.save_to_disk` folder, torch format, one row per sample:
                                #   input_ids int64[seq], loss_mask int64[seq] (1 = assistant token), seq_len int64
      hidden_states/hs_<row>.safetensors
                                #   "hidden_states": (seq, n_aux + 1, H) in the target dtype (bf16 by default):
                                #       [:, j] = residual stream entering layer aux_layer_ids[j] (HF
                                #       output_hidden_states[k]; id 0 = the embeddings), ids ascending;
                                #       [:, -1] = the last decoder layer's output BEFORE the final norm
                                #       (speculators applies its own frozen copy of the norm, verifier_norm)
                                #   "token_ids": int64[seq], equal to the row's input_ids (checked at load)
      token_freq.pt             # {target token id: count} over loss-masked tokens, for --draft-vocab-size
      d2t-<V>.npy, t2d-<V>.npy  # only with --draft-vocab-size V: the pruned-vocab maps, built as draftsmith does
      speculators_data.json     # what was written and the flags `speculators train` needs to match it

This is what vLLM's `extract_hidden_states` method writes for the layer ids launch_vllm.py passes
([2, L//2, L-3] plus L): vLLM records id 0 before the first layer and id i+1 after layer i, as the residual
stream (hidden + residual), so id L is the last layer's pre-norm output. `speculators train` takes
`--target-layer-ids` WITHOUT that appended L. The final hidden state of transformers' `output_hidden_states`
is after the norm, so it is not used here: forward pre-hooks read the input of each aux layer and of the norm.

    python -m benchmarks.speculators_data --target .fixture/sharegpt-llama-19m \
        --data .devdata/sharegpt_train.jsonl --max-samples 64 --max-length 512 --out /tmp/spec_data
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ_FILE = "token_freq.pt"
METADATA_FILE = "speculators_data.json"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """speculators' (and launch_vllm.py's) default aux layers, without the final layer it appends."""
    return [2, num_layers // 2, num_layers - 3]


def _check_aux_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    ids = default_aux_layer_ids(num_layers) if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(
            f"aux layer ids {ids} must be distinct and within [0, {num_layers - 1}] for this {num_layers}-layer "
            f"target; the final layer ({num_layers}) is always written as the last slot and must not be listed"
        )
    # vLLM appends aux states in layer order whatever order the ids were given in; so do we.
    return sorted(ids)


def _decoder_parts(model: Any) -> tuple[Any, Any, Any]:
    """(the decoder, its list of layers, its final norm) of a transformers causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if layers is None or norm is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder .layers and final .norm to hook")
    return base, layers, norm


def token_frequencies(samples: Iterable[Any]) -> dict[int, int]:
    """{token id: count} of the tokens under each sample's loss mask (what speculators' token_freq.pt holds)."""
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(t for t, m in zip(s.input_ids, s.loss_mask) if m)
    return dict(counts)


def draft_vocab_maps(freq: dict[int, int], target_vocab_size: int, draft_vocab_size: int):
    """(d2t int64 (V,), t2d bool (target_vocab,)): the top-V ids by count, ties and padding by lowest id, sorted.

    The same selection as draftsmith.data.vocab.build_draft_vocab and speculators' vocab_mapping.
    """
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be in [1, {target_vocab_size}]")
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    for tid, n in freq.items():
        counts[tid] = n
    used = torch.sort(-counts, stable=True).indices[:draft_vocab_size].sort().values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


@torch.no_grad()
def write_speculators_dataset(
    target_path: str,
    samples: Sequence[Any],
    out_dir: str | os.PathLike,
    aux_layer_ids: Sequence[int] | None = None,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    *,
    dtype: str = "bfloat16",
    vocab_samples: int | None = None,
    draft_vocab_size: int | None = None,
    log=print,
) -> Path:
    """Run the target over `samples` (objects with .input_ids / .loss_mask lists) and write speculators' data folder.

    Row i of the dataset is samples[i]; its hidden states go to hidden_states/hs_i.safetensors. `dtype` is the
    target's compute dtype and the stored one (vLLM serves and writes bf16). token_freq.pt counts the first
    `vocab_samples` samples (all by default: pass the number of training samples to leave held-out ones out,
    as draftsmith's vocabulary does). Returns the folder.
    """
    from datasets import Dataset, Features, Sequence as HFSequence, Value
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; speculators keys hidden states by row, so write a fresh folder")
    if not samples:
        raise ValueError("no samples to write")
    for i, s in enumerate(samples):
        if len(s.input_ids) != len(s.loss_mask) or not s.input_ids:
            raise ValueError(f"sample {i}: input_ids ({len(s.input_ids)}) and loss_mask ({len(s.loss_mask)}) "
                             "must be non-empty and of equal length")

    config = AutoConfig.from_pretrained(target_path)
    text_config = getattr(config, "text_config", config)
    num_layers, vocab_size = text_config.num_hidden_layers, text_config.vocab_size
    ids = _check_aux_ids(aux_layer_ids, num_layers)
    torch_dtype = getattr(torch, dtype)
    device = torch.device(device)

    # 1. the dataset rows (before anything else lands in the folder: save_to_disk wants to own it)
    out.mkdir(parents=True, exist_ok=True)
    features = Features({"input_ids": HFSequence(Value("int64")), "loss_mask": HFSequence(Value("int64")),
                         "seq_len": Value("int64")})
    rows = Dataset.from_dict(
        {"input_ids": [list(map(int, s.input_ids)) for s in samples],
         "loss_mask": [[int(bool(m)) for m in s.loss_mask] for s in samples],
         "seq_len": [len(s.input_ids) for s in samples]},
        features=features,
    )
    rows.set_format(type="torch")
    rows.save_to_disk(str(out))

    # 2. hidden states
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch_dtype, attn_implementation="sdpa")
    model.to(device).eval()
    base, layers, norm = _decoder_parts(model)
    recorded: dict[int, torch.Tensor] = {}

    def hook(layer_id: int):
        def pre_hook(_module, args, kwargs):
            recorded[layer_id] = args[0] if args else kwargs["hidden_states"]
        return pre_hook

    handles = [layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in ids]
    handles.append(norm.register_forward_pre_hook(hook(num_layers), with_kwargs=True))
    hs_dir = out / HIDDEN_STATES_DIR
    hs_dir.mkdir()
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))  # batches of similar lengths
    try:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            longest = max(len(samples[i].input_ids) for i in batch)
            input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
            attention_mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for row, i in enumerate(batch):  # right padding: causal attention keeps real positions exact
                n = len(samples[i].input_ids)
                input_ids[row, :n] = torch.tensor(samples[i].input_ids, dtype=torch.long)
                attention_mask[row, :n] = 1
            recorded.clear()
            base(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
            stacked = torch.stack([recorded[k] for k in (*ids, num_layers)], dim=2)  # (B, S, n_aux + 1, H)
            stacked = stacked.to("cpu", torch_dtype)
            for row, i in enumerate(batch):
                n = len(samples[i].input_ids)
                _save_atomic({"hidden_states": stacked[row, :n].contiguous(),
                              "token_ids": input_ids[row, :n].clone()}, hs_dir / f"hs_{i}.safetensors")
            log(f"hidden states: {min(start + batch_size, len(order))}/{len(order)} samples")
    finally:
        for h in handles:
            h.remove()

    # 3. the token frequencies (and, if asked, the vocab maps speculators would derive from them)
    n_vocab = len(samples) if vocab_samples is None else vocab_samples
    freq = token_frequencies(samples[:n_vocab])
    torch.save(freq, out / TOKEN_FREQ_FILE)
    if draft_vocab_size is not None:
        import numpy as np

        d2t, t2d = draft_vocab_maps(freq, vocab_size, draft_vocab_size)
        np.save(out / f"d2t-{draft_vocab_size}.npy", d2t.numpy())
        np.save(out / f"t2d-{draft_vocab_size}.npy", t2d.numpy())

    target_ref = str(Path(target_path).resolve()) if Path(target_path).exists() else str(target_path)
    meta = {
        "target": target_ref,
        "num_samples": len(samples),
        "tokens": int(sum(len(s.input_ids) for s in samples)),
        "loss_tokens": int(sum(sum(1 for m in s.loss_mask if m) for s in samples)),
        "num_hidden_layers": num_layers,
        "hidden_size": text_config.hidden_size,
        "dtype": dtype,
        "aux_layer_ids": ids,
        "stored_layer_ids": [*ids, num_layers],
        "vocab_samples": n_vocab,
        "draft_vocab_size": draft_vocab_size,
        "train_flags": ["--verifier-name-or-path", target_ref, "--data-path", str(out.resolve()),
                        "--target-layer-ids", *map(str, ids)],
    }
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log(f"wrote {len(samples)} samples to {out} (aux layers {ids} + final layer {num_layers}, {dtype})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model folder or HF id")
    p.add_argument("--data", required=True, help="training records (anything draftsmith's data.path accepts)")
    p.add_argument("--max-samples", type=int, default=None, help="records read (draftsmith data.max_samples)")
    p.add_argument("--max-length", type=int, default=2048, help="draftsmith data.max_length")
    p.add_argument("--on-long", choices=["drop", "truncate"], default="drop", help="draftsmith data.on_long")
    p.add_argument("--start-index", type=int, default=0, help="draftsmith data.start_index")
    p.add_argument("--format", default="auto", help="draftsmith data.format")
    p.add_argument("--eval-samples", type=int, default=0,
                   help="draftsmith data.eval_samples: they are written after the training samples, left out of "
                        "token_freq.pt, and the --train-data-ratio that makes them speculators' validation split "
                        "is printed (speculators always holds out a validation split)")
    p.add_argument("--out", required=True, help="data folder to create (speculators --data-path)")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", default=None,
                   help="aux layers, without the final one (default [2, L//2, L-3], speculators' default)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="also write d2t-V.npy / t2d-V.npy (speculators would build the same from token_freq.pt)")
    p.add_argument("--device", default=None, help="default: the accelerator draftsmith finds, else the CPU")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from draftsmith.config import DataConfig
    from draftsmith.data import prepare_dataset

    data_cfg = DataConfig(path=args.data, format=args.format, max_length=args.max_length, on_long=args.on_long,
                          start_index=args.start_index, max_samples=args.max_samples, eval_samples=args.eval_samples)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prepared = prepare_dataset(data_cfg, tokenizer)
    samples = [*prepared.train, *prepared.eval]
    from draftsmith import device as dev

    write_speculators_dataset(args.target, samples, args.out, args.aux_layer_ids, dev.get_device(args.device),
                              args.batch_size,
                              dtype=args.dtype, vocab_samples=len(prepared.train),
                              draft_vocab_size=args.draft_vocab_size)
    n_train, n = len(prepared.train), len(samples)
    if prepared.eval:
        # speculators splits at int(n * ratio); the midpoint makes that exactly n_train
        print(f"validate on draftsmith's eval samples with: --train-data-ratio {(n_train + 0.5) / n:.6f}")
    else:
        print(f"speculators validates on the last {n - int(n * 0.9)} of {n} samples (--train-data-ratio 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
