"""EAGLE-1/2 (method eagle): the drafter's forward against a plain per-position loop (concat order, residual, no
input or final norm, RoPE positions), the loss against the EAGLE reference's formula, runtime drafts = the training
forward's argmax over its own outputs, the reference and speculators layouts read back and run, the export contract,
the recipe's rules, and lossless decoding, greedy with a drafter that accepts and sampled against the target's exact
distribution."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.config import RecipeError, recipe_from_dict
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.checkpoint import ExportError, save_safetensors_atomic, write_json_atomic
from draftsmith.models.eagle.config import EagleConfig
from draftsmith.models.eagle.export import check_native_eagle, export_native_eagle, native_config
from draftsmith.models.eagle.io import load_drafter, read_drafter_folder
from draftsmith.models.eagle.loss import eagle_loss
from draftsmith.models.eagle.model import EagleDrafter
from draftsmith.models.eagle.proposer import EagleProposer
from draftsmith.models.eagle.spec import is_eagle_layout
from draftsmith.models.importer import CheckpointImportError, detect_format, import_checkpoint
from draftsmith.models.registry import detect_layout
from draftsmith.models.target import TargetModel

V, H, HEADS, KV, INTER = 256, 64, 4, 2, 128


def tiny_target(seed=0) -> TargetModel:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=4, num_attention_heads=HEADS,
                         num_key_value_heads=KV, intermediate_size=INTER, max_position_embeddings=512)
    return TargetModel(LlamaForCausalLM(config).eval())


def tiny_drafter(target: TargetModel, fc_bias=True, seed=1, std=0.2) -> EagleDrafter:
    """An eval-mode drafter with weights large enough that its argmaxes vary, sharing the target's norm and head."""
    torch.manual_seed(seed)
    drafter = EagleDrafter(EagleConfig.from_target(target.config, fc_bias=fc_bias, target_name_or_path="org/target"))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)
    drafter.share_target(target.final_norm, target.lm_head)
    return drafter.eval()


# ---- the forward, against a plain loop --------------------------------------------------------------------------
def _rms_norm(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean() + eps)


def _rotate(x, position, head_dim, theta):
    """RoPE of one head vector at `position`, written out: pairs (i, i + hd/2) turned by position * theta^(-2i/hd)."""
    half = head_dim // 2
    angle = position * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
    a, b = x[:half], x[half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin])


def plain_forward(drafter: EagleDrafter, hidden, token_ids, embed):
    """The EAGLE reference's forward (cnets1.py Model.forward with layer index 0) position by position: hidden (S, H)
    h_t, token_ids (S,) x_t, embed (V, H). Position t reads cat(embed(x_{t+1}), h_t) (zeros past the end)."""
    cfg, layer = drafter.config, drafter.layer
    attn, hd = layer.self_attn, cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    keys, values, outs = [], [], []
    for t in range(hidden.shape[0]):
        e = embed[token_ids[t + 1]] if t + 1 < len(token_ids) else torch.zeros(H)
        x = drafter.fc.weight @ torch.cat([e, hidden[t]]) + (drafter.fc.bias if drafter.fc.bias is not None else 0)
        q = (attn.q_proj.weight @ x).view(HEADS, hd)
        k = (attn.k_proj.weight @ x).view(KV, hd)
        keys.append(torch.stack([_rotate(k[j], t, hd, theta) for j in range(KV)]))
        values.append((attn.v_proj.weight @ x).view(KV, hd))
        heads = []
        for h in range(HEADS):
            g = h // (HEADS // KV)  # grouped query attention: query head h reads kv head g
            qh = _rotate(q[h], t, hd, theta)
            scores = torch.stack([qh @ keys[j][g] for j in range(t + 1)]) / math.sqrt(hd)  # causal: keys 0..t
            heads.append(sum(p * values[j][g] for j, p in enumerate(torch.softmax(scores, 0))))
        a = x + attn.o_proj.weight @ torch.cat(heads)  # residual: fc's output, no input norm
        n = _rms_norm(a, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        mlp = layer.mlp.down_proj.weight @ (F.silu(layer.mlp.gate_proj.weight @ n) * (layer.mlp.up_proj.weight @ n))
        outs.append(a + mlp)  # no final norm
    return torch.stack(outs)


def test_forward_matches_the_reference_loop_position_by_position():
    target = tiny_target()
    drafter = tiny_drafter(target)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 9, H, generator=g)
    ids = torch.randint(0, V, (2, 9), generator=g)
    embed = target.embed_tokens.weight
    with torch.no_grad():
        out = drafter(hidden, embed[ids])
        for b in range(2):
            torch.testing.assert_close(out[b], plain_forward(drafter, hidden[b], ids[b], embed), rtol=1e-4,
                                       atol=1e-4)


def test_fc_reads_the_embedding_first_then_the_hidden_state():
    """vLLM's llama_eagle.py and the reference: fc(cat(embeds, hidden)). With fc's hidden half zeroed, the output
    depends on the tokens only; with the embedding half zeroed, on the hidden states only."""
    target = tiny_target()
    drafter = tiny_drafter(target, fc_bias=False)
    g = torch.Generator().manual_seed(3)
    hidden, other_hidden = torch.randn(2, 1, 6, H, generator=g)
    ids = torch.randint(0, V, (1, 6), generator=g)
    other_ids = (ids + 1) % V
    embed = target.embed_tokens
    with torch.no_grad():
        weight = drafter.fc.weight.clone()
        drafter.fc.weight[:, H:] = 0
        assert torch.equal(drafter(hidden, embed(ids)), drafter(other_hidden, embed(ids)))
        assert not torch.allclose(drafter(hidden, embed(ids)), drafter(hidden, embed(other_ids)))
        drafter.fc.weight.copy_(weight)
        drafter.fc.weight[:, :H] = 0
        assert torch.equal(drafter(hidden, embed(ids)), drafter(hidden, embed(other_ids)))
        assert not torch.allclose(drafter(hidden, embed(ids)), drafter(other_hidden, embed(ids)))


# ---- the loss, against the reference's formula --------------------------------------------------------------------
def reference_loss(out, last_hidden, loss_mask, head_weight, v_w=1.0, p_w=0.1):
    """SafeAILab/EAGLE eagle/train/main.py compute_loss: the target is h shifted by one (its dataset's `target`),
    vloss = sum(mean(mask * SmoothL1)) / mask.sum(), ploss = -sum(mask * sum(p * log q)) / mask.sum(); the mask
    is draftsmith's (x_{t+2} an answer token)."""
    target = torch.cat([last_hidden[:, 1:], torch.zeros_like(last_hidden[:, :1])], dim=1)
    mask = torch.cat([loss_mask[:, 2:], torch.zeros_like(loss_mask[:, :2])], dim=1)[..., None].float()
    target_p = torch.softmax(target @ head_weight.T, dim=2)
    out_logp = torch.log_softmax(out @ head_weight.T, dim=2)
    ploss = -torch.sum(torch.sum(mask * target_p * out_logp, 2)) / mask.sum()
    vloss = torch.sum(torch.mean(mask * torch.nn.SmoothL1Loss(reduction="none")(out, target), 2)) / mask.sum()
    return v_w * vloss + p_w * ploss, vloss, ploss


@pytest.mark.parametrize("loss_grad", ["in_forward", "recompute"])
@pytest.mark.parametrize("weights", [(1.0, 0.1), (1.0, 0.0), (0.0, 1.0)])
def test_loss_and_gradient_match_the_reference(loss_grad, weights):
    g = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    head.requires_grad_(False)
    out = (torch.randn(2, 7, H, generator=g) * 2).requires_grad_()  # |x| > 1 somewhere: both smooth-L1 branches
    last = torch.randn(2, 7, H, generator=g)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1, 1]])
    loss, metrics = eagle_loss(out, last, loss_mask, head, regression_weight=weights[0], ce_weight=weights[1],
                               chunk_size=3, loss_grad=loss_grad)
    loss.backward()
    got = out.grad.clone()
    out.grad = None
    want, vloss, ploss = reference_loss(out, last, loss_mask, head.weight, *weights)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, out.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(metrics["regression_loss"], vloss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["ce_loss"], ploss.detach(), rtol=1e-5, atol=1e-6)
    assert metrics["count_0"] == 4 + 5  # x_{t+2} an answer token: row 0 at t = 0, 1, 2, 4 (x_5 is not), row 1 t = 0..4
    assert torch.equal(got[0, 3], torch.zeros(H))  # an invalid position gets no gradient


# ---- runtime drafts = the training forward ------------------------------------------------------------------------
def test_runtime_drafts_are_the_training_forwards_argmax_over_its_own_outputs():
    """The runtime drafts k tokens with a KV cache, feeding each output back as the next step's hidden. The training
    forward (one causal pass) given the same sequence, the target's normed states followed by the drafter's own
    outputs, gives the same argmaxes: pairing, positions, the target's final norm (`fuse`) and head all agree."""
    k = 4
    target = tiny_target()
    drafter = tiny_drafter(target)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, V, (1, 7), generator=g)
    captured = torch.randn(1, 6, H, generator=g) * 3  # the last layer's output at positions 0..5, before the norm
    proposer = EagleProposer(drafter, target.embed_tokens, target.num_layers)
    assert proposer.aux_layer_ids == (target.num_layers,)
    proposer.begin(prompt)
    proposer.extend(prompt[:, 1:], captured)  # pairs (x_{t+1}, h_t), t = 0..5
    drafts = proposer.propose(k)
    assert drafts.lengths.tolist() == [k]

    hidden = target.final_norm(captured)[0]  # h_0..h_5, as the target's head reads them
    tokens = prompt[0].tolist()  # x_0..x_6
    with torch.no_grad():
        for i in range(k):
            padded = torch.cat([hidden, torch.zeros(1, H)])  # the last position's pair has no next token
            out = drafter(padded[None], target.embed_tokens(torch.tensor([tokens])))[0]
            o = out[hidden.shape[0] - 1]  # the pair (x_last, h or o before it): predicts the next token
            token = int(target.lm_head(o).argmax())
            assert token == int(drafts.token_ids[0, i]), f"draft {i}"
            hidden = torch.cat([hidden, o[None]])
            tokens.append(token)

    # EAGLE-2's dynamic tree of top_k 1 is the same chain
    tree = EagleProposer(drafter, target.embed_tokens, target.num_layers, dynamic_tree={"depth": k, "top_k": 1},
                         num_nodes=k)
    tree.begin(prompt)
    tree.extend(prompt[:, 1:], captured)
    proposal = tree.propose(k)
    assert proposal.token_ids.tolist() == drafts.token_ids.tolist()
    assert proposal.parents.tolist() == [[-1, 0, 1, 2]]


def test_the_drafter_needs_the_targets_head_and_norm():
    drafter = EagleDrafter(EagleConfig.from_target(tiny_target().config))
    with pytest.raises(RuntimeError, match="share_target"):
        drafter.logits(torch.zeros(1, 1, H))
    saved = [k for k in drafter.state_dict() if not k.startswith("rotary_emb.")]
    assert all(k.startswith(("fc.", "layers.0.")) for k in saved)  # the target's norm and head: never owned nor saved


# ---- published layouts: the reference's, speculators' ------------------------------------------------------------
def reference_config(bias):
    """A config.json as the reference ships it (eagle/train/EAGLE-LLaMA3-Instruct-8B.json), at tiny sizes; the
    Vicuna-era configs have no "bias" key (bias=None here)."""
    config = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": H, "initializer_range": 0.02, "intermediate_size": INTER, "max_position_embeddings": 128,
              "model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1,
              "pad_token_id": 0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "float16",
              "transformers_version": "4.28.1", "use_cache": True, "vocab_size": V, "rope_theta": 10000.0}
    return config if bias is None else {**config, "bias": bias}


def published(folder, target_dir, drafter, layout):
    """`drafter` written as a published folder: the reference's names (fc.*, layers.0.*, plus the embedding it
    saves) or speculators' (fusion_fc.*, transformer.*)."""
    target = TargetModel.from_pretrained(target_dir, dtype="float32", device="cpu")
    tensors = {k: v.clone() for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    bias = drafter.config.fc_bias
    if layout == "speculators":
        tensors = {k.replace("fc.", "fusion_fc.", 1) if k.startswith("fc.") else k.replace("layers.0.", "transformer.")
                   : v for k, v in tensors.items()}
        layer = {k: v for k, v in reference_config(None).items() if k not in ("architectures", "torch_dtype")}
        config = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
                  "speculators_version": "0.1.0", "transformer_layer_architecture": "LlamaDecoderLayer",
                  "transformer_layer_config": layer, "layernorms": False, "fusion_bias": bias,
                  "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                         "verifier": {"name_or_path": str(target_dir),
                                                      "architectures": ["LlamaForCausalLM"]}}}
    else:
        config = reference_config(None if layout == "vicuna" else bias)
    folder.mkdir()
    save_safetensors_atomic(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    tiny_target().model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("layout, bias", [("llama3", False), ("vicuna", True), ("speculators", False),
                                          ("speculators", True)])
def test_published_layouts_import_run_and_are_lossless(tmp_path, target_dir, layout, bias):
    target = TargetModel.from_pretrained(target_dir, dtype="float32", device="cpu")
    drafter = tiny_drafter(target, fc_bias=bias)
    folder = published(tmp_path / layout, target_dir, drafter, layout)
    assert is_eagle_layout(json.loads((folder / "config.json").read_text()))
    result = import_checkpoint(folder, tmp_path / "imported", target=str(target_dir))
    assert result.format == "native-eagle"
    assert not any("differs" in note for note in result.notes)  # the embedding it ships is the target's
    loaded = load_drafter(tmp_path / "imported")
    assert loaded.config.fc_bias is bias and loaded.config.num_target_layers == 4
    assert loaded.config.max_position_embeddings == 512  # raised to the target's, as vLLM does
    for name, t in drafter.state_dict().items():
        if not name.startswith("rotary_emb."):
            assert torch.equal(loaded.state_dict()[name], t), name
    # the runtime reads the published folder itself, and decodes losslessly with it
    prompt = torch.tensor([[1, 5, 9, 13, 17]])
    plain = SpeculativeGenerator(target, None, 0).generate(prompt, 10).token_ids
    spec = parse_spec_config({"method": "eagle", "model": str(folder), "num_speculative_tokens": 3}, "cpu")
    proposer = build_proposer(spec, target)
    assert torch.equal(proposer.drafter.fc.weight, drafter.fc.weight)
    result = SpeculativeGenerator(target, proposer, 3).generate(prompt, 10)
    assert result.token_ids == plain and result.metrics.num_drafts > 0


def test_what_draftsmith_cannot_run_is_refused_by_name(tmp_path, target_dir):
    target = TargetModel.from_pretrained(target_dir, dtype="float32", device="cpu")
    folder = published(tmp_path / "norms", target_dir, tiny_drafter(target, fc_bias=False), "speculators")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "layernorms": True}))
    with pytest.raises(CheckpointImportError, match="layernorms true"):
        import_checkpoint(folder, tmp_path / "a")
    folder = published(tmp_path / "two", target_dir, tiny_drafter(target), "llama3")
    (folder / "config.json").write_text(json.dumps({**reference_config(True), "num_hidden_layers": 2}))
    assert detect_format(json.loads((folder / "config.json").read_text())) is None  # not a one-layer drafter
    folder = published(tmp_path / "eagle3", target_dir, tiny_drafter(target), "llama3")
    eagle3 = {**reference_config(False), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32}
    assert detect_layout(eagle3)[0].method == "eagle3"  # EAGLE-3's native config is EAGLE-3's, not ours
    assert not is_eagle_layout({**reference_config(False), "draft_vocab_size": 32})


# ---- export --------------------------------------------------------------------------------------------------------
def checkpoint(folder, drafter):
    folder.mkdir(parents=True)
    save_safetensors_atomic({k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")},
                            folder / "model.safetensors")
    write_json_atomic(drafter.config.to_dict(), folder / "config.json")
    return folder


def test_export_writes_the_reference_layout_and_reads_back_the_same(tmp_path):
    drafter = tiny_drafter(tiny_target(), fc_bias=False)
    result = export_native_eagle(checkpoint(tmp_path / "ckpt", drafter), tmp_path / "out", dtype=None)
    config = json.loads((result.out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["bias"] is False and config["tie_word_embeddings"] is False  # written: missing means true
    assert config["draftsmith"]["method"] == "eagle"
    assert detect_format(config).name == "eagle"
    from safetensors.torch import load_file

    names = set(load_file(str(result.out_dir / "model.safetensors")))
    assert "fc.weight" in names and "fc.bias" not in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n or "input_layernorm" in n for n in names)
    assert '"method":"eagle"' in result.serve_commands["vLLM"] and result.warnings == []
    read, tensors, _ = read_drafter_folder(result.out_dir)
    assert read.to_dict() == drafter.config.to_dict()
    for name, t in tensors.items():
        assert torch.equal(t, drafter.state_dict()[name]), name


def test_export_contract_refuses_what_vllm_would_misread():
    drafter = tiny_drafter(tiny_target(), fc_bias=False)
    config = native_config(drafter.config)
    tensors = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    assert check_native_eagle(config, tensors) == ([], [])
    cases = [
        ({**config, "architectures": ["LlamaForCausalLMEagle3"]}, "architectures"),
        ({k: v for k, v in config.items() if k != "bias"}, "reads a missing key as true"),
        ({**config, "draft_vocab_size": V}, "EAGLE-3 keys"),
        ({**config, "num_hidden_layers": 2}, "num_hidden_layers"),
        ({**config, "hidden_size": 2 * H}, "fc.weight: shape"),
    ]
    for bad, message in cases:
        problems, _ = check_native_eagle(bad, tensors)
        assert any(message in p for p in problems), (message, problems)
    problems, warnings = check_native_eagle({**config, "bias": True}, {**tensors, "fc.bias": torch.zeros(H)})
    assert problems == [] and "vLLM 0.32 builds fc without a bias" in warnings[0]
    problems, _ = check_native_eagle(config, {**tensors, "fc.bias": torch.zeros(H)})
    assert any("unexpected tensors" in p and "fc.bias" in p for p in problems)


def test_export_refuses_another_methods_checkpoint(tmp_path):
    drafter = tiny_drafter(tiny_target())
    folder = checkpoint(tmp_path / "ckpt", drafter)
    (folder / "config.json").write_text(json.dumps({**drafter.config.to_dict(), "method": "mtp"}))
    with pytest.raises(ExportError, match="cannot be exported as native EAGLE"):
        export_native_eagle(folder, tmp_path / "out")


# ---- recipe and speculative config ----------------------------------------------------------------------------------
BASE = {"model": {"target": "t", "method": "eagle"}, "data": {"path": "x.jsonl"}, "output_dir": "out"}


def test_recipe_section_defaults_are_the_references_and_bad_keys_are_one_line():
    section = recipe_from_dict(BASE).eagle
    assert (section.fc_bias, section.regression_weight, section.ce_weight, section.hidden_noise) == (False, 1.0, 0.1,
                                                                                                     0.0)
    for patch, message in (({"model": {"target": "t", "method": "eagle", "aux_layer_ids": [3]}},
                            "model.aux_layer_ids .3.: EAGLE-1 reads only"),
                           ({"eagle": {"regression_weight": 0, "ce_weight": 0}}, "both 0"),
                           ({"eagle": {"fc_bais": True}}, "fc_bias"),
                           ({"training": {"loss": "lk"}}, "training.loss lk")):
        with pytest.raises(RecipeError, match=message) as err:
            recipe_from_dict({**BASE, **patch})
        assert "\n" not in str(err.value)


def test_the_speculative_config_takes_eagle_with_trees_and_sampled_drafts():
    spec = parse_spec_config({"method": "eagle", "model": "m", "num_speculative_tokens": 6,
                              "dynamic_tree": {"depth": 3, "top_k": 2}}, "cpu")
    assert spec.method == "eagle" and spec.dynamic_tree == {"depth": 3, "top_k": 2}
    assert parse_spec_config({"method": "eagle", "model": "m", "num_speculative_tokens": 3,
                              "draft_sample_method": "probabilistic"}, "cpu").draft_sample_method == "probabilistic"


@pytest.mark.parametrize("options", [
    {"speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]", "num_speculative_tokens": 5},
    {"dynamic_tree": {"depth": 3, "top_k": 2}, "num_speculative_tokens": 5},
    {"suffix_hybrid": {"min_score": 1.0}, "num_speculative_tokens": 3},
    {"draft_sample_method": "probabilistic", "num_speculative_tokens": 3},
], ids=["static tree", "dynamic tree", "suffix hybrid", "sampled chain"])
def test_every_runtime_form_of_eagle3_serves_eagle_losslessly(tmp_path, options):
    """The forms the runtime shares with EAGLE-3 take an EAGLE-1 drafter from its checkpoint and keep greedy output
    (a sampled chain too: at temperature 0 its drafts count as the target's argmax's)."""
    target = tiny_target()
    folder = checkpoint(tmp_path / "ckpt", tiny_drafter(target, std=0.05))
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]])  # repeats: the suffix half has matches
    plain = SpeculativeGenerator(target, None, 0).generate(prompt, 16).token_ids
    spec = parse_spec_config({"method": "eagle", "model": str(folder), **options}, "cpu")
    result = SpeculativeGenerator(target, build_proposer(spec, target), spec.num_speculative_tokens).generate(prompt,
                                                                                                              16)
    assert result.token_ids == plain and result.metrics.num_drafts > 0


# ---- lossless -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
def test_eagle_is_lossless_with_a_drafter_that_accepts(fixture_prompts, accepting_drafter, k):
    """Greedy chains and EAGLE-2's dynamic tree equal plain decoding with a drafter that accepts, so accepted,
    partly accepted and rejected drafts all ran."""
    from conftest import generate_lossless

    target, _, prompts, answers, eos = fixture_prompts
    spec = {"method": "eagle", "model": str(accepting_drafter("eagle")), "num_speculative_tokens": k}
    chain = generate_lossless(target, build_proposer(parse_spec_config(spec, "cpu"), target), k, prompts, answers,
                              eos)
    print(f"k={k}: {chain.num_accepted_tokens} of {chain.num_draft_tokens} drafts accepted, per position "
          f"{chain.num_accepted_tokens_per_pos}")
    assert chain.num_accepted_tokens >= 8 * k
    assert chain.num_accepted_tokens < chain.num_draft_tokens  # and rejected ones: rollback ran
    if k > 1:
        assert 0 < chain.num_accepted_tokens_per_pos[-1] < chain.num_accepted_tokens_per_pos[0]
        tree = parse_spec_config({**spec, "num_speculative_tokens": 6, "dynamic_tree": {"depth": k, "top_k": 2}},
                                 "cpu")
        m = generate_lossless(target, build_proposer(tree, target), tree.num_speculative_tokens, prompts, answers,
                              eos)  # a tree's k counts its nodes, as vLLM's
        print(f"dynamic tree: {m.num_accepted_tokens} accepted in {m.num_drafts} steps")
        assert m.num_accepted_tokens > chain.num_accepted_tokens // 2


def test_sampled_drafts_keep_the_targets_distribution():
    """Speculative sampling with an EAGLE drafter's sampled drafts (draft_sample_method probabilistic) draws
    sequences from the target's exact distribution (test_sampling.py's chi-square check), and drafts are accepted."""
    from test_sampling import SamplingParams, chi_square, exact_distribution, sample_sequences
    from test_sampling import tiny_target as tiny_sampling_target

    target = tiny_sampling_target()
    drafter = EagleDrafter(EagleConfig.from_target(target.config))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    drafter.share_target(target.final_norm, target.lm_head)
    proposer = EagleProposer(drafter.eval(), target.embed_tokens, target.num_layers,
                             draft_sample_method="probabilistic")
    params = SamplingParams(temperature=1.0, seed=21)
    samples, results = sample_sequences(target, proposer, 2, params, 4)
    stat, critical = chi_square(samples, exact_distribution(target, [1, 2, 3], 4, params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"
    accepted = sum(r.metrics.num_accepted_tokens for r in results)
    assert 0 < accepted < sum(r.metrics.num_draft_tokens for r in results)


def test_a_published_config_whose_sizes_cannot_build_a_layer_is_one_line(tmp_path):
    """Issue 47 item 14: hidden_size not a multiple of num_attention_heads was transformers' 48-line validation
    traceback at import; now one line naming the config file and the keys."""
    import json as json_mod

    from draftsmith.cli import main

    folder = tmp_path / "eagle"
    folder.mkdir()
    (folder / "config.json").write_text(json_mod.dumps({
        "architectures": ["LlamaForCausalLMEagle"], "hidden_size": 66, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(66, 132)}, str(folder / "model.safetensors"))
    from draftsmith.models.importer import CheckpointImportError, import_checkpoint

    with pytest.raises(CheckpointImportError, match=r"config.json: EAGLE config: hidden_size 66 is not a multiple "
                                                    r"of num_attention_heads 4"):
        import_checkpoint(folder, tmp_path / "out")
    assert main(["import", str(folder), "--out", str(tmp_path / "out")]) == 2
