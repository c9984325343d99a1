"""Pinned losses: every method of the registry trains STEPS optimizer steps of a tiny recipe at a fixed seed on the
CPU (float32), and the `loss` column of its metrics.jsonl must equal the values recorded in pinned_losses.json.

The values pin the trainer's behaviour, not its shape: a refactor of `train/` or of the method folders that keeps
the numbers passes, one that changes a learning rate, a loss weight, the schedule, the batch order or skips a step
fails. Record them again only for an intended change of behaviour, and say why in the commit:

    python tests/test_pinned_losses.py --record          # all methods, into tests/pinned_losses.json
    python tests/test_pinned_losses.py                   # compare only: each method's largest relative deviation

Everything a run reads is made here (the conversations, the tiny Gemma 4 target and assistant) except the shared
fixture target's weights and tokenizer (tests/conftest.py, `fixture_target_dir`).

Tolerance (REL_TOL, on every step's loss), measured at a44ddc3 on the 2-core CPU: the same recipe run twice gives
bit-identical losses; 2 threads against 1 moved EAGLE-3's by 1.4e-7 at most (the others not at all), and
training.loss_chunk_size 16 (the same loss summed in another float32 order, as a refactor may) 2.3e-7 at most. A 1%
change of behaviour moved each method's largest deviation by 2.4e-4 (DFlash's loss_gamma 2 -> 2.02) to 7e-3: lr x1.01
by 4e-4 (Gemma 4 MTP) to 6e-3 (DSpark); ttt_decay 0.8 -> 0.79 (EAGLE-3) 7e-3; eagle.ce_weight, mtp.depth_decay,
gemma4_mtp.step_decay, dspark.ce_weight changed by 1%: 4e-3 to 6e-3; the first batch skipped: 2.6e-3 to 0.6.
1e-5 sits 40 times above that summation noise and 24 times below the smallest of those changes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.models import registry

PINNED = Path(__file__).with_name("pinned_losses.json")
STEPS = 20
SEED = 11
THREADS = 1
REL_TOL = 1e-5

# Every method's recipe: 24 conversations in micro-batches of 2 (12 steps an epoch, so the 20 steps cross into the
# second epoch and its reshuffle), a 2-step warm-up and the cosine decay to 0 inside the 20 steps, no evaluation and
# no checkpoint but the final one. The depth and size knobs are tests/test_registry.py's smallest settings
# (SMALL_SECTIONS), copied and not imported: the pin must not move when another test's helper does.
TRAINING = {"max_steps": STEPS, "batch_size": 2, "grad_accum_steps": 1, "lr": 1e-3, "warmup_ratio": 0.1,
            "seed": SEED, "mixed_precision": "no", "log_every": 1, "eval_every": 100000, "save_every": 100000}
OVERRIDES = {  # method -> recipe sections merged over the common recipe
    "eagle3": {"model": {"draft_vocab_size": 512}, "training": {"ttt_steps": 2}},
    "eagle": {},
    "mtp": {"mtp": {"num_depths": 2}},
    # target and assistant: tiny_gemma4 below; at 1e-3 its loss hardly moves in 20 steps, and the pin would too
    "gemma4_mtp": {"training": {"lr": 3e-3}, "gemma4_mtp": {"num_steps": 2}},
    "dflash": {"dflash": {"num_layers": 1, "block_size": 4, "anchors_per_sequence": 16}},
    "dspark": {"dspark": {"num_layers": 1, "block_size": 4, "anchors_per_sequence": 16, "markov_rank": 8}},
}

REPLIES = [
    "The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
    "To sort a list in Python, call sorted(items) or items.sort() for an in-place sort.",
    "Water boils at 100 degrees Celsius at sea level, and at lower temperatures at altitude.",
    "A good night's sleep helps memory, mood and health; most adults need seven to nine hours.",
]


def write_conversations(path: Path, n: int = 24) -> Path:
    """n short chats (about 50 tokens each with the fixture's chat template), the same bytes every time."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"conversations": [{"role": "user", "content": f"Question number {i}?"},
                                                  {"role": "assistant", "content": REPLIES[i % len(REPLIES)]}]})
                    + "\n")
    return path


def tiny_gemma4(folder: Path, fixture_target_dir: Path) -> tuple[Path, Path]:
    """(a random 4-layer Gemma 4 target with the fixture's tokenizer, a random 2-layer assistant shaped to read its
    K/V): the shapes of tests/test_gemma4_mtp.py's target_config and assistant_config (16 centroids, top 4),
    built from transformers' classes only, seeded."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.gemma4 import Gemma4TextConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    vocab, window = len(tokenizer), 8
    target_config = Gemma4TextConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=96,
        sliding_window=window, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, final_logit_softcapping=30.0,
        max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    text = Gemma4TextConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                            attention_k_eq_v=True, intermediate_size=64, sliding_window=window,
                            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                            vocab_size_per_layer_input=0, max_position_embeddings=256)
    assistant_config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, use_ordered_embeddings=True,
                                             num_centroids=16, centroid_intermediate_top_k=4)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(target_config, dtype=torch.float32)
    assistant = Gemma4AssistantForCausalLM(assistant_config)
    with torch.no_grad():  # transformers' init is near zero: a target with spread logits trains a real signal
        for model, std in ((target, 0.08), (assistant, 0.1)):
            for name, p in model.named_parameters():
                if "norm" not in name and p.dim() > 1:
                    p.normal_(0, std)
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
    target.save_pretrained(folder / "target")
    assistant.save_pretrained(folder / "assistant")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(fixture_target_dir / name, folder / "target" / name)
    return folder / "target", folder / "assistant"


def run_losses(method: str, fixture_target_dir: Path, workdir: Path) -> list[float]:
    """Train `method`'s pinned recipe in `workdir`; its metrics.jsonl losses, step 1 to STEPS."""
    from draftsmith.config import recipe_from_dict
    from draftsmith.train import train

    data = write_conversations(workdir / "chats.jsonl")
    recipe = {"model": {"target": str(fixture_target_dir), "method": method, "dtype": "float32"},
              "data": {"path": str(data), "max_length": 96, "eval_samples": 0, "cache_dir": str(workdir / "cache")},
              "training": dict(TRAINING),
              "output_dir": str(workdir / "run")}
    if method == "gemma4_mtp":  # a Gemma 4 assistant drafts for a Gemma 4 target only
        target, assistant = tiny_gemma4(workdir, fixture_target_dir)
        recipe["model"]["target"] = str(target)
        recipe["gemma4_mtp"] = {"assistant": str(assistant)}
    for section, values in OVERRIDES[method].items():
        recipe.setdefault(section, {}).update(values)
    train(recipe_from_dict(recipe), log=lambda *a: None)
    rows = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    assert sorted(losses) == list(range(1, STEPS + 1)), f"{method}: logged steps {sorted(losses)}"
    return [losses[step] for step in range(1, STEPS + 1)]


def test_every_method_is_pinned():
    """A method added to the registry is recorded with the others (`--record --method NAME`)."""
    missing = set(registry.methods()) - set(json.loads(PINNED.read_text()))
    assert not missing, f"no pinned losses for {sorted(missing)}: run python tests/test_pinned_losses.py --record"


@pytest.fixture
def one_thread():
    """The losses are recorded on one thread (THREADS): the same float32 sums whatever the suite sets, and on a
    loaded 2-core machine two threads took 8 times the CPU time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.mark.slow
@pytest.mark.parametrize("method", registry.methods())
def test_losses_equal_the_pinned_ones(method, fixture_target_dir, tmp_path, one_thread):
    pinned = json.loads(PINNED.read_text())
    if method not in pinned:
        pytest.fail(f"no pinned losses for {method}: run python tests/test_pinned_losses.py --record --method {method}")
    losses = run_losses(method, fixture_target_dir, tmp_path)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, pinned[method]))
    assert losses == pytest.approx(pinned[method], rel=REL_TOL), (
        f"{method}: losses moved (largest relative change {worst:.2e}, tolerance {REL_TOL:g}); if the change of "
        "behaviour is intended, record again: python tests/test_pinned_losses.py --record")


def main(argv: list[str]) -> None:
    """Run the pinned recipes outside pytest: --record writes the pinned losses, otherwise print each method's
    largest relative deviation from them."""
    import argparse
    import tempfile

    from conftest import FIXTURE_TARGET, missing_fixture_reason

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--record", action="store_true", help="write --file (merged over what it holds)")
    parser.add_argument("--method", action="append", choices=registry.methods(), help="default: every method")
    parser.add_argument("--threads", type=int, default=THREADS, help="measuring only: the test runs THREADS")
    parser.add_argument("--file", type=Path, default=PINNED, help="the pinned losses read and, with --record, written")
    args = parser.parse_args(argv)
    if not (FIXTURE_TARGET / "config.json").is_file():
        sys.exit(missing_fixture_reason("fixture target", FIXTURE_TARGET))
    torch.set_num_threads(args.threads)
    pinned = json.loads(args.file.read_text()) if args.file.is_file() else {}
    recorded = dict(pinned)
    for method in args.method or registry.methods():
        with tempfile.TemporaryDirectory() as workdir:
            losses = run_losses(method, FIXTURE_TARGET, Path(workdir))
        recorded[method] = losses
        if method in pinned:
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, pinned[method]))
            print(f"{method}: largest relative deviation from {args.file}: {worst:.3e}", flush=True)
        else:
            print(f"{method}: {losses[0]:.6f} ... {losses[-1]:.6f} (not pinned before)", flush=True)
    if args.record:
        args.file.write_text(json.dumps({m: recorded[m] for m in registry.methods() if m in recorded}, indent=1)
                             + "\n")
        print(f"wrote {args.file}")


if __name__ == "__main__":
    main(sys.argv[1:])
