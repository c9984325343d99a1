"""Speculative config: vLLM's keys and defaults, strict errors, the NPU limit, and the proposer table."""


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
                 '"draft_tensor_parallel_size": 1, "max_model_len": 4096, "enforce_eager": true}')
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle3", "/ckpt", 3)
    assert spec.to_dict() == {"method": "eagle3", "model": "/ckpt", "num_speculative_tokens": 3}


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


