"""Everything that sees a whole sequence: the exchange, the ring, the local kernels.

``ulysses_attention`` is the one place that chooses between pure Ulysses (``ulysses.py``, a
mesh without a ring axis) and hybrid Ulysses x Ring (``ring.py``, ring axis size R > 1);
the model and the public API both call it.
"""
from __future__ import annotations

from jax.sharding import Mesh

from ..mesh import RING, axis_size
from .cudnn import DEFAULT_MAX_SEGMENTS
from ..head_layout import HeadLayout, head_layout
from .kernels import local_attention, reference_attention, resolve_impl
from .ring import hybrid_attention, inverse_zigzag_permutation, zigzag_permutation
from .ulysses import heads_to_seq, seq_to_heads, ulysses_only_attention


def ulysses_attention(q, k, v, *, mesh: Mesh, causal: bool = True, segment_ids=None,
                      impl: str = "auto", head_chunks: int = 1, layout: str = "natural",
                      max_segments: int = DEFAULT_MAX_SEGMENTS, scale: float | None = None,
                      window: int | None = None, softcap: float | None = None):
    """Sequence-parallel attention over the mesh's sequence axes (DeepSpeed-Ulysses).

    Args:
      q: [B, S, N, H] queries, sharded P("data", "seq") or not sharded.
      k, v: [B, S, K, H] keys and values, same layout; N % K == 0. Head counts that the seq
        axis size does not divide are padded with zero heads (``heads.py``).
      mesh: a mesh with a "seq" axis (and usually "data"), see ``make_mesh``.
      causal: causal masking over global positions; False attends both ways.
      segment_ids: optional [B, S] ints; tokens attend only within their own segment.
      impl: local kernel, "auto", "xla", "cudnn" or "chunked" (see ``kernels.resolve_impl``).
      head_chunks: C > 1 splits each device's heads into C groups, each exchanged and attended
        on its own (2C all-to-alls of 1/C the size), so XLA can overlap the exchange of one
        group with the attention of another. C must divide the kv heads per device. Pure
        Ulysses only.
      layout: token order of the inputs and the result on a ring mesh ("natural", or
        "zigzag" as the training loader emits; see ``ring.hybrid_attention``). Without a ring
        axis only "natural" exists.
      max_segments: bound on documents per row for cuDNN's packed layout (the kernel for
        segment ids on Hopper GPUs, ``cudnn.py``); rows with more run an exact fallback.
      scale: softmax scale of q.k, default 1/sqrt(H) (Gemma: query_pre_attn_scalar ** -0.5).
      window: sliding window W: the query at position i sees the keys i - W < j <= i (causal)
        or |i - j| < W, within its segment; skipped work and, on a ring, skipped ring steps.
      softcap: scores c * tanh(score / c) before masking (Gemma 2); the chunked kernel.

    Returns:
      [B, S, N, H], sharded P("data", "seq").

    With a "ring" mesh axis of size R > 1 this runs hybrid Ulysses x Ring attention
    (``ring.hybrid_attention``): inputs and output are then sharded P("data", ("ring", "seq")),
    and heads need only divide by the seq size.
    """
    ring = axis_size(mesh, RING)
    if ring > 1:
        if head_chunks != 1:
            raise ValueError(f"head_chunks {head_chunks} > 1 is not supported with a ring axis "
                             f"(ring axis size {ring})")
        return hybrid_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=segment_ids,
                                impl=impl, layout=layout, scale=scale, window=window,
                                softcap=softcap)
    if layout != "natural":
        raise ValueError(f"layout {layout!r} needs a ring axis; this mesh has none "
                         f"(axes {mesh.axis_names})")
    return ulysses_only_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=segment_ids,
                                  impl=impl, head_chunks=head_chunks,
                                  max_segments=max_segments, scale=scale, window=window,
                                  softcap=softcap)


__all__ = ["DEFAULT_MAX_SEGMENTS", "HeadLayout", "head_layout", "ulysses_attention", "ulysses_only_attention", "hybrid_attention",
           "local_attention", "reference_attention", "resolve_impl", "seq_to_heads",
           "heads_to_seq", "zigzag_permutation", "inverse_zigzag_permutation"]
