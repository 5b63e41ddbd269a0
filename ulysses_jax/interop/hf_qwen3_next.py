"""Hugging Face config and tensor names of Qwen3-Next (``Qwen3NextForCausalLM``), for ``hf.py``.

Our ``model.family=qwen3_next`` (models/qwen3_next.py) keeps transformers' fused tensors, so
each maps by the generic rule of ``hf.py`` (a Linear [out, in] transposed and reshaped, or
copied): q_proj [N * 2H, D] -> wq [D, N, 2H] (query then gate per head), in_proj_qkvz
[Hk (2Q + 2rV), D] -> [D, Hk, 2Q + 2rV], in_proj_ba [2 Hv, D] -> [D, Hk, 2r], conv1d.weight
[C, 1, W] as is, A_log / dt_bias [Hv], norm.weight [V], out_proj [D, Hv V] -> [Hv, V, D].
Experts are stored one Linear per expert on disk, as for Qwen3-MoE (transformers' conversion
mapping treats qwen3_next like qwen2_moe); the shared expert is ``mlp.shared_expert.*`` with
its gate ``mlp.shared_expert_gate`` [1, D].

Config: layer_types (linear_attention / full_attention; by default full attention every
``full_attention_interval`` = 4 layers) becomes ``mixer_pattern``; RoPE's
partial_rotary_factor (default 0.25) is read from rope_parameters or the top level, RoPE
scaling as for the other families (``hf_variants.rope_scaling_from_hf``: linear, llama3,
yarn). Other scalings, biases and activations are refused with a ValueError naming them.
"""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .hf_family import HFFamily, dtype_name
from .hf_variants import min_max_position_embeddings, rope_scaling_from_hf, rope_scaling_to_hf

ARCH = "Qwen3NextForCausalLM"

# Our parameter path inside one block -> (HF tensor name, n_in), as hf_llama.LAYER.
LAYER = {
    ("attn_norm", "scale"): ("input_layernorm.weight", 0),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", 0),
    ("attn", "wq"): ("self_attn.q_proj.weight", 1),
    ("attn", "wk"): ("self_attn.k_proj.weight", 1),
    ("attn", "wv"): ("self_attn.v_proj.weight", 1),
    ("attn", "wo"): ("self_attn.o_proj.weight", 2),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", 0),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", 0),
    ("linear_attn", "in_proj_qkvz"): ("linear_attn.in_proj_qkvz.weight", 1),
    ("linear_attn", "in_proj_ba"): ("linear_attn.in_proj_ba.weight", 1),
    ("linear_attn", "conv"): ("linear_attn.conv1d.weight", 0),
    ("linear_attn", "a_log"): ("linear_attn.A_log", 0),
    ("linear_attn", "dt_bias"): ("linear_attn.dt_bias", 0),
    ("linear_attn", "norm_scale"): ("linear_attn.norm.weight", 0),
    ("linear_attn", "out_proj"): ("linear_attn.out_proj.weight", 2),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", 1),
    ("mlp", "w_up"): ("mlp.up_proj.weight", 1),
    ("mlp", "w_down"): ("mlp.down_proj.weight", 1),
    ("moe", "router"): ("mlp.gate.weight", 1),
    ("moe", "shared_gate"): ("mlp.shared_expert.gate_proj.weight", 1),
    ("moe", "shared_up"): ("mlp.shared_expert.up_proj.weight", 1),
    ("moe", "shared_down"): ("mlp.shared_expert.down_proj.weight", 1),
    ("moe", "shared_expert_gate"): ("mlp.shared_expert_gate.weight", 1),
}
# Qwen3NextConfig's class defaults, for keys a config.json may omit.
_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "linear_conv_kernel_dim": 4,
             "linear_key_head_dim": 128, "linear_value_head_dim": 128,
             "linear_num_key_heads": 16, "linear_num_value_heads": 32,
             "decoder_sparse_step": 1, "moe_intermediate_size": 512,
             "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
             "num_experts": 512, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
             "hidden_act": "silu", "full_attention_interval": 4}
_MIXER = {"linear_attention": "D", "full_attention": "A"}
_HF_MIXER = {v: k for k, v in _MIXER.items()}


def _pattern(kinds: str) -> str:
    """The shortest prefix of ``kinds`` that repeats to it."""
    n = len(kinds)
    return next(kinds[:p] for p in range(1, n + 1) if (kinds[:p] * -(-n // p))[:n] == kinds)


def config_from_hf(hf: dict, *, dtype: Any, **overrides) -> ModelConfig:
    """A qwen3_next config.json as a ModelConfig (family qwen3_next).

    Raises:
      ValueError: a bad dtype, what the model does not implement, or missing keys.
    """
    dtype = dtype_name(dtype)
    hf = {**_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    problems = []
    if hf["hidden_act"] != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (only silu is implemented)")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true (the Qwen3-Next block has no biases)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    try:  # default, linear, llama3, yarn, on the rotated dims (rope.py)
        scaling = rope_scaling_from_hf(rope, hf)
    except ValueError as e:
        problems.append(str(e))
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
        problems.append(f"config.json lacks {missing}")
    n = hf.get("num_hidden_layers", 0)
    types = hf.get("layer_types")
    if types is None:
        every = hf["full_attention_interval"]
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - set(_MIXER))
    if unknown or len(types) != n:
        problems.append(f"layer_types must list {n} of {sorted(_MIXER)}, got {types}")
    if hf["num_experts"] and not hf["shared_expert_intermediate_size"]:
        problems.append("shared_expert_intermediate_size 0 (the sparse block always has a "
                        "shared expert)")
    if problems:
        raise ValueError("cannot import this qwen3_next checkpoint: " + "; ".join(problems))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    moe = {}
    if hf["num_experts"]:
        moe = dict(num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                   moe_ffn_dim=hf["moe_intermediate_size"],
                   moe_shared_ffn_dim=hf["shared_expert_intermediate_size"],
                   norm_topk_prob=bool(hf["norm_topk_prob"]),
                   decoder_sparse_step=hf["decoder_sparse_step"],
                   mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                   router_aux_loss_coef=float(hf["router_aux_loss_coef"]))
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n,
        n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"], ffn_dim=hf["intermediate_size"], rope_theta=theta,
        norm_eps=float(hf["rms_norm_eps"]), qk_norm=True, qkv_bias=False,
        tie_embeddings=bool(hf["tie_word_embeddings"]), dtype=dtype, family="qwen3_next",
        mixer_pattern=_pattern("".join(_MIXER[t] for t in types)),
        linear_key_heads=hf["linear_num_key_heads"],
        linear_value_heads=hf["linear_num_value_heads"],
        linear_key_dim=hf["linear_key_head_dim"], linear_value_dim=hf["linear_value_head_dim"],
        linear_conv=hf["linear_conv_kernel_dim"], partial_rotary_factor=partial,
        rope_scaling=scaling,
        **{**moe, **overrides})


def config_to_hf(cfg: ModelConfig, arch: str | None,
                 max_position_embeddings: int | None) -> dict:
    """The config.json of a family-qwen3_next Decoder (arch None or qwen3_next)."""
    if arch not in (None, "qwen3_next"):
        raise ValueError(f"arch {arch!r} does not fit a qwen3_next-family model; use "
                         f"arch='qwen3_next'")
    if cfg.qkv_bias or not cfg.qk_norm:
        raise ValueError(f"Qwen3-Next attention has q/k norms and no biases; qk_norm="
                         f"{cfg.qk_norm}, qkv_bias={cfg.qkv_bias}")
    if cfg.attn_scale and abs(cfg.attn_scale - cfg.head_dim ** -0.5) > 1e-12:
        raise ValueError(f"Qwen3-Next scales attention by head_dim ** -0.5; attn_scale "
                         f"{cfg.attn_scale}")
    if cfg.num_experts and not cfg.moe_shared_ffn_dim:
        raise ValueError("a Qwen3-Next MoE layer always has a shared expert; "
                         "moe_shared_ffn_dim=0")
    rope = {**rope_scaling_to_hf(cfg.rope_scaling, cfg.rope_theta),
            "partial_rotary_factor": cfg.partial_rotary_factor}
    max_position_embeddings = max(max_position_embeddings or 4096,
                                  min_max_position_embeddings(cfg.rope_scaling))
    hf = {"architectures": [ARCH], "model_type": "qwen3_next", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
          "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
          "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
          "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor,
          "max_position_embeddings": max_position_embeddings,
          "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
          "attention_dropout": 0.0,
          "layer_types": [_HF_MIXER[c] for c in cfg.layer_mixers()],
          "linear_conv_kernel_dim": cfg.linear_conv,
          "linear_key_head_dim": cfg.linear_key_dim,
          "linear_value_head_dim": cfg.linear_value_dim,
          "linear_num_key_heads": cfg.linear_key_heads,
          "linear_num_value_heads": cfg.linear_value_heads,
          "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
          "moe_intermediate_size": cfg.moe_ffn_dim,
          "shared_expert_intermediate_size": cfg.moe_shared_ffn_dim,
          "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
          "mlp_only_layers": list(cfg.mlp_only_layers),
          "router_aux_loss_coef": cfg.router_aux_loss_coef,
          "torch_dtype": "float32", "dtype": "float32"}
    return hf


HF = HFFamily(archs={"qwen3_next": ARCH}, layer=LAYER, config_from_hf=config_from_hf,
              config_to_hf=config_to_hf)
