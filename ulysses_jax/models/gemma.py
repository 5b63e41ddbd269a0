"""The Gemma 2 / Gemma 3 decoder block (``model.family=gemma``).

Letters as in decoder.py. What differs from the Llama block (decoder.Block), as transformers'
Gemma2/Gemma3 modeling code defines it:
  - RMSNorm scales by (1 + w), w stored and initialised at 0 (``decoder.norm``); q/k norms
    too (Gemma 3's qk-norm, ``model.qk_norm``);
  - four norms per block: the attention and the MLP outputs are normed again before their
    residual add (post_attention_layernorm, post_feedforward_layernorm);
  - GeGLU MLP: tanh-approximated GELU of the gate (``decoder.MLP``);
  - embeddings multiplied by sqrt(D) (``decoder.Decoder.hidden``);
  - softmax scale query_pre_attn_scalar ** -0.5 (``model.attn_scale``), attention logit
    softcap (Gemma 2, ``model.attn_softcap``), final logit softcap (Gemma 2,
    ``model.final_softcap``), local layers with a sliding window and their own RoPE base
    (Gemma 3, ``model.rope_local_theta``; ``model.layer_pattern``, e.g. LLLLLG).
The attention itself is decoder.Attention: the exchange does not care which block it sits in.
"""
from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh

from ..config import ModelConfig
from ..mesh import act_spec, shard
from .decoder import MLP, Attention, norm


class GemmaBlock(nnx.Module):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(norm(x))); x: [B, S, D]."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs,
                 layout: str = "natural", head_chunks: int = 1):
        self.attn_norm = norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, mesh, rngs=rngs, layout=layout, head_chunks=head_chunks)
        self.attn_post_norm = norm(cfg, cfg.d_model)
        self.mlp_norm = norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg, mesh, rngs=rngs)
        self.mlp_post_norm = norm(cfg, cfg.d_model)
        self.mesh = mesh

    def __call__(self, x, positions, segment_ids, kind="G"):
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), positions, segment_ids, kind))
        x = x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))
        return x if self.mesh is None else shard(x, self.mesh, act_spec(self.mesh, 1))
