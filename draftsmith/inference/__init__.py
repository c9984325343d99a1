"""Speculative generation over the runtime core (draftsmith/runtime: the proposer protocol, sampling, verification,
trees, metrics): the generation loop, speculative configs and the proposers they build (n-gram, suffix, the
methods' through the registry), evaluation and its report, the generate and eval commands."""

from draftsmith.inference.generator import GenerationResult, SpeculativeGenerator
from draftsmith.inference.ngram import NgramProposer
from draftsmith.inference.spec_config import SpecConfig, SpecConfigError, build_proposer, parse_spec_config
from draftsmith.inference.suffix import SuffixProposer

__all__ = [
    "GenerationResult",
    "NgramProposer",
    "SpecConfig",
    "SpecConfigError",
    "SpeculativeGenerator",
    "SuffixProposer",
    "build_proposer",
    "parse_spec_config",
]
