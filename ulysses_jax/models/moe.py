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

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ..config import ModelConfig
from . import lora
from .expert_parallel import moe_experts
from .layers import MLP
from .layers import gathered as _gathered
# The routing functions live in routing.py (expert_parallel.py uses them too); kept here
# under their old names.
from .routing import capacity, route, router_stats, swiglu  # noqa: F401

_F32 = jnp.float32
# Parameter names of the expert weights ([E, ...] leading expert axis) inside an MoE module.
EXPERT_PARAMS = ("w_gate", "w_up", "w_down")
STAT_KEYS = ("load", "prob", "tokens", "dropped")


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Layer ``i`` is sparse (transformers' Qwen3MoeDecoderLayer rule)."""
    return (cfg.num_experts > 0 and i not in cfg.mlp_only_layers
            and (i + 1) % cfg.decoder_sparse_step == 0)


def is_expert_param(keys: tuple) -> bool:
    """A parameter path (tuple of names) that holds expert weights with a leading E axis:
    the experts' weights and their LoRA adapters (``lora.EXPERTS``)."""
    names = [str(k) for k in keys]
    return len(names) >= 2 and names[-2] == "moe" and (
        names[-1] in EXPERT_PARAMS
        or names[-1] in {n for t in lora.EXPERTS for n in lora.names(t)})


def aux_loss(stats: dict, num_experts: int) -> jax.Array:
    """E * sum_e f_e p_e from global sums pooled over layers (see the module docstring).

    Args:
      stats: router_stats summed over devices and MoE layers (tokens = layers x tokens).
    Returns:
      fp32 scalar.
    """
    tokens = jnp.maximum(stats["tokens"], 1.0)
    return num_experts * jnp.sum((stats["load"] / tokens) * (stats["prob"] / tokens))


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
        dt, mesh, cfg = x.dtype, self.mesh, self.cfg
        experts = [w[...].astype(dt) for w in (self.w_gate, self.w_up, self.w_down)]
        adapters = [w.astype(dt) for w in lora.expert_adapters(self)]  # [] without LoRA
        scale = lora.scaling(cfg.lora) if adapters else 0.0
        y, stats = moe_experts(x, valid, _gathered(self.router[...], dt, mesh), *experts,
                               mesh=mesh, top_k=cfg.num_experts_per_tok,
                               norm_topk_prob=cfg.norm_topk_prob,
                               capacity_factor=cfg.moe_capacity_factor,
                               adapters=adapters, scale=scale)
        if self.shared_expert_gate is not None:
            ws = [_gathered(w[...], dt, mesh) for w in
                  (self.shared_gate, self.shared_up, self.shared_down, self.shared_expert_gate)]
            gate = jax.nn.sigmoid(jnp.einsum("BSD,DO->BSO", x, ws[3]))             # [B, S, 1]
            shared = lora.adapters(self, lora.SHARED)  # {} without LoRA
            flat = [_gathered(w, dt, mesh) for ab in shared.values() for w in ab]
            y = y + gate * MLP._mlp(x, *ws[:3], *flat, targets=tuple(shared),
                                    scale=lora.scaling(cfg.lora) if shared else 0.0)
        return y, stats
