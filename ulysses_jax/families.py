"""The model families: the one place that says what differs between them.

A family is its decoder block (one module per family under ``models/``: ``llama.py``,
``gemma.py``, ``qwen3_next.py``; Qwen2.5-VL adds ``vision.py`` to the llama block; the blocks
are registered in ``models/blocks.py``) and the few traits here that the config's validation,
the shared layers (``models/layers.py``) and the decoder read instead of asking
``cfg.family == ...``. This module imports nothing from the package, so the config at the
bottom can validate with it. A new family is one new module, one line here and one line in
``models/blocks.py``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    """What the shared code needs to know about a family."""
    one_plus_norms: bool = False    # RMSNorm scales by (1 + w), w initialised at 0
    activation: str = "silu"        # the MLP gate activation (layers.ACTIVATIONS)
    embed_scale: bool = False       # embeddings multiplied by sqrt(d_model)
    gated_attention: bool = False   # q_proj also yields a per-head output gate
    linear_attention: bool = False  # layers may be Gated DeltaNet (model.mixer_pattern)
    experts: bool = True            # MoE layers exist (model.num_experts)
    sliding_windows: bool = True    # local layers exist (model.sliding_window)
    vision: bool = False            # a vision tower and M-RoPE (model.vision, mrope_section)


FAMILIES = {
    "llama": Family(),
    "gemma": Family(one_plus_norms=True, activation="gelu_tanh", embed_scale=True,
                    experts=False),
    "qwen3_next": Family(one_plus_norms=True, gated_attention=True, linear_attention=True,
                         sliding_windows=False),
    # Qwen2.5-VL: the Qwen2 text block, a vision tower (vision.py) and M-RoPE.
    "qwen2_5_vl": Family(experts=False, sliding_windows=False, vision=True),
}


def traits(name: str) -> Family:
    """``family(name)``, or a plain Llama-like family for a name that is not registered (the
    config's validation reports the name; its other rules still run)."""
    return FAMILIES.get(name, FAMILIES["llama"])


def family(name: str) -> Family:
    """The registered family ``name`` (config.validate has checked it is one of them)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family {name!r} is not one of {', '.join(FAMILIES)}") from None
