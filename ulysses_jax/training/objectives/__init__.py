"""What a run minimises, one module per objective (``objective`` in the config), each with
an ``OBJECTIVE`` class (``base.Objective``): ``sft.py`` the next-token loss, ``dpo.py`` the
preference loss, GRPO's in ``training/grpo.py`` (its rollout) over the policy loss of
``grpo.py`` here. ``config.OBJECTIVES`` names each objective's module: a new objective is its
module and that line.

``get(cfg)`` gives the objective of ``cfg``.
"""
from __future__ import annotations

import importlib

from ...config import OBJECTIVES, Config
from .base import Objective


def get(cfg: Config) -> Objective:
    """The objective ``cfg.objective`` names (config.validate has checked the name)."""
    try:
        module = OBJECTIVES[cfg.objective]
    except KeyError:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got "
                         f"{cfg.objective!r}") from None
    return importlib.import_module(module).OBJECTIVE(cfg)
