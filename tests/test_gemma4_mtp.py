"""Gemma 4 MTP (method gemma4_mtp): Google's assistant drafter loaded from its published layout, matched against
transformers' own forward, run in draftsmith's runtime over the target's KV cache (lossless, batches with holes
included), fine-tuned with the target frozen and exported back. Tiny random Gemma 4 configs built here: a target
whose first sliding and full layers compute K/V and whose last two reuse them, and a two-layer assistant with a
centroid head."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma4 import Gemma4TextConfig
from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models import registry
from draftsmith.models.gemma4_mtp.config import Gemma4MtpConfig, source_layers
from draftsmith.models.gemma4_mtp.io import load_drafter, read_folder
from draftsmith.models.gemma4_mtp.model import Gemma4MtpDrafter
from draftsmith.models.gemma4_mtp.proposer import Gemma4MtpProposer
from draftsmith.models.target import TargetModel

WINDOW = 8
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def target_config(vocab: int = 128, **overrides) -> Gemma4TextConfig:
    """4 layers, sliding / full alternating; layers 2 and 3 reuse the K/V of layers 0 and 1 (the assistant's
    sources); full layers have their own head dim and one K/V head, keys as values."""
    args = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                intermediate_size=96, sliding_window=WINDOW, layer_types=TYPES, num_kv_shared_layers=2,
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, final_logit_softcapping=30.0,
                max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Gemma4TextConfig(**{**args, **overrides})


def assistant_config(vocab: int = 128, centroids: int | None = 8, top_k: int = 4, head_dim: int = 16,
                     global_head_dim: int = 32, max_positions: int = 256) -> Gemma4AssistantConfig:
    """Two q-only layers (sliding, full) shaped to read the target's K/V; `centroids` None: no centroid head."""
    text = Gemma4TextConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=head_dim, global_head_dim=global_head_dim,
                            num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=64,
                            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                            max_position_embeddings=max_positions)
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, use_ordered_embeddings=bool(centroids),
                                 num_centroids=centroids or 2048, centroid_intermediate_top_k=top_k)


def random_target(vocab: int = 128, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(vocab, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() > 1:
                p.normal_(0, 0.08)
    return model


def random_assistant(vocab: int = 128, seed: int = 1, **kwargs) -> Gemma4AssistantForCausalLM:
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(assistant_config(vocab, **kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() > 1:
                p.normal_(0, 0.1)
        if model.masked_embedding is not None:
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
    return model


def published(folder, model=None):
    """An assistant folder as transformers writes (and Google ships) it."""
    (model or random_assistant()).save_pretrained(folder)
    return folder


def test_published_layout_loads_with_its_key_names(tmp_path):
    hf = random_assistant()
    folder = published(tmp_path / "assistant", hf)
    config, tensors = read_folder(folder)
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors  # tied, as vLLM reads it
    assert tensors["masked_embedding.token_ordering"].dtype == torch.int64
    drafter = load_drafter(folder)
    theirs = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ours = drafter.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert registry.detect_layout(json.loads((folder / "config.json").read_text()))[0].method == "gemma4_mtp"


def test_a_folder_that_is_no_assistant_is_one_line(tmp_path):
    folder = published(tmp_path / "assistant")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="is not a Gemma 4 assistant"):
        read_folder(folder)


def test_forward_matches_transformers_assistant():
    """Same K/V, positions and masks (transformers' own, whose sliding window keeps one key more than vLLM's):
    the fed-back state and every selected logit agree."""
    hf = random_assistant()
    ours = Gemma4MtpDrafter(Gemma4MtpConfig.from_assistant(hf.config.to_dict()))
    ours.load_state_dict({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    ours.eval()
    g = torch.Generator().manual_seed(0)
    batch, length = 2, 12
    kv = {"sliding_attention": (torch.randn(batch, 2, length, 16, generator=g),) * 2,
          "full_attention": (torch.randn(batch, 1, length, 32, generator=g),) * 2}
    embeds, hidden = torch.randn(batch, 1, 64, generator=g), torch.randn(batch, 1, 64, generator=g)
    positions = torch.full((batch, 1), length - 1)
    with torch.no_grad():
        out = hf(inputs_embeds=torch.cat([embeds, hidden], -1), position_ids=positions, shared_kv_states=kv)
        masks = hf.create_attention_masks(embeds, None, kv)
        d, fed_back = ours(embeds, hidden, positions, kv, masks)
        logits = ours.served_logits(d)
    torch.testing.assert_close(fed_back, out.last_hidden_state, rtol=1e-5, atol=1e-5)
    kept = torch.isfinite(logits)
    assert kept.sum(-1).eq(4 * 128 // 8).all()  # top 4 of 8 clusters of 16 tokens
    torch.testing.assert_close(logits[kept], out.logits.float()[kept], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), out.logits.argmax(-1))


def test_sources_are_the_last_layers_that_compute_their_own_kv():
    assert source_layers(target_config()) == {"sliding_attention": 0, "full_attention": 1}
    assert source_layers(target_config(num_kv_shared_layers=0)) == {"sliding_attention": 2, "full_attention": 3}


def fine_tuned(target: TargetModel, hf, sequences, steps: int, num_steps: int = 3) -> Gemma4MtpDrafter:
    """The assistant fine-tuned `steps` full-batch steps with the method's own loss on `sequences`."""
    from draftsmith.models.gemma4_mtp.section import Gemma4MtpSection
    from draftsmith.models.gemma4_mtp.training import Gemma4MtpMethod

    method = Gemma4MtpMethod.__new__(Gemma4MtpMethod)  # the method without a recipe's data: its pieces only
    section = Gemma4MtpSection(assistant="a", num_steps=num_steps)
    method.target, method.num_steps, method.decay = target, num_steps, section.step_decay
    method.centroid_weight, method.loss_chunk_size = section.centroid_weight, None
    method.sources = source_layers(target.config)
    method.aux_layer_ids = sorted(set(method.sources.values()))
    drafter = Gemma4MtpDrafter(Gemma4MtpConfig.from_assistant(hf.config.to_dict()))
    drafter.load_state_dict({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    ids = torch.tensor(sequences)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    metrics = {}
    for _ in range(steps):
        loss, metrics = method.loss(drafter, batch, target.capture)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval(), method, metrics


def test_training_reads_the_kv_the_runtime_caches():
    """K/V computed from the captured layer inputs equal the rows of the runtime's cache after a prefill."""
    target = TargetModel(random_target())
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(3))
    _, method, _ = fine_tuned(target, random_assistant(), ids.tolist(), steps=0)
    _, kv = method.target_states(target.capture, ids, torch.ones_like(ids))
    cache = target.new_cache(1, 32)
    target.step(ids, cache)
    proposer = Gemma4MtpProposer(Gemma4MtpDrafter(Gemma4MtpConfig.from_assistant(assistant_config().to_dict())),
                                 target, 3)
    proposer.see_target_cache(cache, None)
    cached, _ = proposer._target_kv()
    for kind in kv:
        torch.testing.assert_close(cached[kind][0], kv[kind][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cached[kind][1], kv[kind][1], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def accepting():
    """(target, its greedy answers to 4 prompts, prompts, an assistant fine-tuned on them until it accepts)."""
    target = TargetModel(random_target())
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (8,), generator=g).tolist() for _ in range(4)]
    plain = SpeculativeGenerator(target, None, 0)
    answers = [plain.generate(torch.tensor([p]), 24).token_ids for p in prompts]
    drafter, _, metrics = fine_tuned(target, random_assistant(), [p + a for p, a in zip(prompts, answers)], steps=60)
    return target, prompts, answers, drafter, metrics


@pytest.mark.slow
def test_greedy_speculation_with_an_accepting_assistant_equals_plain_greedy(accepting):
    target, prompts, answers, drafter, metrics = accepting
    generator = SpeculativeGenerator(target, Gemma4MtpProposer(drafter, target, 3), 3)
    accepted = drafted = 0
    for prompt, answer in zip(prompts, answers):
        result = generator.generate(torch.tensor([prompt]), 24)
        assert result.token_ids == answer
        accepted += result.metrics.num_accepted_tokens
        drafted += result.metrics.num_draft_tokens
    print(json.dumps({"accepted": accepted, "drafted": drafted, "train acc": float(metrics["acc_0"])}))
    assert drafted // 4 < accepted < drafted  # a drafter that accepts, and rejections too
    # a batch of different lengths (holes in the cache) drafts what each row drafts alone
    rows = [prompts[0], prompts[1][:5], prompts[2][:7]]
    singles = [generator.generate(torch.tensor([r]), 24) for r in rows]
    batched = generator.generate_batch(rows, 24)
    for one, many in zip(singles, batched):
        assert many.token_ids == one.token_ids
        assert many.metrics.num_accepted_tokens == one.metrics.num_accepted_tokens


def write_checkpoint(folder, drafter: Gemma4MtpDrafter):
    from draftsmith.models.checkpoint import save_safetensors_atomic, write_json_atomic

    folder.mkdir(parents=True)
    write_json_atomic(drafter.config.to_dict(), folder / "config.json")
    save_safetensors_atomic({k: v.contiguous() for k, v in drafter.state_dict().items() if k != "lm_head.weight"},
                            folder / "model.safetensors")
    return folder


def test_export_round_trip_is_exact_and_transformers_loads_it(tmp_path):
    from draftsmith.models.export import exporter

    hf = random_assistant()
    drafter = load_drafter(published(tmp_path / "assistant", hf))
    with torch.no_grad():
        drafter.pre_projection.weight.add_(0.01)  # "fine-tuned"
    ckpt = write_checkpoint(tmp_path / "checkpoint-1", drafter)
    out = tmp_path / "export"
    exporter("gemma4_mtp")(ckpt, out, dtype=None)
    config, tensors = read_folder(out)
    mine = {k: v for k, v in drafter.state_dict().items() if k != "lm_head.weight"}
    assert sorted(tensors) == sorted(mine) and all(torch.equal(tensors[k], mine[k]) for k in mine)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma4AssistantForCausalLM"]
    theirs = Gemma4AssistantForCausalLM.from_pretrained(out).eval()  # transformers reads the export
    assert torch.equal(theirs.pre_projection.weight, drafter.pre_projection.weight)
    assert torch.equal(theirs.lm_head.weight, drafter.model.embed_tokens.weight)  # tied again
    spec, fmt = registry.detect_layout(json.loads((out / "config.json").read_text()))
    assert (spec.method, fmt.name) == ("gemma4_mtp", "gemma4_mtp")


def test_vllms_mtp_config_picks_the_gemma4_proposer(tmp_path):
    target = TargetModel(random_target())
    folder = published(tmp_path / "assistant")
    spec = parse_spec_config({"method": "mtp", "model": str(folder), "num_speculative_tokens": 2})
    proposer = build_proposer(spec, target)
    assert isinstance(proposer, Gemma4MtpProposer) and spec.method == "mtp"  # eval still recommends vLLM's name
    result = SpeculativeGenerator(target, proposer, 2).generate(torch.tensor([[5, 9, 11, 4]]), 6)
    assert result.token_ids == SpeculativeGenerator(target, None, 0).generate(torch.tensor([[5, 9, 11, 4]]),
                                                                              6).token_ids


def test_recipe_rules():
    from draftsmith.config import RecipeError, recipe_from_dict

    base = {"model": {"target": "t", "method": "gemma4_mtp"}, "data": {"path": "d"}, "output_dir": "o"}
    with pytest.raises(RecipeError, match="gemma4_mtp.assistant is not set"):
        recipe_from_dict(base)
    with pytest.raises(RecipeError, match="aux_layer_ids"):
        recipe_from_dict({**base, "model": {**base["model"], "aux_layer_ids": [1]}, "gemma4_mtp": {"assistant": "a"}})
    with pytest.raises(RecipeError, match="hidden-state store does not hold"):
        recipe_from_dict({**base, "data": {"path": "d", "hidden_states_path": "store"},
                          "gemma4_mtp": {"assistant": "a"}})
    recipe_from_dict({**base, "gemma4_mtp": {"assistant": "a", "num_steps": 2}})


# ---- end to end: `draftsmith train` fine-tunes the assistant, the export serves it as vLLM's mtp -----------------
TOPICS = ["rivers", "mountains", "stars", "forests", "oceans", "deserts"]


def conversation(i: int) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Tell me about {topic}, number {i}."},
            {"role": "assistant", "content": f"Here is a short note about {topic}. The {topic} are large and old, "
                                             f"and the {topic} are loved by many people around the world."}]


def trained_target(folder, fixture_target_dir, steps: int = 120):
    """A tiny Gemma 4 target with the fixture's tokenizer, trained `steps` steps on the chats, so its greedy
    answers have structure an assistant can learn (a random target's are noise)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    model = random_target(vocab=len(tokenizer), seed=2)
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    texts = [tokenizer.apply_chat_template(conversation(i), tokenize=True) for i in range(24)]
    texts = [t["input_ids"] if isinstance(t, dict) or hasattr(t, "keys") else t for t in texts]
    width = max(len(t) for t in texts)
    ids = torch.tensor([t + [tokenizer.pad_token_id] * (width - len(t)) for t in texts])
    labels = ids.masked_fill(ids == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(fixture_target_dir / name, folder / name)
    return folder, tokenizer, float(loss.detach())


def acceptance(target, model_path, prompts, k: int = 3, new: int = 24):
    """(mean acceptance length, acceptance rate, outputs) of {"method": "mtp", "model": model_path}."""
    spec = parse_spec_config({"method": "mtp", "model": str(model_path), "num_speculative_tokens": k}, "cpu")
    generator = SpeculativeGenerator(target, build_proposer(spec, target), k)
    drafts = accepted = tokens = 0
    outputs = []
    for prompt in prompts:
        result = generator.generate(torch.tensor([prompt]), new)
        drafts += result.metrics.num_drafts
        tokens += result.metrics.num_draft_tokens
        accepted += result.metrics.num_accepted_tokens
        outputs.append(result.token_ids)
    return 1 + accepted / max(drafts, 1), accepted / max(tokens, 1), outputs


@pytest.mark.slow
def test_fine_tune_raises_acceptance_export_serves_it(tmp_path, fixture_target_dir):
    """`draftsmith train` with model.method gemma4_mtp fine-tunes a (random) published assistant on a tiny Gemma 4
    target trained here; acceptance before (the assistant as published) and after (its export), both served as
    vLLM's {"method": "mtp"}, greedy output equal to plain greedy either way."""
    from draftsmith.config import recipe_from_dict
    from draftsmith.models.export import export_all
    from draftsmith.models.importer import import_checkpoint
    from draftsmith.train import train

    folder, tokenizer, target_loss = trained_target(tmp_path / "target", fixture_target_dir)
    vocab = len(tokenizer)
    assistant = published(tmp_path / "assistant", random_assistant(vocab, centroids=16, top_k=4))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"conversations": conversation(i)}) + "\n" for i in range(24)))
    recipe = recipe_from_dict({
        "model": {"target": str(folder), "method": "gemma4_mtp", "dtype": "float32"},
        "data": {"path": str(chats), "max_length": 128, "eval_samples": 0, "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 40, "batch_size": 8, "lr": 3e-3, "mixed_precision": "no", "log_every": 1000,
                     "eval_every": 100000, "save_every": 100000},
        "gemma4_mtp": {"assistant": str(assistant), "num_steps": 3},
        "output_dir": str(tmp_path / "run"),
    })
    checkpoint = train(recipe, log=lambda *a: None)
    results, _ = export_all(checkpoint, tmp_path / "export", dtype=None)
    exported = results["gemma4_mtp"].out_dir
    imported = import_checkpoint(exported, tmp_path / "imported", target=str(folder))
    assert json.loads((imported.out_dir / "config.json").read_text())["method"] == "gemma4_mtp"

    target = TargetModel.from_pretrained(folder, dtype="float32", device="cpu")
    prompts = [tokenizer.apply_chat_template(conversation(i)[:1], tokenize=True, add_generation_prompt=True)
               for i in range(24, 28)]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    plain = [SpeculativeGenerator(target, None, 0).generate(torch.tensor([p]), 24).token_ids for p in prompts]
    before_tau, before_rate, before_out = acceptance(target, assistant, prompts)
    after_tau, after_rate, after_out = acceptance(target, exported, prompts)
    print(json.dumps({"target LM loss": round(target_loss, 3), "k": 3, "prompts": len(prompts), "max_new_tokens": 24,
                      "before": {"mean acceptance length": round(before_tau, 3), "acceptance rate":
                                 round(before_rate, 3)},
                      "after": {"mean acceptance length": round(after_tau, 3), "acceptance rate":
                                round(after_rate, 3)}}))
    assert before_out == plain and after_out == plain
    assert after_tau > before_tau


def test_an_assistant_for_another_target_is_one_line(tmp_path, tiny_llama):
    folder = published(tmp_path / "assistant")
    spec = parse_spec_config({"method": "mtp", "model": str(folder), "num_speculative_tokens": 2})
    llama, _ = tiny_llama(vocab_size=128)
    with pytest.raises(ValueError, match="drafts for Gemma 4 targets, not a 'llama' target"):
        build_proposer(spec, TargetModel(llama))
    wider = TargetModel(random_target(vocab=256))
    with pytest.raises(ValueError, match="assistant for a target of vocab 128"):
        build_proposer(spec, wider)


def test_out_of_range_ordering_settings_are_refused_at_import_and_load(tmp_path):
    """Issue 47 item 9: an out-of-range token_ordering or centroid_intermediate_top_k imported, then generate was
    a traceback. One validation (read_folder), at import and at load."""
    from safetensors.torch import load_file, save_file

    from draftsmith.models.importer import CheckpointImportError, import_checkpoint

    folder = published(tmp_path / "top_k")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "centroid_intermediate_top_k": 9}))
    for read in (read_folder, load_drafter):
        with pytest.raises(ValueError, match=r"centroid_intermediate_top_k 9 must be an integer in 1..num_centroids"):
            read(folder)
    with pytest.raises(CheckpointImportError, match="centroid_intermediate_top_k 9"):
        import_checkpoint(folder, tmp_path / "imported")

    folder = published(tmp_path / "ordering")
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["masked_embedding.token_ordering"][5] = 128  # one past the vocabulary
    save_file(tensors, str(weights), metadata={"format": "pt"})
    for read in (read_folder, load_drafter):
        with pytest.raises(ValueError, match=r"token_ordering holds ids in 0..128, outside the vocabulary 0..127"):
            read(folder)
    with pytest.raises(CheckpointImportError, match="token_ordering holds ids"):
        import_checkpoint(folder, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()
