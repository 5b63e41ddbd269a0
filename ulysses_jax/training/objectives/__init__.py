"""What a run minimises, one module per objective (``objective`` in the config): ``sft.py``
the next-token loss, ``dpo.py`` the preference loss, ``grpo.py`` the policy loss of sampled
completions.

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
    if cfg.objective == "grpo":
        from . import grpo
        return functools.partial(grpo.objective, cfg)
    from .sft import objective
    return objective


def micro_weighting(cfg: Config) -> str:
    """How the micro-batches of an accumulated step weigh (accumulate.py): "tokens" (each
    its share of the supervised tokens: a mean over tokens, SFT), "equal" (1/k each: a mean
    over pairs, DPO) or "sum" (1 each: GRPO's batches weigh every token themselves)."""
    return {"dpo": "equal", "grpo": "sum"}.get(cfg.objective, "tokens")
