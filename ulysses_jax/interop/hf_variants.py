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
GeGLU (gelu_pytorch_tanh); Gemma 3 adds q/k norms and a RoPE base and scaling of its own for
sliding layers (rope_parameters["sliding_attention"], older files rope_local_base_freq, and
their rope_scaling applies to the full-attention layers only). Gemma 2 layer i slides when i
is even, Gemma 3's when (i + 1) % sliding_window_pattern != 0, unless the file lists
layer_types. RoPE scalings (default, linear, llama3, yarn) are read and written here for all
families (``rope_scaling_from_hf``, ``rope_scaling_to_hf``); dynamic, longrope and other types
are refused. Anything else (biases, bidirectional attention, other activations) is refused
with a ValueError naming it.
"""
from __future__ import annotations

from ..config import ROPE_TYPES, ModelConfig, RopeScalingConfig, rope_scaling_errors

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


# The fields each scaling type reads from a rope_parameters dict, with transformers' defaults
# where it has one (None: required). ModelConfig.rope_scaling holds the same names.
_ROPE_FIELDS = {
    "default": {},
    "linear": {"factor": None},
    "llama3": {"factor": None, "low_freq_factor": None, "high_freq_factor": None,
               "original_max_position_embeddings": None},
    "yarn": {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0,
             "beta_slow": 1.0, "attention_factor": 0.0, "mscale": 0.0, "mscale_all_dim": 0.0,
             "truncate": True},
}


def rope_scaling_from_hf(rope: dict, hf: dict, where: str = "",
                         truncate_from: dict | None = None) -> RopeScalingConfig:
    """The scaling of one transformers RoPE dict (rope_parameters, or the older rope_scaling
    with ``type`` for ``rope_type``), read as transformers' init functions read it.

    Args:
      rope: the dict ({} = unscaled).
      hf: the whole config.json: original_max_position_embeddings defaults to its
        max_position_embeddings (transformers' standardize_rope_params), a yarn factor of
        null to max_position_embeddings / original_max_position_embeddings.
      where: names the dict in messages (e.g. " on full_attention layers").
      truncate_from: the dict yarn's truncate is read from (transformers reads the top-level
        rope_parameters even when it is split per layer type); default ``rope``.
    Raises:
      ValueError: a type we do not implement (dynamic, longrope, ...), missing or bad fields.
    """
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"RoPE scaling {kind!r}{where} is not implemented (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {rope['partial_rotary_factor']}{where}: RoPE "
                         f"on the whole head_dim only")
    fields = {}
    for name, default in _ROPE_FIELDS[kind].items():
        value = rope.get(name)
        if name == "original_max_position_embeddings" and value is None:
            value = hf.get("max_position_embeddings")
        if kind == "yarn" and name == "factor" and "factor" in rope and value is None and \
                "max_position_embeddings" in hf:  # an explicit null: the length ratio
            orig = rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]
            value = hf["max_position_embeddings"] / orig
        if name in ("beta_fast", "beta_slow"):
            value = value or default  # transformers: `get(...) or 32` (resp. 1)
        if name == "truncate":
            value = (rope if truncate_from is None else truncate_from).get("truncate", True)
        if value is None:
            value = default
        if value is None:
            raise ValueError(f"RoPE scaling {kind!r}{where} lacks {name!r}")
        fields[name] = bool(value) if name == "truncate" else (
            int(value) if name == "original_max_position_embeddings" else float(value))
    scaling = RopeScalingConfig(type=kind, **fields)
    errors = rope_scaling_errors(scaling, "rope_scaling")
    if errors:
        raise ValueError(f"RoPE scaling {kind!r}{where}: " + "; ".join(errors))
    return scaling


def rope_scaling_to_hf(s: RopeScalingConfig, theta: float) -> dict:
    """The transformers rope_parameters dict of a scaling: rope_type, rope_theta and the
    fields its type reads (yarn's attention_factor / mscale only when set)."""
    out = {"rope_type": s.type, "rope_theta": theta}
    for name in _ROPE_FIELDS[s.type]:
        value = getattr(s, name)
        if name in ("attention_factor", "mscale", "mscale_all_dim") and not value:
            continue
        out[name] = value
    return out


def min_max_position_embeddings(*scalings: RopeScalingConfig) -> int:
    """The length a scaled model covers: original_max_position_embeddings x factor (0 when
    no scaling names an original length)."""
    return max([round(s.original_max_position_embeddings * s.factor) for s in scalings
                if s.type in ("llama3", "yarn")] + [0])


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
        rope_scaling=scalings["full_attention"],
        rope_local_scaling=(RopeScalingConfig(type="") if scalings["sliding_attention"] ==
                            scalings["full_attention"] else scalings["sliding_attention"]),
        attn_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
        # transformers' Gemma3 attention ignores attn_logit_softcapping (Gemma 3 has none)
        attn_softcap=0.0 if mt == "gemma3_text" else float(hf["attn_logit_softcapping"] or 0.0),
        final_softcap=float(hf["final_logit_softcapping"] or 0.0), **overrides)


def gemma_config_to_hf(cfg: ModelConfig, arch: str | None,
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
        truncate = {r.get("truncate") for r in (full, local)} - {None}
        if truncate:  # yarn reads it from the top level only (rope_scaling_from_hf)
            hf["rope_parameters"]["truncate"] = truncate.pop()
    else:
        hf["rope_parameters"] = full
    return hf

