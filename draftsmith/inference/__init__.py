"""Speculative runtime: proposers, greedy verification, the generation loop, vLLM-style metrics, evaluation."""

from draftsmith.inference.generator import GenerationResult, SpeculativeGenerator
from draftsmith.inference.metrics import SpecDecodingMetrics
from draftsmith.inference.ngram import NgramProposer
from draftsmith.inference.proposer import PAD_DRAFT_TOKEN, Proposal, Proposer
from draftsmith.inference.spec_config import SpecConfig, SpecConfigError, build_proposer, parse_spec_config
from draftsmith.inference.verify import greedy_verify

__all__ = [
    "PAD_DRAFT_TOKEN",
    "GenerationResult",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SpecConfig",
    "SpecConfigError",
    "SpecDecodingMetrics",
    "SpeculativeGenerator",
    "build_proposer",
    "greedy_verify",
    "parse_spec_config",
]
