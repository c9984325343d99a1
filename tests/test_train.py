"""End-to-end training on the fixture target: the loop learns, checkpoints load, resume is exact."""

import json
import math
import shutil

import pytest
import torch

from draftsmith.config import recipe_from_dict
from draftsmith.train import batching
from draftsmith.train import loop as loop_mod
from draftsmith.train import train

REPLIES = [
    "The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
    "To sort a list in Python, call sorted(items) or items.sort() for an in-place sort.",
    "Water boils at 100 degrees Celsius at sea level, and at lower temperatures at altitude.",
    "A good night's sleep helps memory, mood and health; most adults need seven to nine hours.",
]


def write_conversations(path, n=24):
    with path.open("w") as f:
        for i in range(n):
            reply = REPLIES[i % len(REPLIES)]
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Question number {i}?"},
                                                  {"from": "gpt", "value": reply}]}) + "\n")
    return path


def tiny_recipe(target_dir, data_path, out_dir, **training):
    return recipe_from_dict({
        "model": {"target": str(target_dir), "draft_vocab_size": 512},
        "data": {"path": str(data_path), "max_length": 96, "eval_samples": 4, "cache_dir": str(out_dir / "cache")},
        "training": {"max_steps": 6, "batch_size": 2, "grad_accum_steps": 2, "ttt_steps": 2, "lr": 1e-3,
                     "log_every": 1, "eval_every": 3, "save_every": 3, "seed": 7, **training},
        "output_dir": str(out_dir / "run"),
    })


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("batching", [{}, {"packing": True, "tokens_per_step": 192}], ids=["padded", "packed"])
def test_resume_continues_exactly(tmp_path, fixture_target_dir, monkeypatch, batching):
    data = write_conversations(tmp_path / "conv.jsonl")
    full = tmp_path / "full"
    lines = []
    train(tiny_recipe(fixture_target_dir, data, full, **batching), log=lambda *a: lines.append(" ".join(a)))
    if batching:
        assert any("micro-batches of 192 tokens packed into one row" in line for line in lines)
    expected = losses(full / "run")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    interrupted = tmp_path / "interrupted"
    real_save = loop_mod.save_checkpoint

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt  # killed right after the step-3 checkpoint landed

    monkeypatch.setattr(loop_mod, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_recipe(fixture_target_dir, data, interrupted, **batching), log=lambda *a: None)
    monkeypatch.setattr(loop_mod, "save_checkpoint", real_save)
    assert sorted(losses(interrupted / "run")) == [1, 2, 3]
    train(tiny_recipe(fixture_target_dir, data, interrupted, **batching), log=lambda *a: None)
    resumed = losses(interrupted / "run")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


def test_training_lowers_loss_and_writes_a_loadable_checkpoint(tmp_path, fixture_target_dir):
    from draftsmith.models.eagle3.io import load_drafter

    data = write_conversations(tmp_path / "conv.jsonl", n=40)
    lines = []
    recipe = tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=30, eval_every=30, save_every=30,
                         grad_accum_steps=1, peak_tflops=0.5)
    ckpt = train(recipe, log=lambda *a: lines.append(" ".join(a)))
    # the end-of-training evaluation says what the wait at 100% is for (issue 25, item 18h): 4 of the 40 held out
    assert recipe.data.eval_samples == 4 and "step 30: evaluating on the 4 held-out samples" in lines, lines
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in rows if "loss" in r]
    # throughput in model FLOPs (train/flops.py) and MFU against training.peak_tflops, on every log row
    assert any(line.startswith("model FLOPs at ") and "target_forward" in line and "0.5 TFLOP/s" in line
               for line in lines)
    logged = [r for r in rows if "loss" in r]
    assert all(r["tflops_per_s"] > 0 and r["mfu"] == pytest.approx(r["tflops_per_s"] / 0.5) for r in logged)
    assert sum(train_losses[-5:]) / 5 < 0.7 * sum(train_losses[:5]) / 5
    evals = [r for r in rows if "eval/loss" in r]
    # the replies repeat, so 30 steps learn them: most step-0 drafts right (2.46 and 0.93 when this was written)
    assert evals and evals[-1]["eval/sim_accept_len"] > 1.8 and evals[-1]["eval/acc_0"] > 0.6
    assert (tmp_path / "run" / "latest").read_text().strip() == ckpt.name
    drafter = load_drafter(tmp_path / "run")  # an output_dir means its latest checkpoint
    assert drafter.config.draft_vocab_size == 512 and drafter.t2d.sum() == 512
    assert not list((tmp_path / "run").glob(".*tmp*")), "no half-written checkpoint left behind"


def test_init_from_continues_from_a_checkpoint(tmp_path, fixture_target_dir):
    """model.init_from starts a run from an earlier (or imported) drafter: its weights, not fresh ones."""
    from safetensors.torch import load_file

    from draftsmith.train import TrainingError

    data = write_conversations(tmp_path / "conv.jsonl")
    first = train(tiny_recipe(fixture_target_dir, data, tmp_path / "a", max_steps=2), log=lambda *a: None)
    recipe = tiny_recipe(fixture_target_dir, data, tmp_path / "b", max_steps=1, lr=1e-12, warmup_ratio=0.0)
    recipe.model.init_from = str(first)
    second = train(recipe, log=lambda *a: None)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert torch.allclose(a["fc.weight"], b["fc.weight"], atol=1e-6)  # lr ~ 0: the weights are the loaded ones
    bad = tiny_recipe(fixture_target_dir, data, tmp_path / "c", max_steps=1)
    bad.model.draft_vocab_size = 256
    bad.model.init_from = str(first)
    with pytest.raises(TrainingError, match="does not fit"):
        train(bad, log=lambda *a: None)


def tiny_random_target(folder, fixture_target_dir):
    """A 4-layer, 64-wide random Llama with the fixture target's tokenizer and vocabulary: trains in seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fixture = json.loads((fixture_target_dir / "config.json").read_text())
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=fixture["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=fixture["bos_token_id"],
        eos_token_id=fixture["eos_token_id"], pad_token_id=fixture["pad_token_id"])).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(fixture_target_dir / name, folder / name)
    return folder


def test_gradient_accumulation_trains_as_the_batch_it_splits(tmp_path, fixture_target_dir):
    """training.grad_accum_steps=2 at batch_size 2 ends with the weights of batch_size 4 at 1 (float32, float
    rounding only): accelerate divides each micro-batch's loss by 2, and EAGLE-3's loss gradient, taken in the
    forward pass, must follow that scale (a backward that ignored it doubled the logged gradient norm; Adam's
    normalisation hides most of a uniform scale from the weights).

    Both runs see the same samples in each optimizer step: an epoch's order is one permutation of the samples
    (seed, epoch), cut into micro-batches in order, so step s reads samples order[4s:4s+4] either way. The loss is
    a mean over each micro-batch's valid tokens, so two micro-batches average to the mean over both only when
    they hold as many: every sample here has the same length and the same number of assistant tokens (asserted),
    and mask_outside_draft_vocab is off so the target's argmax does not drop positions."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from draftsmith.data import prepare_dataset

    target = tiny_random_target(tmp_path / "target", fixture_target_dir)
    data = tmp_path / "sums.jsonl"
    with data.open("w") as f:
        for i in range(18):  # one token per digit: same length and loss mask, different tokens
            a, b = i % 10, (3 * i + 1) % 10
            f.write(json.dumps({"conversations": [
                {"from": "human", "value": f"Please add {a} and {b}."},
                {"from": "gpt", "value": f"Sure: {a} plus {b} makes {(a + b) % 10} here."}]}) + "\n")

    def recipe_for(batch_size, accum):
        out = tmp_path / f"batch{batch_size}"
        recipe = tiny_recipe(target, data, out, max_steps=3, batch_size=batch_size, grad_accum_steps=accum,
                             eval_every=100, save_every=100, mixed_precision="no", mask_outside_draft_vocab=False)
        recipe.data.eval_samples = 2
        recipe.model.dtype = "float32"
        return recipe

    samples = prepare_dataset(recipe_for(2, 2).data, AutoTokenizer.from_pretrained(target), log=lambda *a: None).train
    assert len({(len(s.input_ids), sum(s.loss_mask)) for s in samples}) == 1  # the premise of an exact match
    runs = {}
    for batch_size, accum in ((2, 2), (4, 1)):
        checkpoint = train(recipe_for(batch_size, accum), log=lambda *a: None)
        rows = [json.loads(line) for line in (checkpoint.parent / "metrics.jsonl").read_text().splitlines()]
        runs[batch_size] = load_file(checkpoint / "model.safetensors"), [r for r in rows if "loss" in r]

    (split_weights, split_rows), (whole_weights, whole_rows) = runs[2], runs[4]
    assert [r["step"] for r in split_rows] == [r["step"] for r in whole_rows] == [1, 2, 3]
    for split, whole in zip(split_rows, whole_rows):
        assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
        assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert split_weights.keys() == whole_weights.keys()
    for name in whole_weights:
        torch.testing.assert_close(split_weights[name], whole_weights[name], rtol=0, atol=1e-5, msg=name)


# ---- health: NaN and stuck runs (issue 16, item 9) -----------------------------------------------------------------
def poison_target(monkeypatch, poison):
    """TargetModel.from_pretrained returns the fixture with `poison(model)` applied: a NaN weight."""
    from draftsmith.models.target import TargetModel

    real = TargetModel.from_pretrained.__func__

    def patched(cls, *args, **kwargs):
        target = real(cls, *args, **kwargs)
        with torch.no_grad():
            poison(target.model)
        return target

    monkeypatch.setattr(TargetModel, "from_pretrained", classmethod(patched))


def test_nan_features_stop_the_run_naming_the_step_and_the_sample(tmp_path, fixture_target_dir, monkeypatch):
    """The target's forward turns NaN on a word that only one sample holds (as an fp16 overflow would, with
    finite weights): the run stops with the step and that sample named (found at the step-6 log line, it names
    step 2) and writes no checkpoint."""
    from transformers import AutoTokenizer

    from draftsmith.train import TrainingError
    from draftsmith.train.batching import epoch_batches

    order = epoch_batches([1] * 20, 2, seed=7, epoch=0, rank=0, world=1)  # 24 records, 4 held out, batches of 2
    poisoned = order[2][1]  # micro-batch 2 opens optimizer step 2 (grad_accum_steps 2)
    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    data = write_conversations(tmp_path / "conv.jsonl")
    texts = data.read_text().splitlines()
    texts[poisoned] = texts[poisoned].replace("Question number", "Question on Zanzibar quokkas number")
    data.write_text("\n".join(texts) + "\n")
    others = {t for i, line in enumerate(texts) if i != poisoned for t in tokenizer(line)["input_ids"]}
    unique = [t for t in tokenizer(" Zanzibar quokkas")["input_ids"]
              if t in tokenizer(texts[poisoned])["input_ids"] and t not in others]
    assert unique, "the poisoned word needs a token no other sample has"

    def nan_on_the_word(model):
        def hook(module, inputs, output):
            return output.masked_fill((inputs[0] == unique[0]).unsqueeze(-1), float("nan"))

        model.get_input_embeddings().register_forward_hook(hook)

    poison_target(monkeypatch, nan_on_the_word)
    recipe = tiny_recipe(fixture_target_dir, data, tmp_path, log_every=6, eval_every=6, save_every=6)
    with pytest.raises(TrainingError) as raised:
        train(recipe, log=lambda *a: None)
    message = str(raised.value)
    assert message.startswith("step 2: the target's hidden states for training sample ") and "\n" not in message
    assert f"training sample {poisoned} (" in message and "not finite" in message
    assert not list((tmp_path / "run").glob("checkpoint-*")), "a NaN never reaches a checkpoint"


def test_a_target_with_a_nan_weight_is_refused_naming_the_tensor(tmp_path, fixture_target_dir, monkeypatch):
    """A NaN in the target's lm_head leaves its features finite; EAGLE-3 would mask the NaN teacher rows away and
    train on nothing. The weights are checked once at load."""
    from draftsmith.train import TrainingError

    poison_target(monkeypatch, lambda m: m.get_output_embeddings().weight[7, 3].fill_(float("nan")))
    data = write_conversations(tmp_path / "conv.jsonl")
    tied = "model.embed_tokens.weight"  # the fixture ties its lm_head to the embedding
    with pytest.raises(TrainingError, match=rf"the target's weight (lm_head.weight|{tied}) holds NaN or inf"):
        train(tiny_recipe(fixture_target_dir, data, tmp_path), log=lambda *a: None)


def test_a_nan_loss_stops_the_run_before_the_first_checkpoint(tmp_path, fixture_target_dir, monkeypatch):
    """The drafter's loss turns NaN at the third micro-batch (step 2); the step-3 log line finds it, names step
    2, and the step-3 checkpoint is never written."""
    from draftsmith.models.eagle3.training import Eagle3Method
    from draftsmith.train import TrainingError

    real_loss, calls = Eagle3Method.loss, []

    def loss(self, drafter, batch, features):
        value, metrics = real_loss(self, drafter, batch, features)
        calls.append(1)
        return (value * float("nan") if len(calls) == 3 else value), metrics

    monkeypatch.setattr(Eagle3Method, "loss", loss)
    data = write_conversations(tmp_path / "conv.jsonl")
    with pytest.raises(TrainingError, match=r"^step 2: the loss is not finite"):
        train(tiny_recipe(fixture_target_dir, data, tmp_path, log_every=3), log=lambda *a: None)
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_saturated_run_stops_before_any_checkpoint(tmp_path, fixture_target_dir):
    """training.lr=1e6 saturates the drafter after one step: gradient norm 0 while the loss is not. The run stops
    at the next sync (here the log line of step 2), before its checkpoint."""
    from draftsmith.train import TrainingError

    data = write_conversations(tmp_path / "conv.jsonl")
    with pytest.raises(TrainingError, match=r"^step 2: the gradient norm is exactly 0 while the loss is not: "
                                            r"training.lr=1e\+06 saturated the drafter"):
        train(tiny_recipe(fixture_target_dir, data, tmp_path, lr=1e6, max_steps=7, eval_every=100, save_every=3),
              log=lambda *a: None)
    assert not list((tmp_path / "run").glob("checkpoint-*"))


# ---- resume: same recipe only, one row per step, the weights stored once (items 10, 14) --------------------------
def test_a_changed_recipe_is_not_resumed(tmp_path, fixture_target_dir):
    from draftsmith.train import TrainingError

    data = write_conversations(tmp_path / "conv.jsonl")
    train(tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=2), log=lambda *a: None)
    changed = tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=3)
    changed.model.aux_layer_ids = [1, 4, 5]  # the default is [2, 4, 5]: same fc shape, other features
    with pytest.raises(TrainingError) as raised:
        train(changed, log=lambda *a: None)
    message = str(raised.value)
    assert "model.aux_layer_ids null there, [1, 4, 5] now" in message and "\n" not in message
    assert "set output_dir to a new folder, or delete" in message
    lines = []
    train(tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=3), log=lines.append)  # training keys may change
    assert any(line.startswith("resuming from") and "at step 2" in line for line in lines)


def test_resume_keeps_one_metrics_row_per_step(tmp_path, fixture_target_dir, monkeypatch):
    """Killed after logging step 4 (the last checkpoint is step 3): the resumed run logs step 4 again, once."""
    data = write_conversations(tmp_path / "conv.jsonl")
    real_log_row = loop_mod.log_row

    def log_then_die(accelerator, path, row):
        real_log_row(accelerator, path, row)
        if row["step"] == 4 and "loss" in row:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop_mod, "log_row", log_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_recipe(fixture_target_dir, data, tmp_path), log=lambda *a: None)
    monkeypatch.setattr(loop_mod, "log_row", real_log_row)
    train(tiny_recipe(fixture_target_dir, data, tmp_path), log=lambda *a: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "loss" in r]
    eval_steps = [r["step"] for r in rows if "eval/loss" in r]
    assert (train_steps, eval_steps) == ([1, 2, 3, 4, 5, 6], [3, 6])


def test_a_checkpoint_stores_the_weights_once(tmp_path, fixture_target_dir):
    from safetensors.torch import load_file

    data = write_conversations(tmp_path / "conv.jsonl")
    ckpt = train(tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=1), log=lambda *a: None)
    state_files = sorted(p.name for p in (ckpt / "training_state").iterdir())
    assert not [name for name in state_files if name.startswith(("model", "pytorch_model"))], state_files
    weights = sum(t.numel() * t.element_size() for t in load_file(ckpt / "model.safetensors").values())
    total = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    assert total < 3.3 * weights  # the weights once plus AdamW's two moments, not the weights twice


def test_a_tokenizer_that_does_not_fit_the_target_is_refused_or_warned():
    """Issue 16, item 14: a tokenizer smaller than the target's vocabulary trained silently."""
    import warnings

    from draftsmith.train import TrainingError
    from draftsmith.train.setup import check_tokenizer_fits

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_tokenizer_fits(151669, 151936, "Qwen/Qwen3-8B")  # padded embedding rows: fine, silent
        check_tokenizer_fits(16000, 16000, "fixture")
    with pytest.warns(UserWarning, match="32000 tokens, the target's vocabulary 128256"):
        check_tokenizer_fits(32000, 128256, "meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(TrainingError, match="more than the target's vocabulary of 16000"):
        check_tokenizer_fits(32000, 16000, "fixture")


def test_shipped_recipes_train_on_another_target_without_overrides_for_what_they_leave_open(tmp_path,
                                                                                             fixture_target_dir,
                                                                                             monkeypatch):
    """The DFlash recipe needed model.draft_vocab_size and dflash.mask_token_id overrides to train for the fixture
    (issue 16, item 8): what a recipe leaves open now follows the target, and the choice is logged. Nor do they need
    model.dtype, training.mixed_precision or model.draft_vocab_size overrides on a CPU any more (issue 25, item 17):
    `auto` is float32 there, and the draft vocabulary is null (derived) or one that fits."""
    from draftsmith.config import load_recipe
    from draftsmith.device import accelerator_type
    from draftsmith.models.target import TargetModel

    data = write_conversations(tmp_path / "conv.jsonl")
    dtypes = []
    for loader in ("from_pretrained", "head_and_embeddings"):  # the dtype the recipe's `auto` picks for the target
        real = getattr(TargetModel, loader)
        monkeypatch.setattr(TargetModel, loader, classmethod(
            lambda cls, *a, real=real, **kw: dtypes.append(kw.get("dtype")) or real(*a, **kw)))
    for name in ("dflash_sharegpt", "mtp_sharegpt", "eagle3_sharegpt", "eagle3_fixture", "dflash_fixture",
                 "dspark_fixture", "dspark_qwen3_8b"):
        lines = []
        # only what makes the run small and quiet: dtype, mixed precision and the draft vocabulary are the recipe's
        recipe = load_recipe(f"recipes/{name}.yaml", [
            f"model.target={fixture_target_dir}", f"data.path={data}", "data.eval_samples=2", "data.max_length=96",
            f"data.cache_dir={tmp_path / 'cache'}", "training.max_steps=1", "training.batch_size=2",
            "training.grad_accum_steps=1", "training.report_to=none", f"output_dir={tmp_path / name}"])
        dtypes.clear()
        train(recipe, log=lines.append)
        if accelerator_type() == "cpu":  # auto: float32 weights and no mixed precision on a CPU
            assert dtypes == ["float32"], (name, dtypes)
        text = "\n".join(lines)
        if name.startswith("dflash"):
            assert "dflash: mask slots use a learned mask embedding (engines substitute it at spare token id 0)" in text
        if name.startswith("dspark"):  # the fixture's tokenizer uses every id below 16000: its pad token
            assert "dspark: mask slots take the target's embedding row of spare token id 0" in text
        if name.startswith("mtp"):
            assert "model.draft_vocab_size is not used by mtp" in text
        if name.startswith("eagle3"):
            assert "eagle3: norm_before_fc, norm_before_residual, norm_output on" in text
            # eagle3_sharegpt leaves it open (null: min(32000, the target's)); eagle3_fixture sets 12000 of 16000
            assert f"draft vocab: {16000 if name == 'eagle3_sharegpt' else 12000} of 16000 tokens" in text


def test_what_the_targets_config_decides_is_refused_before_the_data_loads(tmp_path, fixture_target_dir, monkeypatch):
    """A draft vocabulary larger than the target's was refused only after the data was tokenized and the target
    loaded (87 s, issue 25, item 18); the target's config.json decides it, so it is read first."""
    from draftsmith.config import RecipeError

    def loaded(*args, **kwargs):
        raise AssertionError("the data was loaded before the recipe was checked against the target")

    monkeypatch.setattr("draftsmith.data.prepare_dataset", loaded)
    recipe = recipe_from_dict({"model": {"target": str(fixture_target_dir), "draft_vocab_size": 32000},
                               "data": {"path": str(write_conversations(tmp_path / "c.jsonl"))},
                               "output_dir": str(tmp_path / "run")})
    with pytest.raises(RecipeError, match=r"model.draft_vocab_size \(32000\) exceeds the target vocabulary \(16000\)"):
        train(recipe, log=lambda *a: None)
    dflash = recipe_from_dict({"model": {"target": str(fixture_target_dir), "method": "dflash"},
                               "data": {"path": "unused.jsonl"}, "dflash": {"target_layer_ids": [1, 4, 9]},
                               "output_dir": str(tmp_path / "run2")})
    with pytest.raises(RecipeError, match=r"dflash.target_layer_ids \[1, 4, 9\]: id 9 is outside 0..7"):
        train(dflash, log=lambda *a: None)


@pytest.mark.slow
def test_an_uncached_hub_target_of_a_recipe_fails_at_once_when_the_hub_cannot_be_reached(tmp_path):
    """`draftsmith train` with model.target ORG/NAME, offline: one line at once, not minutes of retries."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HOME": str(tmp_path / "home")}
    env.pop("HF_HUB_OFFLINE", None)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"# test\nmodel: {{target: org/not-cached}}\ndata: {{path: x.jsonl}}\n"
                      f"output_dir: {tmp_path / 'run'}\n")
    failed = subprocess.run([sys.executable, "-m", "draftsmith.cli", "train", str(recipe)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2 and "Retrying" not in failed.stderr, failed.stderr[-2000:]
    (line,) = failed.stderr.strip().splitlines()
    assert "model.target org/not-cached: not a local folder and not cached locally" in line
    assert "Hugging Face Hub cannot be reached" in line


@pytest.mark.parametrize("norm_output", [False, True], ids=["head-reads-norm", "norm-output"])
def test_a_frozen_draft_head_keeps_the_targets_rows_while_the_rest_trains(tmp_path, fixture_target_dir,
                                                                           norm_output):
    """training.train_draft_head=false (speculators' way: its lm_head has requires_grad False): the head stays at
    the target's rows of the draft vocabulary, every other weight moves. With norm_output the loss reads the head
    alone, without it the head and the final norm (both paths of the fused loss)."""
    from safetensors.torch import load_file

    from draftsmith.models.target import TargetModel

    data = write_conversations(tmp_path / "conv.jsonl")
    recipe = tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=2, grad_accum_steps=1, save_every=1,
                         keep_checkpoints=3, train_draft_head=False)
    recipe.eagle3.norm_output = norm_output
    train(recipe, log=lambda *a: None)
    one, two = (load_file(tmp_path / "run" / f"checkpoint-{n}" / "model.safetensors") for n in (1, 2))
    target = TargetModel.from_pretrained(str(fixture_target_dir), dtype="float32")
    rows = two["d2t"] + torch.arange(two["d2t"].numel())
    assert torch.equal(two["lm_head.weight"].float(), target.lm_head.weight[rows].float())
    moved = {k for k in two if two[k].is_floating_point() and not torch.equal(two[k], one[k])}
    assert "lm_head.weight" not in moved and {"fc.weight", "midlayer.mlp.down_proj.weight"} <= moved


def test_training_runs_attention_without_cudnn(tmp_path, fixture_target_dir, monkeypatch):
    """cuDNN attention builds a plan for every new shape (7-12 ms of host time a call on an H200,
    benchmarks/results/profile_train_h200/) and training batches change shape every step: the trainer's target and
    drafter run every loss with it off, and leave torch's setting as it was."""
    from draftsmith.models.eagle3.training import Eagle3Method

    seen = []
    real_loss = Eagle3Method.loss

    def loss_noting_the_backends(self, drafter, batch, features):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return real_loss(self, drafter, batch, features)

    monkeypatch.setattr(Eagle3Method, "loss", loss_noting_the_backends)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    data = write_conversations(tmp_path / "conv.jsonl", n=12)
    train(tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=2, grad_accum_steps=1), log=lambda *a: None)
    assert seen and all(flags == (False, True) for flags in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_collate_right_pads_each_sample_in_place():
    """collate builds the (B, S) batch from the samples end to end (one numpy conversion, not one per row): each row
    holds its sample's ids and loss mask, then pad_id and zeros; collate_packed puts the same ids in one row."""
    from draftsmith.data.tokenize import TokenizedSample

    samples = [TokenizedSample(input_ids=[5, 6, 7], loss_mask=[0, 1, 1]), TokenizedSample(input_ids=[8], loss_mask=[1]),
               TokenizedSample(input_ids=[9, 10, 11, 12], loss_mask=[0, 0, 1, 0])]
    batch = batching.collate(samples, pad_id=3, device="cpu")
    assert batch["input_ids"].tolist() == [[5, 6, 7, 3], [8, 3, 3, 3], [9, 10, 11, 12]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert all(t.dtype == torch.long for t in batch.values())
    packed = batching.collate_packed(samples, "cpu")
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert packed["loss_mask"].tolist() == [[0, 1, 1, 1, 0, 0, 1, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    # training.loss_on all: every real token is under the loss, padding still is not
    every = batching.collate(samples, pad_id=3, device="cpu", every_token=True)
    assert every["loss_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert every["input_ids"].tolist() == batch["input_ids"].tolist()
    assert batching.collate_packed(samples, "cpu", every_token=True)["loss_mask"].tolist() == [[1] * 8]


def test_feature_noise_is_relative_to_each_aux_layer_and_stays_out_of_the_export(tmp_path, fixture_target_dir):
    """eagle3.feature_noise disturbs each aux layer's state by the same fraction of its own RMS (a quiet early layer
    is not drowned, a loud late one not left untouched), only while training: the checkpoint's config, which the
    exports copy, has no such key, and a run with it trains to finite losses."""
    from draftsmith.models.eagle3.training import with_relative_noise

    torch.manual_seed(0)
    quiet, loud = torch.randn(2, 64, 32), 1000 * torch.randn(2, 64, 32)
    noise = with_relative_noise(torch.cat([quiet, loud], -1), 2, 0.2) - torch.cat([quiet, loud], -1)
    for state, part in ((quiet, noise[..., :32]), (loud, noise[..., 32:])):
        rms = state.pow(2).mean(-1, keepdim=True).sqrt()
        assert (part.abs() <= 0.1 * rms + 1e-6).all()  # U(-w/2, w/2) x RMS, w = 0.2
        assert 0.8 < (part / rms).std().item() / (0.2 / 12 ** 0.5) < 1.2  # the uniform's spread, not 0

    lines = []
    data = write_conversations(tmp_path / "conv.jsonl")
    recipe = tiny_recipe(fixture_target_dir, data, tmp_path, max_steps=2, grad_accum_steps=1, save_every=2)
    recipe.eagle3.feature_noise = 0.2
    train(recipe, log=lines.append)
    assert "target states read with uniform noise of width 0.2 x each aux layer's RMS" in "\n".join(lines)
    config = json.loads((tmp_path / "run" / "checkpoint-2" / "config.json").read_text())
    assert "feature_noise" not in json.dumps(config)
    assert all(math.isfinite(v) for v in losses(tmp_path / "run").values())
