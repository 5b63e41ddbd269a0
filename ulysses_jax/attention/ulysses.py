"""DeepSpeed-Ulysses attention: swap sequence sharding for head sharding around attention.

Every device holds S/P tokens of Q, K and V for all heads. One all-to-all regroups them so
each device holds the whole sequence for N/P heads; ordinary attention runs there; a second
all-to-all restores the sequence split. Q, K and V travel in a single all-to-all (packed along
the head axis, grouped by destination), so the forward pass costs two collectives and, since
the transpose of an all-to-all is an all-to-all, the backward pass two more.

GQA/MQA: if K % P == 0 the kv heads are split like the query heads. If P % K == 0 each kv head
is repeated P/K times before the exchange (a local copy, no communication), so the device that
gets query heads [i*N/P, (i+1)*N/P) also gets the one kv head they read. Head counts that P
does not divide are padded with zero heads whose outputs are discarded (``heads.py``: the
layout, and what it costs in exchange bytes and compute).

Variants: ``scale``, ``window`` (sliding window) and ``softcap`` pass through to the local
kernel, which the mesh's devices and the variant choose (``kernels.resolve_impl``).

On a mesh with a "ring" axis of size R > 1 the public ``ulysses_attention`` (attention/__init__.py,
the one place that chooses) hands over to ``ring.py`` (hybrid Ulysses x Ring), which builds on
this module's exchange; this module's own path and its one shard_map site serve R == 1.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from . import kernels
from .chunked import check_variants
from ..head_layout import HeadLayout, head_layout
from .heads import pad_heads, unpad_output
from ..mesh import DATA, RING, SEQ, axis_size, shard


def seq_to_heads(x: jax.Array, axis_name: str = SEQ) -> jax.Array:
    """All-to-all inside shard_map: [B, S/P, N, H] -> [B, S, N/P, H]."""
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, axis_name: str = SEQ) -> jax.Array:
    """All-to-all inside shard_map: [B, S, N/P, H] -> [B, S/P, N, H]."""
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


# ----------------------------------------------------------------------------- validators

def kv_repeats(num_q_heads: int, num_kv_heads: int, p: int, ring: int = 1) -> int:
    """How many copies of each kv head the exchange makes (1 = none), ``heads.head_layout``'s.

    ``p`` is the all-to-all degree (the seq axis size U); the ring axis never splits heads,
    ``ring`` only enters the messages.
    """
    return head_layout(num_q_heads, num_kv_heads, p, ring).reps


def validate(q, k, v, segment_ids, mesh: Mesh, chunks: int = 1) -> HeadLayout:
    """Checks shapes against the mesh; returns the head layout of the exchange.

    The sequence must split into ``chunks`` pieces per ring rank and seq device: 1 for
    Ulysses and contiguous ring, 2 for the zigzag ring layout.
    """
    if SEQ not in mesh.axis_names:
        raise ValueError(f"mesh has no {SEQ!r} axis (axes: {mesh.axis_names}); build it with make_mesh")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, S, heads, head_dim], got shape {x.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} must agree on batch, sequence and head_dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, s, n, _ = q.shape
    p, r, d = axis_size(mesh, SEQ), axis_size(mesh, RING), axis_size(mesh, DATA)
    if s % (chunks * r * p):
        if chunks == r == 1:
            raise ValueError(f"sequence length {s} is not divisible by the seq axis size {p}")
        zig = "" if chunks == 1 else "2 zigzag chunks x "
        raise ValueError(
            f"sequence length {s} is not divisible by {zig}ring x seq = "
            f"{chunks * r * p} (ring axis size R={r}, seq axis size U={p}"
            f"{', zigzag layout' if chunks > 1 else ''})")
    if b % d:
        raise ValueError(f"batch size {b} is not divisible by the data axis size {d}")
    if segment_ids is not None and tuple(segment_ids.shape) != (b, s):
        raise ValueError(f"segment_ids must be [B, S] = {(b, s)}, got {tuple(segment_ids.shape)}")
    return head_layout(n, k.shape[2], p, r)


def variant(s: int, scale, window, softcap) -> dict:
    """The attention variant as keyword arguments for the kernels, checked; a window that
    covers the whole sequence (W >= S) is no window."""
    check_variants(window, softcap)
    if window is not None and window >= s:
        window = None
    return {"scale": None if scale is None else float(scale), "window": window,
            "softcap": None if softcap is None else float(softcap)}


def mesh_kernel(impl: str, q, mesh: Mesh, segments: bool, heads: tuple[int, int],
                **variant) -> str:
    """``kernels.resolve_impl`` for the devices of ``mesh`` (not JAX's default backend: on a
    GPU host a mesh of CPU devices must not get cuDNN). ``heads`` = (query, kv) heads each
    device attends with; ``variant``: causal, window, softcap."""
    platform, capability = kernels.device_facts(mesh.devices.flat[0])
    return kernels.resolve_impl(impl, q.dtype, q.shape[3], backend=platform, segments=segments,
                                capability=capability, heads=heads, **variant)


# ----------------------------------------------------------------------------- packing

def _pack_qkv(q, k, v, p: int):
    """[B, s, N, H], [B, s, K, H] x2 -> [B, s, N + 2K, H], heads grouped by destination device.

    The head axis is laid out as P blocks of (N/P q heads, K/P k heads, K/P v heads), so a
    tiled all-to-all over it hands each device its own q, k and v heads in one message.
    """
    b, s, n, h = q.shape
    kh = k.shape[2]
    parts = [x.reshape(b, s, p, x.shape[2] // p, h) for x in (q, k, v)]  # [B, s, P, heads/P, H]
    return jnp.concatenate(parts, axis=3).reshape(b, s, n + 2 * kh, h)


def _head_group(x, p: int, chunks: int, c: int):
    """Group c of C of every destination block: [B, s, heads, H] -> [B, s, heads/C, H].

    Heads stay destination-major (P blocks), so the group packs and exchanges like a whole
    tensor, and query head j of a group still reads kv head j // G of the same group."""
    b, s, n, h = x.shape
    return x.reshape(b, s, p, chunks, n // (p * chunks), h)[:, :, :, c].reshape(b, s, n // chunks, h)


def _unpack_qkv(qkv, n_local: int, k_local: int):
    """[B, S, N/P + 2K/P, H] -> q [B, S, N/P, H], k and v [B, S, K/P, H]."""
    return (qkv[:, :, :n_local], qkv[:, :, n_local:n_local + k_local],
            qkv[:, :, n_local + k_local:])


# ----------------------------------------------------------------------------- public API

def ulysses_only_attention(q, k, v, *, mesh: Mesh, causal: bool = True, segment_ids=None,
                           impl: str = "auto", head_chunks: int = 1,
                           max_segments: int = kernels.cudnn.DEFAULT_MAX_SEGMENTS,
                           scale: float | None = None, window: int | None = None,
                           softcap: float | None = None):
    """Sequence-parallel attention over the mesh's "seq" axis (DeepSpeed-Ulysses), R == 1.

    Args:
      q: [B, S, N, H] queries, sharded P("data", "seq") or not sharded.
      k, v: [B, S, K, H] keys and values, same layout; N % K == 0.
      mesh: a mesh with a "seq" axis (and usually "data"), see ``make_mesh``.
      causal: causal masking over global positions.
      segment_ids: optional [B, S] ints; tokens attend only within their own segment.
      impl: local kernel, "auto", "xla", "cudnn" or "chunked" (see ``kernels.resolve_impl``).
      head_chunks: C > 1 splits each device's heads into C groups, each exchanged and attended
        on its own (2C all-to-alls of 1/C the size), so XLA can overlap the exchange of one
        group with the attention of another. C must divide the kv heads per device.
      max_segments: bound on documents per row for cuDNN's packed layout (the kernel with
        segment ids on Hopper GPUs; see ``cudnn.py``); rows with more run an exact fallback.
      scale, window, softcap: see ``ulysses_attention``.

    Returns:
      [B, S, N, H], sharded P("data", "seq").

    A mesh with a "ring" axis of size R > 1 is ``ring.hybrid_attention``'s; the public
    ``ulysses_attention`` (attention/__init__.py) chooses between the two.
    """
    if axis_size(mesh, RING) > 1:
        raise ValueError(f"ulysses_only_attention serves meshes without a ring axis (ring axis "
                         f"size {axis_size(mesh, RING)}); call ulysses_attention")
    lay = validate(q, k, v, segment_ids, mesh)
    p = axis_size(mesh, SEQ)
    batch_axis = DATA if DATA in mesh.axis_names else None
    spec = P(batch_axis, SEQ)
    n_local, k_local = lay.n_local, lay.k_local
    chunks = head_chunks if p > 1 else 1
    if not isinstance(head_chunks, int) or head_chunks < 1 or k_local % chunks:
        raise ValueError(f"head_chunks {head_chunks} must be a positive divisor of the kv heads "
                         f"per device, {k_local} (kv heads {lay.k_pad} x {lay.reps} copies / "
                         f"seq axis size {p})")
    var = variant(q.shape[1], scale, window, softcap)
    kernel = mesh_kernel(impl, q, mesh, segment_ids is not None, (n_local, k_local),
                         causal=causal, window=var["window"], softcap=var["softcap"])
    attend = partial(kernels.local_attention, causal=causal, impl=kernel,
                     max_segments=max_segments, **var)

    def exchange_and_attend(q, k, v, seg):
        # q: [B, S/P, N', H]; k, v: [B, S/P, K', H], heads destination-major
        qkv = seq_to_heads(_pack_qkv(q, k, v, p))                        # [B, S, (N'+2K')/P, H]
        q, k, v = _unpack_qkv(qkv, q.shape[2] // p, k.shape[2] // p)    # q: [B, S, N'/P, H]
        out = attend(q, k, v, segment_ids=seg)                           # [B, S, N'/P, H]
        return heads_to_seq(out)                                         # [B, S/P, N', H]

    def body(q, k, v, *seg):
        # q: [B/D, S/P, N, H]; k, v: [B/D, S/P, K, H]; seg: [B/D, S/P]
        seg = seg[0] if seg else None
        q, k, v = pad_heads(q, k, v, lay)                # k: [B, S/P, K'R, H] (copies, padding)
        if p == 1:
            return attend(q, k, v, segment_ids=seg)
        if seg is not None:
            seg = jax.lax.all_gather(seg, SEQ, axis=1, tiled=True)      # [B, S]
        if chunks == 1:
            return unpad_output(exchange_and_attend(q, k, v, seg), lay)  # [B, S/P, N, H]
        outs = [exchange_and_attend(*(_head_group(x, p, chunks, c) for x in (q, k, v)), seg)
                for c in range(chunks)]                                  # C x [B, S/P, N'/C, H]
        b, s, _, h = outs[0].shape
        grouped = jnp.stack([o.reshape(b, s, p, n_local // chunks, h) for o in outs], axis=3)
        return unpad_output(grouped.reshape(b, s, p * n_local, h), lay)  # [B, S/P, N, H]

    args = [shard(x, mesh, spec) for x in (q, k, v)]
    if segment_ids is not None:
        args.append(shard(segment_ids, mesh, spec))
    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(spec for _ in args), out_specs=spec)
    return fn(*args)
