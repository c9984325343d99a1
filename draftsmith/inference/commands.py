"""`draftsmith generate` and `draftsmith eval`: argument parsing and glue around the runtime.

Errors the user can fix are raised as ValueError subclasses with a one-line message; `draftsmith.cli.main`
prints them on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

DEFAULT_GENERATE_TOKENS = 128
DEFAULT_EVAL_TOKENS = 256
DEFAULT_EVAL_OUT = "eval_results"


class CommandError(ValueError):
    """A command-line argument that cannot be used."""


def _add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True,
                   help="target model: a folder (Hugging Face format) or a Hub id ORG/NAME (cached or downloaded)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, npu, npu:N (default: the accelerator found)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="target dtype (auto: bf16 on accelerators, float32 on CPU; losslessness is exact in float32)")
    p.add_argument("--compile", action="store_true",
                   help="fuse the target's decoder layers with torch.compile in its CUDA-graph steps (as "
                        "DRAFTSMITH_COMPILE=1; a warm-up of seconds; no effect without CUDA graphs)")
    # vLLM's SamplingParams names; speculation keeps the output distribution of plain sampling with them.
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 or -1: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this mass (1: all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: a fresh one)")
    p.add_argument("--truncate-prompts", action="store_true",
                   help="cut a prompt too long for the target's context with --max-new-tokens to its last "
                        "(context - max-new-tokens) tokens, as vLLM's truncate_prompt_tokens keeps the end, instead "
                        "of refusing it")


def _sampling(args: argparse.Namespace):
    """The SamplingParams of --temperature/--top-k/--top-p/--seed, or None for greedy decoding."""
    from draftsmith.runtime.sampling import SamplingError, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except SamplingError as e:
        raise CommandError(f"--{str(e).split()[0].replace('_', '-')}: {e}") from None
    return None if params.greedy else params


def add_generate_args(p: argparse.ArgumentParser) -> None:
    _add_common_args(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM-style config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(default: plain greedy decoding)")
    p.add_argument("--prompt", required=True, action="append",
                   help="user message, rendered with the chat template when there is one; repeat to serve several "
                        "together as one batch")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_GENERATE_TOKENS,
                   help="stop each reply after this many tokens, or earlier at an EOS "
                        f"(default {DEFAULT_GENERATE_TOKENS})")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (a line each): token_ids, text, metrics")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    from draftsmith.inference.eval import SKIP_MALFORMED_FLAG

    _add_common_args(p)
    p.add_argument("--speculative-config", action="append", required=True, metavar="JSON",
                   help="vLLM-style config; repeat to compare several. One without num_speculative_tokens runs "
                        "once per length in --num-speculative-tokens")
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=None, metavar="K",
                   help="proposal lengths to sweep, e.g. 1 3 5 7 (for configs that do not set num_speculative_tokens)")
    p.add_argument("--dataset", action="append", required=True, metavar="[NAME=]PATH",
                   help="JSONL prompt set: MT-bench question.jsonl (first of 'turns'), records with 'prompt' "
                        "(HumanEval), 'question' or 'instruction', or conversations (first user turn); repeat for "
                        "several, each reported on its own (NAME defaults to the file name)")
    p.add_argument(SKIP_MALFORMED_FLAG, action="store_true",
                   help="skip records that hold no prompt, counting them, instead of stopping at the first")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_EVAL_TOKENS,
                   help=f"stop each reply after this many tokens, or earlier at an EOS (default {DEFAULT_EVAL_TOKENS})")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use the first N prompts of each dataset (default: all)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="serve the prompts N at a time, plain decoding too, so tokens/s and speedups compare at that "
                        "concurrency (default 1: one request at a time, CUDA graphs)")
    p.add_argument("--tie-tolerance", type=float, default=None, metavar="FRACTION",
                   help="speedups this close to the best (relative) count as ties, won by the smaller k (default 0.01)")
    p.add_argument("--out", default=DEFAULT_EVAL_OUT,
                   help=f"folder for eval.json, eval.txt and the plots (default: ./{DEFAULT_EVAL_OUT}); a drafter "
                        "that is a draftsmith training checkpoint also gets its own rows as eval.json in its folder, "
                        "for the model card of `draftsmith export`")


def _prepare(args: argparse.Namespace, spec_texts: list[str]):
    """(device, configs, tokenizer, the target's config.json) with the cheap things validated (configs, paths,
    sizes, each k against the target's context), before any model is loaded."""
    from draftsmith import device as dev
    from draftsmith.inference.spec_config import parse_spec_config

    _check_max_new_tokens(args)
    device = dev.get_device(args.device)
    specs = [parse_spec_config(text, device_type=device.type) for text in spec_texts]
    _check_drafters_reachable(specs)
    tokenizer = _load_tokenizer(args.target)
    _check_drafter_tokenizers(specs, tokenizer, args.target)
    config = _target_config(args.target)
    _check_speculative_tokens(specs, config)
    return device, specs, tokenizer, config


def _target_config(target: str):
    """The config.json of --target (its context length, read before the weights are)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as e:
        raise CommandError(f"--target {target}: cannot read its config.json: {str(e).splitlines()[0]}") from None


def _check_speculative_tokens(specs, target_config) -> None:
    """Every config's k against the target's context (`target.check_num_speculative_tokens`); the method's own limit
    is its proposer factory's."""
    from draftsmith.models.target import check_num_speculative_tokens

    for i, spec in enumerate(specs, 1):
        try:
            check_num_speculative_tokens(spec.num_speculative_tokens, target_config)
        except ValueError as e:
            raise CommandError(f"{e}{f' [--speculative-config #{i}]' if len(specs) > 1 else ''}") from None


def _load_target(args: argparse.Namespace, device):
    """The target of --target in --dtype on `device`, its layers compiled with --compile (else as the
    environment says)."""
    from draftsmith.models.target import TargetModel

    return TargetModel.from_pretrained(args.target, dtype=args.dtype, device=device,
                                       compile_layers=True if args.compile else None)


def _check_drafters_reachable(specs) -> None:
    """A drafter `model` given as a Hub id that is neither cached nor reachable fails now, not after huggingface_hub's
    retries once the target is loaded (and, in eval, the baseline measured)."""
    from draftsmith.models.drafter_config import hub_unreachable

    for model in dict.fromkeys(spec.model for spec in specs if spec.model):
        why_not = hub_unreachable(model)
        if why_not:
            raise CommandError(f"--speculative-config model {why_not}")


def _check_drafter_tokenizers(specs, tokenizer, target: str) -> None:
    """Refuse a drafter exported for another tokenizer than the target's: the fingerprint its export recorded
    (config.json "draftsmith" block) against this tokenizer's. Ids that mean other tokens draft nothing useful,
    silently; the vocabulary size alone is checked when the drafter loads."""
    from draftsmith.models.target_files import tokenizer_fingerprint

    mine = None
    for model in dict.fromkeys(spec.model for spec in specs if spec.model):
        path = Path(model) / "config.json"
        try:
            recorded = (json.loads(path.read_text(encoding="utf-8")).get("draftsmith") or {}).get("tokenizer")
        except (OSError, ValueError, AttributeError):
            continue  # not a local export folder: its loader says what is wrong with it
        if not isinstance(recorded, str):
            continue
        mine = mine or tokenizer_fingerprint(tokenizer)
        if recorded != mine:
            raise CommandError(f"{path}: this drafter was trained with another tokenizer than --target {target}'s "
                               f"(fingerprint {recorded}, the target's {mine}: its token ids or special ids "
                               "differ): train a drafter for this target")


def _check_max_new_tokens(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise CommandError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def _load_tokenizer(target: str):
    """The tokenizer of --target, a folder or Hub id as `draftsmith train` takes it (models/target.py); an id that
    is neither cached nor reachable fails at once, before huggingface_hub's retries."""
    from draftsmith.models.drafter_config import hub_unreachable
    from draftsmith.models.target import load_target_tokenizer

    why_not = hub_unreachable(target)
    if why_not:
        raise CommandError(f"--target {why_not}")
    return load_target_tokenizer(target, "--target", CommandError)


def run_generate(args: argparse.Namespace) -> int:
    from draftsmith.inference.eval import PromptRecord, eos_token_ids, fit_prompts, render_prompt
    from draftsmith.inference.generator import SpeculativeGenerator
    from draftsmith.inference.spec_config import build_proposer

    spec_texts = [args.speculative_config] if args.speculative_config is not None else []
    sampling = _sampling(args)
    device, specs, tokenizer, config = _prepare(args, spec_texts)
    records = [PromptRecord(f"--prompt #{i}" if len(args.prompt) > 1 else "--prompt", text,
                            render_prompt(tokenizer, text)) for i, text in enumerate(args.prompt, 1)]
    prompts = fit_prompts(records, args.max_new_tokens, config, args.truncate_prompts)
    target = _load_target(args, device)
    spec = specs[0] if specs else None
    proposer = build_proposer(spec, target) if spec is not None else None
    generator = SpeculativeGenerator(target, proposer, spec.num_speculative_tokens if spec else 0)
    eos = eos_token_ids(target, tokenizer)
    if len(prompts) == 1:
        results = [generator.generate(torch.tensor(prompts), args.max_new_tokens, eos, sampling=sampling)]
    else:  # one batch: rows of different lengths, each finishing on its own
        results = generator.generate_batch(prompts, args.max_new_tokens, eos, sampling=sampling)
    for i, result in enumerate(results):
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({
                "token_ids": result.token_ids,
                "text": text,
                "metrics": result.metrics.to_dict(),
                "num_target_steps": result.num_target_steps,
                "seconds": result.seconds,
                "batch_size": len(prompts),
                "speculative_config": spec.to_dict() if spec else None,
            }))
        else:
            print(f"[{i + 1}/{len(results)}] {text}" if len(results) > 1 else text)
            if spec is not None:
                print(result.metrics.log_line(result.seconds))
    return 0


def run_eval_command(args: argparse.Namespace) -> int:
    """Sweep configs x proposal lengths x datasets in one process; write eval.json, eval.txt and one PNG per dataset.

    Everything that can be wrong in the arguments (configs, lengths, each k and every prompt against the target's
    context, dataset files and lines) fails before the target is loaded.
    """
    from draftsmith import device as dev
    from draftsmith.inference.eval import (
        drafter_eval_results,
        expand_spec_configs,
        fit_prompts,
        name_datasets,
        read_prompts,
        run_sweep,
        write_eval_json,
    )
    from draftsmith.inference.report import SPEEDUP_TIE_TOLERANCE, add_recommendations, format_report, write_plots
    from draftsmith.models.checkpoint import EVAL_FILE, is_disk_full, write_failure, write_text_atomic

    _check_max_new_tokens(args)
    if args.batch_size < 1:
        raise CommandError(f"--batch-size must be >= 1, got {args.batch_size}")
    sampling = _sampling(args)
    tie_tolerance = SPEEDUP_TIE_TOLERANCE if args.tie_tolerance is None else args.tie_tolerance
    if not 0 <= tie_tolerance < 1:
        raise CommandError(f"--tie-tolerance must be in [0, 1), got {tie_tolerance}")
    device = dev.get_device(args.device)
    specs = expand_spec_configs(args.speculative_config, args.num_speculative_tokens, device.type)
    _check_drafters_reachable(specs)
    paths = name_datasets(args.dataset)
    tokenizer = _load_tokenizer(args.target)
    _check_drafter_tokenizers(specs, tokenizer, args.target)
    config = _target_config(args.target)
    _check_speculative_tokens(specs, config)
    prompts = {name: fit_prompts(read_prompts(path, tokenizer, limit=args.num_prompts,
                                              skip_malformed=args.skip_malformed),
                                 args.max_new_tokens, config, args.truncate_prompts, label=f"--dataset {name}")
               for name, path in paths.items()}
    target = _load_target(args, device)

    out = Path(args.out)
    failed_write: list[str] = []

    def save_so_far(partial: dict) -> None:
        """eval.json after each configuration; a full disk stops the saving, not the measuring."""
        if failed_write:
            return
        try:
            write_eval_json(partial, out / "eval.json", target)
        except OSError as e:
            if not is_disk_full(e):
                raise
            failed_write.append(write_failure(e, out / "eval.json"))
            print(f"draftsmith eval: {failed_write[0]}: measuring goes on, and the report is printed at the end",
                  file=sys.stderr)

    sweep = run_sweep(target, tokenizer, prompts, specs, args.max_new_tokens, progress=sys.stderr.isatty(),
                      sampling=sampling, dataset_paths={name: str(path) for name, path in paths.items()},
                      on_progress=save_so_far, batch_size=args.batch_size)
    add_recommendations(sweep, tie_tolerance)
    report = format_report(sweep, target=args.target, dtype=str(target.dtype).removeprefix("torch."))
    print(report, flush=True)  # before any file: a full disk cannot take the results with it
    try:
        written = [write_eval_json(sweep, out / "eval.json", target)]
        write_text_atomic(report + "\n", out / "eval.txt")
        written += [out / "eval.txt", *write_plots(sweep, out)]
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise CommandError(f"{write_failure(e, out)}: the results are in the report printed above (and "
                           f"{out / 'eval.json'} holds those saved before the disk filled); free space and rerun to "
                           "save them") from None
    print("wrote " + ", ".join(str(p) for p in written))
    for ckpt, result in drafter_eval_results(sweep).items():  # the acceptance table of the drafter's model card
        try:
            path = write_eval_json(result, ckpt / EVAL_FILE, target)
        except OSError as e:
            print(f"{write_failure(e, ckpt / EVAL_FILE)}: the model card of `draftsmith export {ckpt}` will have no "
                  f"acceptance table ({out / 'eval.json'} has the results)", file=sys.stderr)
            continue
        print(f"wrote {path} (this drafter's rows, shown in the model card of `draftsmith export {ckpt}`)")
    return 0
