"""Local (single-device) attention kernels and the dense reference.

Shapes use the letters of models/decoder.py: B batch, T query positions, S key positions,
N query heads, K kv heads, G = N // K, H head dim.

``reference_attention`` is the truth the tests compare against: plain einsums, an explicit
boolean mask and an fp32 softmax. It shares no code with the fast paths on purpose.
``local_attention`` is what runs on each device after the Ulysses exchange; ``impl`` picks
the kernel (``resolve_impl``: cuDNN on GPUs, its packed layout for packed documents, the
memory-linear chunked kernel elsewhere).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cudnn
from .chunked import chunked_attention

IMPLS = ("auto", "xla", "cudnn", "chunked")
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
# The GPU a program is being compiled for in place of the mesh's own devices, as (platform,
# compute capability): set by ``gpu_target.compiling_for``, which lowers from this process's
# CPU devices for XLA's GPU compiler. None: kernels are chosen for the mesh's devices.
COMPILING_FOR: tuple[str, tuple[int, int]] | None = None


def device_facts(device) -> tuple[str, tuple[int, int] | None]:
    """(platform, CUDA compute capability or None) that kernels are chosen for on ``device``:
    its own, or the GPU target's while one is compiled for (``COMPILING_FOR``)."""
    if COMPILING_FOR is not None:
        return COMPILING_FOR
    return device.platform, cudnn.compute_capability(device)


def reference_attention(q, k, v, causal: bool = True, segment_ids=None, scale: float | None = None,
                        window: int | None = None, softcap: float | None = None):
    """Dense attention on one device, for tests.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values; N must be a multiple of K (GQA/MQA).
      causal: mask out keys after each query (needs T == S).
      segment_ids: optional [B, S] ints; a query only sees keys with the same id.
      scale: logit scale, default 1/sqrt(H).
      window: sliding window W: query i sees keys j with i - W < j (and j < i + W when not
        causal), by position index.
      softcap: logits become softcap * tanh(logits / softcap) before masking (Gemma 2).

    Returns:
      [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    scale = h ** -0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(b, t, kh, g, h)                       # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale  # [B, K, G, T, S]
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    s = k.shape[1]
    allowed = jnp.ones((b, t, s), dtype=bool)
    rel = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]                   # [T, S] query - key
    if causal:
        allowed &= (rel >= 0)[None]
    if window is not None:
        allowed &= ((rel < window) & (rel > -window))[None]
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32))      # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)


def resolve_impl(impl: str, dtype, head_dim: int, backend: str | None = None,
                 segments: bool = False, capability: tuple[int, int] | None = None,
                 heads: tuple[int, int] | None = None, *, causal: bool = True,
                 window: int | None = None, softcap: float | None = None) -> str:
    """Turns ``impl`` ("auto", "xla", "cudnn", "chunked") into the kernel that will run:
    "xla", "cudnn", "cudnn_packed" or "chunked".

    Args:
      impl: the requested kernel.
      dtype, head_dim: of q.
      backend: platform the attention runs on ("cpu", "gpu", ...); default JAX's default.
      segments: segment ids are given (packed documents).
      capability: the GPU's CUDA compute capability, e.g. (9, 0) for Hopper; None if unknown.
      heads: (query heads, kv heads) each device attends with (for the packed layout's GQA rule).
      causal, window, softcap: the attention variant (see ``local_attention``).

    "auto" picks cuDNN flash attention on a GPU for bf16/fp16 with a head dim it supports
    (a multiple of 8, at most 128, or 256 on Hopper): plain causal without segment ids, and
    cuDNN's packed layout with them where jax allows it (``cudnn.packed_supported``: Hopper
    or newer; GQA needs jax 0.11). Everything else gets the memory-linear "chunked" kernel,
    which skips the tiles between documents too. An explicit "cudnn" is honoured or refused
    with the reason; it never builds a dense [S, S] segment mask.

    Variants: cuDNN takes a causal sliding window (``sliding_window_length``) but no window
    without the causal mask and no logit softcap; XLA's dense kernel takes any window but no
    softcap. "auto" then picks "chunked", which does all of them; an explicit kernel that
    cannot is refused. A window with segment ids stays on "chunked" under "auto" until
    ``cudnn.PACKED_WINDOW_CHECKED`` (jax does not document windows in the packed layout).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {', '.join(IMPLS)}")
    backend = backend or jax.default_backend()
    max_dim = 256 if capability is not None and capability >= (9, 0) else 128
    cudnn_ok = (backend == "gpu" and jnp.dtype(dtype) in [jnp.dtype(d) for d in _CUDNN_DTYPES]
                and head_dim % 8 == 0 and head_dim <= max_dim)
    packed_why = None
    if segments:
        n, kh = heads if heads is not None else (1, 1)
        packed_why = cudnn.packed_supported(capability, n, kh)
    if impl == "cudnn":
        if backend != "gpu":
            raise ValueError(f"impl='cudnn' needs a GPU backend, but the backend is {backend!r}")
        if not cudnn_ok:
            raise ValueError(
                f"impl='cudnn' needs bfloat16/float16 inputs and a head dim that is a multiple "
                f"of 8 and at most {max_dim}; got dtype {jnp.dtype(dtype).name}, head dim "
                f"{head_dim}")
        if packed_why:
            raise ValueError(f"impl='cudnn' with segment ids runs cuDNN's packed layout, but "
                             f"{packed_why}; use impl='auto' or 'chunked'")
    if impl in ("cudnn", "xla"):
        why = _variant_refusal(impl, causal, window, softcap)
        if why:
            raise ValueError(f"impl={impl!r} {why}; use impl='auto' or 'chunked'")
        return impl + ("_packed" if impl == "cudnn" and segments else "")
    if impl == "auto":
        if not cudnn_ok or _variant_refusal("cudnn", causal, window, softcap):
            return "chunked"
        if not segments:
            return "cudnn"
        if window is not None and not cudnn.PACKED_WINDOW_CHECKED:
            return "chunked"
        return "chunked" if packed_why else "cudnn_packed"
    return impl


def _variant_refusal(impl: str, causal: bool, window, softcap) -> str | None:
    """Why kernel ``impl`` ("cudnn" or "xla") cannot run this variant, or None."""
    if softcap is not None:
        return f"cannot apply a logit softcap ({softcap}); only the chunked kernel does"
    if impl == "cudnn" and window is not None and not causal:
        return (f"cannot apply a sliding window ({window}) without the causal mask (cuDNN "
                f"takes left windows only)")
    return None


def local_attention(q, k, v, *, causal: bool, segment_ids=None, impl: str = "xla",
                    max_segments: int = cudnn.DEFAULT_MAX_SEGMENTS, scale: float | None = None,
                    window: int | None = None, softcap: float | None = None):
    """Attention over the full sequence held by one device.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H] with N a multiple of K.
      causal: causal masking.
      segment_ids: optional [B, S] ints (packed documents).
      impl: a resolved kernel name, "xla", "cudnn", "cudnn_packed" or "chunked".
      max_segments: the bound on documents per row for "cudnn_packed".
      scale: logit scale, default 1/sqrt(H).
      window: sliding window W (T == S): query i sees keys i - W < j <= i (causal), or
        |i - j| < W.
      softcap: tanh logit cap before masking (Gemma 2); the chunked kernel only.

    Returns:
      [B, T, N, H].
    """
    if impl == "chunked":
        return chunked_attention(q, k, v, causal=causal, segment_ids=segment_ids, scale=scale,
                                 window=window, softcap=softcap)
    why = _variant_refusal(impl.removesuffix("_packed"), causal, window, softcap)
    if why:
        raise ValueError(f"kernel {impl!r} {why}")
    if impl == "cudnn_packed":
        if segment_ids is None:
            raise ValueError("impl 'cudnn_packed' needs segment ids")
        return cudnn.packed_attention(q, k, v, segment_ids, causal=causal,
                                      max_segments=max_segments, scale=scale, window=window)
    if impl == "cudnn" and segment_ids is not None:
        raise ValueError("impl 'cudnn' takes no segment ids; resolve_impl gives 'cudnn_packed'")
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, S]
    extra = {}
    if window is not None:  # jax's (left, right) window excludes the query itself
        extra["local_window_size"] = (window - 1, 0 if causal else window - 1)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=impl,
                                        scale=scale, **extra)
