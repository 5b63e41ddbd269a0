"""The model families: one record each of what differs between them.

A family is one entry of ``FAMILIES``: the traits that the config's validation, the shared
layers (``models/layers.py``) and the decoder read instead of asking ``cfg.family == ...``,
and where its parts live, each named "module:attribute" under ``ulysses_jax`` and imported
(``load``) only by the layer that uses it, so that this module imports nothing from the
package and the config at the bottom can validate with it:

- ``block``: its decoder block class (``models/``: ``llama.py``, ``gemma.py``,
  ``qwen3_next.py``), which the decoder builds (``models/blocks.py``);
- ``generation``: its (prefill, decode) layer functions (``generation/blocks.py``), or None
  where generation is not built for it (``block_functions`` says so);
- ``hf``: its Hugging Face record (``interop/hf_<family>.py``'s ``HF``, a
  ``hf_family.HFFamily``: model types, block tensor names, config.json both ways), which
  ``interop/hf.py`` reads.

A new family is its block's module, its Hugging Face module and one entry here (and its
generation pair where its block mixes tokens otherwise than an existing one's; docs/MODELS.md,
"Adding a family"). tests/test_imports.py checks that every part resolves, in its layer.
"""
from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """What the shared code needs to know about a family, and where its parts live."""
    block: str                      # its decoder block class (models/)
    hf: str                         # its Hugging Face record (interop/, hf_family.HFFamily)
    generation: str | None = None   # its (prefill, decode) layer functions (generation/)
    one_plus_norms: bool = False    # RMSNorm scales by (1 + w), w initialised at 0
    activation: str = "silu"        # the MLP gate activation (layers.ACTIVATIONS)
    embed_scale: bool = False       # embeddings multiplied by sqrt(d_model)
    gated_attention: bool = False   # q_proj also yields a per-head output gate
    linear_attention: bool = False  # layers may be Gated DeltaNet (model.mixer_pattern)
    experts: bool = True            # MoE layers exist (model.num_experts)
    sliding_windows: bool = True    # local layers exist (model.sliding_window)
    vision: bool = False            # a vision tower and M-RoPE (model.vision, mrope_section)


FAMILIES = {
    "llama": Family(block="models.llama:Block", generation="generation.blocks:LLAMA",
                    hf="interop.hf_llama:HF"),
    "gemma": Family(block="models.gemma:GemmaBlock", generation="generation.blocks:GEMMA",
                    hf="interop.hf_gemma:HF", one_plus_norms=True, activation="gelu_tanh",
                    embed_scale=True, experts=False),
    "qwen3_next": Family(block="models.qwen3_next:Qwen3NextBlock",
                         generation="generation.blocks:QWEN3_NEXT",
                         hf="interop.hf_qwen3_next:HF", one_plus_norms=True,
                         gated_attention=True, linear_attention=True, sliding_windows=False),
    # Qwen2.5-VL: the Qwen2 text block, a vision tower (models/vision.py) and M-RoPE; its
    # prompts' images enter generation in the prefill's embeddings.
    "qwen2_5_vl": Family(block="models.llama:Block", generation="generation.blocks:LLAMA",
                         hf="interop.hf_qwen2_5_vl:HF", experts=False, sliding_windows=False,
                         vision=True),
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


def load(part: str):
    """The object a family part names: "models.gemma:GemmaBlock" is ``GemmaBlock`` of
    ``ulysses_jax.models.gemma``, its module imported on first use."""
    module, _, name = part.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)
