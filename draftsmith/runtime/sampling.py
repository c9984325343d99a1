"""Sampling parameters and the one function that turns logits into the distribution tokens are drawn from.

Speculative sampling is lossless only if the target distribution `p` and the draft distribution `q` are the
*post-processing* distributions, after temperature, top-k and top-p, computed the same way for both (Leviathan
et al. 2023, arXiv 2211.17192; DESIGN.md §3 "Verification"). Everything that samples in the runtime therefore
goes through `Sampler.probs`, and every random draw through the same seeded `torch.Generator`.

Processing order (vLLM's): logits / temperature -> keep the top_k largest -> softmax -> keep the smallest set of
most likely tokens whose mass reaches top_p -> renormalise. Temperature 0 means greedy decoding: no
distribution, the runtime verifies by argmax instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TOP_K_OFF = (0, -1)  # vLLM: top_k 0 or -1 keeps the whole vocabulary
MIN_RACE = 1e-30  # floor of the exponential draws in `Sampler.sample`; any positive float32 works


class SamplingError(ValueError):
    """Sampling parameters that cannot be used; the message names the parameter."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax), as in vLLM
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = a fresh random seed per generation

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < float("inf"):
            raise SamplingError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise SamplingError(f"top_k must be an integer >= 1, or 0 / -1 for no limit, got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise SamplingError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SamplingError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed}


GREEDY = SamplingParams()


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The sampling distribution (..., V) float32 of `logits` (..., V) under temperature, top-k and top-p.

    Pure and vectorised over every leading dimension; ties at the top-k threshold are all kept (the same for
    target and draft, which is all losslessness needs).
    """
    if params.greedy:
        raise SamplingError("logits_to_probs: temperature 0 is greedy decoding and has no sampling distribution")
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if params.top_k not in TOP_K_OFF and params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (..., 1) smallest kept logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (..., V)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (..., V) mass of strictly likelier tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token always has mass_before 0: kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Sampler:
    """Sampling parameters plus the random stream of one generation (target and draft share it)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def probs(self, logits: Tensor) -> Tensor:
        return logits_to_probs(logits, self.params)

    def uniform(self, shape) -> Tensor:
        """U[0, 1) draws, float32, on the sampler's device."""
        return torch.rand(shape, generator=self.generator, device=self.device)

    def race(self, shape) -> Tensor:
        """Exp(1) draws (float32, on the sampler's device) for `sample`; drawn ahead when the sampling itself
        runs inside a CUDA graph, which must not draw from this generator."""
        return torch.empty(shape, device=self.device).exponential_(generator=self.generator).clamp_min_(MIN_RACE)

    def sample(self, probs: Tensor, race: Tensor | None = None) -> Tensor:
        """One token per distribution: (..., V) -> (...,) int64, from `race` (..., V) if given (see `race`).

        The exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability p_i, is
        vectorised and needs no host sync (torch.multinomial checks its input on the host side on some devices).
        E is kept above 0 (a draw of exactly 0 would make 0 / 0 = NaN win the argmax), so zero-probability
        tokens are never picked.
        """
        if race is None:
            race = self.race(probs.shape)
        return (probs / race).argmax(dim=-1)
