"""Target families in the runtime: each adapter (models/targets) and the generic path decode exactly as transformers
does, and speculation on them is lossless.

Every family is a tiny random config built here: Qwen3-MoE (4 experts, top-2, norm_topk_prob, a dense layer, a
sliding window), GPT-OSS (sinks, a sliding window on alternate layers, a biased router, YaRN), Gemma 4 (sliding and
full layers of different head dims and K/V heads, K = V on full layers, KV shared by the last two layers, per-layer
inputs, an MoE block, a double-wide MLP, logit softcapping; as Gemma4ForCausalLM and inside the multimodal
Gemma4ForConditionalGeneration), the Llama adapter's dense Qwen3, Mistral and Qwen2 (no window here), and Phi-3
and DeepSeek-V3 (latent attention, routed and shared experts), which have no adapter: transformers' own forward.
Windows are 8 tokens and outputs run well past them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, GptOssConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)
from transformers.models.gemma4 import Gemma4Config, Gemma4TextConfig

from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.ngram import NgramProposer
from draftsmith.models.eagle3.section import default_aux_layer_ids
from draftsmith.models.target import TargetError, TargetModel, context_length_of
from test_batch import ChainOracle, assert_same_as_alone
from test_graph_paths import recorded_graphs  # noqa: F401 - a fixture
from test_tree import OracleTreeProposer

WINDOW = 8
DENSE = ("qwen3", "mistral", "qwen2")  # the Llama adapter's dense families (windowed forms: test_target.py)
ADAPTED = ("qwen3_moe", "gpt_oss", "gemma4_text")
GENERIC = ("phi3", "deepseek_v3")  # no adapter: transformers' own forward (DeepSeek-V3: MLA, routed + shared experts)
# weights redrawn where the default init decodes flat
STD = {"gemma4_text": 0.08, "gemma4": 0.08, "phi3": 0.1, "mistral": 0.1, "qwen2": 0.1}


def family_config(family: str, vocab: int = 128, hidden: int = 64, layers: int = 4, **overrides):
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    alternate = ["sliding_attention", "full_attention"] * (layers // 2)
    if family == "qwen3_moe":
        args = dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=True, mlp_only_layers=[1], use_sliding_window=True, sliding_window=WINDOW)
        return Qwen3MoeConfig(**{**common, **args, **overrides})
    if family == "gpt_oss":
        args = dict(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=WINDOW, layer_types=alternate,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0})
        return GptOssConfig(**{**common, **args, **overrides})
    if family == "gemma4_text":
        args = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                    intermediate_size=96, sliding_window=WINDOW, layer_types=alternate,
                    num_kv_shared_layers=layers // 2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab,
                    enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                    use_double_wide_mlp=True, final_logit_softcapping=30.0)
        return Gemma4TextConfig(**{**common, **args, **overrides})
    if family == "deepseek_v3":
        args = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                    num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)
        return DeepseekV3Config(**{**common, **args, **overrides})
    if family == "gemma4":  # the multimodal checkpoints Google ships, with no vision or audio tower here
        return Gemma4Config(text_config=family_config("gemma4_text", vocab, hidden, layers, **overrides).to_dict(),
                            vision_config=None, audio_config=None)
    if family in DENSE:  # no sliding window: past it, the runtime refuses these (test_target.py pins that)
        config = {"qwen3": Qwen3Config, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
        extra = {"head_dim": 16} if family == "qwen3" else {}
        return config(**{**common, "intermediate_size": 96, **extra, **overrides, "sliding_window": None})
    if family == "phi3":
        return Phi3Config(**{**common, "intermediate_size": 96, "sliding_window": WINDOW, **overrides})
    raise ValueError(family)


def family_model(family: str, seed: int = 0, std: float | None = None, **config):
    """An eval-mode float32 model; `std` (default: STD's) redraws every weight matrix, norms aside."""
    std = STD.get(family) if std is None else std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **config), dtype=torch.float32).eval()
    if std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name and p.dim() > 1:
                    p.normal_(0, std)
    return model


@pytest.fixture(scope="module", params=[*DENSE, *ADAPTED, "gemma4", *GENERIC])
def family(request):
    """(family name, model, its TargetModel, two prompts)."""
    model = family_model(request.param)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 5)]
    return request.param, model, TargetModel(model), prompts


def hf_greedy(model, prompt, max_new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_a_window_keeps_the_last_keys_each_query_sees_as_a_grid():
    """Slots 0-3 hold committed positions 0-3; a tree step writes its root r (position 4) and nodes a, b (5, children
    of r) and c (6, child of a) at slots 4-7. A 3-token window keeps, of the keys each query sees, the last three:
    those at positions > its own - 3, whatever slots they sit in."""
    from draftsmith.models.targets.base import windowed

    sees = torch.tensor([  # slot: 0  1  2  3  r  a  b  c
        [1, 1, 1, 1, 1, 0, 0, 0],  # r
        [1, 1, 1, 1, 1, 1, 0, 0],  # a
        [1, 1, 1, 1, 1, 0, 1, 0],  # b
        [1, 1, 1, 1, 1, 1, 0, 1],  # c
    ], dtype=torch.bool)[None, None]
    window = torch.tensor([
        [0, 0, 1, 1, 1, 0, 0, 0],  # r at 4: positions 2, 3, 4
        [0, 0, 0, 1, 1, 1, 0, 0],  # a at 5: 3, 4, 5
        [0, 0, 0, 1, 1, 0, 1, 0],  # b at 5: 3, 4, 5
        [0, 0, 0, 0, 1, 1, 0, 1],  # c at 6: 4, 5, 6
    ], dtype=torch.bool)[None, None]
    assert torch.equal(windowed(sees, 3), window)


def test_default_aux_layer_ids_follow_vllm_for_every_family():
    """vLLM 0.32 captures (2, L // 2, L - 3) for all of these (SupportsEagle3's default, which qwen3_moe.py, gpt_oss.py
    and gemma4.py do not override), in the capture convention; SGLang's output ids (each - 1) are the export's."""
    for name in (*ADAPTED, "gemma4", "phi3"):
        target = TargetModel(family_model(name, hidden=32, layers=12, std=0.0))
        assert default_aux_layer_ids(target.num_layers) == [2, 6, 9], name


def test_each_family_gets_its_adapter_and_the_rest_the_generic_path(family):
    name, _, target, _ = family
    assert (target.family is None) == (name in GENERIC)
    assert context_length_of(target.config) == 256  # windows are applied exactly: they bound no context


def test_runtime_greedy_equals_transformers_generate(family):
    """Plain decoding through the runtime's cache is transformers' greedy decoding, token for token, 3x past the
    8-token windows."""
    _, model, target, prompts = family
    plain = SpeculativeGenerator(target, None, 0)
    for prompt in prompts:
        want = hf_greedy(model, prompt, 24)
        assert plain.generate(torch.tensor([prompt]), 24).token_ids == want
    assert len(set(want)) > 4  # a varied output, not one token repeated


def test_cached_steps_and_capture_equal_the_full_forward(family):
    """Aux features (id k = the residual stream entering layer k, id L before the final norm) from cached steps of
    several widths and from training's capture equal transformers' hidden states."""
    _, model, target, prompts = family
    ids = torch.tensor([prompts[0] + prompts[1] * 2])  # 19 tokens
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    layers = target.num_layers
    cache = target.new_cache(1, 32)
    outs = [target.step(ids[:, a:b], cache, aux_layer_ids=[1, layers]) for a, b in ((0, 7), (7, 8), (8, 19))]
    logits = torch.cat([o.logits for o in outs], dim=1)
    aux = torch.cat([o.aux_hidden for o in outs], dim=1)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=1e-4)
    h = target.hidden_size
    torch.testing.assert_close(aux[..., :h], ref.hidden_states[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(target.final_norm(aux[..., h:]), ref.hidden_states[layers], atol=1e-5, rtol=1e-5)
    captured = target.capture(ids, aux_layer_ids=[1, layers])
    torch.testing.assert_close(captured.aux_hidden, aux, atol=1e-4, rtol=1e-4)


def test_ngram_speculation_equals_plain_greedy(family):
    _, _, target, prompts = family
    plain = SpeculativeGenerator(target, None, 0)
    speculative = SpeculativeGenerator(target, NgramProposer(1, 3, 4), 4)
    accepted = drafted = 0
    for prompt in prompts:  # 40 tokens: long enough for the random target to repeat itself
        want = plain.generate(torch.tensor([prompt]), 40).token_ids
        got = speculative.generate(torch.tensor([prompt]), 40)
        assert got.token_ids == want
        accepted += got.metrics.num_accepted_tokens
        drafted += got.metrics.num_draft_tokens
    assert 0 < accepted < drafted  # drafts accepted and rejected: rollback ran


@pytest.mark.parametrize("name", ADAPTED)
def test_batches_with_holes_and_draft_trees_equal_single_runs(name):
    """Rows accepting different numbers of drafts (holes, defragmentation) and draft trees: each row's windowed
    attention sees exactly what it sees alone, for every family with an adapter."""
    model = family_model(name)
    target = TargetModel(model)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 11, 2, 8)]
    plain = SpeculativeGenerator(target, None, 0)
    references = [p + plain.generate(torch.tensor([p]), 30).token_ids for p in prompts]

    def chains(rows):
        return SpeculativeGenerator(target, ChainOracle([references[r] for r in rows],
                                                        [[[4], [0], [1, 3, 0], [2]][r] for r in rows], 128), 4)

    batch = assert_same_as_alone(chains, prompts, 26)
    assert [r.metrics.num_accepted_tokens > 0 for r in batch] == [True, False, True, True]

    def trees(rows):
        return SpeculativeGenerator(target, OracleTreeProposer([references[r] for r in rows], [3, 0, 2, 1], 128), 6)

    batch = assert_same_as_alone(trees, prompts, 24)
    assert all(r.metrics.num_accepted_tokens_per_pos[2] > 0 for r in batch)
    for prompt, result in zip(prompts, batch):
        assert result.token_ids == hf_greedy(model, prompt, 24)


@pytest.mark.parametrize("name", ADAPTED)
def test_static_step_ignores_stale_cache_entries(name):
    """The shape-static step (what CUDA graphs replay) attends over the whole cache masked by position: K/V left by
    a rejected draft, and keys outside the windows, change nothing."""
    model = family_model(name)
    target = TargetModel(model)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = target.new_cache(1, 32)
    target.step(ids[:, :14], cache)
    target.step(torch.randint(3, 128, (1, 5)), cache)  # rejected
    cache.rollback(14)
    positions = torch.arange(14, 20)[None]
    logits, aux = target._layers_forward(ids[:, 14:], positions, cache, None, None, None, (2,), None)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, ref.logits[:, 14:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux, ref.hidden_states[2][:, 14:], atol=1e-5, rtol=1e-5)


def test_graph_paths_of_dense_gemma4_decode_what_transformers_decodes(recorded_graphs):
    """Dense Gemma 4 takes the CUDA-graph paths (here tests/test_graph_paths.py's stand-in recorder on the CPU):
    the pooled cache, the shape-static steps and the tree masks widened to the whole cache decode what
    transformers decodes; MoE families stay eager (their expert loop reads on the host which experts were hit)."""
    model = family_model("gemma4_text", enable_moe_block=False)
    target = TargetModel(model)
    assert target._graphs_on and not TargetModel(family_model("gpt_oss"))._graphs_on
    prompt = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    want = hf_greedy(model, prompt, 24)
    reference = prompt + want + [0] * 8
    for proposer, k in ((None, 0), (NgramProposer(1, 3, 4), 4), (OracleTreeProposer([reference], [3, 0, 2, 1], 128), 6)):
        assert SpeculativeGenerator(target, proposer, k).generate(torch.tensor([prompt]), 24).token_ids == want
    assert len(recorded_graphs) >= 3  # decode, verify and tree steps were recorded


# ---- EAGLE-3 ------------------------------------------------------------------------------------------------------
def trained_eagle3(target, sequences, steps):
    """An EAGLE-3 drafter trained `steps` full-batch steps on `sequences` (token lists of one length): the target's
    own greedy outputs, so it learns to draft what the target will say."""
    from draftsmith.models.eagle3.config import Eagle3Config
    from draftsmith.models.eagle3.loss import teacher_targets
    from draftsmith.models.eagle3.model import Eagle3Drafter, init_drafter_from_target

    vocab = target.vocab_size
    config = Eagle3Config.from_target(target.config, vocab)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    drafter.set_draft_vocab(torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    init_drafter_from_target(drafter, target.lm_head.weight.float())
    ids = torch.tensor(sequences)
    captured = target.capture(ids, aux_layer_ids=config.aux_layer_ids)
    teacher, in_draft = teacher_targets(captured.last_hidden, target.lm_head, drafter.t2d,
                                        draft_ids=torch.arange(vocab))
    embeds = target.embed_tokens(ids)
    targets = dict(teacher_draft_logits=teacher, teacher_in_draft=in_draft, loss_mask=torch.ones_like(ids))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = drafter(captured.aux_hidden, embeds, 3, loss_targets=targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", [*DENSE, *ADAPTED, "gemma4", *GENERIC])
def test_eagle3_drafter_trained_on_the_target_is_lossless(name):
    from draftsmith.models.eagle3.proposer import Eagle3Proposer

    model = family_model(name)
    target = TargetModel(model)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (8,), generator=g).tolist() for _ in range(4)]
    plain = SpeculativeGenerator(target, None, 0)
    answers = [plain.generate(torch.tensor([p]), 24).token_ids for p in prompts]
    drafter = trained_eagle3(target, [p + a for p, a in zip(prompts, answers)], steps=80)
    generator = SpeculativeGenerator(target, Eagle3Proposer(drafter, target.embed_tokens), 3)
    accepted = drafted = 0
    for prompt, answer in zip(prompts, answers):
        result = generator.generate(torch.tensor([prompt]), 24)
        assert result.token_ids == answer
        accepted += result.metrics.num_accepted_tokens
        drafted += result.metrics.num_draft_tokens
    assert drafted // 4 < accepted < drafted  # a drafter that accepts, and rejections too


# ---- sampling keeps the target's distribution ------------------------------------------------------------------
def sampling_target(name):
    """The family at the sampling test's size: an 8-token vocabulary, 16 wide, 2 heads, a 3-token window where the
    family has one."""
    extra = dict(global_head_dim=16, hidden_size_per_layer_input=4) if name.startswith("gemma4") else {}
    heads = dict(num_key_value_heads=2 if name == "deepseek_v3" else 1)  # MLA: as many K/V heads as queries
    return TargetModel(family_model(name, vocab=8, hidden=16, std=0.5, num_attention_heads=2, head_dim=8,
                                    sliding_window=3, **heads, **extra))


def sample_one_at_a_time(target, proposer, k, params, length):
    """test_sampling.sample_sequences for a target that takes no batch (the generic path): its SAMPLES rows as
    SAMPLES generations of one prompt, each with its own seed, so the samples stay independent draws."""
    from dataclasses import replace

    from test_sampling import PROMPT, SAMPLES

    generator = SpeculativeGenerator(target, proposer, k)
    seeds = [params.seed * SAMPLES + i for i in range(SAMPLES)]
    prompt = torch.tensor([PROMPT])
    results = [generator.generate(prompt, length, sampling=replace(params, seed=seed)) for seed in seeds]
    assert all(len(r.token_ids) == length for r in results)
    return [tuple(r.token_ids) for r in results], results


@pytest.mark.slow
@pytest.mark.parametrize("name, scenario", [
    *((name, scenario) for name in (*DENSE, *ADAPTED, "gemma4")
      for scenario in ("probabilistic chain, top-p", "static tree")),
    *((name, "probabilistic chain, top-p") for name in GENERIC),  # chains only: the generic path refuses trees
])
def test_speculative_sampling_keeps_the_family_target_distribution(name, scenario):
    """tests/test_sampling.py's chi-square test on each family: an 8-token vocabulary, 4000 sampled continuations
    against the exact distribution enumerated with transformers' forward; a 3-token window (DeepSeek-V3 and the dense
    Qwen3, Mistral and Qwen2 configs have none), so the window cuts in within the 3-token prompt and the continuation. A family on the generic path samples its
    4000 continuations one request at a time (it takes no batch), each with its own seed."""
    from test_sampling import PROMPT, SAMPLES, SCENARIOS, chi_square, exact_distribution, sample_sequences

    target = sampling_target(name)
    assert (target.family is None) == (name in GENERIC)
    make, k, params, length = SCENARIOS[scenario]
    sample = sample_one_at_a_time if target.family is None else sample_sequences
    samples, results = sample(target, make(target), k, params, length)
    stat, critical = chi_square(samples, exact_distribution(target, PROMPT, length, params))
    assert stat < critical, f"{name}, {scenario}: chi-square {stat:.1f} >= {critical:.1f}"
    accepted = sum(r.metrics.num_accepted_tokens for r in results)
    assert 0 < accepted < sum(r.metrics.num_draft_tokens for r in results)
    assert sum(r.metrics.num_accepted_tokens_per_pos[1] for r in results) > 0
    if scenario != "static tree":  # as in test_sampling: rows whose one step accepted all k drafts end in the bonus
        assert length == k + 2
        bonus = sum(r.metrics.num_drafts == 1 and r.metrics.num_accepted_tokens == k for r in results)
        assert bonus >= SAMPLES // 100, f"{name}: {bonus} rows end with a bonus token"


# ---- FLOPs for MFU ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*ADAPTED, "deepseek_v3"])
def test_flops_of_moe_targets_count_the_experts_each_token_runs(name):
    """The count equals torch's FlopCounterMode on the target's forward: transformers' eager expert loop multiplies
    only the top-k experts of each token (and the shared ones, and the router), so counting all would not match."""
    from torch.utils.flop_counter import FlopCounterMode

    from draftsmith.models.flops import target_forward_flops

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(name), attn_implementation="eager",
                                             experts_implementation="eager")  # not grouped_mm: torch counts it not
    target = TargetModel(model.eval())
    b, s = 2, 20
    ids = torch.randint(3, 128, (b, s), generator=torch.Generator().manual_seed(5))
    with FlopCounterMode(display=False) as mode:
        target.capture(ids, None, [0])
    # eager attention multiplies the whole S x S square, so compare with the "full" count
    assert mode.get_total_flops() == pytest.approx(b * s * target_forward_flops(model.config, s, "full"), rel=1e-9)


def test_flops_of_published_moe_shapes_match_their_active_parameters():
    """2 FLOP per active weight: Qwen3-30B-A3B's 3.3B activated parameters (embeddings and head included) and
    gpt-oss-20b's 3.6B active (the head, not the input embedding, counted), against ~30B / ~21B with all experts."""
    from draftsmith.models.flops import target_forward_flops

    qwen = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          intermediate_size=6144, vocab_size=151936)
    active = target_forward_flops(qwen, 1) / 2 + 2 * qwen.vocab_size * qwen.hidden_size
    assert active == pytest.approx(3.3e9, rel=0.02)
    oss = GptOssConfig(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=64, num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880,
                       vocab_size=201088)
    assert target_forward_flops(oss, 1) / 2 + oss.vocab_size * oss.hidden_size == pytest.approx(3.6e9, rel=0.02)


# ---- the generic path -------------------------------------------------------------------------------------------
def test_generic_path_is_noted_once_and_refuses_what_it_cannot_serve(capsys):
    from draftsmith.models.targets import generic

    generic._noted.discard("phi3")
    target = TargetModel(family_model("phi3"))
    plain = SpeculativeGenerator(target, None, 0)
    plain.generate(torch.tensor([[5, 6, 7]]), 3)
    plain.generate(torch.tensor([[5, 6, 7]]), 3)
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "'phi3'" in note[0] and "transformers' own forward" in note[0]
    with pytest.raises(TargetError, match="'phi3' targets .* cannot take a batch .*one at a time"):
        plain.generate_batch([[5, 6, 7], [8, 9]], 3)
    tree = OracleTreeProposer([[5, 6, 7] + [9] * 10], [2], 128)
    with pytest.raises(TargetError, match="'phi3' targets .* cannot take a draft tree: use a chain"):
        SpeculativeGenerator(target, tree, 6).generate(torch.tensor([[5, 6, 7]]), 5)


def test_a_target_the_runtime_cannot_serve_exactly_is_one_line_naming_its_family():
    target = TargetModel(family_model("gemma4_text", use_bidirectional_attention="all"))
    with pytest.raises(TargetError, match="cannot serve this 'gemma4_text' target exactly: .*bidirectional"):
        SpeculativeGenerator(target, None, 0).generate(torch.tensor([[5, 6, 7]]), 3)


def test_compiled_layers_are_refused_for_families_without_them():
    with pytest.raises(TargetError, match="DRAFTSMITH_COMPILE=1 compiles the dense layers .* not 'gpt_oss'"):
        TargetModel(family_model("gpt_oss"), compile_layers=True)
