"""ulysses-jax: DeepSpeed-Ulysses sequence parallelism for JAX on GPUs.

Layers, each a folder: ``attention/`` (the exchange, the ring, the local kernels: everything
that sees a whole sequence), ``models/`` (decoder families, vocabulary-parallel embedding and
loss), ``interop/`` (Hugging Face import/export, the PyTorch-baseline harnesses;
``ulysses_jax.hf`` and ``ulysses_jax.compare`` keep their old paths), ``data/`` (sources, token
stores, packing, chat, media, batches), ``training/`` (train step, checkpoints, the loop).
Below them: ``mesh``, ``config``, ``families``, ``head_layout`` (shared by every layer, importing
none); above them ``runs`` (a run or Hugging Face directory opened) and the command-line
tools ``plan``, ``plot``, ``evaluate``, ``export`` and ``generate``. Imports run down only
(tests/test_imports.py).
"""
from .attention import (heads_to_seq, hybrid_attention, inverse_zigzag_permutation,
                        local_attention, reference_attention, seq_to_heads, ulysses_attention,
                        zigzag_permutation)
from .mesh import DATA, RING, SEQ, act_spec, make_mesh, seq_axes

__all__ = [
    "DATA", "RING", "SEQ", "act_spec", "make_mesh", "seq_axes", "ulysses_attention",
    "hybrid_attention", "zigzag_permutation", "inverse_zigzag_permutation",
    "reference_attention", "local_attention", "seq_to_heads", "heads_to_seq",
]
