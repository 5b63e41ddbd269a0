"""Routing of the mixture of experts (Qwen3-MoE semantics), shared by ``moe.py`` and
``expert_parallel.py``: the top-k choice, the capacity slots, the router statistics of the
load-balancing loss, and the SwiGLU expert MLP. Letters as in moe.py.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def capacity(tokens: int, factor: float, top_k: int, num_experts: int) -> int:
    """Slots per (device, expert) for ``tokens`` tokens per device.

    ``factor`` 0 (``model.moe_capacity_factor``) means no dropping: one expert can receive
    every token of a device (a token picks an expert at most once), so ``tokens`` slots.
    Otherwise ceil(factor x tokens x A / E), at least 1 and at most ``tokens``.
    """
    if factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * top_k / num_experts)))


def route(x, w_router, top_k: int, norm_topk_prob: bool):
    """Router probabilities and the top-k choices of every token.

    Args:
      x: [T, D] tokens in the compute dtype; w_router: [D, E] in the same dtype.
    Returns:
      (probs [T, E] fp32, top_w [T, A] fp32, top_i [T, A] int32).
    """
    logits = jnp.einsum("TD,DE->TE", x, w_router)                          # [T, E]
    probs = jax.nn.softmax(logits.astype(_F32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, top_k)                            # [T, A]
    if norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return probs, top_w, top_i.astype(jnp.int32)


def router_stats(probs, top_i, valid, dropped=None) -> dict:
    """This device's sums for the aux loss and the metrics (reduce them over devices).

    Args:
      probs: [T, E] fp32; top_i: [T, A] ints; valid: [T] fp32 (1 = a real token).
      dropped: [] number of assignments this device dropped (None = 0).
    Returns:
      {"load": [E] assignments per expert, "prob": [E] summed probabilities, "tokens": [],
       "dropped": []}, all fp32; load and dropped carry no gradient.
    """
    e = probs.shape[-1]
    hits = jnp.zeros((e,), _F32).at[top_i.reshape(-1)].add(
        jnp.repeat(valid, top_i.shape[-1]))                                 # [E]
    return {"load": jax.lax.stop_gradient(hits),
            "prob": jnp.einsum("TE,T->E", probs, valid),
            "tokens": jnp.sum(valid),
            "dropped": jnp.zeros((), _F32) if dropped is None
            else jax.lax.stop_gradient(dropped.astype(_F32))}


def swiglu(x, w_gate, w_up, w_down, spec: str = "TD,DF->TF"):
    """SwiGLU MLP; ``spec`` is the first projection's einsum (the rest follow from it)."""
    ins, out = spec.split("->")
    x_spec, w_spec = ins.split(",")
    h = jax.nn.silu(jnp.einsum(spec, x, w_gate)) * jnp.einsum(spec, x, w_up)
    back_w = w_spec[:-2] + w_spec[-1] + w_spec[-2]                          # ..DF -> ..FD
    return jnp.einsum(f"{out},{back_w}->{out[:-1]}{x_spec[-1]}", h, w_down)
