"""Hugging Face config and tensor names of the Gemma 2 / Gemma 3 text decoders
(``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, model types gemma2 and gemma3_text; our
``model.family=gemma``, models/gemma.py), for ``hf.py``.

Conventions checked against transformers' modeling code: Gemma scales logits by
query_pre_attn_scalar ** -0.5, caps attention logits at c tanh(x / c) before the mask
(attn_logit_softcapping) and the output logits likewise (final_logit_softcapping), multiplies
embeddings by sqrt(hidden_size) in the weights' dtype, norms with (1 + w), uses GeGLU
(gelu_pytorch_tanh); Gemma 3 adds q/k norms and a RoPE base and scaling of its own for
sliding layers (rope_parameters["sliding_attention"], older files rope_local_base_freq, and
their rope_scaling applies to the full-attention layers only). Gemma 2 layer i slides when i
is even, Gemma 3's when (i + 1) % sliding_window_pattern != 0, unless the file lists
layer_types. Anything else (biases, bidirectional attention, other activations) is refused
with a ValueError naming it.
"""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, RopeScalingConfig
from .hf_family import HFFamily, dtype_name
from .hf_variants import (kinds_from_hf, layer_types_to_hf, min_max_position_embeddings,
                          pattern_string, rope_scaling_from_hf, rope_scaling_to_hf)

ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}

# Our parameter path -> (HF tensor name, n_in), as hf_llama.LAYER, for the Gemma block: four
# norms, of which post_attention_layernorm norms the attention output (not the MLP input, as in
# Llama).
LAYER = {
    ("attn_norm", "scale"): ("input_layernorm.weight", 0),
    ("attn", "wq"): ("self_attn.q_proj.weight", 1),
    ("attn", "wk"): ("self_attn.k_proj.weight", 1),
    ("attn", "wv"): ("self_attn.v_proj.weight", 1),
    ("attn", "wo"): ("self_attn.o_proj.weight", 2),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", 0),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", 0),
    ("attn_post_norm", "scale"): ("post_attention_layernorm.weight", 0),
    ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", 0),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", 1),
    ("mlp", "w_up"): ("mlp.up_proj.weight", 1),
    ("mlp", "w_down"): ("mlp.down_proj.weight", 1),
    ("mlp_post_norm", "scale"): ("post_feedforward_layernorm.weight", 0),
}
# Class defaults of transformers' configs, for keys a config.json may omit.
_DEFAULTS = {
    "gemma2": {"num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "attn_logit_softcapping": None,
                    "final_logit_softcapping": None, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
                    "sliding_window_pattern": 6},
}
_THETA = {"gemma2": (10000.0, None), "gemma3_text": (1_000_000.0, 10000.0)}  # (global, local)


def config_from_hf(hf: dict, *, dtype: Any, **overrides) -> ModelConfig:
    """A Gemma 2 / Gemma 3 text config.json as a ModelConfig (family gemma).

    Args:
      hf: the parsed config.json (model_type gemma2 or gemma3_text).
      dtype: compute dtype, float32 or bfloat16 (a name or a dtype).
      **overrides: other ModelConfig fields (runtime options).
    Raises:
      ValueError: a bad dtype, features the Decoder does not implement, or missing keys.
    """
    dtype = dtype_name(dtype)
    mt = hf["model_type"]
    hf = {**_DEFAULTS[mt], **{k: v for k, v in hf.items() if v is not None or k in (
        "attn_logit_softcapping", "final_logit_softcapping", "sliding_window")}}
    problems = []
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        problems.append(f"hidden_activation {act!r} (only gelu_pytorch_tanh is implemented)")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true (the Gemma block has no biases)")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=true (the Decoder is causal)")
    global_theta, local_theta = _THETA[mt]
    rope = hf.get("rope_parameters") or {}
    nested = mt == "gemma3_text" and ("full_attention" in rope or "sliding_attention" in rope)
    if nested:
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    elif mt == "gemma3_text":  # Gemma3TextConfig applies the older rope_scaling to global layers
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            problems.append(f"a scaled rope_parameters not split per layer type "
                            f"(gemma3_text reads rope_parameters['full_attention'] and "
                            f"['sliding_attention']): {rope}")
        full, local = hf.get("rope_scaling") or {}, {}  # bases: rope_theta, rope_local_base_freq
    else:  # gemma2: one dict for all layers
        full = local = hf.get("rope_scaling") or rope
    scalings = {}
    for name, r in (("full_attention", full), ("sliding_attention", local)):
        if nested and "truncate" in r and r["truncate"] != rope.get("truncate", True):
            problems.append(f"truncate={r['truncate']} inside rope_parameters[{name!r}] "
                            f"(transformers reads only rope_parameters['truncate'])")
        try:
            scalings[name] = rope_scaling_from_hf(
                r, hf, f" on {name} layers", truncate_from=rope if nested else None)
        except ValueError as e:
            problems.append(str(e))
    theta = float(full.get("rope_theta", hf.get("rope_theta", global_theta)))
    if mt == "gemma3_text":
        theta_local = float(local.get("rope_theta", hf.get("rope_local_base_freq", local_theta)))
        pattern = hf["sliding_window_pattern"]
        kinds = kinds_from_hf(hf, lambda i: bool((i + 1) % pattern))
    else:
        theta_local = theta
        kinds = kinds_from_hf(hf, lambda i: bool((i + 1) % 2))
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
        problems.append(f"config.json lacks {missing}")
    if problems:
        raise ValueError(f"cannot import this {mt} checkpoint: " + "; ".join(problems))
    window = hf["sliding_window"] if "L" in kinds else None
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf["head_dim"], ffn_dim=hf["intermediate_size"], rope_theta=theta,
        norm_eps=float(hf["rms_norm_eps"]), qk_norm=mt == "gemma3_text", qkv_bias=False,
        tie_embeddings=bool(hf["tie_word_embeddings"]), dtype=dtype, family="gemma",
        sliding_window=int(window or 0),
        layer_pattern=pattern_string(kinds) if window else "",
        rope_local_theta=theta_local if theta_local != theta else 0.0,
        rope_scaling=scalings["full_attention"],
        rope_local_scaling=(RopeScalingConfig(type="") if scalings["sliding_attention"] ==
                            scalings["full_attention"] else scalings["sliding_attention"]),
        attn_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
        # transformers' Gemma3 attention ignores attn_logit_softcapping (Gemma 3 has none)
        attn_softcap=0.0 if mt == "gemma3_text" else float(hf["attn_logit_softcapping"] or 0.0),
        final_softcap=float(hf["final_logit_softcapping"] or 0.0), **overrides)


def config_to_hf(cfg: ModelConfig, arch: str | None,
                       max_position_embeddings: int | None) -> dict:
    """The config.json of a family-gemma Decoder: gemma3_text (q/k norms) or gemma2.

    max_position_embeddings: None = 4096, raised to original x factor of a scaling."""
    fits = "gemma3_text" if cfg.qk_norm else "gemma2"
    arch = arch or fits
    if arch != fits:
        raise ValueError(f"arch {arch!r} does not fit a gemma-family model with qk_norm="
                         f"{cfg.qk_norm}; use arch={fits!r}")
    if cfg.qkv_bias:
        raise ValueError("the Gemma block has no q/k/v biases; qkv_bias=True")
    if arch == "gemma3_text" and cfg.attn_softcap:
        raise ValueError(f"gemma3_text applies no attention logit softcap (transformers' "
                         f"Gemma3 attention ignores attn_logit_softcapping), but attn_softcap="
                         f"{cfg.attn_softcap}; gemma2 has one but no q/k norms (qk_norm=True)")
    if arch == "gemma2" and cfg.rope_local_theta not in (0.0, cfg.rope_theta):
        raise ValueError(f"gemma2 has one RoPE base; rope_local_theta {cfg.rope_local_theta} "
                         f"!= rope_theta {cfg.rope_theta}")
    (theta, scaling), (theta_local, local_scaling) = cfg.rope("G"), cfg.rope("L")
    if arch == "gemma2" and local_scaling != scaling:
        raise ValueError(f"gemma2 has one RoPE scaling; rope_local_scaling {local_scaling} "
                         f"!= rope_scaling {scaling}")
    if arch == "gemma3_text" and local_scaling.type == "yarn" and scaling.type == "yarn" and \
            local_scaling.truncate != scaling.truncate:
        raise ValueError("gemma3_text reads one yarn truncate for both layer types; "
                         f"rope_scaling.truncate {scaling.truncate} != rope_local_scaling."
                         f"truncate {local_scaling.truncate}")
    scalar = (cfg.attn_scale ** -2) if cfg.attn_scale else float(cfg.head_dim)
    if abs(scalar - round(scalar)) > 1e-6 * scalar:  # transformers types it as an int
        raise ValueError(f"attn_scale {cfg.attn_scale} is not query_pre_attn_scalar ** -0.5 "
                         f"for a whole-number query_pre_attn_scalar ({scalar:.6g})")
    scalar = round(scalar)
    kinds = cfg.layer_kinds()
    local = rope_scaling_to_hf(local_scaling, theta_local)
    full = rope_scaling_to_hf(scaling, theta)
    max_position_embeddings = max(max_position_embeddings or 4096,
                                  min_max_position_embeddings(scaling, local_scaling))
    hf = {"architectures": [ARCHS[arch]], "model_type": arch,
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
          "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
          "rms_norm_eps": cfg.norm_eps, "query_pre_attn_scalar": scalar,
          "sliding_window": cfg.sliding_window or None,
          "layer_types": layer_types_to_hf(kinds),
          "attn_logit_softcapping": cfg.attn_softcap or None,
          "final_logit_softcapping": cfg.final_softcap or None,
          "max_position_embeddings": max_position_embeddings,
          "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
          "attention_dropout": 0.0, "torch_dtype": "float32", "dtype": "float32"}
    if arch == "gemma3_text":
        hf["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        truncate = {r.get("truncate") for r in (full, local)} - {None}
        if truncate:  # yarn reads it from the top level only (rope_scaling_from_hf)
            hf["rope_parameters"]["truncate"] = truncate.pop()
    else:
        hf["rope_parameters"] = full
    return hf


HF = HFFamily(archs=ARCHS, layer=LAYER, config_from_hf=config_from_hf, config_to_hf=config_to_hf)
