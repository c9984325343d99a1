"""Speculative-decoding counters with vLLM's names and definitions (vllm/v1/spec_decode/metrics.py).

Reporting exactly what vLLM reports lets a number measured here be compared with one read from a vLLM server's
`vllm:spec_decode_*` counters without translation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodingMetrics:
    """Counters over many verification steps.

    Definitions (vLLM's):
      * a *draft* is one verification step in which the proposer drafted at least one token. A step where it
        drafted nothing (no n-gram match, or no room left before max_new_tokens) is not a draft and is not
        observed: vLLM counts drafts only for requests that were scheduled with draft tokens;
      * `num_draft_tokens`: tokens proposed, summed over drafts;
      * `num_accepted_tokens`: draft tokens accepted, summed over drafts; the bonus token is *not* included;
      * `num_accepted_tokens_per_pos[i]`: drafts in which at least i+1 tokens were accepted (prefix counts, so
        the list is non-increasing);
      * mean acceptance length = 1 + accepted / drafts: tokens committed per draft, bonus included, in [1, k+1];
      * draft acceptance rate = accepted / draft tokens;
      * per-position acceptance[i] = per_pos[i] / drafts: the unconditional probability that the first i+1
        drafts were all accepted.
    The Prometheus names are `vllm:spec_decode_<counter>` (plus `_total` in the exposition format).
    """

    num_spec_tokens: int  # k: the length of `num_accepted_tokens_per_pos`
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        missing = self.num_spec_tokens - len(self.num_accepted_tokens_per_pos)
        self.num_accepted_tokens_per_pos = list(self.num_accepted_tokens_per_pos) + [0] * max(0, missing)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one verification step that checked `num_draft_tokens` drafts and accepted the first
        `num_accepted_tokens` of them (bonus excluded)."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"observe_draft: need 0 <= accepted ({num_accepted_tokens}) <= drafted ({num_draft_tokens}) "
                f"<= num_spec_tokens ({self.num_spec_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def merge(self, other: "SpecDecodingMetrics") -> "SpecDecodingMetrics":
        """Counters of both runs summed (e.g. over prompts); a new object, the inputs are left alone."""
        k = max(self.num_spec_tokens, other.num_spec_tokens)
        per_pos = [0] * k
        for counts in (self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos):
            for i, c in enumerate(counts):
                per_pos[i] += c
        return SpecDecodingMetrics(
            num_spec_tokens=k,
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            num_accepted_tokens_per_pos=per_pos,
        )

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    @property
    def per_position_acceptance(self) -> list[float]:
        if not self.num_drafts:
            return [math.nan] * self.num_spec_tokens
        return [c / self.num_drafts for c in self.num_accepted_tokens_per_pos]

    def to_dict(self) -> dict[str, Any]:
        """vLLM's counter names plus the derived values; undefined ratios (no drafts) are None, not NaN,
        so the dict is valid JSON."""

        def finite(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {
            "num_spec_tokens": self.num_spec_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": finite(self.mean_acceptance_length),
            "draft_acceptance_rate": finite(self.draft_acceptance_rate),
            "per_position_acceptance": [finite(x) for x in self.per_position_acceptance],
        }

    def log_line(self, elapsed_seconds: float | None = None) -> str:
        """The line vLLM's SpecDecodingLogging prints; throughputs are 0 when no elapsed time is given."""
        draft_tps = self.num_draft_tokens / elapsed_seconds if elapsed_seconds else 0.0
        accepted_tps = self.num_accepted_tokens / elapsed_seconds if elapsed_seconds else 0.0
        rates = ", ".join(f"{p:.3f}" for p in self.per_position_acceptance)
        return (
            "SpecDecoding metrics: "
            f"Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {accepted_tps:.2f} tokens/s, "
            f"Drafted throughput: {draft_tps:.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, "
            f"Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {self.draft_acceptance_rate * 100:.1f}%"
        )
