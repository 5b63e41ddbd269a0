"""The model families: the one place that says what differs between them.

A family is its decoder block (one module per family: ``llama.py``, ``gemma.py``,
``qwen3_next.py``; Qwen2.5-VL adds ``vision.py`` to the llama block) and the few traits the shared parts (``layers.py``) and the decoder read
instead of asking ``cfg.family == ...``. This module imports nothing from the model
package: the block class is named by "module:Class" and imported when a model is built, so
the families can import the shared parts and the decoder can import this registry without
an import circle. A new family is one new module and one line here.
"""
from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Family:
    """What the shared code needs to know about a family."""
    block: str                      # "module:Class" under ulysses_jax.models
    one_plus_norms: bool = False    # RMSNorm scales by (1 + w), w initialised at 0
    activation: str = "silu"        # the MLP gate activation (layers.ACTIVATIONS)
    embed_scale: bool = False       # embeddings multiplied by sqrt(d_model)
    gated_attention: bool = False   # q_proj also yields a per-head output gate
    linear_attention: bool = False  # layers may be Gated DeltaNet (model.mixer_pattern)
    experts: bool = True            # MoE layers exist (model.num_experts)
    sliding_windows: bool = True    # local layers exist (model.sliding_window)
    vision: bool = False            # a vision tower and M-RoPE (model.vision, mrope_section)

    def block_class(self):
        """The family's decoder block class (imported now)."""
        module, name = self.block.split(":")
        return getattr(importlib.import_module(f"ulysses_jax.models.{module}"), name)


FAMILIES = {
    "llama": Family("llama:Block"),
    "gemma": Family("gemma:GemmaBlock", one_plus_norms=True, activation="gelu_tanh",
                    embed_scale=True, experts=False),
    "qwen3_next": Family("qwen3_next:Qwen3NextBlock", one_plus_norms=True,
                         gated_attention=True, linear_attention=True, sliding_windows=False),
    # Qwen2.5-VL: the Qwen2 text block, a vision tower (vision.py) and M-RoPE.
    "qwen2_5_vl": Family("llama:Block", experts=False, sliding_windows=False, vision=True),
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
