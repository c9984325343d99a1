"""DFlash: the block mask and loss against slow references, training forward = cached runtime pass, lossless
runtime on the fixture target, end-to-end training, and the `--format dflash` export contract."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config

from draftsmith.config import RecipeError, recipe_from_dict
from draftsmith.models.checkpoint import ExportError, save_safetensors_atomic, write_json_atomic
from draftsmith.models.dflash.config import DflashConfigError, DflashDrafterConfig, spare_token_id
from draftsmith.models.dflash.section import default_loss_gamma, default_target_layer_ids
from draftsmith.models.dflash.export import check_dflash_export, export_config, export_dflash
from draftsmith.models.dflash.loss import (
    block_labels,
    dflash_loss,
    position_weights,
    sample_anchors,
    teacher_rows,
)
from draftsmith.models.dflash.io import load_drafter
from draftsmith.models.dflash.model import MASK_EMBEDDING_FILE, DflashDrafter, block_attention_mask, init_drafter
from draftsmith.models.drafter_config import DrafterLoadError

H = 64


def tiny_config(learned_mask=True, block_size=4, num_layers=2, target_cls=LlamaConfig, **target):
    target_config = target_cls(**{"vocab_size": 256, "hidden_size": H, "num_hidden_layers": 6,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                  **target})
    return DflashDrafterConfig.from_target(
        target_config, num_layers=num_layers, block_size=block_size, num_features=3,
        mask_token_id=None if learned_mask else 7, learned_mask=learned_mask, target_name_or_path="org/target")


def tiny_drafter(config, seed=0):
    torch.manual_seed(seed)
    drafter = DflashDrafter(config)
    init_drafter(drafter, torch.randn(config.vocab_size, config.hidden_size), std=0.1)
    for name, p in drafter.named_parameters():  # norms away from 1, so a missed norm shows
        if "norm" in name:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return drafter.eval()


# ---- configuration ---------------------------------------------------------------------------------------------
def test_default_target_layers_follow_the_reference():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab / DeepSpec Qwen3-8B
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]  # the fixture target: layers 1 .. L-3
    assert default_target_layer_ids(4, 3) == [0, 2, 3]  # too shallow for 1 .. L-3: spread over all layers
    with pytest.raises(DflashConfigError, match="num_target_layers"):
        default_target_layer_ids(3, 5)
    cfg = tiny_config()
    assert cfg.target_layer_ids == [1, 2, 3] and cfg.aux_layer_ids == [2, 3, 4]  # capture = output-of-layer + 1


def test_loss_gamma_and_position_weights():
    assert [default_loss_gamma(b) for b in (16, 10, 8, 12)] == [7, 5, 4, 6]
    w = position_weights(4, 2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


@pytest.mark.parametrize("bad, message", [
    (dict(target_layer_ids=[1, 6]), r"0\.\.5"),
    (dict(target_layer_ids=[3, 1]), "strictly increasing"),
    (dict(mask_token_id=999, learned_mask=False), "outside the target vocabulary"),
    (dict(mask_token_id=None, learned_mask=False), "mask_token_id or a learned"),
])
def test_impossible_configs_are_refused(bad, message):
    d = tiny_config().to_dict()
    with pytest.raises(DflashConfigError, match=message):
        DflashDrafterConfig.from_dict({**d, **bad})


def test_spare_token_id_prefers_unused_rows_then_reserved_then_pad():
    class Tok:
        eos_token_id, bos_token_id, pad_token_id = 2, 1, 0
        added_tokens_decoder = {}

        def __init__(self, n):
            self.n = n

        def get_vocab(self):
            return {f"t{i}": i for i in range(self.n)}

    assert spare_token_id(Tok(10), 12) == 10  # an embedding row no token maps to (Qwen3's 151669)
    tok = Tok(12)
    tok.added_tokens_decoder = {8: "<|reserved_special_token_0|>", 9: "<|reserved_special_token_1|>"}
    assert spare_token_id(tok, 12) == 9
    assert spare_token_id(Tok(12), 12) == 0  # the pad token
    no_pad = Tok(12)
    no_pad.pad_token_id = 2
    assert spare_token_id(no_pad, 12) is None


def test_recipe_section_checks():
    base = {"model": {"target": "t", "method": "dflash"}, "data": {"path": "sharegpt"}, "output_dir": "o"}
    r = recipe_from_dict(base)
    assert (r.dflash.num_layers, r.dflash.block_size, r.dflash.num_target_layers) == (5, 16, 5)
    assert r.dflash.mask_token_id is None and r.dflash.anchors_per_sequence == 512
    assert recipe_from_dict({**base, "dflash": {"target_layer_ids": [1, 4]}}).dflash.num_target_layers == 2
    with pytest.raises(ValueError, match="increasing order"):
        recipe_from_dict({**base, "dflash": {"target_layer_ids": [4, 1]}})
    with pytest.raises(ValueError, match="make them agree"):
        recipe_from_dict({**base, "dflash": {"target_layer_ids": [1, 4], "num_target_layers": 3}})
    with pytest.raises(ValueError, match="dflash.block_size: must be >= 2"):
        recipe_from_dict({**base, "dflash": {"block_size": 1}})


# ---- the block mask ----------------------------------------------------------------------------------------------
# Context of 5 positions, blocks of 3 at anchors 2 and 4, plus a padding block (anchor 0): who sees whom
# (tests/test_dflash_flex.py holds the FlexAttention mask to the same grid)
#                  context 0..4 | block 0 | block 1 | block 2
BLOCK_MASK_GRID = [[1, 1, 0, 0, 0,   1, 1, 1,  0, 0, 0,  0, 0, 0],  # block 0 (anchor 2): context < 2, its own slots
                   [1, 1, 0, 0, 0,   1, 1, 1,  0, 0, 0,  0, 0, 0],
                   [1, 1, 0, 0, 0,   1, 1, 1,  0, 0, 0,  0, 0, 0],
                   [1, 1, 1, 1, 0,   0, 0, 0,  1, 1, 1,  0, 0, 0],  # block 1 (anchor 4): context < 4
                   [1, 1, 1, 1, 0,   0, 0, 0,  1, 1, 1,  0, 0, 0],
                   [1, 1, 1, 1, 0,   0, 0, 0,  1, 1, 1,  0, 0, 0],
                   [0, 0, 0, 0, 0,   0, 0, 0,  0, 0, 0,  1, 1, 1],  # padding: only itself, so no NaN
                   [0, 0, 0, 0, 0,   0, 0, 0,  0, 0, 0,  1, 1, 1],
                   [0, 0, 0, 0, 0,   0, 0, 0,  0, 0, 0,  1, 1, 1]]


def test_block_mask_literal_grid():
    """Context of 5 positions, blocks of 3 at anchors 2 and 4, plus a padding block (anchor 0)."""
    got = block_attention_mask(torch.tensor([[2, 4, 0]]), context_length=5, block_size=3)[0].int()
    assert got.tolist() == BLOCK_MASK_GRID


@pytest.mark.parametrize("learned_mask, target_cls", [(True, LlamaConfig), (False, Qwen3Config)])
def test_training_forward_equals_one_block_at_a_time_and_the_cached_runtime(learned_mask, target_cls):
    """All blocks in one masked pass == each block alone with its context prefix == the runtime's cache path."""
    cfg = tiny_config(learned_mask=learned_mask, target_cls=target_cls)
    drafter = tiny_drafter(cfg)
    g = torch.Generator().manual_seed(1)
    b, s = 2, 12
    aux = torch.randn(b, s, 3 * H, generator=g)
    anchors = torch.tensor([[2, 5, 9], [0, 4, 11]])
    anchor_embeds = torch.randn(b, 3, H, generator=g)
    mask_embed = None if learned_mask else torch.randn(H, generator=g)
    with torch.no_grad():
        batched = drafter(aux, anchor_embeds, anchors, mask_embed)  # (B, N, B_k, H)
        for row in range(b):
            for j, a in enumerate(anchors[row].tolist()):
                # slow reference: the training forward on this block alone, its context cut at the anchor
                alone = drafter(aux[row:row + 1, :max(a, 1)], anchor_embeds[row:row + 1, j:j + 1], torch.tensor([[a]]), mask_embed)
                torch.testing.assert_close(alone[0, 0], batched[row, j], atol=1e-5, rtol=1e-5)
                # the runtime: context K/V appended in two pieces, then one cached block pass
                cache = drafter.new_cache(1, 32, torch.float32, "cpu")
                cache.keys.fill_(float("nan"))  # a stale slot read anywhere would show
                cache.values.fill_(float("nan"))
                drafter.extend_context(aux[row:row + 1, : a // 2], cache, torch.arange(a // 2)[None])
                drafter.extend_context(aux[row:row + 1, a // 2: a], cache, torch.arange(a // 2, a)[None])
                blocks = drafter.block_inputs(anchor_embeds[row:row + 1, j:j + 1], mask_embed)
                cached = drafter.draft_block(blocks, cache, torch.tensor([a]), key_length=a + cfg.block_size)
                torch.testing.assert_close(cached[0], batched[row, j], atol=1e-5, rtol=1e-5)


def test_checkpointed_layers_give_the_same_values_and_gradients():
    """dflash.checkpoint_layers recomputes each layer in the backward pass; nothing it returns may change."""
    from draftsmith.models.dflash.training import BlockOptions, apply_training_options

    drafter = tiny_drafter(tiny_config()).train()
    g = torch.Generator().manual_seed(2)
    aux = torch.randn(2, 12, 3 * H, generator=g)
    anchors = torch.tensor([[2, 5, 9], [0, 4, 11]])
    anchor_embeds = torch.randn(2, 3, H, generator=g)
    results = []
    for recompute in (False, True):
        drafter.zero_grad()
        apply_training_options(drafter, BlockOptions(recompute=recompute))
        out = drafter(aux, anchor_embeds, anchors)
        out.square().sum().backward()
        results.append((out.detach(), {k: p.grad.clone() for k, p in drafter.named_parameters()}))
    (plain, plain_grads), (recomputed, recomputed_grads) = results
    torch.testing.assert_close(recomputed, plain)
    assert plain_grads.keys() == recomputed_grads.keys() and any(v.abs().sum() > 0 for v in plain_grads.values())
    for k in plain_grads:
        torch.testing.assert_close(recomputed_grads[k], plain_grads[k], msg=lambda m, k=k: f"{k}: {m}")


# ---- anchors, labels, loss -----------------------------------------------------------------------------------------
def test_anchors_are_positions_before_assistant_tokens():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1],
                              [0, 0, 0, 0, 0, 1, 0, 0]])
    for seed in range(5):
        anchors, valid = sample_anchors(loss_mask, 3, generator=torch.Generator().manual_seed(seed))
        assert anchors.shape == (2, 3)
        row0 = anchors[0][valid[0]].tolist()
        assert len(row0) == 3 and set(row0) <= {1, 2, 3, 6} and row0 == sorted(set(row0))
        assert valid[1].tolist() == [True, False, False] and anchors[1].tolist() == [4, 0, 0]
    everything, _ = sample_anchors(loss_mask, 100)
    assert everything.shape == (2, 4) and everything[0].tolist() == [1, 2, 3, 6]


def test_block_labels_literal():
    teacher = torch.tensor([[10, 11, 12, 13, 14, 15]])  # target argmax at each position (predicts position + 1)
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1]])
    labels, valid = block_labels(teacher, loss_mask, torch.tensor([[0, 3, 0]]), torch.tensor([[True, True, False]]),
                                 block_size=4)
    # block at 0: slots predict positions 1, 2, 3 -> teacher at 0, 1, 2; position 3 is not an assistant token
    assert labels[0, 0].tolist() == [10, 11, 12] and valid[0, 0].tolist() == [True, True, False]
    # block at 3: positions 4, 5, (6 is past the end)
    assert labels[0, 1, :2].tolist() == [13, 14] and valid[0, 1].tolist() == [True, True, False]
    assert valid[0, 2].tolist() == [False, False, False]  # padding block


def slow_dflash_loss(block_hidden, head, labels, valid, gamma):
    """Loops over blocks and slots: sum_k w_k CE_k / sum_k w_k, and 1 + leading correct slots per block."""
    num, den, runs, blocks = 0.0, 0.0, 0, 0
    b, n, bk1 = labels.shape
    for i in range(b):
        for j in range(n):
            leading, broken = 0, False
            for k in range(bk1):
                logits = head @ block_hidden[i, j, k + 1]
                correct = int(logits.argmax()) == int(labels[i, j, k])
                if valid[i, j, k]:
                    w = math.exp(-k / gamma)
                    num += w * float(F.cross_entropy(logits[None], labels[i, j, k][None]))
                    den += w
                if not (valid[i, j, k] and correct):
                    broken = True
                if not broken:
                    leading += 1
            if valid[i, j, 0]:
                runs, blocks = runs + leading, blocks + 1
    return num / den, 1 + runs / blocks


def test_loss_matches_a_slow_loop_and_trains_only_valid_slots():
    g = torch.Generator().manual_seed(0)
    b, n, bk, v = 2, 3, 5, 11
    head = torch.randn(v, H, generator=g)
    hidden = torch.randn(b, n, bk, H, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (b, n, bk - 1), generator=g)
    with torch.no_grad():  # make some leading runs: the label is the head's argmax for a few slots
        labels[0, 0, :3] = (hidden[0, 0, 1:4] @ head.T).argmax(-1)
        labels[1, 2, :2] = (hidden[1, 2, 1:3] @ head.T).argmax(-1)
    valid = torch.rand(b, n, bk - 1, generator=g) > 0.25
    valid[0, 0] = valid[1, 2] = True
    loss, metrics = dflash_loss(hidden, head, labels, valid, gamma=3.0)
    want_loss, want_tau = slow_dflash_loss(hidden.detach(), head, labels, valid, 3.0)
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    assert float(metrics["sim_accept_len"]) == pytest.approx(want_tau, rel=1e-6)
    assert int(metrics["count_0"]) == int(valid[..., 0].sum()) and set(metrics) >= {"loss_3", "acc_3", "count_3"}
    loss.backward()
    assert hidden.grad[:, :, 0].abs().sum() == 0  # the anchor slot predicts nothing
    assert (hidden.grad[:, :, 1:].abs().sum(-1) > 0).tolist() == valid.tolist()


def test_soft_loss_matches_a_slow_loop_against_the_teacher_distribution():
    """dflash.loss soft_ce: each valid slot's CE is against softmax(head @ teacher state of its label position)."""
    g = torch.Generator().manual_seed(3)
    b, s, n, bk, v = 2, 9, 3, 4, 13
    head = torch.randn(v, H, generator=g)
    last_hidden = torch.randn(b, s, H, generator=g)
    anchors = torch.tensor([[0, 3, 7], [1, 2, 0]])
    block_valid = torch.tensor([[True, True, True], [True, True, False]])
    loss_mask = (torch.rand(b, s, generator=g) > 0.2).long()
    teacher = (last_hidden @ head.T).argmax(-1)
    labels, valid = block_labels(teacher, loss_mask, anchors, block_valid, bk)
    hidden = torch.randn(b, n, bk, H, generator=g, requires_grad=True)
    rows = teacher_rows(last_hidden, anchors, valid, bk)
    loss, _ = dflash_loss(hidden, head, labels, valid, 2.0, rows)
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            for k in range(bk - 1):
                if valid[i, j, k]:
                    source = int(anchors[i, j]) + k  # slot k+1 sits at a+k+1, labelled by the output at a+k
                    assert int(labels[i, j, k]) == int(teacher[i, source])
                    p = (head @ last_hidden[i, source]).softmax(-1)
                    w = math.exp(-k / 2.0)
                    num += w * float(-(p * (head @ hidden[i, j, k + 1].detach()).log_softmax(-1)).sum())
                    den += w
    assert valid.any() and not valid.all()
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    loss.backward()
    assert (hidden.grad[:, :, 1:].abs().sum(-1) > 0).tolist() == valid.tolist()


def test_dflash_loss_key_reaches_the_method(fixture_target_dir):
    from draftsmith.config import RecipeError, recipe_from_dict
    from draftsmith.models.dflash.training import DflashMethod
    from draftsmith.models.target import TargetModel

    target = TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")
    for key, soft in (("soft_ce", True), ("ce", False)):
        recipe = recipe_from_dict({"model": {"target": str(fixture_target_dir), "method": "dflash"},
                                   "data": {"path": "x.jsonl"}, "output_dir": "unused",
                                   "dflash": {"num_layers": 1, "block_size": 4, "loss": key}})
        assert DflashMethod(recipe, target).soft_targets is soft
    with pytest.raises(ValueError, match="loss"):
        recipe_from_dict({"model": {"target": "t", "method": "dflash"}, "data": {"path": "x.jsonl"},
                          "output_dir": "unused", "dflash": {"loss": "kl"}})


# ---- runtime ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def fixture_target(fixture_target_dir):
    from draftsmith.models.target import TargetModel

    return TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")


def untrained_checkpoint(folder, target, learned_mask=True, block_size=8, seed=0):
    torch.manual_seed(seed)
    config = DflashDrafterConfig.from_target(
        target.config, num_layers=2, block_size=block_size, num_features=3, mask_token_id=0 if not learned_mask
        else None, learned_mask=learned_mask, target_name_or_path=target.name_or_path)
    drafter = DflashDrafter(config)
    init_drafter(drafter, target.embed_tokens.weight)
    folder.mkdir(parents=True)
    save_safetensors_atomic({k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")},
                            folder / "model.safetensors")
    write_json_atomic(config.to_dict(), folder / "config.json")
    return folder, drafter


@pytest.mark.slow
def test_dflash_is_lossless_with_a_drafter_that_accepts(fixture_prompts, accepting_drafter):
    """Whole blocks accepted, blocks cut short and blocks rejected, and the output is plain greedy decoding's."""
    from conftest import generate_lossless

    from draftsmith.inference.spec_config import build_proposer, parse_spec_config

    target, _, prompts, answers, eos = fixture_prompts
    k = 3  # the whole block of 4 (tests/conftest.py trains block 4)
    spec = parse_spec_config({"method": "dflash", "model": str(accepting_drafter("dflash")),
                              "num_speculative_tokens": k}, "cpu")
    m = generate_lossless(target, build_proposer(spec, target), k, prompts, answers, eos)
    assert m.num_accepted_tokens >= 25  # 46 of 195 drafts when this was written
    assert m.num_accepted_tokens < m.num_draft_tokens and m.num_accepted_tokens_per_pos[-1] > 0


@pytest.mark.slow
def test_batched_generation_equals_each_request_alone(fixture_prompts, accepting_drafter):
    """Rows of different lengths grow their DFlash context independently, accept their own amounts and finish at
    different steps; each row's output and counters are its own."""
    from conftest import ACCEPTING_NEW_TOKENS

    from draftsmith.inference.generator import SpeculativeGenerator
    from draftsmith.inference.spec_config import build_proposer, parse_spec_config

    target, _, prompts, answers, eos = fixture_prompts
    spec = parse_spec_config({"method": "dflash", "model": str(accepting_drafter("dflash")),
                              "num_speculative_tokens": 3}, "cpu")
    speculative = SpeculativeGenerator(target, build_proposer(spec, target), 3)
    assert len({len(p) for p in prompts}) > 1
    together = speculative.generate_batch(prompts, ACCEPTING_NEW_TOKENS, eos_token_ids=eos)
    for ids, got, answer in zip(prompts, together, answers):
        alone = speculative.generate(torch.tensor([ids]), ACCEPTING_NEW_TOKENS, eos_token_ids=eos)
        assert got.token_ids == alone.token_ids == answer
        assert got.metrics.to_dict() == alone.metrics.to_dict()
    accepted = [r.metrics.num_accepted_tokens for r in together]
    assert min(accepted) > 0 and len(set(accepted)) > 1


def test_ragged_rows_draft_as_if_alone():
    """extend() pads each row past its own count; every row's block must equal that row's proposer alone."""
    from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN as PAD
    from draftsmith.models.dflash.proposer import DflashProposer

    cfg = tiny_config(learned_mask=False, block_size=5)
    drafter = tiny_drafter(cfg)
    torch.manual_seed(2)
    embed, head = torch.nn.Embedding(256, H), torch.nn.Linear(H, 256, bias=False)
    aux = torch.randn(2, 9, 3 * H)
    tokens = torch.randint(0, 256, (2, 10))
    counts = [[5, 2, 0, 1], [3, 1, 2, 0]]  # tokens committed per extend, per row (prefill first)

    def run(rows):
        proposer = DflashProposer(drafter, embed, head)
        proposer.begin(torch.stack([tokens[r] for r in rows]))
        done = [0] * len(rows)
        for step in range(len(counts[0])):
            n = max(counts[r][step] for r in rows)
            ids = torch.full((len(rows), n), PAD)
            feats = torch.zeros(len(rows), n, 3 * H)
            for j, r in enumerate(rows):
                c = counts[r][step]
                ids[j, :c] = tokens[r, done[j] + 1: done[j] + 1 + c]
                feats[j, :c] = aux[r, done[j]: done[j] + c]
                done[j] += c
            proposer.extend(ids, feats)
        return proposer.propose(4)

    together = run([0, 1])
    for r in (0, 1):
        alone = run([r])
        assert together.token_ids[r].tolist() == alone.token_ids[0].tolist()
        torch.testing.assert_close(together.scores[r], alone.scores[0], atol=1e-5, rtol=1e-5)


def test_proposer_drafts_what_the_training_forward_predicts(tmp_path, fixture_target):
    """The runtime's block after a prefill equals the training forward's block at that anchor."""
    from draftsmith.inference.spec_config import build_proposer, parse_spec_config

    folder, drafter = untrained_checkpoint(tmp_path / "d", fixture_target, learned_mask=True, block_size=6)
    proposer = build_proposer(parse_spec_config({"method": "dflash", "model": str(folder),
                                                 "num_speculative_tokens": 5}, "cpu"), fixture_target)
    ids = torch.randint(10, 16000, (1, 9), generator=torch.Generator().manual_seed(0))
    captured = fixture_target.capture(ids, aux_layer_ids=drafter.config.aux_layer_ids)
    proposer.begin(ids[:, :6])
    proposer.extend(ids[:, 1:7], captured.aux_hidden[:, :6])  # features 0..5 paired with tokens 1..6
    proposal = proposer.propose(5)
    with torch.no_grad():
        hidden = drafter(captured.aux_hidden, fixture_target.embed_tokens(ids[:, 6:7]), torch.tensor([[6]]))
        want = fixture_target.lm_head(hidden[0, 0, 1:]).argmax(-1)  # slots 1..5
    assert proposal.token_ids[0].tolist() == want.tolist() and proposal.lengths.tolist() == [5]
    # k = 2 runs a block of 3 (the anchor and 2 masks), as vLLM queries it: a drafter trained at block 6, run at 3
    narrow = DflashDrafter(dataclasses.replace(drafter.config, block_size=3))
    narrow.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        hidden = narrow(captured.aux_hidden, fixture_target.embed_tokens(ids[:, 6:7]), torch.tensor([[6]]))
        want = fixture_target.lm_head(hidden[0, 0, 1:]).argmax(-1)  # slots 1..2 of the narrow block
    assert proposer.propose(2).token_ids[0].tolist() == want.tolist()
    with pytest.raises(ValueError, match="DFlash drafts at most 5 tokens a block, asked 6"):
        proposer.propose(6)


def test_block_over_the_whole_cache_drafts_what_the_written_prefix_drafts(tmp_path, fixture_target):
    """The CUDA-graph layout (every step attends over the whole cache, masked past the row's length) gives the same
    block as attending over the written slots only; stale slots past the length are never seen."""
    from draftsmith.inference.spec_config import build_proposer, parse_spec_config

    folder, _ = untrained_checkpoint(tmp_path / "d", fixture_target, learned_mask=True, block_size=6)
    proposer = build_proposer(parse_spec_config({"method": "dflash", "model": str(folder),
                                                 "num_speculative_tokens": 5}, "cpu"), fixture_target)
    ids = torch.randint(10, 16000, (1, 12), generator=torch.Generator().manual_seed(1))
    captured = fixture_target.capture(ids, aux_layer_ids=proposer.aux_layer_ids)
    proposer.begin(ids[:, :6])
    proposer.extend(ids[:, 1:7], captured.aux_hidden[:, :6])
    proposer.cache.keys[:, :, :, 20:].normal_()  # stale entries, as rejected blocks of earlier steps leave them
    proposer.cache.values[:, :, :, 20:].normal_()
    with torch.no_grad():
        prefix = proposer._draft(proposer.last, proposer.lengths, proposer.bound + proposer.block_size, 5)
        whole = proposer._draft(proposer.last, proposer.lengths, proposer.cache.max_length, 5)
    assert torch.equal(prefix[1], whole[1])
    torch.testing.assert_close(prefix[0], whole[0])


def test_k_beyond_the_block_and_mismatched_targets_are_refused(tmp_path, fixture_target, tiny_llama):
    from draftsmith.inference.spec_config import build_proposer, parse_spec_config
    from draftsmith.models.target import TargetModel

    folder, _ = untrained_checkpoint(tmp_path / "d", fixture_target, block_size=8)
    with pytest.raises(DflashConfigError, match="num_speculative_tokens <= 7"):
        build_proposer(parse_spec_config({"method": "dflash", "model": str(folder), "num_speculative_tokens": 8},
                                         "cpu"), fixture_target)
    other = TargetModel(tiny_llama()[0].float())
    with pytest.raises(DflashConfigError, match="vocab 16000 and hidden size 384"):
        build_proposer(parse_spec_config({"method": "dflash", "model": str(folder), "num_speculative_tokens": 2},
                                         "cpu"), other)


# ---- training end to end ------------------------------------------------------------------------------------------------
def test_tiny_training_run_writes_a_loadable_checkpoint(tmp_path, fixture_target_dir):
    from draftsmith.train import train

    replies = ["The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
               "Water boils at 100 degrees Celsius at sea level, and at lower temperatures at altitude."]
    data = tmp_path / "conv.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": replies[i % 2]}]}) for i in range(20)))
    recipe = recipe_from_dict({
        "model": {"target": str(fixture_target_dir), "method": "dflash", "draft_vocab_size": 512},
        "dflash": {"num_layers": 1, "block_size": 4, "target_layer_ids": [1, 4, 6], "anchors_per_sequence": 8},
        "data": {"path": str(data), "max_length": 64, "eval_samples": 2, "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 10, "batch_size": 2, "lr": 3e-3, "log_every": 1, "eval_every": 10,
                     "save_every": 10, "seed": 3, "warmup_ratio": 0.0, "peak_tflops": 0.5},
        "output_dir": str(tmp_path / "run"),
    })
    lines = []
    ckpt = train(recipe, log=lambda *a: lines.append(" ".join(map(str, a))))
    config = json.loads((ckpt / "config.json").read_text())
    assert config["method"] == "dflash" and config["target_layer_ids"] == [1, 4, 6] and config["learned_mask"]
    assert config["mask_token_id"] == 0  # the fixture has no spare row: its pad token marks masks for engines
    drafter = load_drafter(tmp_path / "run")
    assert drafter.config.aux_layer_ids == [2, 5, 7] and drafter.mask_embedding.shape == (384,)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 10 and sum(losses[-3:]) < 0.8 * sum(losses[:3])
    assert {"train/acc_0", "train/loss_2", "train/sim_accept_len"} <= set(rows[0])
    # model FLOPs (train/flops.dflash_flops_per_token) and MFU on every log row, the count logged term by term
    logged = [r for r in rows if "loss" in r]
    assert all(r["tflops_per_s"] > 0 and r["mfu"] == pytest.approx(r["tflops_per_s"] / 0.5) for r in logged)
    assert any("model FLOPs at" in line and "drafter_forward_backward" in line for line in lines)
    evals = [r for r in rows if "eval/loss" in r]
    # ten steps on two repeated replies: some first-slot drafts are already right (1.06 when this was written)
    assert evals and evals[-1]["eval/sim_accept_len"] > 1.0 and evals[-1]["eval/acc_0"] > 0


def test_recipe_refuses_eagle3_aux_ids(tmp_path):
    """DFlash's layers are dflash.target_layer_ids: the recipe is refused when it is read, before any loading."""
    with pytest.raises(RecipeError, match="dflash.target_layer_ids"):
        recipe_from_dict({"model": {"target": "unused", "method": "dflash", "aux_layer_ids": [2, 4]},
                          "data": {"path": "x.jsonl"}, "output_dir": str(tmp_path)})


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_recipes_refuse_training_on_user_turns(tmp_path, method):
    """DFlash's and DSpark's CE reads the data's tokens: training.loss_on all is refused when the recipe is read."""
    with pytest.raises(RecipeError, match="training.loss_on 'all'"):
        recipe_from_dict({"model": {"target": "unused", "method": method}, "data": {"path": "x.jsonl"},
                          "training": {"loss_on": "all"}, "output_dir": str(tmp_path)})


def test_recipe_checkpoint_layers_reaches_the_drafter(tmp_path, fixture_target_dir, fixture_target):
    from draftsmith.models.dflash.training import DflashMethod

    for on in (False, True):
        recipe = recipe_from_dict({"model": {"target": str(fixture_target_dir), "method": "dflash"},
                                   "dflash": {"num_layers": 1, "checkpoint_layers": on},
                                   "data": {"path": "x.jsonl"}, "output_dir": str(tmp_path)})
        method = DflashMethod(recipe, fixture_target)
        drafter = method.build_drafter(torch.zeros(0), torch.zeros(0))
        method.apply_training_options(drafter)
        assert drafter.block_kernels.options.recompute is on


# ---- export -----------------------------------------------------------------------------------------------------------
def make_checkpoint(root, drafter, step=40):
    ckpt = root / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    write_json_atomic(drafter.config.to_dict(), ckpt / "config.json")
    save_safetensors_atomic({k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")},
                            ckpt / "model.safetensors")
    write_json_atomic({"step": step}, ckpt / "trainer_state.json")
    (root / "latest").write_text(ckpt.name + "\n")
    return ckpt


@pytest.mark.parametrize("learned_mask", [True, False])
def test_export_writes_the_engine_format_and_reloads(tmp_path, learned_mask):
    from safetensors import safe_open

    cfg = tiny_config(learned_mask=learned_mask)
    if learned_mask:
        cfg.mask_token_id = 255  # the spare id engines substitute the learned vector at
    drafter = tiny_drafter(cfg)
    make_checkpoint(tmp_path / "run", drafter)
    result = export_dflash(tmp_path / "run", tmp_path / "out", dtype=None)
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"target_layer_ids": [1, 2, 3], "mask_token_id": 255 if learned_mask else 7}
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert (config["num_hidden_layers"], config["block_size"], config["num_target_layers"]) == (2, 4, 6)
    assert config["head_dim"] == 16 and config["layer_types"] == ["full_attention"] * 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n or "mask" in n for n in names)
    assert (out / MASK_EMBEDDING_FILE).is_file() == learned_mask
    assert "base_model: org/target" in (out / "README.md").read_text()
    assert any(MASK_EMBEDDING_FILE in w for w in result.warnings) == learned_mask
    assert "num_speculative_tokens\":3" in result.serve_commands["vLLM"]

    reloaded = load_drafter(out)
    assert reloaded.config.learned_mask == learned_mask and reloaded.config.target_layer_ids == [1, 2, 3]
    g = torch.Generator().manual_seed(5)
    aux, emb = torch.randn(1, 9, 3 * H, generator=g), torch.randn(1, 2, H, generator=g)
    mask_embed = None if learned_mask else torch.randn(H, generator=g)
    with torch.no_grad():
        want = drafter(aux, emb, torch.tensor([[3, 8]]), mask_embed)
        got = reloaded(aux, emb, torch.tensor([[3, 8]]), mask_embed)
    torch.testing.assert_close(got, want)


def test_export_refuses_broken_checkpoints_and_writes_nothing(tmp_path):
    drafter = tiny_drafter(tiny_config(learned_mask=True))  # learned mask, but no spare id recorded
    make_checkpoint(tmp_path / "run", drafter)
    with pytest.raises(ExportError, match="mask_token_id: None"):
        export_dflash(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    cfg = tiny_config(learned_mask=False)
    config = export_config(cfg)
    tensors = {k: v for k, v in tiny_drafter(cfg).state_dict().items() if not k.startswith("rotary_emb.")}
    assert check_dflash_export(config, tensors)[0] == []
    problems = check_dflash_export(config, {**tensors, "lm_head.weight": torch.zeros(256, H)})[0]
    assert problems == ["unexpected tensors (engines would ignore them silently): lm_head.weight"]
    missing = dict(tensors)
    del missing["layers.1.self_attn.q_norm.weight"]
    assert check_dflash_export(config, missing)[0] == ["missing tensors: layers.1.self_attn.q_norm.weight"]
    bad_shape = {**tensors, "fc.weight": torch.zeros(H, 2 * H)}
    assert "fc.weight: shape (64, 128), expected (64, 192)" in check_dflash_export(config, bad_shape)[0][0]
    bad_ids = {**config, "dflash_config": {"target_layer_ids": [1, 9], "mask_token_id": 7}}
    assert any("outside 0..5" in p for p in check_dflash_export(bad_ids, tensors)[0])


def test_export_refuses_another_method_and_reads_back_through_the_cli(tmp_path, capsys):
    from safetensors import safe_open

    from draftsmith.cli import main

    drafter = tiny_drafter(tiny_config(learned_mask=False))
    ckpt = make_checkpoint(tmp_path / "run", drafter)
    rc = main(["export", str(ckpt), "--format", "dflash", "--out", str(tmp_path / "out")])
    assert rc == 0 and "DFLASH" in capsys.readouterr().out
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16  # the default export dtype
    config = json.loads((ckpt / "config.json").read_text())
    write_json_atomic({**config, "method": "eagle3"}, ckpt / "config.json")
    with pytest.raises(ExportError, match="cannot be exported as dflash"):
        export_dflash(ckpt, tmp_path / "out2")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{}")
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"")
    with pytest.raises(DrafterLoadError, match="not a DFlash drafter"):
        load_drafter(tmp_path / "junk")



@pytest.mark.parametrize("learned_mask", [True, False])
def test_import_of_a_dflash_export_round_trips_unchanged(tmp_path, learned_mask):
    """`draftsmith import` turns a DFlashDraftModel folder back into a draftsmith checkpoint; exporting that again
    gives the same config and bit-identical tensors."""
    from safetensors.torch import load_file

    from draftsmith.models.importer import import_checkpoint

    cfg = tiny_config(learned_mask=learned_mask)
    if learned_mask:
        cfg.mask_token_id = 255
    make_checkpoint(tmp_path / "run", tiny_drafter(cfg))
    export_dflash(tmp_path / "run", tmp_path / "first", dtype=None)
    result = import_checkpoint(tmp_path / "first", tmp_path / "imported")
    assert result.format == "dflash"
    assert json.loads((tmp_path / "imported" / "config.json").read_text())["method"] == "dflash"
    export_dflash(tmp_path / "imported", tmp_path / "second", dtype=None)
    for name in ["config.json"]:
        first = json.loads((tmp_path / "first" / name).read_text())
        second = json.loads((tmp_path / "second" / name).read_text())
        first.pop("draftsmith", None), second.pop("draftsmith", None)  # provenance names the source folder
        assert first == second
    a, b = load_file(str(tmp_path / "first" / "model.safetensors")), load_file(str(tmp_path / "second" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "second" / MASK_EMBEDDING_FILE).is_file() == learned_mask


class _RunsCode:
    """A pickled object that would run a command if unpickled without restriction."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_pickled_mask_embedding_is_refused_in_one_line_without_torchs_advice(tmp_path):
    """Issue 47 item 14: the refusal repeated torch's advice to set weights_only=False (which would run it)."""
    from draftsmith.models.dflash.io import read_mask_embedding
    from draftsmith.models.drafter_config import DrafterLoadError

    path = tmp_path / MASK_EMBEDDING_FILE
    torch.save({"mask_token_id": 1, "embedding": _RunsCode(tmp_path / "ran")}, path)
    with pytest.raises(DrafterLoadError) as refused:
        read_mask_embedding(path, {"dflash_config": {"mask_token_id": 1}})
    message = str(refused.value)
    assert "not a torch file of tensors alone" in message and "never unpickles" in message
    assert "weights_only" not in message and "\n" not in message
    assert not (tmp_path / "ran").exists()
    (tmp_path / "text.pt").write_text("not a tensor file")
    with pytest.raises(DrafterLoadError, match="not a torch file of tensors alone"):
        read_mask_embedding(tmp_path / "text.pt", {})
