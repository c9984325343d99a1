"""Speculative runtime: proposers, verification (greedy, sampling, trees), the generation loop, vLLM-style
metrics, evaluation."""

from draftsmith.inference.generator import GenerationResult, SpeculativeGenerator
from draftsmith.inference.metrics import SpecDecodingMetrics
from draftsmith.inference.ngram import NgramProposer
from draftsmith.inference.proposer import PAD_DRAFT_TOKEN, ROOT_PARENT, Proposal, Proposer
from draftsmith.inference.sampling import Sampler, SamplingParams
from draftsmith.inference.spec_config import SpecConfig, SpecConfigError, build_proposer, parse_spec_config
from draftsmith.inference.suffix import SuffixProposer
from draftsmith.inference.verify import greedy_tree_verify, greedy_verify, rejection_verify, sampling_tree_verify

__all__ = [
    "PAD_DRAFT_TOKEN",
    "ROOT_PARENT",
    "GenerationResult",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "Sampler",
    "SamplingParams",
    "SpecConfig",
    "SpecConfigError",
    "SpecDecodingMetrics",
    "SpeculativeGenerator",
    "SuffixProposer",
    "build_proposer",
    "greedy_tree_verify",
    "greedy_verify",
    "parse_spec_config",
    "rejection_verify",
    "sampling_tree_verify",
]
