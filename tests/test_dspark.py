"""DSpark: the slot layout, each loss term against a plain loop, training forward = the runtime's Markov drafting,
the export contract and the published layouts read back, the recipe's rules, and lossless generation with a
drafter that accepts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from draftsmith.config import RecipeError, recipe_from_dict
from draftsmith.inference.spec_config import SpecConfigError, build_proposer, parse_spec_config
from draftsmith.models.checkpoint import ExportError, save_safetensors_atomic, write_json_atomic
from draftsmith.models.dflash.loss import sample_anchors
from draftsmith.models.dflash.model import init_drafter
from draftsmith.models.dflash.section import DflashConfigError
from draftsmith.models.drafter_config import DrafterLoadError
from draftsmith.models.dspark.config import DsparkDrafterConfig
from draftsmith.models.dspark.export import check_dspark_export, dspark_export_config, export_dspark
from draftsmith.models.dspark.io import load_drafter, read_drafter_folder
from draftsmith.models.dspark.loss import block_targets, dspark_loss, slot_weights
from draftsmith.models.dspark.model import DsparkDrafter, init_heads
from draftsmith.models.dspark.proposer import DsparkProposer
from draftsmith.models.dspark.section import DsparkConfigError
from draftsmith.models.importer import CheckpointImportError, import_checkpoint

H, V, R = 64, 256, 8


def tiny_config(block_size=4, markov_head="vanilla", confidence_head=True):
    target = Qwen3Config(vocab_size=V, hidden_size=H, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, head_dim=16)
    return DsparkDrafterConfig.from_target(target, num_layers=2, block_size=block_size, num_features=3,
                                           mask_token_id=7, markov_rank=R, markov_head=markov_head,
                                           confidence_head=confidence_head, target_name_or_path="org/target")


def tiny_drafter(config, seed=0):
    torch.manual_seed(seed)
    drafter = DsparkDrafter(config)
    init_drafter(drafter, torch.randn(V, H), std=0.1)
    init_heads(drafter, std=0.3)  # a Markov bias large enough to change argmaxes
    return drafter.eval()


# ---- slots and targets ----------------------------------------------------------------------------------------------
def test_anchors_sit_inside_the_answer():
    """DSpark's anchor slot predicts, so an anchor and the token after it are both answer tokens (DeepSpec)."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1]])
    anchors, valid = sample_anchors(loss_mask, 100, anchor_in_mask=True)
    assert anchors[0][valid[0]].tolist() == [2, 3]  # 1 (before the answer) and 6 (a gap) are DFlash's, not ours


def test_block_targets_literal():
    """Slot k of the block at a: label x_{a+k+1}, Markov prev x_{a+k}, teacher position a+k; a slot counts only
    while every earlier slot of its block counts."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1]])
    labels, prev, teacher_at, valid = block_targets(ids, loss_mask, torch.tensor([[1, 4, 0]]),
                                                    torch.tensor([[True, True, False]]), block_size=3)
    assert labels[0, 0].tolist() == [12, 13, 14] and prev[0, 0].tolist() == [11, 12, 13]
    assert teacher_at[0, 0].tolist() == [1, 2, 3]
    assert valid[0, 0].tolist() == [True, False, False]  # x_3 is not an answer token: slot 1 and all after it
    assert labels[0, 1, :2].tolist() == [15, 16] and valid[0, 1].tolist() == [True, True, False]  # x_7 is past S
    assert valid[0, 2].tolist() == [False, False, False]  # a padding block


# ---- the loss, term by term ---------------------------------------------------------------------------------------
def slow_dspark_loss(hidden, head, drafter, labels, prev, valid, teacher_hidden, ce_w, l1_w, conf_w, gamma):
    """A plain loop: every counted slot's CE, L1 and BCE, each a weighted mean with weights exp(-k / gamma)."""
    rows, t = [], 0
    for index in valid.nonzero().tolist():
        k = index[-1]
        h = hidden[tuple(index)]
        prev_embed = drafter.markov_head.markov_w1.weight[prev[tuple(index)]]
        if drafter.markov_head.gated:
            gate = torch.sigmoid(drafter.markov_head.gate_proj(torch.cat([h, prev_embed])))
            prev_for_bias = gate * prev_embed
        else:
            prev_for_bias = prev_embed
        logits = head @ h + drafter.markov_head.markov_w2.weight @ prev_for_bias
        p_draft = torch.softmax(logits, -1)
        p_target = torch.softmax(head @ teacher_hidden[t], -1)
        t += 1
        ce = -torch.log(p_draft[labels[tuple(index)]])
        l1 = sum((p_draft[v] - p_target[v]).abs() for v in range(head.shape[0]))
        c = drafter.confidence_head.proj.weight[0] @ torch.cat([h, prev_embed]) + drafter.confidence_head.proj.bias[0]
        want = 1 - l1.detach() / 2
        bce = -(want * torch.log(torch.sigmoid(c)) + (1 - want) * torch.log(1 - torch.sigmoid(c)))
        rows.append((torch.exp(torch.tensor(-k / gamma)), ce, l1, bce))
    total_w = sum(w for w, *_ in rows)
    ce_term = sum(w * ce for w, ce, _, _ in rows) / total_w
    l1_term = sum(w * l1 for w, _, l1, _ in rows) / total_w
    bce_term = sum(w * bce for w, _, _, bce in rows) / total_w
    return ce_w * ce_term + l1_w * l1_term + conf_w * bce_term, (ce_term, l1_term, bce_term)


@pytest.mark.parametrize("markov_head", ["vanilla", "gated"])
@pytest.mark.parametrize("loss_grad", ["in_forward", "recompute"])
def test_loss_terms_and_gradients_match_a_plain_loop(markov_head, loss_grad):
    cfg = tiny_config(markov_head=markov_head)
    drafter = tiny_drafter(cfg).train()
    g = torch.Generator().manual_seed(3)
    head = torch.randn(V, H, generator=g)
    b, n, bk = 2, 2, cfg.block_size
    hidden = torch.randn(b, n, bk, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (b, n, bk), generator=g)
    prev = torch.randint(0, V, (b, n, bk), generator=g)
    valid = torch.tensor([[[1, 1, 1, 0], [1, 0, 0, 0]], [[1, 1, 1, 1], [0, 0, 0, 0]]], dtype=torch.bool)
    teacher = torch.randn(int(valid.sum()), H, generator=g)
    weights = dict(ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0, gamma=4.0)
    # each term alone, then all three: a term dropped, doubled or misweighted shows
    for one in ({"ce_weight": 1.0, "l1_weight": 0.0, "confidence_weight": 0.0},
                {"ce_weight": 0.0, "l1_weight": 1.0, "confidence_weight": 0.0},
                {"ce_weight": 0.0, "l1_weight": 0.0, "confidence_weight": 1.0}, {}):
        options = {**weights, **one}
        drafter.zero_grad()
        hidden.grad = None
        loss, metrics = dspark_loss(hidden, head, drafter.markov_head, drafter.confidence_head, labels, prev, valid,
                                    teacher, chunk_size=3, loss_grad=loss_grad, **options)
        loss.backward()
        got = {"hidden": hidden.grad.clone(), **{k: p.grad.clone() for k, p in drafter.named_parameters()
                                                 if k.startswith(("markov_head", "confidence_head"))}}
        drafter.zero_grad()
        hidden.grad = None
        want, _ = slow_dspark_loss(hidden, head, drafter, labels, prev, valid, teacher, options["ce_weight"],
                                   options["l1_weight"], options["confidence_weight"], options["gamma"])
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["hidden"], hidden.grad, rtol=1e-4, atol=1e-6)
        for name, grad in got.items():
            if name != "hidden":
                reference = dict(drafter.named_parameters())[name].grad
                torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-6, msg=lambda m, k=name: f"{k}: {m}")
    assert metrics["count_0"] == 3 and metrics["count_3"] == 1


def test_slot_weights_decay_from_the_anchor_slot():
    w = slot_weights(7, 4.0)
    assert w[0] == 1.0 and w[1] == pytest.approx(torch.exp(torch.tensor(-0.25)).item())  # exp(-k / gamma), k from 0


def test_the_loss_gradient_scales_with_the_upstream_gradient():
    """d(c * loss) = c * d(loss): gradient accumulation and loss scaling divide or multiply the loss."""
    cfg = tiny_config()
    drafter = tiny_drafter(cfg).train()
    g = torch.Generator().manual_seed(4)
    head = torch.randn(V, H, generator=g)
    hidden = torch.randn(1, 2, cfg.block_size, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (1, 2, cfg.block_size), generator=g)
    valid = torch.ones(1, 2, cfg.block_size, dtype=torch.bool)
    teacher = torch.randn(int(valid.sum()), H, generator=g)
    grads = []
    for scale in (1.0, 0.5):
        hidden.grad = None
        loss, _ = dspark_loss(hidden, head, drafter.markov_head, drafter.confidence_head, labels, labels, valid,
                              teacher, ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0, gamma=4.0)
        (scale * loss).backward()
        grads.append(hidden.grad.clone())
    torch.testing.assert_close(grads[1], 0.5 * grads[0])


# ---- training forward = the runtime ----------------------------------------------------------------------------------
class _Embedding(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, ids):
        return F.embedding(ids, self.weight)


@pytest.mark.parametrize("markov_head", ["vanilla", "gated"])
def test_runtime_drafts_are_the_training_forwards_argmax_over_its_own_drafts(markov_head):
    """The runtime drafts k tokens with a block of k slots, the Markov head fed its own drafts. Teacher-forced on
    exactly those drafts, the training forward (one block of k slots at the same anchor) gives the same argmaxes:
    the slot layout, the positions, the Markov inputs and the context cut all agree."""
    k = 4
    cfg = tiny_config(block_size=k, markov_head=markov_head)
    drafter = tiny_drafter(cfg)
    g = torch.Generator().manual_seed(5)
    embed = torch.randn(V, H, generator=g)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    a = 6
    prompt = torch.randint(0, V, (1, a + 1), generator=g)
    aux = torch.randn(1, a, 3 * H, generator=g)
    proposer = DsparkProposer(drafter, _Embedding(embed), head)
    proposer.begin(prompt)
    proposer.extend(prompt[:, 1:], aux)  # features of positions 0..a-1; the last committed token is x_a
    proposal = proposer.propose(k)
    drafts = proposal.token_ids[0]
    assert proposal.lengths.tolist() == [k]

    ids = torch.cat([prompt[0], drafts])  # x_0..x_a, then the drafts at a+1..a+k
    with torch.no_grad():
        hidden = drafter(torch.cat([aux, torch.zeros(1, k + 1, 3 * H)], dim=1), embed[ids[a]][None, None],
                         torch.tensor([[a]]), embed[cfg.mask_token_id])[0, 0]  # (k, H); context < a only
        prev_embed = drafter.markov_head.embed(ids[a:a + k])  # x_a, d_0, .., d_{k-2}
        logits = head(hidden) + drafter.markov_head.bias(hidden, prev_embed)
    assert logits.argmax(-1).tolist() == drafts.tolist()
    assert proposer.propose(2).token_ids[0].tolist() != [] and proposer.propose(2).lengths.tolist() == [2]


def test_the_confidence_threshold_cuts_each_proposal_before_its_first_doubt():
    k = 4
    drafter = tiny_drafter(tiny_config(block_size=k))
    g = torch.Generator().manual_seed(6)
    embed, head = torch.randn(V, H, generator=g), torch.nn.Linear(H, V, bias=False)
    prompt = torch.randint(0, V, (2, 5), generator=g)
    full = DsparkProposer(drafter, _Embedding(embed), head)
    full.begin(prompt)
    full.extend(prompt[:, 1:], torch.randn(2, 4, 3 * H, generator=torch.Generator().manual_seed(7)))
    reference = full.propose(k)
    with torch.no_grad():  # a bias that makes the head doubt everything, then nothing
        drafter.confidence_head.proj.bias.fill_(-50.0)
    for bias, want in ((-50.0, [0, 0]), (50.0, [k, k])):
        with torch.no_grad():
            drafter.confidence_head.proj.bias.fill_(bias)
        cut = DsparkProposer(drafter, _Embedding(embed), head, confidence_threshold=0.5)
        cut.begin(prompt)
        cut.extend(prompt[:, 1:], torch.randn(2, 4, 3 * H, generator=torch.Generator().manual_seed(7)))
        proposal = cut.propose(k)
        assert proposal.lengths.tolist() == want
        if want[0] == k:
            assert torch.equal(proposal.token_ids, reference.token_ids)  # the cut never changes the drafts
        else:
            assert (proposal.token_ids == -1).all()


# ---- export, import ------------------------------------------------------------------------------------------------
def checkpoint(folder, config=None, seed=0):
    config = config or tiny_config()
    drafter = tiny_drafter(config, seed)
    folder.mkdir(parents=True)
    save_safetensors_atomic({k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")},
                            folder / "model.safetensors")
    write_json_atomic(config.to_dict(), folder / "config.json")
    return folder, drafter


def test_export_writes_what_both_engines_read_and_reads_back_the_same(tmp_path):
    ckpt, drafter = checkpoint(tmp_path / "ckpt")
    out = export_dspark(ckpt, tmp_path / "out", dtype=None).out_dir
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["sample_from_anchor"] is True and "sample_from_anchor" not in config["dflash_config"]
    assert (config["markov_rank"], config["markov_head_type"]) == (R, "vanilla")
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["target_layer_ids"] == config["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # capture form: output of layer i = i + 1
    assert config["mask_token_id"] == config["dflash_config"]["mask_token_id"] == 7
    assert config["draftsmith"]["slot_convention"] == "sample_from_anchor"
    assert "## Serving" in (out / "README.md").read_text() and "DSPARK" in (out / "README.md").read_text()
    read, tensors, _ = read_drafter_folder(out)
    assert read.to_dict() == {**drafter.config.to_dict(), "target_name_or_path": "org/target"}
    for name, t in drafter.state_dict().items():
        if not name.startswith("rotary_emb."):
            assert torch.equal(tensors[name], t), name


def test_export_contract_refuses_what_an_engine_would_misread(tmp_path):
    ckpt, drafter = checkpoint(tmp_path / "ckpt")
    config = dspark_export_config(drafter.config)
    tensors = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    assert check_dspark_export(config, tensors) == ([], [])
    cases = [
        ({**config, "sample_from_anchor": False}, "sample_from_anchor"),
        ({**config, "dflash_config": {**config["dflash_config"], "sample_from_anchor": True}}, "refuses it there"),
        ({**config, "speculators_model_type": "dspark"}, "SGLang refuses"),
        ({**config, "confidence_head_with_markov": False}, "confidence_head_with_markov"),
        ({**config, "markov_rank": 4}, "markov_head.markov_w1.weight: shape"),
        ({**config, "target_layer_ids": [1, 2, 4]}, "must agree"),
    ]
    for bad, message in cases:
        problems, _ = check_dspark_export(bad, tensors)
        assert any(message in p for p in problems), (message, problems)
    problems, _ = check_dspark_export(config, {k: v for k, v in tensors.items() if "confidence" not in k})
    assert any("missing tensors: confidence_head.proj.bias" in p for p in problems)


def test_a_drafter_without_confidence_head_exports_with_sglangs_serving_mode_named(tmp_path):
    """SGLang builds a confidence head for every DSpark draft outside its static verify mode and refuses a
    checkpoint without one: the export still goes ahead, and says so."""
    ckpt, _ = checkpoint(tmp_path / "ckpt", tiny_config(confidence_head=False))
    result = export_dspark(ckpt, tmp_path / "out", dtype=None)
    config = json.loads((result.out_dir / "config.json").read_text())
    _, tensors, _ = read_drafter_folder(result.out_dir)
    assert config["enable_confidence_head"] is False and not any(n.startswith("confidence_head.") for n in tensors)
    assert [w for w in result.warnings if "SGLANG_RAGGED_VERIFY_MODE is static" in w], result.warnings


def _published(tmp_path, name, edit_config, edit_tensors=lambda t: t):
    """A published folder made from our export, rewritten to another project's layout."""
    ckpt, drafter = checkpoint(tmp_path / f"{name}-ckpt")
    out = export_dspark(ckpt, tmp_path / f"{name}-export", dtype=None).out_dir
    folder = tmp_path / name
    folder.mkdir()
    config = edit_config(json.loads((out / "config.json").read_text()))
    from safetensors.torch import load_file

    tensors = edit_tensors(load_file(str(out / "model.safetensors")))
    save_safetensors_atomic(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder, drafter


def _deepspec(config):
    """DeepSpec: top-level keys only, no dflash_config, no sample_from_anchor; it ships the target's embedding and
    head."""
    config = {k: v for k, v in config.items() if k not in ("dflash_config", "sample_from_anchor", "draftsmith",
                                                            "eagle_aux_hidden_state_layer_ids")}
    return config


def _specforge(config):
    """SpecForge before normalize_dflash_export.py: DSparkDraftModel, the DSpark keys inside dflash_config."""
    nested = {k: config.pop(k) for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                         "confidence_head_with_markov", "target_layer_ids", "mask_token_id")}
    config.pop("sample_from_anchor")
    config["architectures"] = ["DSparkDraftModel"]
    config["dflash_config"] = {**config["dflash_config"], **nested}
    return config


def _speculators(anchor):
    def edit(config):
        layer = {k: config.pop(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
                                             "rms_norm_eps", "model_type")}
        config.pop("dflash_config")
        config.pop("target_layer_ids")
        if anchor is None:
            config.pop("sample_from_anchor")
        else:
            config["sample_from_anchor"] = anchor
        return {**config, "speculators_model_type": "dspark", "transformer_layer_config": layer,
                "aux_hidden_state_layer_ids": [2, 3, 4], "draft_vocab_size": layer["vocab_size"],
                "speculators_config": {"algorithm": "dspark", "verifier": {"name_or_path": "org/target"}}}
    return edit


@pytest.mark.parametrize("layout, edit_config, edit_tensors", [
    ("deepspec", _deepspec, lambda t: {**t, "embed_tokens.weight": torch.zeros(V, H), "lm_head.weight": torch.zeros(V, H)}),
    ("specforge", _specforge, lambda t: t),
    ("speculators", _speculators(True), lambda t: {**t, "embed_tokens.weight": torch.zeros(V, H),
                                                    "d2t": torch.zeros(V, dtype=torch.long),
                                                    "t2d": torch.ones(V, dtype=torch.bool)}),
])
def test_published_layouts_import_to_the_same_drafter(tmp_path, layout, edit_config, edit_tensors):
    folder, drafter = _published(tmp_path, layout, edit_config, edit_tensors)
    result = import_checkpoint(folder, tmp_path / "imported")
    assert result.format == "dspark"
    loaded = load_drafter(tmp_path / "imported")
    assert loaded.config.target_layer_ids == [1, 2, 3] and loaded.config.mask_token_id == 7
    assert loaded.config.markov_rank == R and loaded.confidence_head is not None
    for name, t in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert torch.equal(load_drafter(folder).markov_head.markov_w2.weight, drafter.markov_head.markov_w2.weight)


def test_other_slot_conventions_and_pruned_vocabularies_without_their_head_are_refused_by_name(tmp_path):
    """A pruned draft vocabulary reads (tests/test_dspark_vocab.py) only with its own lm_head and d2t, as vLLM's."""
    folder, _ = _published(tmp_path, "fill-in", _speculators(None))  # speculators without the key: fill-in slots
    with pytest.raises(CheckpointImportError, match="fill-in slots"):
        import_checkpoint(folder, tmp_path / "a")
    with pytest.raises(DrafterLoadError, match="fill-in slots"):
        load_drafter(folder)

    def pruned(config):
        return {**_speculators(True)(config), "draft_vocab_size": 128}
    folder, _ = _published(tmp_path, "pruned", pruned)
    with pytest.raises(CheckpointImportError, match="pruned draft vocabulary needs its own lm_head.weight and d2t"):
        import_checkpoint(folder, tmp_path / "b")


# ---- recipe and speculative config ---------------------------------------------------------------------------------
BASE = {"model": {"target": "t", "method": "dspark"}, "data": {"path": "x.jsonl"}, "output_dir": "out"}


def test_recipe_section_defaults_are_deepspecs_and_bad_keys_are_one_line():
    section = recipe_from_dict(BASE).dspark
    assert (section.block_size, section.num_layers, section.markov_rank, section.markov_head) == (7, 5, 256, "vanilla")
    assert (section.ce_weight, section.l1_weight, section.confidence_weight, section.loss_gamma) == (0.1, 0.9, 1.0, 4.0)
    for patch, message in (({"dspark": {"target_layer_ids": [4, 1]}}, "dspark.target_layer_ids"),
                           ({"dspark": {"markov_head": "rnn"}}, "dspark.markov_head"),
                           ({"dspark": {"confidence_head": False}}, "dspark.confidence_weight"),
                           ({"model": {"target": "t", "method": "dspark", "aux_layer_ids": [1, 2]}},
                            "dspark.target_layer_ids"),
                           ({"training": {"loss": "lk"}}, "training.loss lk")):
        with pytest.raises(RecipeError, match=message) as err:
            recipe_from_dict({**BASE, **patch})
        assert "\n" not in str(err.value)


def test_speculative_config_keys_and_limits(tmp_path):
    ckpt, _ = checkpoint(tmp_path / "ckpt")
    spec = parse_spec_config({"method": "dspark", "model": str(ckpt), "num_speculative_tokens": 4,
                              "confidence_threshold": 0.3}, "cpu")
    assert spec.options == {"confidence_threshold": 0.3} and spec.to_dict()["confidence_threshold"] == 0.3
    with pytest.raises(SpecConfigError, match="confidence_threshold must be a number in"):
        parse_spec_config({"method": "dspark", "model": "m", "num_speculative_tokens": 4, "confidence_threshold": 2})
    with pytest.raises(SpecConfigError, match="DSpark's key, not 'dflash'"):
        parse_spec_config({"method": "dflash", "model": "m", "num_speculative_tokens": 4, "confidence_threshold": .5})
    with pytest.raises(SpecConfigError, match="enable_adaptive_verification"):
        parse_spec_config({"method": "dspark", "model": "m", "num_speculative_tokens": 4,
                           "enable_adaptive_verification": True})

    class Target:  # what from_config reads of the target
        device, dtype, vocab_size, hidden_size, num_layers = torch.device("cpu"), torch.float32, V, H, 6
        embed_tokens, lm_head = _Embedding(torch.randn(V, H)), torch.nn.Linear(H, V, bias=False)

        def check_drafter_fits(self, *args, **kwargs):
            pass

        def check_aux_layer_ids(self, ids):
            return ids
    proposer = build_proposer(spec, Target())
    assert isinstance(proposer, DsparkProposer) and proposer.confidence_threshold == 0.3
    with pytest.raises(DsparkConfigError, match="num_speculative_tokens=5 exceeds what one DSpark block of 4 drafts"):
        build_proposer(parse_spec_config({"method": "dspark", "model": str(ckpt), "num_speculative_tokens": 5},
                                         "cpu"), Target())


def test_dspark_settings_fail_as_its_own_error_naming_its_own_keys():
    """DSpark raises DsparkConfigError, a ValueError (the command line prints it in one line), never DFlash's
    error, and names dspark.* keys also for the rules its DFlash backbone applies."""
    target = Qwen3Config(vocab_size=V, hidden_size=H, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, head_dim=16)
    cases = [(lambda: tiny_config(block_size=1), "dspark.block_size 1: a block needs the anchor"),
             (lambda: tiny_config(markov_head="rnn"), "dspark.markov_head 'rnn'"),
             (lambda: DsparkDrafterConfig.from_dict({**tiny_config().to_dict(), "mask_token_id": V}),
              f"dspark.mask_token_id {V}: outside the target vocabulary"),
             (lambda: DsparkDrafterConfig.from_target(target, num_features=7, mask_token_id=7),
              "dspark.num_target_layers=7 distinct layers do not exist"),
             (lambda: DsparkDrafterConfig.from_dict({**tiny_config().to_dict(), "method": "dflash"}),
              "DSpark config: method 'dflash'")]
    for make, message in cases:
        with pytest.raises(DsparkConfigError, match=message) as err:
            make()
        assert isinstance(err.value, ValueError) and not isinstance(err.value, DflashConfigError)


# ---- end to end ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dspark_is_lossless_with_a_drafter_that_accepts(fixture_prompts, accepting_drafter):
    """Whole blocks accepted, blocks cut short and blocks rejected, and the output is plain greedy decoding's; the
    confidence cut keeps it lossless and drafts no more than the plain proposal."""
    from conftest import generate_lossless

    target, _, prompts, answers, eos = fixture_prompts
    k = 4  # the whole block (tests/conftest.py trains block 4)
    spec = {"method": "dspark", "model": str(accepting_drafter("dspark")), "num_speculative_tokens": k}
    plain = generate_lossless(target, build_proposer(parse_spec_config(spec, "cpu"), target), k, prompts, answers,
                              eos)
    assert plain.num_accepted_tokens >= 25
    assert plain.num_accepted_tokens_per_pos[k - 1] > 0  # some whole blocks accepted
    cut = generate_lossless(target, build_proposer(parse_spec_config({**spec, "confidence_threshold": 0.5}, "cpu"),
                                                   target), k, prompts, answers, eos)
    assert cut.num_draft_tokens < plain.num_draft_tokens
