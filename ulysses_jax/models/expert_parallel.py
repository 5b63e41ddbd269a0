"""Expert parallelism: tokens travel to their experts' devices and back with two all-to-alls.

Letters as in moe.py: T tokens per device, D model dim, F expert ffn dim, E experts, A top-k
choices per token, C slots per (device, expert), N devices, El = E/N experts per device.

Layout. The E experts are split evenly over all N devices of the mesh, data x ring x seq in
mesh order (the devices ZeRO-3 shards over; no extra mesh axis): device n holds experts
n*El .. (n+1)*El - 1, as [El, D, F] slices of the [E, D, F] weights (``expert_spec``). Tokens
stay where Ulysses keeps them between attentions, T = B/data x S/P per device.

One shard_map per MoE layer; on each device:
  1. route its T tokens (the [D, E] router is replicated): A experts per token;
  2. give each assignment (token, choice) a slot: its rank among this device's assignments
     to the same expert, all tokens' first choices ranked before any second choice. Slots
     past C are dropped: the assignment contributes nothing (``moe_capacity_factor``; the
     default C = T never drops) and is counted;
  3. gather tokens into the dispatch buffer [E, C, D] = [N, El, C, D] and all-to-all it over
     all devices: device n receives [N, El, C, D], every device's slots for its own experts;
  4. run its experts as batched SwiGLU matmuls on [El, N*C, D];
  5. all-to-all the results back, gather each assignment's output from its slot, weight it by
     its routing probability and sum over the A choices.
Forward: 2 all-to-alls of E x C x D values per device (backward: 2 more), plus a psum of the
[E] router sums for the aux loss.

Why fixed slots and not ``ragged_all_to_all`` + ``ragged_dot``: on jax 0.10.2 XLA:CPU has no
ragged-all-to-all ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
ThunkEmitter"), and XLA:CPU expands ``ragged_dot`` into a dense masked matmul over every
group (32x the FLOPs and an [M, K, E] buffer for M=8192, K=256, E=16), so neither the tests
nor the CPU-compiled memory analyses in docs/PERF.md could use them. Slots give a dense
all-to-all and dense batched matmuls with the same shapes on every backend; the price is
C x E buffer rows per device: A x T x capacity factor when dropping is allowed, E x T (E/A
times the routed tokens) when it is not.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ..mesh import act_spec, num_devices
from .lora import expert_swiglu
from .routing import capacity, route, router_stats


def expert_spec(ndim: int, mesh: Mesh) -> P:
    """Spec of an expert weight [..., E, D, F] (layer-stacked or not): E over all devices."""
    return P(*([None] * (ndim - 3)), tuple(mesh.axis_names), None, None)


def assign_slots(top_i, num_experts: int, slots: int):
    """Slot of every assignment in this device's [E, C] dispatch buffer.

    Args:
      top_i: [T, A] expert ids; slots: C.
    Returns:
      (slot [A*T] int32 flat index e*C + rank, or E*C when dropped; keep [A*T] bool), in
      choice-major order (index j*T + t is token t's j-th choice).
    """
    t, a = top_i.shape
    expert = top_i.T.reshape(-1)                                          # [A*T]
    order = jnp.argsort(expert, stable=True)
    counts = jnp.zeros((num_experts,), jnp.int32).at[expert].add(1)        # [E]
    starts = jnp.cumsum(counts) - counts
    rank = jnp.zeros((a * t,), jnp.int32).at[order].set(jnp.arange(a * t, dtype=jnp.int32))
    pos = rank - starts[expert]
    keep = pos < slots
    return jnp.where(keep, expert * slots + pos, num_experts * slots), keep


def _local_moe(x, valid, w_router, w_gate, w_up, w_down, *adapters, axes, n: int, top_k: int,
               norm_topk_prob: bool, capacity_factor: float, scale: float = 0.0):
    """One device's part (see the module docstring). x: [B/data, S/P, D] local tokens;
    ``adapters``: this device's experts' LoRA matrices (``lora.expert_adapters``), or none."""
    b, s, d = x.shape
    t, el = b * s, w_gate.shape[0]
    e = el * n
    xt = x.reshape(t, d)
    probs, top_w, top_i = route(xt, w_router, top_k, norm_topk_prob)       # [T, E], [T, A]
    c = capacity(t, capacity_factor, top_k, e)
    slot, keep = assign_slots(top_i, e, c)                                 # [A*T]
    token = jnp.tile(jnp.arange(t, dtype=jnp.int32), top_k)               # [A*T]
    filler = jnp.full((e * c,), t, jnp.int32).at[slot].set(token, mode="drop")   # [E*C]
    send = jnp.take(xt, filler, axis=0, mode="fill", fill_value=0)        # [E*C, D]
    send = send.reshape(n, el, c, d)
    recv = lax.all_to_all(send, axes, 0, 0, tiled=True) if n > 1 else send  # [N, El, C, D]
    h = recv.transpose(1, 0, 2, 3).reshape(el, n * c, d)                   # [El, N*C, D]
    out = expert_swiglu(h, w_gate, w_up, w_down, adapters, scale)          # [El, N*C, D]
    out = out.reshape(el, n, c, d).transpose(1, 0, 2, 3)                   # [N, El, C, D]
    back = lax.all_to_all(out, axes, 0, 0, tiled=True) if n > 1 else out  # [N, El, C, D]
    got = jnp.take(back.reshape(e * c, d), slot, axis=0, mode="fill", fill_value=0)
    weights = top_w.T.astype(x.dtype)                                      # [A, T]
    y = jnp.einsum("ATD,AT->TD", got.reshape(top_k, t, d), weights)        # [T, D]
    v = valid.reshape(t).astype(jnp.float32)
    dropped = jnp.sum(jnp.where(keep, 0.0, jnp.tile(v, top_k)))
    stats = router_stats(probs, top_i, v, dropped)
    if axes:  # (a psum over size-1 axes is free, and marks the sums replicated)
        stats = lax.psum(stats, axes)
    return y.reshape(b, s, d), stats


def moe_experts(x, valid, w_router, w_gate, w_up, w_down, *, mesh: Mesh | None, top_k: int,
                norm_topk_prob: bool, capacity_factor: float = 0.0, adapters=(),
                scale: float = 0.0):
    """The routed-experts output of every token, experts split over the mesh's devices.

    Args:
      x: [B, S, D] normed activations, sharded like the activations (P("data", seq axes)).
      valid: [B, S] 1 for real tokens, 0 for padding (left out of the router sums).
      w_router: [D, E], replicated; w_gate, w_up: [E, D, F]; w_down: [E, F, D], all in x's
        dtype, split over the devices along E (``expert_spec``).
      mesh: the training mesh (None: one device, no collectives).
      top_k, norm_topk_prob: routing (moe.route); capacity_factor: moe.capacity.
      adapters: LoRA on the experts (``lora.expert_adapters``: A, B of gate_up, A, B of
        down, each [E, ...] split along E like the weights, in x's dtype), or (); scale: s.
    Returns:
      (y [B, S, D] like x, stats): stats as ``moe.router_stats``, summed over all devices.
    """
    kw = dict(top_k=top_k, norm_topk_prob=norm_topk_prob, capacity_factor=capacity_factor,
              scale=scale)
    adapters = tuple(adapters)
    if mesh is None:
        return _local_moe(x, valid, w_router, w_gate, w_up, w_down, *adapters, axes=(), n=1,
                          **kw)
    axes, n = tuple(mesh.axis_names), num_devices(mesh)
    if w_gate.shape[0] % n:
        raise ValueError(f"num_experts {w_gate.shape[0]} is not divisible by the mesh's {n} "
                         f"devices; experts are split evenly over all of them")
    body = lambda *args: _local_moe(*args, axes=axes, n=n, **kw)
    ew = expert_spec(3, mesh)
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(act_spec(mesh, 1), act_spec(mesh), P(), ew, ew, ew)
                       + (ew,) * len(adapters),
                       out_specs=(act_spec(mesh, 1), P()))
    return fn(x, valid, w_router, w_gate, w_up, w_down, *adapters)
