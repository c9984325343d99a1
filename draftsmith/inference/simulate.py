"""Acceptance of greedy EAGLE-3 chains over fixed greedy answers, without running the decoding loop.

With greedy verification the committed text is the target's greedy answer whatever the drafter proposes, and a
chain drafted from a committed prefix is exactly the TTT unroll at that position (`forward_ttt` equals the cached
runtime steps, tests/test_eagle3_model.py). So one teacher-forced forward of the drafter over prompt + answer
gives every chain the runtime would draft, and replaying the generator's step rule on them gives its counters:
`SpeculativeGenerator`'s `num_drafts`, `num_draft_tokens`, `num_accepted_tokens` and per-position counts, for
every k at once, at the cost of one forward per answer. The answers must be the target's own greedy output
(`plain_answers`) in the precision the drafter is evaluated in. The runtime counts as vLLM does, drafting k tokens
on a request's last step too and counting drafts accepted past max_new_tokens; for the simulation to see those,
`plain_answers(..., lookahead=K)` also records the target's next K greedy tokens after each answer (EOS or not).
Without them a draft past an answer's end counts as rejected.

The same holds in distribution for speculative *sampling* with greedy (one-hot) drafts, vLLM's default
`draft_sample_method`: accepting draft d with probability p(d) and otherwise sampling from norm(max(0, p - 1_d))
gives the same joint law as sampling y ~ p and accepting iff y == d. So over answers the target *sampled* at
temperature T, the simulated counters are distributed as the runtime's at that temperature (one sample each).

Benchmarks use it to rank many drafters cheaply; `draftsmith eval` remains the measurement of the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.runtime.metrics import SpecDecodingMetrics


@torch.no_grad()
def plain_answers(target, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: set[int],
                  temperature: float = 0.0, seed: int = 0, lookahead: int = 0):
    """The target's plain answers (generated tokens, EOS kept), as the runtime's plain decoding gives them: greedy,
    or sampled at `temperature` with seed `seed + i` for prompt i. With `lookahead` (greedy only), also each
    answer followed by the target's next `lookahead` greedy tokens, past an EOS too: (answers, extended)."""
    from draftsmith.inference.generator import SpeculativeGenerator
    from draftsmith.runtime.sampling import SamplingParams

    if lookahead and temperature > 0:
        raise ValueError("plain_answers: lookahead is defined for greedy answers only")
    plain = SpeculativeGenerator(target, None, 0)
    answers, extended = [], []
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(temperature=temperature, seed=seed + i) if temperature > 0 else None
        answer = plain.generate(torch.tensor([prompt]), max_new_tokens, eos_ids, sampling).token_ids
        answers.append(answer)
        if lookahead:  # greedy: the same tokens again, then the continuation an EOS would have stopped
            longer = plain.generate(torch.tensor([prompt]), len(answer) + lookahead, set()).token_ids
            extended.append(longer)
    return (answers, extended) if lookahead else answers


@torch.no_grad()
def chain_correctness(target, drafter, prompt: Sequence[int], answer: Sequence[int], depth: int) -> torch.Tensor:
    """(depth, P + N) bool: correct[i, t] = the chain drafted from drafter position t proposes, at its step i, the
    answer's token at t + 2 + i (drafter position t holds (x_{t+1}, g_t), DESIGN.md §3)."""
    ids = torch.tensor([list(prompt) + list(answer)], device=target.device)  # (1, L)
    length = ids.shape[1]
    dtype = next(drafter.parameters()).dtype
    captured = target.capture(ids, None, drafter.config.aux_layer_ids)
    embeds = target.embed_tokens(ids).to(dtype)  # (1, L, H)
    step_logits = drafter.forward_ttt(captured.aux_hidden.to(dtype), embeds, depth)
    correct = torch.zeros(depth, length, dtype=torch.bool, device=ids.device)
    for i, logits in enumerate(step_logits):
        draft = drafter.draft_to_target(logits[0].float().argmax(-1))  # (L,) target ids
        span = length - 2 - i  # positions t whose token t + 2 + i exists
        if span > 0:
            correct[i, :span] = draft[:span] == ids[0, 2 + i:]
    return correct


def replay_chains(correct: torch.Tensor, prompt_length: int, answer_length: int, k: int) -> SpecDecodingMetrics:
    """The generator's step rule (generator.py, vLLM's) on known chain correctness: draft k tokens from the last
    committed token, accept the leading correct ones (counted also where they pass the answer's end), commit them
    and the bonus token, until the answer (EOS or max_new_tokens) is complete."""
    metrics = SpecDecodingMetrics(num_spec_tokens=k)
    correct = correct.cpu()
    generated = 1  # the prefill's token
    while generated < answer_length:
        t = prompt_length + generated - 2  # drafter position of the last committed token
        accepted = 0
        while accepted < k and t < correct.shape[1] and bool(correct[accepted, t]):
            accepted += 1
        metrics.observe_draft(k, accepted)
        generated += accepted + 1
    return metrics


def simulate_greedy_chains(target, drafter, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                           ks: Sequence[int], extended: Sequence[Sequence[int]] | None = None
                           ) -> dict[int, SpecDecodingMetrics]:
    """{k: counters summed over the prompts} of greedy-drafted EAGLE-3 chains of length k, as `SpeculativeGenerator`
    would count them when decoding `prompts` into `answers` (greedy answers: exactly, given `extended` with a
    lookahead of max(ks) from `plain_answers`; sampled ones: in law)."""
    depth = max(ks)
    totals = {k: SpecDecodingMetrics(num_spec_tokens=k) for k in ks}
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        if not answer:
            continue
        text = extended[i] if extended is not None else answer
        correct = chain_correctness(target, drafter, prompt, text, depth)
        for k in ks:
            totals[k] = totals[k].merge(replay_chains(correct, len(prompt), len(answer), k))
    return totals
