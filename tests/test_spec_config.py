"""Speculative config: vLLM's keys and defaults, strict errors, the NPU limit, and the proposer table."""

import json

import pytest

from draftsmith import device as dev
from draftsmith.inference.ngram import NgramProposer
from draftsmith.inference.spec_config import MODEL_FREE_PROPOSERS, SpecConfigError, build_proposer, parse_spec_config


def parse(d, device_type="cpu"):
    return parse_spec_config(d, device_type=device_type)


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, (5, 5)),  # vLLM: both 5 when neither is given
        ({"prompt_lookup_max": 3}, (3, 3)),  # vLLM: the missing bound takes the other's value
        ({"prompt_lookup_min": 2}, (2, 2)),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
    ],
)
def test_ngram_prompt_lookup_defaults_follow_vllm(given, expected):
    spec = parse({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == expected


def test_json_string_and_ignored_vllm_keys():
    spec = parse('{"method": "eagle3", "model": "/ckpt", "num_speculative_tokens": 3, '
                 '"max_model_len": 4096, "enforce_eager": true}')
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle3", "/ckpt", 3)
    assert spec.to_dict() == {"method": "eagle3", "model": "/ckpt", "num_speculative_tokens": 3}


def test_vllm_ascend_deployment_keys_are_checked_kept_and_recommended_back():
    """draft_tensor_parallel_size (vLLM and vllm-ascend: 1 or the target's TP; draftsmith's runtime is one device)
    and disable_padded_drafter_batch: accepted, kept in the config, and in the --speculative-config that `draftsmith
    eval` recommends, when given; absent when not."""
    from draftsmith.inference.report import recommend

    given = {"method": "eagle", "model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1,
             "disable_padded_drafter_batch": True}
    spec = parse(given)
    assert (spec.draft_tensor_parallel_size, spec.disable_padded_drafter_batch) == (1, True)
    assert spec.to_dict() == given
    row = {"method": "eagle", "num_speculative_tokens": 3, "speedup": 2.0, "tokens_per_second": 200.0,
           "spec_config": spec.to_dict(), "metrics": {"mean_acceptance_length": 2.5}}
    assert json.loads(recommend({"results": [row]})["vllm_speculative_config"]) == given
    plain = parse({"method": "eagle", "model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": None})
    assert "draft_tensor_parallel_size" not in plain.to_dict() and "disable_padded_drafter_batch" not in plain.to_dict()


def test_vllms_mtp_model_type_names_are_mtp():
    """vLLM still takes its MTP model types as the method ("deprecated and replaced with mtp")."""
    for name in ("deepseek_mtp", "qwen3_next_mtp", "glm4_moe_mtp"):
        assert parse({"method": name, "num_speculative_tokens": 1}).method == "mtp"


@pytest.mark.parametrize(
    "raw, message",
    [
        ('{"method": "ngram",', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"method": "ngram", "num_speculative_token": 3}, "unknown key 'num_speculative_token' "
                                                          r"\(did you mean 'num_speculative_tokens'\?\)"),
        ({"method": "ngram"}, "'num_speculative_tokens' is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer > 0"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer > 0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
        ({"method": "dflash", "num_speculative_tokens": 2}, "'dflash' needs 'model'"),
        ({"method": "eagel3", "num_speculative_tokens": 2}, r"unknown method 'eagel3' \(did you mean 'eagle3'\?\)"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "spec_token_tree": "[]"}, "not supported"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' needs 'model'"),
        ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
         "draft_tensor_parallel_size 2: draftsmith's runtime runs the drafter on one device"),
        ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
         "draft_tensor_parallel_size must be an integer > 0"),
        ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "disable_padded_drafter_batch": "yes"},
         "disable_padded_drafter_batch must be true or false"),
    ],
)
def test_bad_configs_give_one_line_errors(raw, message):
    with pytest.raises(SpecConfigError, match=message) as info:
        parse(raw)
    assert "\n" not in str(info.value)


def test_npu_limits_verified_tokens_to_16(monkeypatch):
    monkeypatch.setattr(dev, "accelerator_type", lambda: "npu")
    assert parse_spec_config({"method": "ngram", "num_speculative_tokens": 15}).num_speculative_tokens == 15
    with pytest.raises(SpecConfigError, match=r"k \+ 1 <= 16"):
        parse_spec_config({"method": "ngram", "num_speculative_tokens": 16})
    monkeypatch.setattr(dev, "accelerator_type", lambda: "cuda")
    assert parse_spec_config({"method": "ngram", "num_speculative_tokens": 16}).num_speculative_tokens == 16


def test_build_proposer_uses_the_table():
    proposer = build_proposer(parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}), None)
    assert isinstance(proposer, NgramProposer)
    assert (proposer.prompt_lookup_min, proposer.prompt_lookup_max, proposer.num_speculative_tokens) == (3, 3, 4)


@pytest.mark.parametrize("method", sorted(MODEL_FREE_PROPOSERS))
def test_every_model_free_proposer_has_from_config(method):
    assert callable(getattr(MODEL_FREE_PROPOSERS[method], "from_config"))


