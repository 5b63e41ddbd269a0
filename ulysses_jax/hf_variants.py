"""Hugging Face configs and tensor names of the attention variants, for ``hf.py``.

Sliding windows of Mistral, Qwen2 / Qwen3 (``use_sliding_window``, ``max_window_layers``,
``layer_types``) and Qwen3-MoE (``use_sliding_window``: every layer), and the Gemma 2 /
Gemma 3 text decoders (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, model types gemma2 and
gemma3_text; our ``model.family=gemma``, models/gemma.py). ``hf.py`` dispatches here and
keeps the Llama-family mapping itself.

Conventions checked against transformers' modeling code: a sliding window W lets the query at
i see keys j with i - W < j <= i (``masking_utils.sliding_window_overlay``); Gemma scales
logits by query_pre_attn_scalar ** -0.5, caps attention logits at c tanh(x / c) before the
mask (attn_logit_softcapping) and the output logits likewise (final_logit_softcapping),
multiplies embeddings by sqrt(hidden_size) in the weights' dtype, norms with (1 + w), uses
GeGLU (gelu_pytorch_tanh); Gemma 3 adds q/k norms and a RoPE base of its own for sliding
layers (rope_parameters["sliding_attention"], older files rope_local_base_freq). Gemma 2 layer
i slides when i is even, Gemma 3's when (i + 1) % sliding_window_pattern != 0, unless the
file lists layer_types. Anything else (scaled RoPE, biases, bidirectional attention, other
activations) is refused with a ValueError naming it.
"""
from __future__ import annotations

from .config import ModelConfig

GEMMA_ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_KIND = {"sliding_attention": "L", "full_attention": "G"}
_HF_KIND = {v: k for k, v in _KIND.items()}

# Our parameter path -> (HF tensor name, n_in), as hf._LAYER, for the Gemma block: four norms,
# of which post_attention_layernorm norms the attention output (not the MLP input, as in Llama).
GEMMA_LAYER = {
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
_GEMMA_DEFAULTS = {
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


def pattern_string(kinds: str) -> str:
    """The shortest prefix of ``kinds`` that repeats to it ("LLLLLGLLLLLGLL" -> "LLLLLG")."""
    n = len(kinds)
    return next(kinds[:p] for p in range(1, n + 1)
                if (kinds[:p] * -(-n // p))[:n] == kinds)


def _kinds(hf: dict, slides) -> str:
    """L/G per layer: the file's layer_types, else ``slides(i)`` for layer i."""
    types = hf.get("layer_types")
    n = hf["num_hidden_layers"]
    if types:
        unknown = sorted(set(types) - set(_KIND))
        if unknown or len(types) != n:
            raise ValueError(f"layer_types must list {n} of {sorted(_KIND)}, got {types}")
        return "".join(_KIND[t] for t in types)
    return "".join("L" if slides(i) else "G" for i in range(n))


def window_from_hf(hf: dict) -> dict:
    """ModelConfig fields for the sliding window of a llama-family config.json (empty: none).

    Mistral slides on every layer (default window 4096 when the key is absent); Qwen3-MoE on
    every layer with use_sliding_window (its attention reads config.sliding_window, which
    Qwen3MoeConfig sets only then); Qwen2 / Qwen3 only with use_sliding_window, on
    layer_types' sliding layers or those at or past max_window_layers; Llama never.
    """
    mt = hf["model_type"]
    if mt == "mistral" or (mt == "qwen3_moe" and hf.get("use_sliding_window", False)):
        window = hf.get("sliding_window", 4096)
        return {} if window is None else {"sliding_window": int(window)}
    if mt not in ("qwen2", "qwen3") or not hf.get("use_sliding_window", False):
        return {}
    window = hf.get("sliding_window", 4096)
    if window is None:
        return {}
    kinds = _kinds(hf, lambda i: i >= hf.get("max_window_layers", 28))
    if "L" not in kinds:
        return {}
    return {"sliding_window": int(window), "layer_pattern": pattern_string(kinds)}


def window_to_hf(cfg: ModelConfig, arch: str) -> dict:
    """config.json keys for a llama-family model's window under ``arch``."""
    kinds = cfg.layer_kinds()
    if "L" not in kinds:
        return {}
    if arch in ("mistral", "qwen3_moe"):
        if "G" in kinds:
            hint = ("use qwen2 or qwen3 (layer_types)" if arch == "mistral" else
                    "its config has no per-layer kinds")
            raise ValueError(f"arch {arch!r} slides on every layer, but the layers are "
                             f"{kinds!r}; {hint}")
        if arch == "qwen3_moe":
            return {"use_sliding_window": True, "sliding_window": cfg.sliding_window}
        return {"sliding_window": cfg.sliding_window}
    if arch in ("qwen2", "qwen3"):
        lead = len(kinds) - len(kinds.lstrip("G"))
        return {"use_sliding_window": True, "sliding_window": cfg.sliding_window,
                "max_window_layers": lead, "layer_types": [_HF_KIND[c] for c in kinds]}
    raise ValueError(f"arch {arch!r} has no sliding window; the model has sliding_window="
                     f"{cfg.sliding_window} (use mistral, qwen2, qwen3 or qwen3_moe)")


def gemma_config_from_hf(hf: dict, *, dtype: str, **overrides) -> ModelConfig:
    """A Gemma 2 / Gemma 3 text config.json as a ModelConfig (family gemma).

    Args:
      hf: the parsed config.json (model_type gemma2 or gemma3_text).
      dtype: compute dtype name, already checked by the caller.
      **overrides: other ModelConfig fields (runtime options).
    Raises:
      ValueError: features the Decoder does not implement, or missing keys.
    """
    mt = hf["model_type"]
    hf = {**_GEMMA_DEFAULTS[mt], **{k: v for k, v in hf.items() if v is not None or k in (
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
    if mt == "gemma3_text" and ("full_attention" in rope or "sliding_attention" in rope):
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    else:  # one dict for all layers, or the older rope_theta / rope_local_base_freq keys
        full = local = rope or hf.get("rope_scaling") or {}
    for name, r in (("full_attention", full), ("sliding_attention", local)):
        kind = r.get("rope_type", r.get("type", "default"))
        if kind != "default":
            problems.append(f"RoPE scaling {kind!r} on {name} layers (only unscaled RoPE)")
    theta = float(full.get("rope_theta", hf.get("rope_theta", global_theta)))
    if mt == "gemma3_text":
        theta_local = float(local.get("rope_theta", hf.get("rope_local_base_freq", local_theta)))
        pattern = hf["sliding_window_pattern"]
        kinds = _kinds(hf, lambda i: bool((i + 1) % pattern))
    else:
        theta_local = theta
        kinds = _kinds(hf, lambda i: bool((i + 1) % 2))
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
        attn_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
        attn_softcap=float(hf["attn_logit_softcapping"] or 0.0),
        final_softcap=float(hf["final_logit_softcapping"] or 0.0), **overrides)


def gemma_config_to_hf(cfg: ModelConfig, arch: str | None,
                       max_position_embeddings: int) -> dict:
    """The config.json of a family-gemma Decoder: gemma3_text (q/k norms) or gemma2."""
    fits = "gemma3_text" if cfg.qk_norm else "gemma2"
    arch = arch or fits
    if arch != fits:
        raise ValueError(f"arch {arch!r} does not fit a gemma-family model with qk_norm="
                         f"{cfg.qk_norm}; use arch={fits!r}")
    if cfg.qkv_bias:
        raise ValueError("the Gemma block has no q/k/v biases; qkv_bias=True")
    if arch == "gemma2" and cfg.rope_local_theta not in (0.0, cfg.rope_theta):
        raise ValueError(f"gemma2 has one RoPE base; rope_local_theta {cfg.rope_local_theta} "
                         f"!= rope_theta {cfg.rope_theta}")
    scalar = (cfg.attn_scale ** -2) if cfg.attn_scale else float(cfg.head_dim)
    if abs(scalar - round(scalar)) > 1e-6 * scalar:  # transformers types it as an int
        raise ValueError(f"attn_scale {cfg.attn_scale} is not query_pre_attn_scalar ** -0.5 "
                         f"for a whole-number query_pre_attn_scalar ({scalar:.6g})")
    scalar = round(scalar)
    kinds = cfg.layer_kinds()
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    hf = {"architectures": [GEMMA_ARCHS[arch]], "model_type": arch,
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
          "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
          "rms_norm_eps": cfg.norm_eps, "query_pre_attn_scalar": scalar,
          "sliding_window": cfg.sliding_window or None,
          "layer_types": [_HF_KIND[c] for c in kinds],
          "attn_logit_softcapping": cfg.attn_softcap or None,
          "final_logit_softcapping": cfg.final_softcap or None,
          "max_position_embeddings": max_position_embeddings,
          "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
          "attention_dropout": 0.0, "torch_dtype": "float32", "dtype": "float32"}
    if arch == "gemma3_text":
        hf["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    else:
        hf["rope_parameters"] = full
    return hf

