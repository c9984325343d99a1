"""TargetModel: capture follows the aux-layer convention; the cached step forward equals transformers' forward."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from draftsmith.models.target import TargetError, TargetModel


def _tiny(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = LlamaConfig(**common) if kind == "llama" else Qwen3Config(head_dim=16, **common)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_capture_follows_hf_hidden_states_convention(kind):
    model = _tiny(kind)
    target = TargetModel(model)
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    got = target.capture(ids, aux_layer_ids=[0, 2, 4])
    # id k = hidden_states[k] (the residual stream entering layer k); id L = last layer output *before* the norm.
    torch.testing.assert_close(got.aux_hidden[..., :64], ref.hidden_states[0])
    torch.testing.assert_close(got.aux_hidden[..., 64:128], ref.hidden_states[2])
    pre_norm = got.aux_hidden[..., 128:]
    torch.testing.assert_close(model.model.norm(pre_norm), ref.hidden_states[4])
    # last_hidden is the normed state: lm_head(last_hidden) gives the target's logits, no double norm.
    torch.testing.assert_close(model.lm_head(got.last_hidden), ref.logits)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cached_step_matches_full_forward(kind):
    model = _tiny(kind)
    target = TargetModel(model)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    cache = target.new_cache(1, 32)
    first = target.step(ids[:, :7], cache, aux_layer_ids=[1, 3])
    second = target.step(ids[:, 7:], cache, aux_layer_ids=[1, 3])
    logits = torch.cat([first.logits, second.logits], dim=1)
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    aux = torch.cat([first.aux_hidden, second.aux_hidden], dim=1)
    torch.testing.assert_close(aux, torch.cat([ref.hidden_states[1], ref.hidden_states[3]], -1), atol=1e-5, rtol=1e-5)
    assert cache.length == 12


def test_rollback_discards_rejected_positions():
    model = _tiny("llama")
    target = TargetModel(model)
    ids = torch.randint(0, 128, (1, 9))
    cache = target.new_cache(1, 32)
    target.step(ids[:, :5], cache)
    target.step(torch.randint(0, 128, (1, 3)), cache)  # a rejected draft
    cache.rollback(5)
    out = target.step(ids[:, 5:], cache, logits_to_keep=1)
    with torch.no_grad():
        ref = model(ids).logits[:, -1:]
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        cache.rollback(20)


def test_aux_id_out_of_range_is_a_clear_error():
    target = TargetModel(_tiny("llama"))
    with pytest.raises(TargetError, match="outside 0..4"):
        target.capture(torch.zeros(1, 3, dtype=torch.long), aux_layer_ids=[1, 5])
    with pytest.raises(TypeError, match="needs aux_layer_ids"):  # each method names its own; no EAGLE-3 default
        target.capture(torch.zeros(1, 3, dtype=torch.long))


def test_static_step_ignores_stale_cache_entries():
    """The shape-static step (what CUDA graphs replay) attends over the whole cache masked by position, so K/V
    left behind by a rejected draft must not change its result."""
    model = _tiny("qwen3")
    target = TargetModel(model)
    ids = torch.randint(0, 128, (1, 10))
    cache = target.new_cache(1, 24)
    assert torch.isfinite(cache.keys).all() and torch.isfinite(cache.values).all()  # masked slots are read too
    target.step(ids[:, :6], cache)
    target.step(torch.randint(0, 128, (1, 5)), cache)  # rejected: stale entries at positions 6..10
    cache.rollback(6)
    positions = torch.arange(6, 10).unsqueeze(0)
    logits, aux = target._layers_forward(ids[:, 6:], positions, cache, None, None, None, (2,), None)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, ref.logits[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, ref.hidden_states[2][:, 6:], atol=1e-5, rtol=1e-5)


def test_a_drafter_for_another_target_is_refused_with_both_shapes(tiny_llama):
    model, config = tiny_llama()
    target = TargetModel(model.float())
    vocab, hidden, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    target.check_drafter_fits("d", "drafter", vocab, hidden)  # fits: no error
    target.check_drafter_fits("m", "MTP drafter", vocab, hidden, layers)
    with pytest.raises(KeyError, match=f"d: drafter was trained for a target with vocab {vocab + 1} and hidden size "
                                       f"{hidden}; this target has vocab {vocab} and hidden size {hidden}"):
        target.check_drafter_fits("d", "drafter", vocab + 1, hidden, error=KeyError)
    with pytest.raises(ValueError, match=f"{layers + 1} layers; this target has .* and {layers} layers"):
        target.check_drafter_fits("m", "MTP drafter", vocab, hidden, layers + 1)


def test_grouped_attention_equals_attention_over_repeated_kv_heads():
    from draftsmith.kernels.attention import attend, grouped_attention

    torch.manual_seed(0)
    q = torch.randn(2, 8, 3, 16)
    keys, values = torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    mask = torch.rand(2, 1, 3, 11) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    for m in (mask, None):
        torch.testing.assert_close(grouped_attention(q, keys, values, m, 0.25), attend(q, keys, values, m, 0.25))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_static_layer_function_with_merged_projections_equals_module_step(kind):
    """The function DRAFTSMITH_COMPILE=1 compiles (uncompiled here) reads merged q/k/v and gate/up matrices; the
    modules' weights become views into them, so the module path is unchanged and both paths agree."""
    model = _tiny(kind)
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        want = model(ids).logits
    target = TargetModel(model, compile_layers=True)
    q_proj = model.model.layers[1].self_attn.q_proj
    merged = target._layer_weights[1].qkv[0][0]
    assert q_proj.weight.data_ptr() == merged.data_ptr() and merged.shape[0] == q_proj.weight.shape[0] + 2 * 2 * 16
    target._compiled_layer = target._layer_step
    cache = target.new_cache(1, 24)
    target.step(ids[:, :6], cache)
    logits, _ = target._layers_forward(ids[:, 6:], torch.arange(6, 10)[None], cache, None, None, None, (), None)
    torch.testing.assert_close(logits, want[:, 6:], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want)  # the module path still computes the same


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_targets_run_inside_the_window_and_are_refused_past_it(kind):
    """A Mistral-7B-v0.1-style config (`sliding_window` set, no `use_sliding_window` flag) used to run full
    attention past its window silently; inside the window both attentions are the same (issue 16, item 4)."""
    from transformers import MistralConfig, Qwen2Config

    from draftsmith.inference.generator import SpeculativeGenerator

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = (MistralConfig(sliding_window=24, **common) if kind == "mistral" else
              Qwen2Config(use_sliding_window=True, sliding_window=24, max_window_layers=2, **common))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    target = TargetModel(model)
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 10:].tolist()
    plain = SpeculativeGenerator(target, None, 0)
    assert plain.generate(ids, max_new_tokens=8).token_ids == ref  # 10 + 8 positions, inside the window of 24
    with pytest.raises(TargetError, match="sliding-window attention \\(24 tokens\\).*shorten it"):
        plain.generate(ids, max_new_tokens=20)  # would reach position 30: refused before the first token
    llama = TargetModel(_tiny("llama"))
    assert llama.new_cache(1, 1000).max_length >= 1000  # full-attention targets have no such limit


def test_a_target_config_that_does_not_describe_its_weights_is_one_line(tmp_path, fixture_target_dir):
    """Issue 47 item 14: a config.json whose sizes disagree with the weights was transformers' 64-line report and
    traceback; now one line naming the file, the tensor and both shapes, before any weight is allocated."""
    import json
    import shutil

    from draftsmith.models.target import TargetError, TargetModel

    folder = tmp_path / "target"
    shutil.copytree(fixture_target_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").chmod(0o644)
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    with pytest.raises(TargetError) as refused:
        TargetModel.from_pretrained(folder, dtype="float32", device="cpu")
    message = str(refused.value)
    assert "\n" not in message and "mlp" in message and "config.json makes it" in message, message
    assert f"({config['hidden_size']}, {config['intermediate_size']})" in message or \
        f"({config['intermediate_size']}, {config['hidden_size']})" in message
