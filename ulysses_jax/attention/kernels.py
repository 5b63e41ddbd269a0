"""Local (single-device) attention kernels and the dense reference.

Shapes use the letters of models/decoder.py: B batch, T query positions, S key positions,
N query heads, K kv heads, G = N // K, H head dim.

``reference_attention`` is the truth the tests compare against: plain einsums, an explicit
boolean mask and an fp32 softmax. It shares no code with the fast paths on purpose.
``local_attention`` is what runs on each device after the Ulysses exchange; ``impl`` picks
the kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .chunked import chunked_attention

IMPLS = ("auto", "xla", "cudnn", "chunked")
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def reference_attention(q, k, v, causal: bool = True, segment_ids=None, scale: float | None = None):
    """Dense attention on one device, for tests.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values; N must be a multiple of K (GQA/MQA).
      causal: mask out keys after each query (needs T == S).
      segment_ids: optional [B, S] ints; a query only sees keys with the same id.
      scale: logit scale, default 1/sqrt(H).

    Returns:
      [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    scale = h ** -0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(b, t, kh, g, h)                       # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale  # [B, K, G, T, S]
    s = k.shape[1]
    allowed = jnp.ones((b, t, s), dtype=bool)
    if causal:
        allowed &= (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None]
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32))      # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)


def resolve_impl(impl: str, dtype, head_dim: int, backend: str | None = None,
                 segments: bool = False) -> str:
    """Turns ``impl`` ("auto", "xla", "cudnn", "chunked") into the kernel that will run.

    "auto" picks cuDNN flash attention on a GPU for bf16/fp16 with a head dim it supports
    (multiple of 8, at most 128) and no segment ids, and the memory-linear "chunked" kernel
    otherwise: jax's cuDNN path turns a segment mask into a dense [B, 1, S, S] bias, which
    would undo the point of a long sequence. An explicit "cudnn" is honoured either way.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {', '.join(IMPLS)}")
    backend = backend or jax.default_backend()
    cudnn_ok = (backend == "gpu" and jnp.dtype(dtype) in [jnp.dtype(d) for d in _CUDNN_DTYPES]
                and head_dim % 8 == 0 and head_dim <= 128)
    if impl == "cudnn":
        if backend != "gpu":
            raise ValueError(f"impl='cudnn' needs a GPU backend, but the backend is {backend!r}")
        if not cudnn_ok:
            raise ValueError(
                f"impl='cudnn' needs bfloat16/float16 inputs and a head dim that is a multiple "
                f"of 8 and at most 128; got dtype {jnp.dtype(dtype).name}, head dim {head_dim}")
        return "cudnn"
    if impl == "auto":
        return "cudnn" if cudnn_ok and not segments else "chunked"
    return impl


def local_attention(q, k, v, *, causal: bool, segment_ids=None, impl: str = "xla"):
    """Attention over the full sequence held by one device.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H] with N a multiple of K.
      causal: causal masking.
      segment_ids: optional [B, S] ints (packed documents).
      impl: a resolved kernel name, "xla", "cudnn" or "chunked".

    Returns:
      [B, T, N, H].
    """
    if impl == "chunked":
        return chunked_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=impl)
