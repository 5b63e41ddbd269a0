"""The Gemma 2 / Gemma 3 decoder block (``model.family=gemma``).

Letters as in decoder.py. What differs from the Llama block (llama.Block), as transformers'
Gemma2/Gemma3 modeling code defines it:
  - RMSNorm scales by (1 + w), w stored and initialised at 0 (``layers.norm``, the
    family's trait in families.py); q/k norms too (Gemma 3's qk-norm, ``model.qk_norm``);
  - four norms per block: the attention and the MLP outputs are normed again before their
    residual add (post_attention_layernorm, post_feedforward_layernorm);
  - GeGLU MLP: tanh-approximated GELU of the gate (``layers.MLP``, families.py);
  - embeddings multiplied by sqrt(D) (``decoder.Decoder.hidden``);
  - softmax scale query_pre_attn_scalar ** -0.5 (``model.attn_scale``), attention logit
    softcap (Gemma 2, ``model.attn_softcap``), final logit softcap (Gemma 2,
    ``model.final_softcap``), local layers with a sliding window and their own RoPE base
    (Gemma 3, ``model.rope_local_theta``; ``model.layer_pattern``, e.g. LLLLLG).
The attention itself is layers.Attention: the exchange does not care which block it sits in.
"""
from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from ..config import ModelConfig
from ..mesh import act_spec, shard
from . import lora
from .layers import MLP, Attention, norm


class GemmaBlock(nnx.Module):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(norm(x))); x: [B, S, D].

    Calls return (x, None), as llama.Block's do for a dense layer (Gemma has no MoE layers;
    config.validate refuses them). With ``model.mlp_chunk`` the pre-norm, the GeGLU MLP and
    the post-norm all run inside the fused token-chunk loop (``MLP.__call__``): every step is
    token-local and the (1 + w) scales are plain fp32 [D] weights, so nothing needs the
    unfused path.
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs,
                 layout: str = "natural", head_chunks: int = 1, sparse: bool = False):
        if sparse:
            raise ValueError("model.family=gemma has no mixture-of-experts layers")
        self.attn_norm = norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, mesh, rngs=rngs, layout=layout, head_chunks=head_chunks)
        self.attn_post_norm = norm(cfg, cfg.d_model)
        self.mlp_norm = norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg, mesh, rngs=rngs)
        self.mlp_post_norm = norm(cfg, cfg.d_model)
        # LoRA adapters (models/lora.py) drawn after every base weight: they leave those alone.
        lora.attach(self.attn, lora.ATTENTION, cfg.lora, rngs)
        lora.attach(self.mlp, lora.MLP, cfg.lora, rngs)
        self.mesh, self.chunk = mesh, cfg.mlp_chunk

    def __call__(self, x, positions, segment_ids, kind="G"):
        mesh, chunk = self.mesh, self.chunk
        with jax.named_scope("attention"):
            normed = self.attn_norm.over_chunks(x, mesh, chunk)                       # [B, S, D]
            o = self.attn(normed, positions, segment_ids, kind)                      # [B, S, D]
            x = x + self.attn_post_norm.over_chunks(o, mesh, chunk)
        with jax.named_scope("mlp"):
            x = x + self.mlp(x, self.mlp_norm, self.mlp_post_norm)
        return (x if mesh is None else shard(x, mesh, act_spec(mesh, 1))), None
