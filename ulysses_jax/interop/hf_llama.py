"""Hugging Face config and tensor names of the llama family: Llama, Mistral, Qwen2, Qwen3
and Qwen3-MoE, for ``hf.py``.

Conventions checked against transformers' modeling code (Llama, Mistral, Qwen2, Qwen3):
half-split RoPE with inv_freq = theta^(-2i/head_dim); RMSNorm in fp32 times the weight; q/k
RMSNorm over head_dim before RoPE (Qwen3); q/k/v projection biases added before RoPE, none on
o_proj (Qwen2); GQA query head n reads kv head n // (N/K); logits
scale head_dim^-0.5; SiLU-gated MLP; ``lm_head`` = embedding when ``tie_word_embeddings``.
Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention; layer i sparse unless i is in
``mlp_only_layers`` or (i + 1) % ``decoder_sparse_step`` != 0 (models/moe.py); router
``mlp.gate.weight`` [E, D]; experts on disk one Linear each, ``mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj`` (``hf._EXPERTS``). transformers 5 holds them fused in memory
(``gate_up_proj`` [E, 2F, D], ``down_proj`` [E, D, F]) but its save_pretrained writes, and its
from_pretrained reads, this per-expert layout (checked with transformers 5.24), as do the
published Qwen3-MoE checkpoints. transformers 5.24 writes the expert count as
``num_local_experts``; older files and the Qwen releases as ``num_experts``: both are read,
``num_experts`` is written. Sliding windows (Mistral, Qwen2 / Qwen3 / Qwen3-MoE with
use_sliding_window) are read and written by ``hf_variants.window_from_hf`` / ``window_to_hf``.
What our Decoder cannot express (an o_proj or MLP bias, dynamic or longrope RoPE, partial
RoPE, other activations) is refused with a ValueError, never silently dropped.
"""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .hf_family import FLAT, HFFamily, dtype_name
from .hf_variants import (min_max_position_embeddings, rope_scaling_from_hf, rope_scaling_to_hf,
                          window_from_hf, window_to_hf)

# The llama family's model types and their transformers classes.
ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM"}
# Our parameter path inside one block -> (HF tensor name, n_in; hf_family.py).
LAYER = {
    ("attn_norm", "scale"): ("input_layernorm.weight", 0),
    ("attn", "wq"): ("self_attn.q_proj.weight", 1),
    ("attn", "wk"): ("self_attn.k_proj.weight", 1),
    ("attn", "wv"): ("self_attn.v_proj.weight", 1),
    ("attn", "wo"): ("self_attn.o_proj.weight", 2),
    ("attn", "bq"): ("self_attn.q_proj.bias", FLAT),
    ("attn", "bk"): ("self_attn.k_proj.bias", FLAT),
    ("attn", "bv"): ("self_attn.v_proj.bias", FLAT),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", 0),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", 0),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", 0),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", 1),
    ("mlp", "w_up"): ("mlp.up_proj.weight", 1),
    ("mlp", "w_down"): ("mlp.down_proj.weight", 1),
    ("moe", "router"): ("mlp.gate.weight", 1),
}
# Class defaults of transformers' configs that differ from "all heads" / hidden // heads, used
# when config.json omits the key (an explicit null still means the generic default).
_ARCH_DEFAULTS = {"mistral": {"num_key_value_heads": 8},
                  "qwen2": {"num_key_value_heads": 32},
                  "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
                  "qwen3_moe": {"num_key_value_heads": 4}}
# Qwen3MoeConfig's defaults for its MoE keys: ours <- (HF key, default).
_MOE_KEYS = {"num_experts_per_tok": ("num_experts_per_tok", 8),
             "moe_ffn_dim": ("moe_intermediate_size", 768),
             "norm_topk_prob": ("norm_topk_prob", False),
             "decoder_sparse_step": ("decoder_sparse_step", 1),
             "router_aux_loss_coef": ("router_aux_loss_coef", 0.001)}
# Config keys that would add biases our Decoder lacks, per model type. Llama's and Qwen3's
# attention_bias biases o_proj too, Llama's mlp_bias the MLP. Mistral (and Qwen3's MLP) ignore
# them in transformers; a file that sets them anyway is refused rather than guessed at. Qwen2
# always has exactly the q/k/v biases (qkv_bias) and reads neither key.
_BIAS_KEYS = {"llama": ("attention_bias", "mlp_bias"), "mistral": ("attention_bias", "mlp_bias"),
              "qwen2": (), "qwen3": ("attention_bias", "mlp_bias"),
              "qwen3_moe": ("attention_bias",)}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def config_from_hf(hf: dict, *, dtype: Any, **overrides) -> ModelConfig:
    """A llama-family config.json (model_type in ``ARCHS``) as a ModelConfig (family llama).

    Raises:
      ValueError: what the Decoder does not implement, a bad dtype, or missing keys.
    """
    mt = hf["model_type"]
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (only silu is implemented)")
    for key in _BIAS_KEYS[mt]:
        if hf.get(key):
            problems.append(f"{key}=true (the Decoder has biases on q/k/v only, and only for "
                            f"qwen2)")
    # transformers >= 5 writes rope_parameters; older files have rope_theta / rope_scaling,
    # which transformers 5 still prefers when both are there.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    scaling = None
    try:
        scaling = rope_scaling_from_hf(
            {"partial_rotary_factor": hf.get("partial_rotary_factor", 1.0), **rope}, hf)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError(f"cannot import this {mt} checkpoint: " + "; ".join(problems))
    dtype = dtype_name(dtype)
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    hf = {**_ARCH_DEFAULTS.get(mt, {}), **hf}
    heads = hf["num_attention_heads"]
    if mt == "qwen3_moe":
        moe = {ours: hf.get(key, default) for ours, (key, default) in _MOE_KEYS.items()}
        moe.update(num_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
                   mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
        overrides = {**moe, **overrides}
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=mt in ("qwen3", "qwen3_moe"),
        qkv_bias=mt == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype,
        **window_from_hf(hf), **overrides)


def config_to_hf(cfg: ModelConfig, arch: str | None,
                 max_position_embeddings: int | None) -> dict:
    """The config.json of a family-llama Decoder (``hf.config_to_hf`` says which arch fits)."""
    if cfg.qk_norm and cfg.qkv_bias:
        raise ValueError("no supported arch has both q/k RMSNorm and q/k/v biases (Qwen3's "
                         "attention_bias also biases o_proj); qk_norm=True, qkv_bias=True")
    if cfg.num_experts and (not cfg.qk_norm or cfg.moe_shared_ffn_dim):
        raise ValueError(f"an MoE model exports as qwen3_moe, which has q/k RMSNorm and no "
                         f"shared expert; qk_norm={cfg.qk_norm}, moe_shared_ffn_dim="
                         f"{cfg.moe_shared_ffn_dim}")
    fits = ("qwen3_moe" if cfg.num_experts else "qwen3" if cfg.qk_norm else
            "qwen2" if cfg.qkv_bias else "llama")
    if fits == "llama" and "L" in cfg.layer_kinds():
        fits = "mistral"
    arch = arch or fits
    if cfg.rope("L") != cfg.rope("G") and "L" in cfg.layer_kinds():
        raise ValueError(f"{arch} has one RoPE base and scaling for all layers, but local "
                         f"layers have {cfg.rope('L')} and global ones {cfg.rope('G')}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)} for a llama-family model, "
                         f"got {arch!r}")
    if bool(cfg.num_experts) != (arch == "qwen3_moe"):
        raise ValueError(f"arch {arch!r} {'has' if arch == 'qwen3_moe' else 'has no'} experts "
                         f"but the model has num_experts={cfg.num_experts}; use arch={fits!r}")
    qk = arch in ("qwen3", "qwen3_moe")
    if cfg.qk_norm != qk:
        raise ValueError(f"arch {arch!r} {'has' if qk else 'has no'} q/k RMSNorm "
                         f"but the model has qk_norm={cfg.qk_norm}; use arch={fits!r}")
    if cfg.qkv_bias != (arch == "qwen2"):
        raise ValueError(f"arch {arch!r} {'has' if arch == 'qwen2' else 'has no'} q/k/v biases "
                         f"but the model has qkv_bias={cfg.qkv_bias}; use arch={fits!r}")
    rope = rope_scaling_to_hf(cfg.rope_scaling, cfg.rope_theta)
    hf = {"architectures": [ARCHS[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
          "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
          "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
          "rope_parameters": rope,
          # transformers 5 reads a non-null rope_scaling first; older versions only it.
          "rope_scaling": None if cfg.rope_scaling.type == "default" else dict(rope),
          "max_position_embeddings": max(
              max_position_embeddings or 4096,
              min_max_position_embeddings(cfg.rope_scaling)),
          "tie_word_embeddings": cfg.tie_embeddings,
          "attention_dropout": 0.0, "torch_dtype": "float32", "dtype": "float32"}
    if arch != "qwen2":  # Qwen2Config has no such key: its q/k/v biases are always there
        hf["attention_bias"] = False
    if arch == "llama":
        hf["mlp_bias"] = False
    else:
        hf["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=False, layer_types=["full_attention"] * cfg.n_layers)
    if arch == "qwen3_moe":
        hf.update({key: getattr(cfg, ours) for ours, (key, _) in _MOE_KEYS.items()})
        hf.update(use_sliding_window=False, num_experts=cfg.num_experts,
                  mlp_only_layers=list(cfg.mlp_only_layers))
    hf.update(window_to_hf(cfg, arch))
    return hf


HF = HFFamily(archs=ARCHS, layer=LAYER, config_from_hf=config_from_hf, config_to_hf=config_to_hf)
