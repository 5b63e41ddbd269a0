"""Gated DeltaNet (Qwen3-Next linear attention) under Ulysses: the same exchange as attention.

Letters: B batch, S sequence, P seq devices, Hk key heads, Hv value heads (Hv = r Hk), Q key
head dim, V value head dim, W convolution width.

Every device projects its S/P tokens (token-local, in the model). One all-to-all then moves,
packed in one message, the pre-convolution q, k, v and the gate inputs b, a of each device's
Hv/P value heads (and the key heads they read) for the whole sequence; there the short causal
convolution, the normalisation and the gated delta rule run as on one device
(``deltanet.py``), with the recurrent state and the convolution restarting at every document
start; a second all-to-all returns the output [B, S/P, Hv, V] to sequence sharding. The
output gate and out_proj are token-local again (model). The convolution runs after the
exchange, on whole sequences, so it needs no halo of the previous device's tokens.

Heads: Hv % P == 0 is required. Value head j reads key head j // r. With Hk % P == 0 the key
heads split like the value heads; otherwise each key head is copied c times before the
exchange (c the smallest divisor of r with Hk c % P == 0; c = r always works since Hv % P ==
0), a local copy like GQA's kv copies in ``heads.py``, its convolution weights with it.

Memory: the local core (convolution, normalisation, gates, delta rule) is one checkpointed
function: the backward pass recomputes it from the exchanged inputs, so it keeps no
sequence-length fp32 intermediates of its own; the delta rule keeps about 2 sqrt(S/C) chunk
states (``deltanet.chunked_delta_rule``).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from . import deltanet
from ..mesh import DATA, RING, SEQ, axis_size, shard

_F32 = jnp.float32


def key_copies(key_heads: int, value_heads: int, p: int) -> int:
    """Copies c of each key head before the exchange (1 = none); see the module docstring.

    Raises:
      ValueError: the value heads do not divide over the P devices.
    """
    if value_heads % key_heads:
        raise ValueError(f"linear value heads {value_heads} are not divisible by linear key "
                         f"heads {key_heads}")
    if value_heads % p:
        raise ValueError(f"linear value heads {value_heads} are not divisible by the seq axis "
                         f"size {p} (each device runs the delta rule for whole value heads)")
    r = value_heads // key_heads
    return next(c for c in range(1, r + 1) if r % c == 0 and key_heads * c % p == 0)


def gated_delta_core(q, k, v, b, a, conv_q, conv_k, conv_v, a_log, dt_bias, segment_ids,
                     *, chunk: int = deltanet.DEFAULT_CHUNK, final_state: bool = False):
    """Convolution, normalisation, gates and the delta rule over whole sequences.

    Args:
      q, k: [B, S, hk, Q] and v: [B, S, h, V] before the convolution; b, a: [B, S, h];
      conv_q, conv_k: [hk, Q, W], conv_v: [h, V, W]; a_log, dt_bias: [h]; h % hk == 0.
      segment_ids: [B, S] or None.
    Returns:
      o [B, S, h, V] in v's dtype, before the output norm and gate; with ``final_state``
      (o, the state after each row's last token [B, h, Q, V] float32).
    """
    beta, g = gates(b, a, a_log, dt_bias)                                         # [B, S, h]
    # SiLU of the convolution (in the compute dtype, as transformers' causal_conv1d_fn)
    # runs inside the kernel, chunk by chunk; the kernel normalises q and k in float32.
    return deltanet.chunked_delta_rule(q, k, v, g, beta, segment_ids, chunk=chunk,
                                       conv=(conv_q, conv_k, conv_v), final_state=final_state)


def gates(b, a, a_log, dt_bias):
    """(beta = sigmoid(b), decay g = -exp(A_log) softplus(a + dt_bias)), float32, from the
    projections b, a [..., h] and the weights [h]."""
    beta = jax.nn.sigmoid(b.astype(_F32))
    g = -jnp.exp(a_log.astype(_F32)) * jax.nn.softplus(a.astype(_F32) + dt_bias.astype(_F32))
    return beta, g


def _exchange(parts, p: int):
    """[B, S/P, heads_i, d_i] (and [B, S/P, heads_i]) -> the same for the whole sequence and
    this device's heads, in one all-to-all; heads split into P contiguous blocks."""
    bsz, s = parts[0].shape[:2]
    flat = [x.reshape(bsz, s, p, -1) for x in parts]                           # [B, S/P, P, w_i]
    widths = [x.shape[-1] for x in flat]
    packed = jax.lax.all_to_all(jnp.concatenate(flat, axis=-1), SEQ, split_axis=2,
                                concat_axis=1, tiled=True)[:, :, 0]            # [B, S, sum w_i]
    out, start = [], 0
    for x, w in zip(parts, widths):
        out.append(packed[..., start:start + w].reshape((bsz, s * p, x.shape[2] // p)
                                                        + x.shape[3:]))
        start += w
    return out


def gated_deltanet(q, k, v, b, a, conv_q, conv_k, conv_v, a_log, dt_bias, *, mesh: Mesh,
                   segment_ids=None, chunk: int = deltanet.DEFAULT_CHUNK,
                   final_state: bool = False):
    """Sequence-parallel Gated DeltaNet over the mesh's "seq" axis.

    Args:
      q, k: [B, S, Hk, Q]; v: [B, S, Hv, V]; b, a: [B, S, Hv] (pre-convolution projections,
        sharded P("data", "seq") or not sharded; any float dtype).
      conv_q, conv_k: [Hk, Q, W]; conv_v: [Hv, V, W]; a_log, dt_bias: [Hv] (replicated).
      mesh: a mesh with a "seq" axis and no ring axis.
      segment_ids: [B, S] ints or None; state and convolution restart at document starts.
      chunk: tokens per chunk of the delta rule.
      final_state: also return the state after each row's last token (generation's prefill;
        S a multiple of ``chunk``).
    Returns:
      o [B, S, Hv, V] in v's dtype, sharded P("data", "seq"); with ``final_state`` (o, the
      state [B, Hv, Q, V] float32, split by head over "seq").
    """
    if axis_size(mesh, RING) > 1:
        raise ValueError(f"Gated DeltaNet layers need a mesh without a ring axis (ring axis "
                         f"size {axis_size(mesh, RING)})")
    bsz, s, hk, _ = q.shape
    hv = v.shape[2]
    p, d = axis_size(mesh, SEQ), axis_size(mesh, DATA)
    if s % p:
        raise ValueError(f"sequence length {s} is not divisible by the seq axis size {p}")
    if bsz % d:
        raise ValueError(f"batch size {bsz} is not divisible by the data axis size {d}")
    c = key_copies(hk, hv, p)
    if c > 1:  # local copies of each key head (and of its convolution weights)
        q, k = (jnp.repeat(x, c, axis=2) for x in (q, k))
        conv_q, conv_k = (jnp.repeat(w, c, axis=0) for w in (conv_q, conv_k))
    dt = v.dtype
    core = jax.checkpoint(partial(gated_delta_core, chunk=chunk, final_state=final_state),
                          prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)

    def body(q, k, v, b, a, cq, ck, cv, alog, dtb, *seg):
        # q, k: [B/D, S/P, Hk c, Q]; v: [B/D, S/P, Hv, V]; weights: this device's heads
        seg = seg[0] if seg else None
        if p > 1:
            q, k, v, b, a = _exchange([q, k, v, b, a], p)                      # v: [B, S, Hv/P, V]
            if seg is not None:
                seg = jax.lax.all_gather(seg, SEQ, axis=1, tiled=True)        # [B, S]
        o = core(q, k, v, b, a, cq, ck, cv, alog, dtb, seg)
        o, state = o if final_state else (o, None)
        o = o.astype(dt)                                                      # [B, S, Hv/P, V]
        if p > 1:
            o = jax.lax.all_to_all(o, SEQ, split_axis=1, concat_axis=2, tiled=True)
        return (o, state) if final_state else o                               # [B, S/P, Hv, V]

    batch_axis = DATA if DATA in mesh.axis_names else None
    act = P(batch_axis, SEQ)
    args = [shard(x, mesh, act) for x in (q, k, v, b, a)]
    args += [shard(w.astype(_F32), mesh, P(SEQ)) for w in (conv_q, conv_k, conv_v, a_log,
                                                           dt_bias)]
    specs = [act] * 5 + [P(SEQ)] * 5
    if segment_ids is not None:
        args.append(shard(segment_ids, mesh, act))
        specs.append(act)
    out = (act, P(batch_axis, SEQ)) if final_state else act
    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=out)
    return fn(*args)
