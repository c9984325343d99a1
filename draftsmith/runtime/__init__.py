"""The runtime core, below the models that implement proposers: the `Proposer` protocol and its one return type
(proposer.py), sampling (sampling.py), verification of chains and trees (verify.py), draft trees (tree.py) and
vLLM's acceptance counters (metrics.py). It imports no other part of draftsmith: the method folders
(models/*/proposer.py) implement its protocol, and inference/ drives it (the generator, speculative configs, eval).
"""

from draftsmith.runtime.metrics import SpecDecodingMetrics
from draftsmith.runtime.proposer import PAD_DRAFT_TOKEN, ROOT_PARENT, Proposal, Proposer
from draftsmith.runtime.sampling import Sampler, SamplingParams
from draftsmith.runtime.verify import greedy_tree_verify, greedy_verify, rejection_verify, sampling_tree_verify

__all__ = [
    "PAD_DRAFT_TOKEN",
    "ROOT_PARENT",
    "Proposal",
    "Proposer",
    "Sampler",
    "SamplingParams",
    "SpecDecodingMetrics",
    "greedy_tree_verify",
    "greedy_verify",
    "rejection_verify",
    "sampling_tree_verify",
]
