"""Packed documents through cuDNN: segment ids -> cuDNN's packed (ragged) layout.

Letters as in models/decoder.py: B batch, T query positions (= S here), N query heads, K kv
heads, H head dim; M the static bound on documents (segments) per row.

After the Ulysses exchange a device holds whole sequences, so every packed document of a row
is a contiguous run of equal segment ids on that device. cuDNN attends within such runs
itself when given each run's start offset and length (its "packed" or THD layout): tiles
between documents are never computed and no [S, S] mask exists. ``packed_layout`` turns
segment ids into those offsets and lengths; ``packed_attention`` calls jax's cuDNN fused
attention with them.

Rules the conversion relies on, checked on the device for every call (the ids are data):
  - at most M runs per row (M is static: it sizes cuDNN's arguments and statistics);
  - every id forms ONE run (an id that comes back later in the row would be split into two
    documents that cannot see each other, which the segment-id contract does not mean).
A batch that breaks either rule runs the memory-linear chunked kernel instead (``lax.cond``),
which is exact for any ids: never a silently wrong mask. Padding (id 0 after the last
document, as the loader packs rows) is a run like any other, so its rows attend among
themselves exactly as the dense reference lets them.

jax's cuDNN call checks the cuDNN version and the GPU while tracing, so only its inputs and
the kernel choice can be tested on a CPU; the call itself is checked by
benchmarks/gpu_check.py on a GPU. jax accepts the packed layout on Hopper (sm_90) or newer
GPUs only. jax before 0.11 scales the kv offsets by the query heads, which is wrong for GQA
(N != K); ``packed_supported`` says no there and the choice falls back to another kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .chunked import chunked_attention

DEFAULT_MAX_SEGMENTS = 64  # documents per row when no bound is given (API use)
_HOPPER = (9, 0)


def _jax_version() -> tuple[int, int]:
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for other devices."""
    cap = getattr(device, "compute_capability", None)
    if not cap:
        return None
    major, minor = str(cap).split(".")[:2]
    return int(major), int(minor)


def packed_supported(capability: tuple[int, int] | None, num_q_heads: int,
                     num_kv_heads: int, jax_version: tuple[int, int] | None = None) -> str | None:
    """None if jax's cuDNN packed layout can serve this call, else the reason it cannot."""
    if capability is None or capability < _HOPPER:
        got = "no CUDA compute capability" if capability is None else \
            f"compute capability {capability[0]}.{capability[1]}"
        return (f"cuDNN's packed layout needs a Hopper (compute capability 9.0) or newer GPU; "
                f"this device has {got}")
    version = jax_version or _jax_version()
    if version < (0, 11) and num_q_heads != num_kv_heads:
        return (f"jax {version[0]}.{version[1]} computes wrong kv offsets for the packed layout "
                f"with GQA ({num_q_heads} query heads, {num_kv_heads} kv heads per device); "
                f"jax 0.11 or newer fixes it")
    return None


def packed_layout(segment_ids, max_segments: int):
    """Segment ids -> cuDNN packed-layout offsets and lengths.

    Args:
      segment_ids: [B, S] ints; each run of equal adjacent ids is one document.
      max_segments: M, the static bound on runs per row.

    Returns:
      offsets [B, M+1] int32: the start of each run, then -1 (jax's convention: M+1 slots, the
        unused ones -1);
      lengths [B, M] int32: the length of each run, then -1;
      ok: bool scalar, True when every row has at most M runs and no id has two runs.
    """
    b, s = segment_ids.shape
    seg = segment_ids.astype(jnp.int32)
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    runs = starts.sum(1)                                                  # [B]
    # Distinct ids per row, from the sorted row: an id with two runs makes runs > distinct.
    ordered = jnp.sort(seg, axis=1)
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(1)             # [B]
    ok = jnp.all((runs <= max_segments) & (runs == distinct))
    first = jax.vmap(lambda r: jnp.nonzero(r, size=max_segments + 1, fill_value=-1)[0])(
        starts).astype(jnp.int32)                                         # [B, M+1]
    first = first.at[:, max_segments].set(-1)  # slot M only holds a start past the bound
    nxt = jnp.concatenate([first[:, 1:max_segments], jnp.full((b, 1), -1, jnp.int32)], 1)
    used = first[:, :max_segments] >= 0                                   # [B, M]
    end = jnp.where(nxt >= 0, nxt, s)                                     # [B, M]
    lengths = jnp.where(used, end - first[:, :max_segments], -1).astype(jnp.int32)
    return first, lengths, ok


def _cudnn_packed_call(q, k, v, offsets, lengths, *, causal: bool, scale: float):
    """jax's cuDNN fused attention in the packed layout (traced only on a CUDA GPU)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    mask = MaskType.PADDING_CAUSAL if causal else MaskType.PADDING
    return dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths,
                                 q_offsets=offsets, kv_offsets=offsets, mask_type=mask,
                                 scale=scale)


def packed_attention(q, k, v, segment_ids, *, causal: bool, max_segments: int,
                     scale: float | None = None):
    """Attention within packed documents, cuDNN's packed layout, exact fallback.

    Args:
      q: [B, S, N, H]; k, v: [B, S, K, H] (bf16/fp16; N a multiple of K).
      segment_ids: [B, S] ints.
      causal: causal within each document.
      max_segments: M, the static bound on documents per row (see module docstring).
      scale: logit scale, default 1/sqrt(H).

    Returns:
      [B, S, N, H] in q's dtype.
    """
    if max_segments < 1:
        raise ValueError(f"max_segments must be positive, got {max_segments}")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    offsets, lengths, ok = packed_layout(segment_ids, max_segments)

    def fast(q, k, v, seg):
        return _cudnn_packed_call(q, k, v, offsets, lengths, causal=causal, scale=scale)

    def exact(q, k, v, seg):
        return chunked_attention(q, k, v, causal=causal, segment_ids=seg, scale=scale)

    return lax.cond(ok, fast, exact, q, k, v, segment_ids)
