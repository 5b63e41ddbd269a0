"""Mixture-of-experts MLP with Qwen3-MoE semantics: router, top-k, SwiGLU experts, aux loss.

Letters as in decoder.py (B batch, S sequence, D model dim, F ffn dim), plus T tokens
(B x S flattened), E experts, A top-k choices per token, C capacity slots per expert.

Per token (as transformers' ``Qwen3MoeSparseMoeBlock``): router logits x @ W_r [E] in the
compute dtype, softmax in fp32, the A largest probabilities pick the experts (renormalised to
sum 1 when ``norm_topk_prob``), and the output is the probability-weighted sum of the chosen
experts' SwiGLU MLPs. An optional shared expert (Qwen3-Next) adds sigmoid(x @ w_g) * MLP(x)
for every token.

Load-balancing loss (transformers' ``load_balancing_loss_func``, Switch Transformer): over all
MoE layers and all tokens of the batch, f_e = assignments to expert e / tokens and
p_e = summed router probability of e / tokens, both pooled over layers; the loss is
E * sum_e f_e p_e. Every device only sees its own tokens, so each layer returns the *sums*
(assignments per expert, probabilities per expert, tokens), reduced over all devices with a
psum; the product is formed once, from the global sums, after the last layer
(``aux_loss``). Padding tokens (segment id 0) are left out, as transformers leaves out
positions its attention mask zeroes.

The expert-parallel computation lives in ``expert_parallel.py``; ``reference_moe`` here runs
every expert on every token (masked), the truth the tests compare it with.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ..config import ModelConfig

_F32 = jnp.float32
# Parameter names of the expert weights ([E, ...] leading expert axis) inside an MoE module.
EXPERT_PARAMS = ("w_gate", "w_up", "w_down")
STAT_KEYS = ("load", "prob", "tokens", "dropped")


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Layer ``i`` is sparse (transformers' Qwen3MoeDecoderLayer rule)."""
    return (cfg.num_experts > 0 and i not in cfg.mlp_only_layers
            and (i + 1) % cfg.decoder_sparse_step == 0)


def is_expert_param(keys: tuple) -> bool:
    """A parameter path (tuple of names) that holds expert weights with a leading E axis."""
    names = [str(k) for k in keys]
    return len(names) >= 2 and names[-2] == "moe" and names[-1] in EXPERT_PARAMS


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


def aux_loss(stats: dict, num_experts: int) -> jax.Array:
    """E * sum_e f_e p_e from global sums pooled over layers (see the module docstring).

    Args:
      stats: router_stats summed over devices and MoE layers (tokens = layers x tokens).
    Returns:
      fp32 scalar.
    """
    tokens = jnp.maximum(stats["tokens"], 1.0)
    return num_experts * jnp.sum((stats["load"] / tokens) * (stats["prob"] / tokens))


def swiglu(x, w_gate, w_up, w_down, spec: str = "TD,DF->TF"):
    """SwiGLU MLP; ``spec`` is the first projection's einsum (the rest follow from it)."""
    ins, out = spec.split("->")
    x_spec, w_spec = ins.split(",")
    h = jax.nn.silu(jnp.einsum(spec, x, w_gate)) * jnp.einsum(spec, x, w_up)
    back_w = w_spec[:-2] + w_spec[-1] + w_spec[-2]                          # ..DF -> ..FD
    return jnp.einsum(f"{out},{back_w}->{out[:-1]}{x_spec[-1]}", h, w_down)


def reference_moe(x, w_router, w_gate, w_up, w_down, *, top_k: int, norm_topk_prob: bool,
                  keep=None):
    """Every expert on every token, weighted by the (dense, mostly zero) routing weights.

    Args:
      x: [T, D]; w_router: [D, E]; w_gate, w_up: [E, D, F]; w_down: [E, F, D].
      keep: optional [T, A] bool, False for assignments to leave out (dropped).
    Returns:
      (y [T, D] in x's dtype, probs [T, E], top_i [T, A]).
    """
    probs, top_w, top_i = route(x, w_router, top_k, norm_topk_prob)
    if keep is not None:
        top_w = jnp.where(keep, top_w, 0.0)
    dense_w = jnp.zeros(probs.shape, _F32).at[
        jnp.arange(x.shape[0])[:, None], top_i].add(top_w)                  # [T, E]
    y = swiglu(x, w_gate, w_up, w_down, "TD,EDF->TEF")                      # [T, E, D]
    return jnp.einsum("TE,TED->TD", dense_w.astype(x.dtype), y), probs, top_i


def mlp_matmul_params(cfg: ModelConfig, i: int) -> int:
    """Weights one token multiplies through in layer ``i``'s MLP: the dense SwiGLU, or the
    router, its A routed experts and the shared expert with its gate (training/flops.py)."""
    d = cfg.d_model
    if not is_moe_layer(cfg, i):
        return 3 * d * cfg.ffn_dim
    shared = 3 * d * cfg.moe_shared_ffn_dim + d if cfg.moe_shared_ffn_dim else 0
    return d * cfg.num_experts + cfg.num_experts_per_tok * 3 * d * cfg.moe_ffn_dim + shared


def active_params_per_token(cfg: ModelConfig) -> int:
    """Parameters a token passes through in one forward pass (MoE layers count only the
    A routed experts, the router and the shared expert); the embedding lookup is excluded,
    the output head and the norm scales included."""
    from .qwen3_next import mixer_matmul_params  # qwen3_next builds on this module

    d, h = cfg.d_model, cfg.head_dim
    norms = 2 * h if cfg.qk_norm else 0
    mixers = cfg.layer_mixers()
    layers = sum(mixer_matmul_params(cfg, mixers[i]) + (norms if mixers[i] == "A" else 0)
                 + 2 * d + mlp_matmul_params(cfg, i) for i in range(cfg.n_layers))
    return layers + d + d * cfg.vocab_size


class MoE(nnx.Module):
    """Sparse MoE MLP: ``moe(x [B, S, D], valid [B, S]) -> (y [B, S, D], stats)``.

    Expert weights are [E, D, F] / [E, F, D] and live split over all mesh devices along E
    (``expert_parallel.expert_spec``); the router [D, E] and the shared expert are gathered
    where used, like every other weight.
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs):
        d, e, f = cfg.d_model, cfg.num_experts, cfg.moe_ffn_dim
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        self.router = nnx.Param(init(rngs.params(), (d, e)))                 # [D, E]
        self.w_gate = nnx.Param(init(rngs.params(), (e, d, f)))              # [E, D, F]
        self.w_up = nnx.Param(init(rngs.params(), (e, d, f)))
        self.w_down = nnx.Param(out_init(rngs.params(), (e, f, d)))          # [E, F, D]
        s = cfg.moe_shared_ffn_dim
        if s:
            self.shared_gate = nnx.Param(init(rngs.params(), (d, s)))
            self.shared_up = nnx.Param(init(rngs.params(), (d, s)))
            self.shared_down = nnx.Param(out_init(rngs.params(), (s, d)))
            self.shared_expert_gate = nnx.Param(init(rngs.params(), (d, 1)))    # [D, 1]
        else:
            self.shared_gate = self.shared_up = self.shared_down = None
            self.shared_expert_gate = None
        self.cfg, self.mesh = cfg, mesh

    def __call__(self, x, valid):
        from .decoder import _gathered  # decoder imports this module
        from .expert_parallel import moe_experts

        dt, mesh, cfg = x.dtype, self.mesh, self.cfg
        experts = [w[...].astype(dt) for w in (self.w_gate, self.w_up, self.w_down)]
        y, stats = moe_experts(x, valid, _gathered(self.router[...], dt, mesh), *experts,
                               mesh=mesh, top_k=cfg.num_experts_per_tok,
                               norm_topk_prob=cfg.norm_topk_prob,
                               capacity_factor=cfg.moe_capacity_factor)
        if self.shared_expert_gate is not None:
            ws = [_gathered(w[...], dt, mesh) for w in
                  (self.shared_gate, self.shared_up, self.shared_down, self.shared_expert_gate)]
            gate = jax.nn.sigmoid(jnp.einsum("BSD,DO->BSO", x, ws[3]))             # [B, S, 1]
            y = y + gate * swiglu(x, *ws[:3], "BSD,DF->BSF")
        return y, stats
