"""Generation under Ulysses: a sequence-parallel prefill that fills a head-split KV cache,
then decode steps that move only the new token's activations (docs/GENERATION.md).

Modules: ``cache`` (the cache's layout), ``blocks`` (the decoder's blocks over a prompt and
over one token), ``prefill``, ``decode``, ``sampling`` and ``generator`` (the loop over new
tokens). Above the models, below training (the RL objective to come samples with it); it
imports no trainer and no data code.
"""
from .blocks import GenerationError
from .generator import Completion, Generator
from .sampling import Sampling

__all__ = ["Completion", "GenerationError", "Generator", "Sampling"]
