"""What ``hf.py`` shares with the families' Hugging Face modules (``hf_llama.py``,
``hf_gemma.py``, ``hf_qwen3_next.py``, ``hf_qwen2_5_vl.py``): the layout codes of their tensor
tables and the compute dtype their config translations read.

A tensor table maps our parameter path to (HF tensor name, n_in). An HF Linear weight W
[out, in] maps to ours as W.T.reshape(our shape), n_in being the number of leading "in" dims
of our array: q_proj [N*H, D] -> wq [D, N, H] (1), o_proj [D, N*H] -> wo [N, H, D] (2);
0 = copied as is; ``FLAT`` = a bias, HF [N*H] <-> ours [N, H] by a reshape; ``CONV`` = a
convolution weight, HF [out, *in] <-> ours [*in, out] (the out axis moved).
"""
from __future__ import annotations

import jax.numpy as jnp

from ..config import DTYPES

FLAT, CONV = -1, -2


def dtype_name(dtype) -> str:
    """float32 or bfloat16 from a name or a dtype; ValueError otherwise."""
    try:
        dtype = jnp.dtype(dtype).name
    except TypeError:
        pass  # not a dtype at all; reported below like any other unsupported one
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype
