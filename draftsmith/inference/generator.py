"""Verified speculative generation: propose, verify with one target step, commit, roll the cache back, repeat.

Greedy and lossless: every committed token is the target's argmax given the tokens before it, so the output
equals plain greedy decoding of the target (up to floating-point ties) whatever the proposer drafts.
With `proposer=None` the same loop is plain greedy decoding, the baseline speedups are measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.inference.metrics import SpecDecodingMetrics
from draftsmith.inference.proposer import PAD_DRAFT_TOKEN, Proposal, Proposer
from draftsmith.inference.verify import greedy_verify


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (EOS kept when it ended the output)
    metrics: SpecDecodingMetrics
    num_target_steps: int  # target forward passes, prefill included
    seconds: float  # wall time of the whole generation, prefill included


class SpeculativeGenerator:
    def __init__(self, target, proposer: Proposer | None, num_speculative_tokens: int):
        if proposer is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with a proposer, got {num_speculative_tokens}")
        self.target = target
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0

    @torch.no_grad()
    def generate(
        self, prompt_ids: Tensor, max_new_tokens: int, eos_token_ids: set[int] | None = None
    ) -> GenerationResult:
        """Greedy-decode up to `max_new_tokens` tokens after `prompt_ids` (1, S), stopping after an EOS token.

        Cache bookkeeping, with c = committed tokens (prompt + generated): the target cache holds positions
        0..c-2; the last committed token is not in it yet and is the first input of the next step::

            step input   [last, d_0 .. d_w-1]      positions c-1 .. c-1+w      cache: c-1 -> c+w
            verified     a drafts accepted + 1 recovered/bonus token
            committed    c -> c + a + 1            cache rolled back to c + a (bonus not in it)
        """
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
            raise ValueError(
                f"generate: prompt_ids must be (1, S) with S >= 1 (batch size 1 for now), got {tuple(prompt_ids.shape)}"
            )
        target, proposer, k = self.target, self.proposer, self.k
        metrics = SpecDecodingMetrics(num_spec_tokens=k)
        eos = eos_token_ids or set()
        start_time = time.perf_counter()
        if max_new_tokens <= 0:
            return GenerationResult([], metrics, 0, time.perf_counter() - start_time)

        prompt_ids = prompt_ids.to(target.device, torch.long)
        aux_ids = proposer.aux_layer_ids if proposer is not None else None
        cache = target.new_cache(1, prompt_ids.shape[1] + max_new_tokens + k + 1)

        out = target.step(prompt_ids, cache, aux_layer_ids=aux_ids, logits_to_keep=1)
        last = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1) first generated token
        output = [int(last.item())]
        steps = 1
        if proposer is not None:
            proposer.begin(prompt_ids)
            # Feature at prompt position i pairs with the token at i+1; the last one with the first generated token.
            proposer.extend(torch.cat([prompt_ids[:, 1:], last], dim=1), out.aux_hidden)

        while output[-1] not in eos and len(output) < max_new_tokens:
            remaining = max_new_tokens - len(output)
            # Never draft past max_new_tokens: the a + 1 committed tokens then always fit.
            num_drafts = min(k, remaining - 1)
            proposal = proposer.propose(num_drafts) if proposer is not None and num_drafts > 0 else Proposal.empty(1)
            drafts, lengths = _step_drafts(proposal, num_drafts, target.device)

            base = cache.length  # = c - 1
            padded = drafts.masked_fill(drafts == PAD_DRAFT_TOKEN, 0)  # pad slots get any valid id; never accepted
            step_ids = torch.cat([last, padded], dim=1)  # (1, 1+w)
            out = target.step(step_ids, cache, aux_layer_ids=aux_ids)  # logits (1, 1+w, V)
            accepted, tokens, _ = greedy_verify(drafts, lengths, out.logits)
            # The one host sync of the step: accepted count, draft length, and the committed tokens.
            accepted_n, drafted_n, *row = torch.cat([accepted, lengths, tokens[0]]).tolist()
            steps += 1
            new_tokens = row[: accepted_n + 1]
            cache.rollback(base + accepted_n + 1)
            if drafted_n > 0:  # a step with no drafts is not a draft (vLLM)
                metrics.observe_draft(drafted_n, accepted_n)

            hit = next((i for i, t in enumerate(new_tokens) if t in eos), None)
            if hit is not None:
                output.extend(new_tokens[: hit + 1])
                break
            output.extend(new_tokens)
            last = tokens[:, accepted_n : accepted_n + 1]  # (1, 1) recovered or bonus token
            if proposer is not None and len(output) < max_new_tokens:
                aux = out.aux_hidden[:, : accepted_n + 1] if out.aux_hidden is not None else None  # (1, a+1, F)
                proposer.extend(tokens[:, : accepted_n + 1], aux)

        return GenerationResult(output, metrics, steps, time.perf_counter() - start_time)


def _step_drafts(proposal: Proposal, num_drafts: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Drafts to verify this step, (1, w) on `device`, and their lengths (1,).

    Lengths a proposer keeps on the CPU (n-gram) are read for free and the drafts cut to them, so a step with
    no match costs one token like plain decoding. Lengths on an accelerator are not read (that would be a
    second sync); the full width is verified and the lengths mask the padding.
    """
    token_ids, lengths = proposal.token_ids[:, :num_drafts], proposal.lengths.clamp_max(num_drafts)
    if token_ids.shape[0] != 1:
        raise ValueError(f"proposer returned {token_ids.shape[0]} rows for 1 request")
    if lengths.device.type == "cpu":
        token_ids = token_ids[:, : int(lengths.max())]
    token_ids = token_ids.to(device, torch.long)
    return token_ids, lengths.to(device, torch.long)
