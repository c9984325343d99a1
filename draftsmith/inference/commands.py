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
    p.add_argument("--target", required=True, help="target model folder (Hugging Face format)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, npu, npu:N (default: the accelerator found)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="target dtype (auto: bf16 on accelerators, float32 on CPU; losslessness is exact in float32)")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    _add_common_args(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM-style config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(default: plain greedy decoding)")
    p.add_argument("--prompt", required=True, help="user message; rendered with the chat template when there is one")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_GENERATE_TOKENS)
    p.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, metrics")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    _add_common_args(p)
    p.add_argument("--speculative-config", action="append", required=True, metavar="JSON",
                   help="vLLM-style config; repeat to compare several")
    p.add_argument("--dataset", required=True, help="MT-bench question.jsonl or conversation JSONL")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_EVAL_TOKENS)
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    p.add_argument("--out", default=DEFAULT_EVAL_OUT, help=f"folder for eval.json (default: ./{DEFAULT_EVAL_OUT})")


def _load(args: argparse.Namespace, spec_texts: list[str]):
    """Validate the cheap things first (configs, paths, sizes), then load the tokenizer and the target."""
    from transformers import AutoTokenizer

    from draftsmith import device as dev
    from draftsmith.inference.spec_config import parse_spec_config
    from draftsmith.models.target import TargetModel

    if args.max_new_tokens < 1:
        raise CommandError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    device = dev.get_device(args.device)
    specs = [parse_spec_config(text, device_type=device.type) for text in spec_texts]
    if not (Path(args.target) / "config.json").is_file():
        raise CommandError(f"--target {args.target}: no config.json there (expected a Hugging Face model folder)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    except (OSError, ValueError) as e:
        raise CommandError(f"--target {args.target}: cannot load the tokenizer: {str(e).splitlines()[0]}") from None
    target = TargetModel.from_pretrained(args.target, dtype=args.dtype, device=device)
    return specs, tokenizer, target


def run_generate(args: argparse.Namespace) -> int:
    from draftsmith.inference.eval import eos_token_ids, render_prompt
    from draftsmith.inference.generator import SpeculativeGenerator
    from draftsmith.inference.spec_config import build_proposer

    spec_texts = [args.speculative_config] if args.speculative_config is not None else []
    specs, tokenizer, target = _load(args, spec_texts)
    spec = specs[0] if specs else None
    proposer = build_proposer(spec, target) if spec is not None else None
    generator = SpeculativeGenerator(target, proposer, spec.num_speculative_tokens if spec else 0)
    prompt_ids = torch.tensor([render_prompt(tokenizer, args.prompt)])
    result = generator.generate(prompt_ids, args.max_new_tokens, eos_token_ids(target, tokenizer))
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "token_ids": result.token_ids,
            "text": text,
            "metrics": result.metrics.to_dict(),
            "num_target_steps": result.num_target_steps,
            "seconds": result.seconds,
            "speculative_config": spec.to_dict() if spec else None,
        }))
    else:
        print(text)
        if spec is not None:
            print(result.metrics.log_line(result.seconds))
    return 0


def run_eval_command(args: argparse.Namespace) -> int:
    from draftsmith.inference.eval import format_table, load_prompts, run_eval, write_eval_json

    if not Path(args.dataset).is_file():
        raise CommandError(f"--dataset {args.dataset}: file not found")
    specs, tokenizer, target = _load(args, args.speculative_config)
    prompts = load_prompts(args.dataset, tokenizer, limit=args.num_prompts)
    result = run_eval(target, tokenizer, prompts, specs, args.max_new_tokens, progress=sys.stderr.isatty())
    result["dataset"] = str(args.dataset)
    print(format_table(result))
    path = write_eval_json(result, Path(args.out) / "eval.json", target)
    print(f"wrote {path}")
    return 0
