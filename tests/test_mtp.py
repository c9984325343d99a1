"""MTP drafter: depth alignment, training/runtime parity, lossless runtime, end-to-end training, native layouts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.config import RecipeError, load_recipe, recipe_from_dict
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.checkpoint import ExportError, save_safetensors_atomic, write_json_atomic
from draftsmith.models.losses import shift_left
from draftsmith.models.mtp.config import MtpDrafterConfig
from draftsmith.models.mtp.export import export_mtp
from draftsmith.models.mtp.io import load_mtp_drafter, read_mtp_folder
from draftsmith.models.mtp.loss import mtp_loss
from draftsmith.models.mtp.model import MtpDrafter
from draftsmith.models.mtp.native import find_native_mtp
from draftsmith.models.mtp.proposer import MtpProposer
from draftsmith.models.mtp.training import MtpMethod
from draftsmith.models.target import TargetModel

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
L = 3  # decoder layers of the tiny native targets (their MTP layer is index L)


@pytest.fixture
def tiny_target(tiny_llama):
    """A tiny Llama whose final norm is not the identity, so a drafter fed the pre-norm state shows."""
    model, config = tiny_llama()
    with torch.no_grad():
        model.model.norm.weight.add_(0.3 * torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(1)))
    return TargetModel(model.float().eval())


def random_drafter(target, num_modules=1, recursive=True, num_depths=3, seed=0, **kw) -> MtpDrafter:
    config = dataclasses.replace(MtpDrafterConfig.from_target(target.config, num_modules=num_modules,
                                                              recursive=recursive, num_depths=num_depths), **kw)
    torch.manual_seed(seed)
    drafter = MtpDrafter(config)
    with torch.no_grad():  # norms away from 1 so that a swapped norm shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return drafter.eval()


def proposer_for(target, drafter: MtpDrafter, k: int) -> MtpProposer:
    return MtpProposer(drafter, target.embed_tokens, target.final_norm, target.lm_head, k)


def save_checkpoint(drafter: MtpDrafter, folder: Path) -> Path:
    tensors = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    save_safetensors_atomic(tensors, folder / "model.safetensors")
    write_json_atomic(drafter.config.to_dict(), folder / "config.json")
    return folder


# ---- alignment -----------------------------------------------------------------------------------------------
def test_loss_teacher_for_depth_d_at_i_is_the_target_at_i_plus_d():
    """A drafter that outputs the target's own normed state at i+d is perfect; one position off is not."""
    torch.manual_seed(0)
    b, s, h, v = 2, 10, 8, 32
    head = torch.nn.Linear(h, v, bias=False)
    last = torch.randn(b, s, h)
    mask = torch.ones(b, s, dtype=torch.long)
    perfect = [shift_left(last, d) for d in (1, 2, 3)]
    _, metrics = mtp_loss(perfect, last, mask, head)
    for i in range(3):
        assert metrics[f"acc_{i}"] == 1.0
        assert metrics[f"count_{i}"] == b * (s - 2 - i)  # depth i+1 at position p predicts t_{p+2+i}
    # per row: 6 positions with all 3 depths inside the sequence, then 1 with 2, then 1 with 1
    assert metrics["sim_accept_len"] == pytest.approx(1 + (6 * 3 + 2 + 1) / 8)
    _, off = mtp_loss([shift_left(last, d + 1) for d in (1, 2, 3)], last, mask, head)
    assert all(off[f"acc_{i}"] < 0.5 for i in range(3)) and off["sim_accept_len"] < 1.5


def test_loss_mask_selects_predicted_assistant_tokens():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 16, bias=False)
    last = torch.randn(1, 8, 8)
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 0, 0]])
    _, metrics = mtp_loss([torch.randn(1, 8, 8, requires_grad=True) for _ in range(2)], last, mask, head)
    # depth 1 at position i predicts t_{i+2}: i = 2, 3; depth 2 predicts t_{i+3}: i = 1, 2
    assert metrics["count_0"] == 2 and metrics["count_1"] == 2
    hidden = torch.randn(1, 8, 8, requires_grad=True)  # no position predicts an assistant token: still differentiable
    loss, metrics = mtp_loss([hidden], last, torch.tensor([[0, 1, 0, 0, 0, 0, 0, 0]]), head)
    loss.backward()
    assert metrics["count_0"] == 0 and loss == 0 and hidden.grad is not None


def test_training_forward_equals_cached_runtime_steps(tiny_target):
    """One causal pass per depth (training) == the runtime's KV-cached step fed one position at a time."""
    drafter = random_drafter(tiny_target, num_modules=2, num_depths=3, mask_position_0=True)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(3))
    h0 = tiny_target.capture(ids, aux_layer_ids=[tiny_target.num_layers]).last_hidden
    embeds = tiny_target.embed_tokens(ids)
    with torch.no_grad():
        trained = drafter(embeds, h0, 3)
        hidden = h0
        for depth in (1, 2, 3):
            cache = drafter.new_cache(1, 32, torch.float32, "cpu")
            e = shift_left(embeds, depth)  # embed(t_{i+d})
            steps = torch.cat([drafter.step(depth, e[:, i:i + 1], hidden[:, i:i + 1], cache) for i in range(11)], 1)
            torch.testing.assert_close(steps, trained[depth - 1], atol=1e-5, rtol=1e-5)
            hidden = steps  # normed h^d, what depth d+1 reads
    assert not torch.allclose(trained[0], trained[1])  # depth 2 runs the second module on other inputs


def reference_drafts(target, drafter, context: torch.Tensor, drafts: list[int]) -> list[int]:
    """The slow reference: the training forward over context ++ drafts, read at the last committed position."""
    p = context.shape[1] - 1  # position p-1 is the last with a target feature
    seq = torch.cat([context, torch.tensor([drafts[:-1]], dtype=torch.long)], dim=1)
    h0 = target.capture(seq, aux_layer_ids=[target.num_layers]).last_hidden
    with torch.no_grad():
        outs = drafter(target.embed_tokens(seq), h0, len(drafts))
    return [int(target.lm_head(out[:, p - 1]).argmax()) for out in outs]


def test_every_proposal_equals_the_training_forward(tiny_target):
    """Through a whole generation (rejections, cache rollbacks), each chain equals the slow reference."""
    drafter = random_drafter(tiny_target, num_modules=2, num_depths=3)
    proposer = proposer_for(tiny_target, drafter, 3)
    checked = []
    real_propose = proposer.propose

    def checked_propose(num_tokens):
        proposal = real_propose(num_tokens)
        drafts = proposal.token_ids[0].tolist()
        assert drafts == reference_drafts(tiny_target, drafter, proposer.rows[0].tokens, drafts)
        checked.append(len(drafts))
        return proposal

    proposer.propose = checked_propose
    prompt = torch.randint(0, 256, (1, 2), generator=torch.Generator().manual_seed(4))  # short: depths > context
    plain = SpeculativeGenerator(tiny_target, None, 0).generate(prompt, 14).token_ids
    result = SpeculativeGenerator(tiny_target, proposer, 3).generate(prompt, 14)
    assert result.token_ids == plain
    assert len(checked) >= 4 and 3 in checked


def test_batch_rows_draft_as_they_would_alone(tiny_target):
    """Rows of different lengths commit different counts; each keeps its own chain state."""
    drafter = random_drafter(tiny_target, num_modules=1, num_depths=2)
    proposer = proposer_for(tiny_target, drafter, 2)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (3, 7)]
    batch = SpeculativeGenerator(tiny_target, proposer, 2).generate_batch(prompts, 10)
    for prompt, result in zip(prompts, batch):
        alone = SpeculativeGenerator(tiny_target, proposer, 2).generate(prompt[None], 10)
        assert result.token_ids == alone.token_ids
        assert result.token_ids == SpeculativeGenerator(tiny_target, None, 0).generate(prompt[None], 10).token_ids
        assert result.metrics.num_draft_tokens == alone.metrics.num_draft_tokens


def oracle_target_and_drafter(tiny_llama, noise: float = 0.05):
    """A one-layer target and an MTP drafter built from its own weights, so that it mostly agrees with it.

    The target's embedding rows have unit RMS, so enorm(embed) = embed; eh_proj passes the embedding half through
    and drops the hidden half; the block is the target's layer and shared_head.norm its final norm. Depth d at
    position i then runs the target's own forward for position i+d, only without the first d tokens of the
    context (attention sharpened x3 so that they matter). That, and `noise` on the block's matrices, makes steps
    accept all, some or none of their drafts.
    """
    model, config = tiny_llama(num_hidden_layers=1)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())  # (V, H) unit RMS rows
        attn = model.model.layers[0].self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.o_proj):
            proj.weight.mul_(3.0)
    target = TargetModel(model.float().eval())
    drafter = MtpDrafter(MtpDrafterConfig.from_target(target.config, num_depths=3))
    h = config.hidden_size
    layer = drafter.layers[0]
    with torch.no_grad():
        layer.block.load_state_dict(target.layers[0].state_dict())
        layer.enorm.weight.fill_(1.0)
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))  # (H, 2H) embedding half
        layer.shared_head["norm"].weight.copy_(target.final_norm.weight)
        g = torch.Generator().manual_seed(9)
        for p in layer.block.parameters():
            if p.dim() == 2:
                p.add_(noise * torch.randn(p.shape, generator=g))
    return target, drafter.eval()


def test_batch_rows_that_accept_differently_and_finish_at_different_steps(tiny_llama):
    """Rows of a batch accept different counts and finish at different steps (one by EOS, two by max_new_tokens at
    different steps); the finished rows ride along, asked for drafts they do not get. Every row equals itself alone
    and plain greedy decoding, and every row accepted some drafts and had some rejected (so the acceptance and the
    rollback paths both ran)."""
    target, drafter = oracle_target_and_drafter(tiny_llama)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (3, 7, 9)]
    max_new = 20
    plain = SpeculativeGenerator(target, None, 0)
    eos = {plain.generate(prompts[0][None], max_new).token_ids[3]}  # row 0 ends at its 4th token
    expected = [plain.generate(prompt[None], max_new, eos).token_ids for prompt in prompts]
    assert [len(e) for e in expected] == [4, max_new, max_new]  # the other rows never emit it
    generator = SpeculativeGenerator(target, proposer_for(target, drafter, 3), 3)
    batch = generator.generate_batch(prompts, max_new, eos)
    for prompt, result, reference in zip(prompts, batch, expected):
        alone = generator.generate(prompt[None], max_new, eos)
        assert result.token_ids == alone.token_ids == reference
        assert result.metrics.to_dict() == alone.metrics.to_dict()
    assert len({r.num_target_steps for r in batch}) == 3  # three rows, three different last steps
    accepted = [r.metrics.num_accepted_tokens for r in batch]
    assert len(set(accepted)) == 3 and sum(accepted) >= 15, accepted
    for r in batch:  # accepted some, rejected some
        assert 0 < r.metrics.num_accepted_tokens < r.metrics.num_draft_tokens, r.metrics.to_dict()


def test_mtp_reads_the_final_normed_hidden_state_in_training_and_at_runtime(tiny_target, tmp_path):
    """Depth 1 reads h^0 = the target's last hidden state after its final norm: what the target's base-model forward
    returns (transformers' last_hidden_state; vLLM's deepseek_v2, glm4_moe and qwen3_next forwards end in
    self.norm), the state vLLM and SGLang hand MTP. Training (MtpMethod.loss) and the runtime (MtpProposer) both feed
    exactly that, never the pre-norm stream (capture id L); depth d+1 reads depth d's normed output, what lm_head
    reads."""
    tiny_target.model.save_pretrained(tmp_path / "target")
    recipe = recipe_from_dict({"model": {"target": str(tmp_path / "target"), "method": "mtp"},
                               "data": {"path": "unused.jsonl"}, "output_dir": str(tmp_path / "run"),
                               "mtp": {"num_depths": 2}})
    method = MtpMethod(recipe, tiny_target)
    drafter = random_drafter(tiny_target, num_depths=2)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        returned = tiny_target.model.model(input_ids=ids).last_hidden_state  # (B, S, H) what the engines pass
    pre_norm = tiny_target.capture(ids, aux_layer_ids=[tiny_target.num_layers]).aux_hidden
    assert not torch.allclose(returned, pre_norm, atol=1e-2)

    seen = []  # hidden input of each fuse call, in order
    layer = drafter.layers[0]
    layer.fuse = lambda embeds, hidden, fuse=layer.fuse: seen.append(hidden.detach().clone()) or fuse(embeds, hidden)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        method.loss(drafter, batch, method.target.capture)
        torch.testing.assert_close(seen[0], returned)  # training, depth 1
        depth_1 = drafter(tiny_target.embed_tokens(ids), returned, 2)[0]  # (B, S, H) what lm_head reads
    torch.testing.assert_close(seen[1], depth_1)  # training, depth 2

    steps = []  # (depth, hidden) of every runtime step
    step = drafter.step
    drafter.step = lambda depth, embeds, hidden, cache: steps.append((depth, hidden.clone())) or step(
        depth, embeds, hidden, cache)
    prompt = ids[:1, :5]
    result = SpeculativeGenerator(tiny_target, proposer_for(tiny_target, drafter, 2), 2).generate(prompt, 8)
    fed = torch.cat([hidden for depth, hidden in steps if depth == 1], dim=1)  # (1, P, H) positions 0..P-1 in order
    sequence = torch.cat([prompt, torch.tensor([result.token_ids])], dim=1)
    with torch.no_grad():
        returned = tiny_target.model.model(input_ids=sequence).last_hidden_state
    assert fed.shape[1] >= prompt.shape[1] + 4
    torch.testing.assert_close(fed, returned[:, : fed.shape[1]], atol=1e-5, rtol=1e-5)  # runtime, depth 1


def test_sequential_modules_cap_the_draft_length(tiny_target):
    drafter = random_drafter(tiny_target, num_modules=2, recursive=False, num_depths=2)
    with pytest.raises(ValueError, match="num_speculative_tokens <= 2"):
        proposer_for(tiny_target, drafter, 3)
    assert proposer_for(tiny_target, drafter, 2).num_depths == 2


# ---- fixture: lossless runtime, end-to-end training, export ----------------------------------------------------
@pytest.mark.slow
def test_mtp_is_lossless_with_a_drafter_that_accepts(fixture_prompts, accepting_drafter):
    """The fixture target with an MTP drafter that accepts (trained on the target's own answers): accepted,
    partly accepted and rejected chains, and the output is plain greedy decoding's."""
    from conftest import generate_lossless

    target, _, prompts, answers, eos = fixture_prompts
    spec = parse_spec_config({"method": "mtp", "model": str(accepting_drafter("mtp")), "num_speculative_tokens": 3},
                             "cpu")
    proposer = build_proposer(spec, target)
    assert isinstance(proposer, MtpProposer) and proposer.aux_layer_ids == (8,)
    m = generate_lossless(target, proposer, 3, prompts, answers, eos)
    assert m.num_accepted_tokens >= 20 and m.num_accepted_tokens < m.num_draft_tokens
    assert m.num_accepted_tokens_per_pos[-1] > 0  # whole chains were accepted too


def write_conversations(path: Path, n: int = 16) -> Path:
    replies = ["The capital of France is Paris, known for the Eiffel Tower.",
               "Water boils at 100 degrees Celsius at sea level."]
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Question {i}?"},
                                                  {"from": "gpt", "value": replies[i % 2]}]}) + "\n")
    return path


def test_end_to_end_training_checkpoint_export_and_run(fixture_target_dir, tmp_path):
    from draftsmith.train import train

    recipe = recipe_from_dict({
        "model": {"target": str(fixture_target_dir), "method": "mtp", "draft_vocab_size": 256},
        "data": {"path": str(write_conversations(tmp_path / "c.jsonl")), "max_length": 64, "eval_samples": 2,
                 "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 3, "batch_size": 2, "lr": 1e-3, "log_every": 1, "eval_every": 3,
                     "save_every": 3, "mixed_precision": "no", "peak_tflops": 0.5},
        "mtp": {"num_depths": 2},
        "output_dir": str(tmp_path / "run"),
    })
    ckpt = train(recipe, log=lambda *a: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last_train = [r for r in rows if "loss" in r][-1]
    assert {"train/loss_0", "train/loss_1", "train/acc_1", "train/sim_accept_len"} <= set(last_train)
    # model FLOPs (train/flops.mtp_flops_per_token) and MFU on every log row
    assert all(r["tflops_per_s"] > 0 and r["mfu"] == pytest.approx(r["tflops_per_s"] / 0.5)
               for r in rows if "loss" in r)
    final = [r for r in rows if "eval/loss" in r][-1]  # 2.12, acc_0 0.72 when this was written: the replies repeat
    assert final["eval/sim_accept_len"] > 1.5 and final["eval/acc_0"] > 0.4
    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["method"] == "mtp" and saved["num_depths"] == 2 and saved["native_layout"] is None
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert "layers.0.eh_proj.weight" in tensors and not any("embed_tokens" in k or "lm_head" in k for k in tensors)

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    trained = load_mtp_drafter(tmp_path / "run")  # an output_dir means its latest checkpoint
    export = export_mtp(ckpt, tmp_path / "export", dtype=None)
    assert [p.name for p in export.files] == ["config.json", "model.safetensors", "README.md"]
    assert export.warnings and "draftsmith" in export.serve_commands
    exported = load_mtp_drafter(tmp_path / "export")
    for (name, a), b in zip(trained.state_dict().items(), exported.state_dict().values()):
        assert torch.equal(a, b), name
    spec = parse_spec_config({"method": "mtp", "model": str(tmp_path / "export"), "num_speculative_tokens": 2}, "cpu")
    prompt = torch.tensor([[1, 306, 4966, 278]])
    got = SpeculativeGenerator(target, build_proposer(spec, target), 2).generate(prompt, 12)
    assert got.token_ids == SpeculativeGenerator(target, None, 0).generate(prompt, 12).token_ids
    with pytest.raises(ExportError, match="not empty"):
        export_mtp(ckpt, tmp_path / "export")


# ---- native layouts ------------------------------------------------------------------------------------------
def tiny_deepseek_v3(num_layers: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=24, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_group=2, topk_group=1,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval()


def tiny_llama_model(num_layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=num_layers,
                                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)).eval()


def write_native_target(folder: Path, layout: str, family: str):
    """A target with L layers whose checkpoint carries one native MTP module, its block written by transformers
    itself (decoder layer L of an (L+1)-layer model, per-expert tensors and all). Returns that (L+1)-layer model."""
    big = (tiny_deepseek_v3 if family == "deepseek_v3" else tiny_llama_model)(L + 1)
    big.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    h = big.config.hidden_size
    own = {"enorm.weight": 1 + 0.1 * torch.randn(h, generator=g), "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           "eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=g),
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = L
    if layout == "deepseek":
        tensors.update({f"model.layers.{L}.{k}": v for k, v in own.items()})
        tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        config["num_nextn_predict_layers"] = 1
    else:
        block = [k for k in tensors if k.startswith(f"model.layers.{L}.")]
        tensors.update({f"mtp.layers.0.{k[len(f'model.layers.{L}.'):]}": tensors.pop(k) for k in block})
        names = {"enorm.weight": "pre_fc_norm_embedding", "hnorm.weight": "pre_fc_norm_hidden",
                 "eh_proj.weight": "fc", "shared_head.norm.weight": "norm"}
        tensors.update({f"mtp.{names[k]}.weight": v for k, v in own.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return big


def native_mtp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(folder / "model.safetensors")).items()
            if k.startswith(("mtp.", f"model.layers.{L}.")) or (k in ("model.embed_tokens.weight", "lm_head.weight"))}


@pytest.mark.parametrize("layout, family", [("deepseek", "deepseek_v3"), ("deepseek", "llama"),
                                            ("qwen3_next", "llama")])
def test_native_import_and_export_round_trip(tmp_path, layout, family):
    big = write_native_target(tmp_path / "target", layout, family)
    target = TargetModel.from_pretrained(tmp_path / "target", dtype="float32", device="cpu")
    assert target.num_layers == L
    native = find_native_mtp(tmp_path / "target", target.config)
    assert (native.layout, native.num_modules) == (layout, 1)

    recipe = recipe_from_dict({"model": {"target": str(tmp_path / "target"), "method": "mtp"},
                               "data": {"path": "unused.jsonl"}, "output_dir": str(tmp_path / "run"),
                               "mtp": {"num_depths": 2}})
    method = MtpMethod(recipe, target)
    drafter = method.build_drafter(torch.zeros(1), torch.zeros(1))
    assert method.config.native_layout == layout and method.config.mask_position_0 == (layout == "deepseek")
    # the block is exactly transformers' own layer L (fused experts included) ...
    for name, value in big.model.layers[L].state_dict().items():
        assert torch.equal(drafter.layers[0].block.state_dict()[name], value), name
    # ... and training runs through it
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss, metrics = method.loss(drafter, batch, method.target.capture)
    loss.backward()
    assert torch.isfinite(loss) and drafter.layers[0].eh_proj.weight.grad is not None and "acc_1" in metrics

    save_checkpoint(drafter, tmp_path / "ckpt")
    result = export_mtp(tmp_path / "ckpt", tmp_path / "export", dtype=None)
    assert "vLLM" in result.serve_commands and '"method":"mtp"' in result.serve_commands["vLLM"]
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["num_hidden_layers"] == L and config["num_nextn_predict_layers"] == 1
    assert config["model_type"] == target.config.model_type
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    original = native_mtp_tensors(tmp_path / "target")
    if layout == "deepseek":  # vLLM's deepseek_mtp loads embed/head from the MTP layer, not the trunk
        original = {k: v for k, v in original.items() if k.startswith(f"model.layers.{L}.")}
    assert sorted(exported) == sorted(original)
    for name in original:
        assert torch.equal(exported[name], original[name]), name
    assert config["draftsmith"]["hidden_input"] == "final_normed"
    card = (tmp_path / "export" / "README.md").read_text()
    assert "after its final norm" in card and "before the final norm" not in card

    # the export and the target folder itself both load as MTP drafters (vLLM's `model` default: the target)
    for folder in (tmp_path / "export", tmp_path / "target"):
        cfg, tensors = read_mtp_folder(folder)
        assert cfg.native_layout == layout
        reloaded = load_mtp_drafter(folder)
        for name, value in drafter.state_dict().items():
            if not name.startswith("rotary_emb."):
                assert torch.equal(reloaded.state_dict()[name], value), name
    if family == "deepseek_v3":  # MLA blocks train and export, but draftsmith's runtime cannot run them
        with pytest.raises(ValueError, match="runtime runs MTP blocks of"):
            proposer_for(target, reloaded, 1)


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next"])
def test_native_mtp_runs_losslessly_without_a_model_path(tmp_path, layout):
    write_native_target(tmp_path / "target", layout, "llama")
    target = TargetModel.from_pretrained(tmp_path / "target", dtype="float32", device="cpu")
    spec = parse_spec_config({"method": "mtp", "num_speculative_tokens": 3}, "cpu")
    assert spec.model is None
    proposer = build_proposer(spec, target)
    assert proposer.drafter.config.native_layout == layout
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(7))
    got = SpeculativeGenerator(target, proposer, 3).generate(prompt, 16)
    assert got.token_ids == SpeculativeGenerator(target, None, 0).generate(prompt, 16).token_ids


def test_native_init_refuses_a_module_count_mismatch(tmp_path):
    write_native_target(tmp_path / "target", "deepseek", "llama")
    target = TargetModel.from_pretrained(tmp_path / "target", dtype="float32", device="cpu")
    recipe = recipe_from_dict({"model": {"target": str(tmp_path / "target"), "method": "mtp"},
                               "data": {"path": "x.jsonl"}, "output_dir": "o",
                               "mtp": {"num_modules": 2, "num_depths": 2}})
    with pytest.raises(ValueError, match="mtp.num_modules=1"):
        MtpMethod(recipe, target)
    fresh = recipe_from_dict({**recipe.model_dump(), "mtp": {"num_modules": 2, "num_depths": 2,
                                                             "init_from_native": False}})
    assert MtpMethod(fresh, target).config.num_modules == 2


def test_a_target_without_mtp_weights_is_a_clear_error(tmp_path, tiny_target):
    tiny_target.model.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no MTP weights"):
        load_mtp_drafter(tmp_path / "plain")


# ---- recipes and config ------------------------------------------------------------------------------------
def test_mtp_recipes():
    sharegpt = load_recipe(RECIPES / "mtp_sharegpt.yaml")
    assert sharegpt.model.method == "mtp" and sharegpt.model.target == "meta-llama/Llama-3.1-8B-Instruct"
    assert sharegpt.mtp.recursive and sharegpt.mtp.num_modules == 1 and sharegpt.mtp.num_depths >= 2
    native = load_recipe(RECIPES / "mtp_deepseek_native.yaml")
    assert native.model.method == "mtp" and native.mtp.init_from_native


def test_mtp_section_errors_say_the_fix():
    base = {"model": {"target": "t", "method": "mtp"}, "data": {"path": "sharegpt"}, "output_dir": "o"}
    with pytest.raises(RecipeError, match="mtp.recursive=true") as info:
        recipe_from_dict({**base, "mtp": {"recursive": False, "num_modules": 1, "num_depths": 3}})
    assert "\n" not in str(info.value)
    with pytest.raises(RecipeError, match="num_depths >= 2"):
        recipe_from_dict({**base, "mtp": {"num_modules": 2, "num_depths": 1}})
    with pytest.raises(RecipeError, match="unknown key 'mtp.depths'"):
        recipe_from_dict({**base, "mtp": {"depths": 2}})
    assert recipe_from_dict(base, overrides=["mtp.num_depths=5"]).mtp.num_depths == 5


def test_a_broken_mtp_config_names_the_file_and_line(tmp_path):
    from draftsmith.models.mtp.io import MtpLoadError, read_mtp_folder

    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text('{\n  "method": "mtp",\n  "hidden_size": 64,,\n}\n')
    with pytest.raises(MtpLoadError, match=r"config\.json:3: invalid JSON"):
        read_mtp_folder(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(MtpLoadError, match=r"config\.json: expected a JSON object"):
        read_mtp_folder(folder)


def test_a_checkpoint_trained_on_the_pre_norm_state_is_refused(tiny_target, tmp_path):
    """Configs from before MTP read the final-normed state have no hidden_input: loading or exporting one says to
    retrain instead of serving it on inputs it was not trained on."""
    from draftsmith.models.mtp.io import MtpLoadError

    folder = save_checkpoint(random_drafter(tiny_target), tmp_path / "old")
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_input"] == "final_normed"
    del config["hidden_input"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MtpLoadError, match=r"config\.json: .*pre-norm hidden state.*retrain") as info:
        load_mtp_drafter(folder)
    assert "\n" not in str(info.value)
    with pytest.raises(ExportError, match="pre-norm hidden state"):
        export_mtp(folder, tmp_path / "export")

