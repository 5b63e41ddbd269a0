"""Hugging Face config and tensor names of Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``),
for ``hf.py``.

Our ``model.family=qwen2_5_vl`` is the Qwen2 text decoder (q/k/v biases, M-RoPE) plus the
vision tower ``visual`` (models/vision.py). Two key layouts exist on disk and both load: the
published checkpoints' ``model.layers.*`` / ``model.embed_tokens`` / ``model.norm`` /
``visual.*`` / ``lm_head``, and transformers 5's own ``model.language_model.*`` /
``model.visual.*`` / ``lm_head`` (``canonical_name`` maps the second to the first). Export
writes the published layout, which transformers 5 converts on load.

Vision tensors: ``patch_embed.proj.weight`` [Dv, C, Tp, P, P] (a Conv3d whose kernel is its
stride) is ours with the out axis moved last; ``blocks.{i}.attn.qkv`` [3 Dv, Dv] -> [Dv, 3, Nv,
Hv] (transformers splits the output as (3, heads, head dim)) and its bias [3 Dv] -> [3, Nv, Hv];
``attn.proj`` [Dv, Dv] -> [Nv, Hv, Dv]; the MLP and the merger's two Linears (``merger.mlp.0``,
``merger.mlp.2``) transposed, their biases as is; the norms as is.

Config: flat (published: text keys at the top level, ``vision_config`` nested) or nested
(transformers 5: ``text_config``); M-RoPE's ``mrope_section`` from rope_scaling /
rope_parameters, whose type ``mrope`` means default (transformers' rule); keys a file omits take
transformers' class defaults (``_TEXT_DEFAULTS``, ``_VISION_DEFAULTS``); the RoPE scalings of
the other families apply on top (``hf_variants.rope_scaling_from_hf``). Sliding windows,
activations other than SiLU and a vision width other than the text's are refused by name.
"""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, VisionConfig
from . import hf_llama
from .hf_family import CONV, FLAT, HFFamily, dtype_name
from .hf_variants import min_max_position_embeddings, rope_scaling_from_hf, rope_scaling_to_hf

ARCH = "Qwen2_5_VLForConditionalGeneration"
# Our path under visual (block paths stacked over the depth) -> (HF name under visual., n_in)
_VISION = {
    ("patch_embed",): ("patch_embed.proj.weight", CONV),
    ("merge_norm", "scale"): ("merger.ln_q.weight", 0),
    ("merge_w1",): ("merger.mlp.0.weight", 1),
    ("merge_b1",): ("merger.mlp.0.bias", 0),
    ("merge_w2",): ("merger.mlp.2.weight", 1),
    ("merge_b2",): ("merger.mlp.2.bias", 0),
}
_VISION_BLOCK = {
    ("norm1", "scale"): ("norm1.weight", 0),
    ("norm2", "scale"): ("norm2.weight", 0),
    ("wqkv",): ("attn.qkv.weight", 1),
    ("bqkv",): ("attn.qkv.bias", FLAT),
    ("wo",): ("attn.proj.weight", 2),
    ("bo",): ("attn.proj.bias", 0),
    ("w_gate",): ("mlp.gate_proj.weight", 1),
    ("b_gate",): ("mlp.gate_proj.bias", 0),
    ("w_up",): ("mlp.up_proj.weight", 1),
    ("b_up",): ("mlp.up_proj.bias", 0),
    ("w_down",): ("mlp.down_proj.weight", 1),
    ("b_down",): ("mlp.down_proj.bias", 0),
}
# Qwen2_5_VLVisionConfig's class defaults, for keys a config.json may omit.
_VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu",
                    "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
                    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                    "tokens_per_second": 4, "window_size": 112, "out_hidden_size": 3584,
                    "fullatt_block_indexes": [7, 15, 23, 31]}
# Qwen2_5_VLTextConfig's class defaults (transformers 5.24) for keys a config.json may omit;
# an explicit num_key_value_heads null means num_attention_heads there (its __post_init__).
_TEXT_DEFAULTS = {"num_key_value_heads": 8, "rms_norm_eps": 1e-5}
_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656,
              "vision_start_token_id": 151652, "vision_end_token_id": 151653}


def canonical_name(name: str) -> str:
    """A tensor name of either layout in the published one."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


def vision_names(keys: tuple, cfg: ModelConfig) -> tuple[list[str], int]:
    """HF names (one per block for the stacked block parameters) and n_in of a parameter
    under ``visual``."""
    inner = tuple(keys[1:])
    if inner[0] == "blocks":
        name, n_in = _VISION_BLOCK[inner[1:]]
        return [f"visual.blocks.{i}.{name}" for i in range(cfg.vision.depth)], n_in
    name, n_in = _VISION[inner]
    return [f"visual.{name}"], n_in


def _rope(text: dict) -> tuple[dict, list]:
    rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    section = list(rope.pop("mrope_section", None) or [])
    if rope.get("rope_type", rope.get("type")) == "mrope":
        rope.pop("type", None)
        rope["rope_type"] = "default"
    return rope, section


def config_from_hf(hf: dict, *, dtype: Any, **overrides) -> ModelConfig:
    """A qwen2_5_vl config.json (flat or nested) as a ModelConfig (family qwen2_5_vl).

    Raises:
      ValueError: a bad dtype, what the model does not implement, or missing keys.
    """
    dtype = dtype_name(dtype)
    text = {**hf, **(hf.get("text_config") or {})}
    vision = {**_VISION_DEFAULTS, **{k: v for k, v in (hf.get("vision_config") or {}).items()
                                     if v is not None}}
    if "in_chans" in vision and "in_channels" not in (hf.get("vision_config") or {}):
        vision["in_channels"] = vision["in_chans"]  # older Qwen2-VL-style files
    problems = []
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in text]
    if missing:
        raise ValueError(f"cannot import this qwen2_5_vl checkpoint: config.json lacks {missing}")
    for where, act in (("hidden_act", text.get("hidden_act", "silu")),
                       ("vision_config.hidden_act", vision["hidden_act"])):
        if act != "silu":
            problems.append(f"{where} {act!r} (only silu is implemented)")
    if text.get("use_sliding_window"):
        problems.append("use_sliding_window=true (the Qwen2.5-VL decoder here has no windows)")
    if vision["out_hidden_size"] != text["hidden_size"]:
        problems.append(f"vision_config.out_hidden_size {vision['out_hidden_size']} differs from "
                        f"hidden_size {text['hidden_size']}")
    rope, section = _rope(text)
    heads = text["num_attention_heads"]
    head_dim = text["hidden_size"] // heads  # transformers' Qwen2.5-VL reads no head_dim key
    section = section or [16, 24, 24]  # transformers' default
    if sum(section) * 2 != head_dim:
        problems.append(f"mrope_section {section} must sum to head_dim / 2 = {head_dim // 2}")
    scaling = None
    try:
        scaling = rope_scaling_from_hf(rope, text)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError("cannot import this qwen2_5_vl checkpoint: " + "; ".join(problems))
    tie = bool(hf.get("tie_word_embeddings", False) or
               (hf.get("text_config") or {}).get("tie_word_embeddings", False))
    vcfg = VisionConfig(
        depth=vision["depth"], hidden_size=vision["hidden_size"], num_heads=vision["num_heads"],
        intermediate_size=vision["intermediate_size"], in_channels=vision["in_channels"],
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        spatial_merge_size=vision["spatial_merge_size"], window_size=vision["window_size"],
        fullatt_block_indexes=tuple(vision["fullatt_block_indexes"]),
        tokens_per_second=vision["tokens_per_second"],
        rope_theta=float(((vision.get("rope_parameters") or {}).get("rope_theta")) or 10000.0))
    ids = {k: hf.get(k, text.get(k, default)) for k, default in _TOKEN_IDS.items()}
    kv_heads = text.get("num_key_value_heads", _TEXT_DEFAULTS["num_key_value_heads"])
    return ModelConfig(
        vocab_size=text["vocab_size"], d_model=text["hidden_size"],
        n_layers=text["num_hidden_layers"], n_heads=heads,
        n_kv_heads=heads if kv_heads is None else kv_heads, head_dim=head_dim,
        ffn_dim=text["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
        rope_scaling=scaling,
        norm_eps=float(text.get("rms_norm_eps", _TEXT_DEFAULTS["rms_norm_eps"])), qkv_bias=True,
        tie_embeddings=tie, dtype=dtype, family="qwen2_5_vl", mrope_section=tuple(section),
        vision=vcfg, **ids, **overrides)


def config_to_hf(cfg: ModelConfig, arch: str | None,
                 max_position_embeddings: int | None) -> dict:
    """The config.json (transformers 5's nested form) of a family-qwen2_5_vl Decoder."""
    if arch not in (None, "qwen2_5_vl"):
        raise ValueError(f"arch {arch!r} does not fit a qwen2_5_vl-family model; use "
                         f"arch='qwen2_5_vl'")
    if cfg.qk_norm or not cfg.qkv_bias:
        raise ValueError(f"Qwen2.5-VL attention has q/k/v biases and no q/k norms; qk_norm="
                         f"{cfg.qk_norm}, qkv_bias={cfg.qkv_bias}")
    v = cfg.vision
    rope = {**rope_scaling_to_hf(cfg.rope_scaling, cfg.rope_theta),
            "mrope_section": list(cfg.mrope_section)}
    text = {"model_type": "qwen2_5_vl_text", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
            "max_position_embeddings": max(max_position_embeddings or 32768,
                                           min_max_position_embeddings(cfg.rope_scaling)),
            "use_sliding_window": False, "attention_dropout": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings}
    vision = {"model_type": "qwen2_5_vl_vision", "depth": v.depth,
              "hidden_size": v.hidden_size, "num_heads": v.num_heads,
              "intermediate_size": v.intermediate_size, "hidden_act": "silu",
              "in_channels": v.in_channels, "patch_size": v.patch_size,
              "temporal_patch_size": v.temporal_patch_size,
              "spatial_merge_size": v.spatial_merge_size, "window_size": v.window_size,
              "fullatt_block_indexes": list(v.fullatt_block_indexes),
              "tokens_per_second": v.tokens_per_second, "out_hidden_size": cfg.d_model,
              "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise ValueError(f"Qwen2.5-VL's head dim is hidden_size / heads = "
                         f"{cfg.d_model / cfg.n_heads:g}, but the model has head_dim "
                         f"{cfg.head_dim}")
    return {"architectures": [ARCH], "model_type": "qwen2_5_vl", "text_config": text,
            "vision_config": vision, "tie_word_embeddings": cfg.tie_embeddings,
            **{k: getattr(cfg, k) for k in _TOKEN_IDS},
            "torch_dtype": "float32", "dtype": "float32"}


# The text decoder's blocks are Qwen2's (hf_llama.LAYER); the tower is named by vision_names.
HF = HFFamily(archs={"qwen2_5_vl": ARCH}, layer=hf_llama.LAYER, config_from_hf=config_from_hf,
              config_to_hf=config_to_hf, canonical_name=canonical_name,
              names={"visual": vision_names})
