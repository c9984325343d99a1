"""DSpark with a pruned draft vocabulary (model.draft_vocab_size, vLLM 0.32's reduced-vocabulary DSpark): each loss
term against a plain loop, the runtime's drafts mapped to target ids with the Markov head fed target ids, the export
vLLM reads (draft_vocab_size, lm_head.weight, d2t) and its refusals, training on a tiny random target, and lossless
generation with a pruned drafter that accepts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_dspark import BASE, H, R, V, _Embedding, tiny_config

from draftsmith.config import RecipeError, check_recipe_against_target, recipe_from_dict
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.checkpoint import ExportError, save_safetensors_atomic, write_json_atomic
from draftsmith.models.dflash.model import init_drafter
from draftsmith.models.drafter_config import DrafterLoadError
from draftsmith.models.dspark.config import DsparkDrafterConfig
from draftsmith.models.dspark.export import (
    check_dspark_export,
    dspark_export_config,
    export_dspark,
    serve_commands_from_config,
)
from draftsmith.models.dspark.io import load_drafter, read_drafter_folder
from draftsmith.models.dspark.loss import dspark_loss
from draftsmith.models.dspark.model import DsparkDrafter, init_heads
from draftsmith.models.dspark.proposer import DsparkProposer
from draftsmith.models.dspark.section import DsparkConfigError
from draftsmith.models.importer import CheckpointImportError, import_checkpoint

VD = 96  # draft ids of the V = 256 target ids


def pruned_config(block_size=4, markov_head="vanilla", draft_vocab_size=VD):
    return DsparkDrafterConfig(**{**tiny_config(block_size, markov_head).to_dict(), "draft_vocab_size": draft_vocab_size})


def draft_vocab(seed=1, size=VD):
    """(d2t, t2d) of `size` random target ids, ascending (data/vocab.py's layout)."""
    used = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(size), t2d


def pruned_drafter(config=None, seed=0, head=None):
    """A drafter over a random draft vocabulary, its head the rows of `head` (the target's, random by default)."""
    config = config or pruned_config()
    torch.manual_seed(seed)
    drafter = DsparkDrafter(config)
    init_drafter(drafter, torch.randn(V, H), std=0.1)
    init_heads(drafter, std=0.3)
    head = head if head is not None else torch.randn(V, H, generator=torch.Generator().manual_seed(seed + 10))
    drafter.set_draft_vocab(*draft_vocab(seed + 1, config.draft_vocab_size), head)
    return drafter.eval()


def test_config_and_drafter_shapes():
    drafter = pruned_drafter()
    state = drafter.state_dict()
    assert state["lm_head.weight"].shape == (VD, H) and not drafter.lm_head.weight.requires_grad  # frozen rows
    assert state["d2t"].dtype == torch.int64 and state["d2t"].shape == (VD,)
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == VD
    assert state["markov_head.markov_w1.weight"].shape == (V, R)  # embeds the previous token: a target id
    assert state["markov_head.markov_w2.weight"].shape == (VD, R)  # a bias over the draft ids
    ids = drafter.draft_ids()
    assert drafter.t2d[ids].all() and torch.equal(drafter.target_to_draft(ids), torch.arange(VD))
    outside = (~drafter.t2d).nonzero().flatten()
    assert (drafter.target_to_draft(outside) == -1).all()
    # the whole vocabulary (None, or a size equal to the target's) is today's drafter: no head, no maps
    for size in (None, V):
        full = DsparkDrafter(pruned_config(draft_vocab_size=size))
        assert full.config.draft_vocab_size is None and full.lm_head is None
        assert set(full.state_dict()) == set(DsparkDrafter(tiny_config()).state_dict())
    # an old checkpoint's config (no draft_vocab_size key) reads as the whole vocabulary
    old = {k: v for k, v in tiny_config().to_dict().items() if k != "draft_vocab_size"}
    assert DsparkDrafterConfig.from_dict(old).draft_vocab_size is None
    with pytest.raises(DsparkConfigError, match=r"model.draft_vocab_size 300: must be an integer in 1..256"):
        pruned_config(draft_vocab_size=300)


# ---- the loss, term by term, over a pruned vocabulary -----------------------------------------------------------------
def slow_pruned_loss(hidden, drafter, target_head, labels, prev, valid, teacher_hidden, ce_w, l1_w, conf_w, gamma):
    """A plain loop: p_draft over the draft ids, p_target over all V ids; the full-vocabulary L1 with p_draft = 0
    outside the draft ids; CE at the label's draft id, none (and no weight) for a label outside them."""
    ids = drafter.draft_ids().tolist()
    draft_of = {t: i for i, t in enumerate(ids)}
    rows, t = [], 0
    for index in valid.nonzero().tolist():
        k = index[-1]
        h = hidden[tuple(index)]
        prev_embed = drafter.markov_head.markov_w1.weight[prev[tuple(index)]]  # prev: a target id
        if drafter.markov_head.gated:
            prev_for_bias = torch.sigmoid(drafter.markov_head.gate_proj(torch.cat([h, prev_embed]))) * prev_embed
        else:
            prev_for_bias = prev_embed
        logits = drafter.lm_head.weight @ h + drafter.markov_head.markov_w2.weight @ prev_for_bias  # (VD,)
        p_draft = torch.softmax(logits, -1)
        p_target = torch.softmax(target_head @ teacher_hidden[t], -1)  # (V,)
        t += 1
        label = int(labels[tuple(index)])
        ce = -torch.log(p_draft[draft_of[label]]) if label in draft_of else None
        l1 = sum((p_draft[i] - p_target[v]).abs() for i, v in enumerate(ids))
        l1 = l1 + sum(p_target[v] for v in range(V) if v not in draft_of)  # |0 - p_target| outside the draft ids
        c = drafter.confidence_head.proj.weight[0] @ torch.cat([h, prev_embed]) + drafter.confidence_head.proj.bias[0]
        want = 1 - l1.detach() / 2
        bce = -(want * torch.log(torch.sigmoid(c)) + (1 - want) * torch.log(1 - torch.sigmoid(c)))
        rows.append((torch.exp(torch.tensor(-k / gamma)), ce, l1, bce))
    total_w = sum(w for w, *_ in rows)
    ce_rows = [(w, ce) for w, ce, _, _ in rows if ce is not None]
    ce_term = sum(w * ce for w, ce in ce_rows) / sum(w for w, _ in ce_rows)
    l1_term = sum(w * l1 for w, _, l1, _ in rows) / total_w
    bce_term = sum(w * bce for w, _, _, bce in rows) / total_w
    return ce_w * ce_term + l1_w * l1_term + conf_w * bce_term


@pytest.mark.parametrize("markov_head", ["vanilla", "gated"])
@pytest.mark.parametrize("loss_grad", ["in_forward", "recompute"])
def test_pruned_loss_terms_and_gradients_match_a_plain_loop(markov_head, loss_grad):
    g = torch.Generator().manual_seed(3)
    target_head = torch.randn(V, H, generator=g)
    drafter = pruned_drafter(pruned_config(markov_head=markov_head), head=target_head).train()
    b, n, bk = 2, 2, drafter.config.block_size
    hidden = torch.randn(b, n, bk, H, generator=g, requires_grad=True)
    ids = drafter.draft_ids()
    # labels mostly inside the draft vocabulary, some outside (no CE there)
    labels = ids[torch.randint(0, VD, (b, n, bk), generator=g)]
    outside = (~drafter.t2d).nonzero().flatten()
    labels[0, 0, 1], labels[1, 0, 2] = outside[0], outside[5]
    prev = torch.randint(0, V, (b, n, bk), generator=g)  # target ids, in the draft vocabulary or not
    valid = torch.tensor([[[1, 1, 1, 0], [1, 0, 0, 0]], [[1, 1, 1, 1], [0, 0, 0, 0]]], dtype=torch.bool)
    teacher = torch.randn(int(valid.sum()), H, generator=g)
    weights = dict(ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0, gamma=4.0)
    params = {k: p for k, p in drafter.named_parameters() if p.requires_grad and k.startswith(("markov", "confid"))}
    for one in ({"ce_weight": 1.0, "l1_weight": 0.0, "confidence_weight": 0.0},
                {"ce_weight": 0.0, "l1_weight": 1.0, "confidence_weight": 0.0},
                {"ce_weight": 0.0, "l1_weight": 0.0, "confidence_weight": 1.0}, {}):
        options = {**weights, **one}
        drafter.zero_grad()
        hidden.grad = None
        loss, metrics = dspark_loss(hidden, drafter.lm_head.weight, drafter.markov_head, drafter.confidence_head,
                                    drafter.target_to_draft(labels), prev, valid, teacher, chunk_size=3,
                                    loss_grad=loss_grad, teacher_head_weight=target_head, draft_ids=ids, **options)
        loss.backward()
        got = {"hidden": hidden.grad.clone(), **{k: p.grad.clone() for k, p in params.items()}}
        drafter.zero_grad()
        hidden.grad = None
        want = slow_pruned_loss(hidden, drafter, target_head, labels, prev, valid, teacher, options["ce_weight"],
                                options["l1_weight"], options["confidence_weight"], options["gamma"])
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["hidden"], hidden.grad, rtol=1e-4, atol=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, k=name: f"{k}: {m}")
    assert drafter.lm_head.weight.grad is None  # the draft head is the target's rows, frozen
    assert metrics["count_0"] == 3 and metrics["count_3"] == 1


def test_the_pruned_l1_is_the_acceptance_of_the_draft_and_a_whole_draft_vocabulary_is_the_full_loss():
    """Over a draft vocabulary of every target id the pruned path gives the full path's loss and metrics; and the
    pruned L1 counts the target's mass outside the draft ids, so 1 - L1 / 2 = sum over all ids min(p_d, p_t)."""
    g = torch.Generator().manual_seed(8)
    head = torch.randn(V, H, generator=g)
    full = DsparkDrafter(tiny_config())
    init_drafter(full, torch.randn(V, H), std=0.1)
    init_heads(full, std=0.3)
    hidden = torch.randn(1, 2, 4, H, generator=g)
    labels = torch.randint(0, V, (1, 2, 4), generator=g)
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    teacher = torch.randn(8, H, generator=g)
    options = dict(ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0, gamma=4.0)
    loss, metrics = dspark_loss(hidden, head, full.markov_head, full.confidence_head, labels, labels, valid, teacher,
                                **options)
    same, same_metrics = dspark_loss(hidden, head, full.markov_head, full.confidence_head, labels, labels, valid,
                                     teacher, teacher_head_weight=head, draft_ids=torch.arange(V), **options)
    torch.testing.assert_close(same, loss, rtol=1e-5, atol=1e-6)
    for key in metrics:
        torch.testing.assert_close(same_metrics[key], metrics[key], rtol=1e-5, atol=1e-6, msg=key)

    drafter = pruned_drafter(head=head)
    ids = drafter.draft_ids()
    one = hidden[:, :1]  # one block: loss_k is its slot k's L1
    _, pruned_metrics = dspark_loss(one, drafter.lm_head.weight, drafter.markov_head, None,
                                    drafter.target_to_draft(labels[:, :1]), labels[:, :1], valid[:, :1], teacher[:4],
                                    teacher_head_weight=head, draft_ids=ids, ce_weight=0.0, l1_weight=1.0,
                                    confidence_weight=0.0, gamma=4.0)
    with torch.no_grad():
        logits = one[0, 0] @ drafter.lm_head.weight.T + drafter.markov_head.bias(
            one[0, 0], drafter.markov_head.embed(labels[0, 0]))
        p_draft = torch.zeros(4, V).index_copy(1, ids, logits.softmax(-1))  # 0 outside the draft ids
        p_target = (teacher[:4] @ head.T).softmax(-1)
        accept = torch.minimum(p_draft, p_target).sum(-1)  # what speculative verification accepts
    l1 = torch.stack([pruned_metrics[f"loss_{k}"] for k in range(4)])
    torch.testing.assert_close(l1, (p_draft - p_target).abs().sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(1 - l1 / 2, accept, rtol=1e-5, atol=1e-6)
    assert p_target[:, ~drafter.t2d].sum() > 0.5  # the mass outside the draft ids is no rounding error


# ---- the runtime: draft ids mapped to target ids, the Markov head fed target ids ---------------------------------------
def test_runtime_drafts_target_ids_and_feeds_them_to_the_markov_head():
    """vLLM's _sample_sequential: logits over the draft ids (own head + Markov bias), argmax, map to the target id,
    and that target id is the draft and the next slot's markov_w1 input. Teacher-forced on those drafts, the
    training forward's argmax (mapped) is the same."""
    k = 4
    drafter = pruned_drafter()
    with torch.no_grad():  # the Markov bias decides the drafts, so feeding it the wrong ids shows
        drafter.lm_head.weight.mul_(0.01)
        drafter.markov_head.markov_w2.weight.mul_(3.0)
    g = torch.Generator().manual_seed(5)
    embed = torch.randn(V, H, generator=g)
    target_head = torch.nn.Linear(H, V, bias=False)  # not used: a pruned drafter reads out with its own head
    a = 6
    prompt = torch.randint(0, V, (1, a + 1), generator=g)
    aux = torch.randn(1, a, 3 * H, generator=g)
    proposer = DsparkProposer(drafter, _Embedding(embed), target_head)
    assert proposer.lm_head is drafter.lm_head
    proposer.begin(prompt)
    proposer.extend(prompt[:, 1:], aux)
    drafts = proposer.propose(k).token_ids[0]
    assert drafter.t2d[drafts].all()  # every draft is a target id inside the draft vocabulary

    ids = torch.cat([prompt[0], drafts])
    with torch.no_grad():
        hidden = drafter(torch.cat([aux, torch.zeros(1, k + 1, 3 * H)], dim=1), embed[ids[a]][None, None],
                         torch.tensor([[a]]), embed[drafter.config.mask_token_id])[0, 0]
        logits = drafter.lm_head(hidden) + drafter.markov_head.bias(hidden, drafter.markov_head.embed(ids[a:a + k]))
    assert drafter.draft_to_target(logits.argmax(-1)).tolist() == drafts.tolist()
    # fed draft ids instead of target ids, the Markov head would draft otherwise: the test can tell them apart
    with torch.no_grad():
        wrong = drafter.lm_head(hidden) + drafter.markov_head.bias(
            hidden, drafter.markov_head.embed(torch.cat([ids[a:a + 1], drafter.target_to_draft(drafts[:-1])])))
    assert drafter.draft_to_target(wrong.argmax(-1)).tolist() != drafts.tolist()


# ---- export and import -------------------------------------------------------------------------------------------
def pruned_checkpoint(folder, drafter=None):
    drafter = drafter or pruned_drafter()
    folder.mkdir(parents=True)
    save_safetensors_atomic({k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")},
                            folder / "model.safetensors")
    write_json_atomic(drafter.config.to_dict(), folder / "config.json")
    return folder, drafter


def test_pruned_export_is_vllms_reduced_vocabulary_layout_and_reads_back(tmp_path):
    ckpt, drafter = pruned_checkpoint(tmp_path / "ckpt")
    result = export_dspark(ckpt, tmp_path / "out", dtype=None)
    out = result.out_dir
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["draft_vocab_size"] == VD and config["vocab_size"] == V
    assert tensors["lm_head.weight"].shape == (VD, H) and tensors["markov_head.markov_w2.weight"].shape == (VD, R)
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], drafter.d2t)  # offsets, as vLLM's
    assert "t2d" not in tensors and "embed_tokens.weight" not in tensors
    assert tensors["markov_head.markov_w1.weight"].shape == (V, R)
    assert any("SGLang's DSpark reads out with the target's whole head" in w for w in result.warnings)
    assert set(serve_commands_from_config(config, "org/draft")) == {"vLLM"}
    card = (out / "README.md").read_text()
    assert "vllm serve" in card and "sglang" not in card.lower().split("## serving")[1]
    assert "\n- sglang" not in card.split("---")[1]  # no sglang tag
    read, back, _ = read_drafter_folder(out)
    assert read.draft_vocab_size == VD
    loaded = load_drafter(out)
    for name, t in drafter.state_dict().items():
        if not name.startswith("rotary_emb."):
            assert torch.equal(loaded.state_dict()[name], t), name  # t2d rebuilt from d2t
    imported = import_checkpoint(out, tmp_path / "imported")
    assert imported.format == "dspark"
    assert torch.equal(load_drafter(tmp_path / "imported").d2t, drafter.d2t)


def test_a_whole_vocabulary_export_keeps_todays_layout(tmp_path):
    """No draft_vocab_size, lm_head or d2t, and both engines' serve commands, as before the pruned vocabulary."""
    drafter = DsparkDrafter(tiny_config())
    ckpt, _ = pruned_checkpoint(tmp_path / "ckpt", drafter)
    result = export_dspark(ckpt, tmp_path / "out", dtype=None)
    config = json.loads((result.out_dir / "config.json").read_text())
    tensors = load_file(str(result.out_dir / "model.safetensors"))
    assert "draft_vocab_size" not in config and not {"lm_head.weight", "d2t", "t2d"} & set(tensors)
    assert set(serve_commands_from_config(config, "d")) == {"vLLM", "SGLang"}
    assert not any("draft_vocab_size" in w for w in result.warnings)


def test_the_export_contract_and_the_reader_refuse_a_bad_draft_vocabulary(tmp_path):
    drafter = pruned_drafter()
    config = dspark_export_config(drafter.config)
    tensors = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.") and k != "t2d"}
    problems, warnings = check_dspark_export(config, tensors)
    assert problems == [] and any("vLLM only" in w for w in warnings)
    cases = [
        ({**tensors, "d2t": tensors["d2t"].float()}, "d2t: dtype torch.float32, expected torch.int64"),
        ({**tensors, "d2t": tensors["d2t"] + V}, "outside the target vocabulary 0..255"),
        ({k: v for k, v in tensors.items() if k != "lm_head.weight"}, "missing tensors: lm_head.weight"),
        ({**tensors, "lm_head.weight": torch.zeros(V, H)}, "(draft_vocab_size, hidden_size)"),
    ]
    for bad, message in cases:
        problems, _ = check_dspark_export(config, bad)
        assert any(message in p for p in problems), (message, problems)
    problems, _ = check_dspark_export({**config, "draft_vocab_size": V + 1}, tensors)
    assert any("config draft_vocab_size: 257" in p for p in problems)

    ckpt, _ = pruned_checkpoint(tmp_path / "ckpt", drafter)
    out = export_dspark(ckpt, tmp_path / "out", dtype=None).out_dir
    for name, edit, message in (
            ("range", lambda t: {**t, "d2t": t["d2t"] + 200}, r"d2t maps draft id \d+ to target id \d+, outside the "
                                                              r"target vocabulary 0..255"),
            ("twice", lambda t: {**t, "d2t": torch.zeros(VD, dtype=torch.long) + 3}, None),
            ("no-head", lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"},
             r"pruned draft vocabulary needs its own lm_head.weight")):
        folder = tmp_path / name
        shutil.copytree(out, folder)
        save_safetensors_atomic(edit(load_file(str(out / "model.safetensors"))), folder / "model.safetensors")
        if message is None:  # all ids shifted by 3: in range and distinct, so it loads (vLLM's rule, ours too)
            assert load_drafter(folder).draft_ids()[0] == 3
            continue
        with pytest.raises(DrafterLoadError, match=message) as err:
            load_drafter(folder)
        assert "\n" not in str(err.value)
        with pytest.raises(CheckpointImportError, match=message):
            import_checkpoint(folder, tmp_path / f"imported-{name}")
    folder = tmp_path / "same-id"
    shutil.copytree(out, folder)
    same = load_file(str(out / "model.safetensors"))
    same["d2t"] = -torch.arange(VD)  # every draft id -> target id 0
    save_safetensors_atomic(same, folder / "model.safetensors")
    with pytest.raises(DrafterLoadError, match="two draft ids to the same target id"):
        load_drafter(folder)


# ---- recipe --------------------------------------------------------------------------------------------------------
def test_the_recipe_takes_the_key_and_refuses_a_size_past_the_target_vocabulary():
    recipe = recipe_from_dict({**BASE, "model": {"target": "t", "method": "dspark", "draft_vocab_size": 300}})
    assert recipe.model.draft_vocab_size == 300  # the target is not known yet
    with pytest.raises(RecipeError, match=r"model.draft_vocab_size \(300\) exceeds the target vocabulary \(256\)") \
            as err:
        check_recipe_against_target(recipe, {"vocab_size": V, "num_hidden_layers": 6})
    assert "\n" not in str(err.value)
    check_recipe_against_target(recipe_from_dict({**BASE, "model": {"target": "t", "method": "dspark",
                                                                     "draft_vocab_size": 100}}),
                                {"vocab_size": V, "num_hidden_layers": 6})


# ---- training on a tiny random target, export, import ------------------------------------------------------------
def test_training_a_pruned_drafter_on_a_tiny_target_exports_and_imports(tmp_path, fixture_target_dir):
    """A few steps on a tiny random target with model.draft_vocab_size 300 of 16,000: the trainer's draft vocabulary
    (the answers' most frequent ids) becomes the drafter's d2t and t2d, its head the target's rows of them, frozen;
    the export carries them to vLLM's layout and reads back as the checkpoint."""
    from test_train import tiny_random_target, write_conversations

    from draftsmith.data.vocab import target_ids_of_draft
    from draftsmith.models.target import TargetModel
    from draftsmith.train import train

    target_dir = tiny_random_target(tmp_path / "target", fixture_target_dir)
    data = write_conversations(tmp_path / "conv.jsonl")
    recipe = recipe_from_dict({
        "model": {"target": str(target_dir), "method": "dspark", "draft_vocab_size": 300, "dtype": "float32"},
        "dspark": {"num_layers": 1, "block_size": 3, "num_target_layers": 2, "anchors_per_sequence": 8,
                   "markov_rank": 8},
        "data": {"path": str(data), "max_length": 96, "eval_samples": 2, "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 3, "batch_size": 2, "lr": 1e-3, "log_every": 1, "eval_every": 3, "save_every": 3,
                     "mixed_precision": "no", "seed": 0},
        "output_dir": str(tmp_path / "run"),
    })
    lines = []
    checkpoint = train(recipe, log=lines.append)
    assert any("draft vocab: 300 of 16000 tokens" in line for line in lines), lines
    rows = [json.loads(line) for line in (checkpoint.parent / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert all(0 < r["loss"] < 100 for r in rows if "loss" in r)
    state = load_file(str(checkpoint / "model.safetensors"))
    assert state["d2t"].shape == (300,) and int(state["t2d"].sum()) == 300
    ids = target_ids_of_draft(state["d2t"])
    assert state["t2d"][ids].all()
    target = TargetModel.head_and_embeddings(str(target_dir), dtype="float32", device="cpu")
    torch.testing.assert_close(state["lm_head.weight"], target.lm_head.weight[ids].float())  # frozen: still the rows
    trained = load_drafter(checkpoint)
    out = export_dspark(checkpoint, tmp_path / "export", dtype=None).out_dir
    exported = load_file(str(out / "model.safetensors"))
    assert torch.equal(exported["d2t"], state["d2t"])
    import_checkpoint(out, tmp_path / "imported")
    back = load_drafter(tmp_path / "imported")
    for name, t in trained.state_dict().items():
        if not name.startswith("rotary_emb."):
            assert torch.equal(back.state_dict()[name], t), name


# ---- end to end ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_pruned_dspark_is_lossless_with_a_drafter_that_accepts(fixture_prompts, accepting_drafter, tmp_path):
    """A drafter over 1,000 of the fixture's 16,000 ids, trained on the target's own answers, exported to vLLM's
    layout and read back from the export: its drafts (target ids) are accepted, whole blocks too, and the output is
    plain greedy decoding's."""
    from conftest import generate_lossless

    target, _, prompts, answers, eos = fixture_prompts
    k = 4
    checkpoint = accepting_drafter("dspark_pruned")
    out = export_dspark(checkpoint, tmp_path / "export", dtype=None).out_dir
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 1000
    for model in (checkpoint, out):
        spec = {"method": "dspark", "model": str(model), "num_speculative_tokens": k}
        proposer = build_proposer(parse_spec_config(spec, "cpu"), target)
        assert proposer.drafter.config.draft_vocab_size == 1000 and proposer.lm_head is proposer.drafter.lm_head
        counts = generate_lossless(target, proposer, k, prompts, answers, eos)
        assert counts.num_accepted_tokens >= 25, counts
        assert counts.num_accepted_tokens_per_pos[k - 1] > 0  # some whole blocks accepted


def test_an_export_refuses_nothing_it_wrote_for_a_pruned_drafter(tmp_path):
    """ExportError would name any contract problem: a pruned export passes its own check (bf16 weights, int64 d2t)."""
    ckpt, _ = pruned_checkpoint(tmp_path / "ckpt")
    try:
        result = export_dspark(ckpt, tmp_path / "out")  # bf16 by default
    except ExportError as e:  # pragma: no cover - the failure message is the point
        pytest.fail(str(e))
    tensors = load_file(str(result.out_dir / "model.safetensors"))
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
