"""What ``hf.py`` reads from the families' Hugging Face modules (``hf_llama.py``,
``hf_gemma.py``, ``hf_qwen3_next.py``, ``hf_qwen2_5_vl.py``): each module's record ``HF``
(``HFFamily``, which ``families.Family.hf`` names), the layout codes of its tensor tables and
the compute dtype its config translation reads.

A tensor table maps our parameter path to (HF tensor name, n_in). An HF Linear weight W
[out, in] maps to ours as W.T.reshape(our shape), n_in being the number of leading "in" dims
of our array: q_proj [N*H, D] -> wq [D, N, H] (1), o_proj [D, N*H] -> wo [N, H, D] (2);
0 = copied as is; ``FLAT`` = a bias, HF [N*H] <-> ours [N, H] by a reshape; ``CONV`` = a
convolution weight, HF [out, *in] <-> ours [*in, out] (the out axis moved).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax.numpy as jnp

from ..config import DTYPES, ModelConfig

FLAT, CONV = -1, -2


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """A family's Hugging Face checkpoints, as ``hf.py`` reads and writes them.

    Attributes:
      archs: model_type -> transformers class (config.json's ``architectures``); no model type
        is in two families.
      layer: our parameter path inside one block -> (HF name after ``model.layers.{i}.``,
        n_in). The embedding, final norm, head and per-expert weights are named alike in every
        family (``hf._GLOBAL``, ``hf._EXPERTS``).
      config_from_hf: ``(hf, *, dtype, **overrides) -> ModelConfig`` of a config.json whose
        model_type is in ``archs``; dtype as the caller gave it (``dtype_name`` reads it).
      config_to_hf: ``(cfg, arch, max_position_embeddings) -> dict``, the config.json of a
        Decoder of this family; arch in ``archs``, or None for the one that fits.
      canonical_name: a tensor name of any key layout the family's files come in -> the name
        the tables give (None: one layout).
      names: our top-level parameter outside the layers and ``hf._GLOBAL`` -> ``(keys, cfg)
        -> (HF names, n_in)`` (Qwen2.5-VL's vision tower ``visual``).
    """
    archs: Mapping[str, str]
    layer: Mapping[tuple, tuple[str, int]]
    config_from_hf: Callable[..., ModelConfig]
    config_to_hf: Callable[..., dict]
    canonical_name: Callable[[str], str] | None = None
    names: Mapping[str, Callable] = dataclasses.field(default_factory=dict)


def dtype_name(dtype) -> str:
    """float32 or bfloat16 from a name or a dtype; ValueError otherwise."""
    try:
        dtype = jnp.dtype(dtype).name
    except TypeError:
        pass  # not a dtype at all; reported below like any other unsupported one
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype
