"""EAGLE-3 in the runtime: a drafter that accepts leaves greedy output unchanged on the real fixture target, and
the drafter loads from draftsmith's checkpoint and from the exported native format alike."""

import pytest
import torch
from torch import nn

from draftsmith.inference.eval import load_prompts
from draftsmith.inference.generator import SpeculativeGenerator
from draftsmith.inference.spec_config import build_proposer, parse_spec_config
from draftsmith.models.checkpoint import save_safetensors_atomic, write_json_atomic
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.export import export_native_eagle3
from draftsmith.models.eagle3.io import load_drafter
from draftsmith.models.eagle3.model import Eagle3Drafter
from draftsmith.models.target import TargetModel


def untrained_drafter(target, draft_vocab=2000, seed=0):
    """An eval-mode EAGLE-3 drafter for `target` with random weights and a random draft vocabulary."""
    torch.manual_seed(seed)
    config = Eagle3Config.from_target(target.config, draft_vocab, target_name_or_path=target.name_or_path)
    drafter = Eagle3Drafter(config).eval()
    for name, p in drafter.named_parameters():
        if "norm" not in name:
            nn.init.normal_(p, std=0.05)
    used = torch.randperm(target.vocab_size)[:draft_vocab].sort().values
    drafter.d2t.copy_(used - torch.arange(draft_vocab))
    drafter.t2d[used] = True
    return drafter


def untrained_checkpoint(folder, target, draft_vocab=2000, seed=0):
    """`untrained_drafter` saved as a draftsmith checkpoint folder; returns (folder, drafter)."""
    drafter = untrained_drafter(target, draft_vocab, seed)
    folder.mkdir(parents=True)
    tensors = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    save_safetensors_atomic(tensors, folder / "model.safetensors")
    write_json_atomic(drafter.config.to_dict(), folder / "config.json")
    return folder, drafter


@pytest.fixture
def fixture_target(fixture_target_dir):
    return TargetModel.from_pretrained(fixture_target_dir, dtype="float32", device="cpu")


@pytest.fixture
def prompts(fixture_target_dir, mt_bench_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixture_target_dir)
    return load_prompts(mt_bench_path, tokenizer, limit=3), tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
def test_eagle3_is_lossless_with_a_drafter_that_accepts(fixture_prompts, accepting_drafter, k):
    """Greedy output equals plain decoding with a drafter that accepts a fair share of its drafts, so accepted,
    partly accepted and rejected chains all ran (an untrained drafter proves only the rejection path)."""
    from conftest import generate_lossless

    target, _, prompts, answers, eos = fixture_prompts
    spec = parse_spec_config({"method": "eagle3", "model": str(accepting_drafter("eagle3")),
                              "num_speculative_tokens": k})
    m = generate_lossless(target, build_proposer(spec, target), k, prompts, answers, eos)
    assert m.num_accepted_tokens >= 10 * k  # accepted drafts (34 at k=1, 53 at k=4 when this was written)
    assert m.num_accepted_tokens < m.num_draft_tokens  # and rejected ones: rollback ran
    if k > 1:
        assert 0 < m.num_accepted_tokens_per_pos[-1] < m.num_accepted_tokens_per_pos[0]  # partial chains too
    per_pos = m.num_accepted_tokens_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and sum(per_pos) == m.num_accepted_tokens


def test_drafter_that_copies_the_target_is_fully_accepted(tmp_path, fixture_target, prompts):
    """A stand-in 'perfect drafter' check of the bookkeeping: with a proposer that drafts the target's own greedy
    tokens, every draft is accepted and mean acceptance length is k + 1 (up to the end of generation)."""
    prompt_ids, tokenizer = prompts
    plain = SpeculativeGenerator(fixture_target, None, 3)
    ids = torch.tensor([prompt_ids[0]])
    reference = prompt_ids[0] + plain.generate(ids, 30).token_ids

    class Oracle:
        aux_layer_ids = None

        def begin(self, prompt, sampler=None):
            self.n = 1  # context length = 1 + tokens paired so far (the prefill restates the prompt)

        def extend(self, token_ids, aux):
            self.n += token_ids.shape[1]

        def propose(self, k):
            from draftsmith.runtime.proposer import Proposal

            drafts = reference[self.n: self.n + k]
            return Proposal(torch.tensor([drafts]), torch.tensor([len(drafts)]))

    got = SpeculativeGenerator(fixture_target, Oracle(), 3).generate(ids, 30)
    assert got.token_ids == reference[len(prompt_ids[0]):]
    assert got.metrics.num_accepted_tokens == got.metrics.num_draft_tokens
    assert got.metrics.mean_acceptance_length > 3.5


def test_native_export_loads_back_identically(tmp_path, fixture_target):
    folder, drafter = untrained_checkpoint(tmp_path / "ckpt", fixture_target)
    export_native_eagle3(folder, tmp_path / "native", dtype=None)  # fp32 kept: bit-identical weights
    loaded = load_drafter(tmp_path / "native")
    ours = load_drafter(folder)
    assert loaded.config.aux_layer_ids == ours.config.aux_layer_ids == [2, 4, 5]
    aux = torch.randn(1, 5, 3 * fixture_target.hidden_size)
    emb = torch.randn(1, 5, fixture_target.hidden_size)
    with torch.no_grad():
        for a, b in zip(loaded.forward_ttt(aux, emb, 2), ours.forward_ttt(aux, emb, 2)):
            torch.testing.assert_close(a, b)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
