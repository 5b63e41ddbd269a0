"""Hugging Face configs of the attention variants, shared by the families' modules
(``hf_llama.py``, ``hf_gemma.py``, ``hf_qwen3_next.py``, ``hf_qwen2_5_vl.py``).

RoPE scalings (default, linear, llama3, yarn) are read and written here for all families
(``rope_scaling_from_hf``, ``rope_scaling_to_hf``); dynamic, longrope and other types are
refused. Layer kinds (``layer_types``: sliding_attention L, full_attention G) are read and
written by ``kinds_from_hf`` / ``layer_types_to_hf``. Sliding windows of Mistral, Qwen2 /
Qwen3 (``use_sliding_window``, ``max_window_layers``, ``layer_types``) and Qwen3-MoE
(``use_sliding_window``: every layer) are the llama family's (``window_from_hf``,
``window_to_hf``).

Conventions checked against transformers' modeling code: a sliding window W lets the query at
i see keys j with i - W < j <= i (``masking_utils.sliding_window_overlay``).
"""
from __future__ import annotations

from ..config import ROPE_TYPES, ModelConfig, RopeScalingConfig, rope_scaling_errors

_KIND = {"sliding_attention": "L", "full_attention": "G"}
_HF_KIND = {v: k for k, v in _KIND.items()}

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


def kinds_from_hf(hf: dict, slides) -> str:
    """L/G per layer: the file's layer_types, else ``slides(i)`` for layer i."""
    types = hf.get("layer_types")
    n = hf["num_hidden_layers"]
    if types:
        unknown = sorted(set(types) - set(_KIND))
        if unknown or len(types) != n:
            raise ValueError(f"layer_types must list {n} of {sorted(_KIND)}, got {types}")
        return "".join(_KIND[t] for t in types)
    return "".join("L" if slides(i) else "G" for i in range(n))


def layer_types_to_hf(kinds: str) -> list[str]:
    """config.json's layer_types of L/G layer kinds."""
    return [_HF_KIND[c] for c in kinds]


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
    kinds = kinds_from_hf(hf, lambda i: i >= hf.get("max_window_layers", 28))
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
                "max_window_layers": lead, "layer_types": layer_types_to_hf(kinds)}
    raise ValueError(f"arch {arch!r} has no sliding window; the model has sliding_window="
                     f"{cfg.sliding_window} (use mistral, qwen2, qwen3 or qwen3_moe)")
