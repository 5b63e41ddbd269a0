"""The Llama-family decoder block (``model.family=llama``: Llama 3, Mistral, Qwen2 / Qwen3 and
Qwen3-MoE): pre-norm attention and MLP (dense SwiGLU or a mixture of experts), built from
the shared parts in ``layers.py``. Letters as in decoder.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ..config import ModelConfig
from ..mesh import act_spec, shard
from . import lora
from .layers import MLP, Attention, norm
from .moe import MoE


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)).

    ``sparse``: the MLP is a mixture of experts (``self.moe``, models/moe.py) instead of the
    dense SwiGLU (``self.mlp``). Calls return (x, router stats or None).
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs,
                 layout: str = "natural", head_chunks: int = 1, sparse: bool = False):
        self.attn_norm = norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, mesh, rngs=rngs, layout=layout, head_chunks=head_chunks)
        self._init_feed_forward(cfg, mesh, rngs, sparse)
        # LoRA adapters (models/lora.py) drawn after every base weight: they leave those alone.
        lora.attach(self.attn, lora.ATTENTION, cfg.lora, rngs)
        self._attach_feed_forward_lora(cfg, rngs)

    def _init_feed_forward(self, cfg: ModelConfig, mesh: Mesh | None, rngs: nnx.Rngs,
                           sparse: bool):
        """The MLP half (``feed_forward``): its norm and the dense MLP or the experts, made
        after the token mixer's parameters (the order the random keys are drawn in)."""
        self.mlp_norm = norm(cfg, cfg.d_model)
        self.mlp = None if sparse else MLP(cfg, mesh, rngs=rngs)
        self.moe = MoE(cfg, mesh, rngs=rngs) if sparse else None
        self.mesh, self.chunk = mesh, cfg.mlp_chunk

    def _attach_feed_forward_lora(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        """The MLP half's adapters: the dense MLP's, or the MoE's (shared and routed experts)."""
        if self.mlp is not None:
            lora.attach(self.mlp, lora.MLP, cfg.lora, rngs)
        else:
            lora.attach_moe(self.moe, cfg.lora, rngs)

    def __call__(self, x, positions, segment_ids, kind="G"):
        """``kind``: the layer's attention kind (``Attention.__call__``)."""
        # Named scopes label the ops (profiles, ulysses_jax/memory.py's categories).
        with jax.named_scope("attention"):
            normed = self._mixer_input(x)                                            # [B, S, D]
            o = self.attn(normed, positions, segment_ids, kind)                      # [B, S, D]
        return self.feed_forward(x, segment_ids, o)

    def _mixer_input(self, x):
        """The token mixer's input: x [B, S, D] normed (over ``model.mlp_chunk`` tokens at a
        time)."""
        return self.attn_norm.over_chunks(x, self.mesh, self.chunk)                  # [B, S, D]

    def feed_forward(self, x, segment_ids, mixed=None):
        """x + mlp(norm(x)), dense or MoE; returns (x resharded, router stats or None).

        ``mixed``: the token mixer's output, added to x first.
        """
        stats = None
        mlp_norm, mlp, moe = self.mlp_norm, self.mlp, self.moe
        if mixed is not None:
            x = x + mixed
        with jax.named_scope("mlp"):
            if moe is None:
                x = x + mlp(x, mlp_norm)
            else:
                valid = jnp.ones(x.shape[:2], jnp.float32) if segment_ids is None else \
                    (segment_ids > 0).astype(jnp.float32)                   # [B, S]
                y, stats = moe(mlp_norm(x), valid)
                x = x + y
        return (x if self.mesh is None else shard(x, self.mesh, act_spec(self.mesh, 1))), stats
