"""What a run minimises, one module per objective (``objective`` in the config): ``sft.py``
the next-token loss, ``dpo.py`` the preference loss.

``for_config(cfg)`` gives ``f(graphdef, params, batch, mesh, weights=None) -> (objective,
(reported loss, metrics))`` for the train step and gradient accumulation.
"""
from __future__ import annotations

import functools

from ...config import Config


def for_config(cfg: Config):
    """The objective function of ``cfg.objective``."""
    if cfg.objective == "dpo":
        from . import dpo
        return functools.partial(dpo.objective, cfg)
    from .sft import objective
    return objective


def counts_by_pairs(cfg: Config) -> bool:
    """Whether the objective is a mean over pairs (every micro-batch of an accumulated step
    then weighs 1/k), not over supervised tokens (each weighs its share of the tokens)."""
    return cfg.objective == "dpo"
