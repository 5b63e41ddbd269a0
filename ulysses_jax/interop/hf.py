"""Hugging Face checkpoint import and export for the Llama / Mistral / Qwen2 / Qwen3 family
and Qwen3-MoE.

A checkpoint is a local directory with ``config.json`` and ``model.safetensors`` (or a
``model.safetensors.index.json`` with shards), as ``transformers`` writes it. Import reads the
tensors with safetensors' numpy API (torch is never imported), maps each Linear weight
[out, in] to our [in, ..., out] layout (a bias [N*H] to [N, H]), stacks the layers on a
leading L axis and places every array straight onto its sharding on the mesh, one parameter at
a time, so host memory holds at most one stacked parameter beyond what the devices hold.

Conventions checked against transformers' modeling code (Llama, Mistral, Qwen2, Qwen3):
half-split RoPE with inv_freq = theta^(-2i/head_dim); RMSNorm in fp32 times the weight; q/k
RMSNorm over head_dim before RoPE (Qwen3); q/k/v projection biases added before RoPE, none on
o_proj (Qwen2); GQA query head n reads kv head n // (N/K); logits
scale head_dim^-0.5; SiLU-gated MLP; ``lm_head`` = embedding when ``tie_word_embeddings``.
Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention; layer i sparse unless i is in
``mlp_only_layers`` or (i + 1) % ``decoder_sparse_step`` != 0 (models/moe.py); router
``mlp.gate.weight`` [E, D]; experts on disk one Linear each, ``mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj``. transformers 5 holds them fused in memory (``gate_up_proj``
[E, 2F, D], ``down_proj`` [E, D, F]) but its save_pretrained writes, and its from_pretrained
reads, this per-expert layout (checked with transformers 5.24), as do the published Qwen3-MoE
checkpoints. transformers 5.24 writes the expert count as ``num_local_experts``; older files
and the Qwen releases as ``num_experts``: both are read, ``num_experts`` is written.
Sliding windows (Mistral, Qwen2 / Qwen3 / Qwen3-MoE with use_sliding_window) and the Gemma 2 /
Gemma 3 text decoders are mapped by ``hf_variants.py``, which this module dispatches to.
RoPE scalings default, linear, llama3 and yarn load from rope_parameters or the older
rope_scaling (``hf_variants.rope_scaling_from_hf``) and are written back. What our Decoder
cannot express (an o_proj or MLP bias, dynamic or longrope RoPE, partial RoPE, other
activations) is refused with a ValueError, never silently dropped.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers numpy's "bfloat16" so safetensors can read bf16 files
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from . import hf_qwen2_5_vl, hf_qwen3_next, hf_variants
from ..config import DTYPES, PARAM_SHARDING, ModelConfig
from ..mesh import make_mesh
from ..models.decoder import Decoder, stacked_layer_indices
from ..models.param_layout import leaf_spec

# The llama family's model types (its translation is config_from_hf / config_to_hf here).
_LLAMA_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
ARCHS = {**_LLAMA_ARCHS, "qwen3_next": hf_qwen3_next.ARCH, "qwen2_5_vl": hf_qwen2_5_vl.ARCH,
         **hf_variants.GEMMA_ARCHS}

# Our parameter path -> (HF tensor name, number of leading "in" dims of our array).
# An HF Linear weight W [out, in] maps to ours as W.T.reshape(our shape): q_proj [N*H, D]
# -> wq [D, N, H] (1 "in" dim), o_proj [D, N*H] -> wo [N, H, D] (2 "in" dims). 0 = copy as is;
# _FLAT = a bias, HF [N*H] <-> ours [N, H] by a reshape; _CONV = a convolution weight
# HF [out, *in] <-> ours [*in, out] (the out axis moved).
_FLAT, _CONV = hf_qwen2_5_vl.FLAT, hf_qwen2_5_vl.CONV
_LAYER = {
    ("attn_norm", "scale"): ("input_layernorm.weight", 0),
    ("attn", "wq"): ("self_attn.q_proj.weight", 1),
    ("attn", "wk"): ("self_attn.k_proj.weight", 1),
    ("attn", "wv"): ("self_attn.v_proj.weight", 1),
    ("attn", "wo"): ("self_attn.o_proj.weight", 2),
    ("attn", "bq"): ("self_attn.q_proj.bias", _FLAT),
    ("attn", "bk"): ("self_attn.k_proj.bias", _FLAT),
    ("attn", "bv"): ("self_attn.v_proj.bias", _FLAT),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", 0),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", 0),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", 0),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", 1),
    ("mlp", "w_up"): ("mlp.up_proj.weight", 1),
    ("mlp", "w_down"): ("mlp.down_proj.weight", 1),
    ("moe", "router"): ("mlp.gate.weight", 1),
}
# Expert weights [E, D, F] / [E, F, D]: one HF Linear [out, in] per expert e (n_in 1 each).
_EXPERTS = {("moe", "w_gate"): "mlp.experts.{e}.gate_proj.weight",
            ("moe", "w_up"): "mlp.experts.{e}.up_proj.weight",
            ("moe", "w_down"): "mlp.experts.{e}.down_proj.weight"}
_GLOBAL = {("embed",): ("model.embed_tokens.weight", 0),
           ("final_norm", "scale"): ("model.norm.weight", 0),
           ("lm_head",): ("lm_head.weight", 1)}
def _qwen3_next_config_to_hf(cfg: ModelConfig, arch: str | None,
                             max_position_embeddings: int | None) -> dict:
    if arch not in (None, "qwen3_next"):
        raise ValueError(f"arch {arch!r} does not fit a qwen3_next-family model; use "
                         f"arch='qwen3_next'")
    return hf_qwen3_next.config_to_hf(cfg, max_position_embeddings)


# config.json writers of the families whose translation lives in a module of its own (the
# llama family's is config_to_hf itself).
_FAMILY_EXPORT = {"gemma": hf_variants.gemma_config_to_hf, "qwen3_next": _qwen3_next_config_to_hf,
                  "qwen2_5_vl": hf_qwen2_5_vl.config_to_hf}
# Families whose checkpoints come in more than one key layout: a name of any -> ours.
_KEY_LAYOUTS = {"qwen2_5_vl": hf_qwen2_5_vl.canonical_name}
# Per-family block tensor maps (families not listed use _LAYER).
_LAYER_TABLES = {"gemma": hf_variants.GEMMA_LAYER, "qwen3_next": hf_qwen3_next.LAYER}
# Non-persistent RoPE buffers that old transformers versions saved; recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Tensors transformers itself skips on load: Qwen3-Next's multi-token-prediction head.
_IGNORED_PREFIXES = ("mtp.",)
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


def config_from_hf(hf: dict, *, dtype: Any = "float32", max_seq_len: int | None = None,
                   **overrides) -> ModelConfig:
    """Translates a transformers ``config.json`` dict to a ModelConfig.

    Args:
      hf: the parsed config.json (model_type llama, mistral, qwen2, qwen3 or qwen3_moe).
      dtype: compute dtype, float32 or bfloat16 (parameters stay float32).
      max_seq_len: accepted for callers of earlier versions, which needed it to load a
        sliding window; windows of any length now load as ``sliding_window``.
      **overrides: other ModelConfig fields (remat, attn_impl, loss_chunk, ...).
    Returns:
      The ModelConfig of an equivalent Decoder.
    Raises:
      ValueError: for a feature our Decoder does not implement; the message names it.
    """
    mt = hf.get("model_type")
    if mt not in ARCHS:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {sorted(ARCHS)}")
    if mt in hf_variants.GEMMA_ARCHS:
        return hf_variants.gemma_config_from_hf(hf, dtype=_dtype_name(dtype), **overrides)
    if mt == "qwen3_next":
        return hf_qwen3_next.config_from_hf(hf, dtype=_dtype_name(dtype), **overrides)
    if mt == "qwen2_5_vl":
        return hf_qwen2_5_vl.config_from_hf(hf, dtype=_dtype_name(dtype), **overrides)
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
        scaling = hf_variants.rope_scaling_from_hf(
            {"partial_rotary_factor": hf.get("partial_rotary_factor", 1.0), **rope}, hf)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError(f"cannot import this {mt} checkpoint: " + "; ".join(problems))
    dtype = _dtype_name(dtype)
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
        **hf_variants.window_from_hf(hf), **overrides)


def _dtype_name(dtype) -> str:
    """float32 or bfloat16 from a name or a dtype; ValueError otherwise."""
    try:
        dtype = jnp.dtype(dtype).name
    except TypeError:
        pass  # not a dtype at all; reported below like any other unsupported one
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype


def config_to_hf(cfg: ModelConfig, arch: str | None = None,
                 max_position_embeddings: int | None = None) -> dict:
    """The transformers config.json dict of a Decoder.

    Args:
      cfg: the Decoder's config.
      arch: llama, mistral, qwen2, qwen3, qwen3_moe, gemma2 or gemma3_text; None = qwen3_moe
        with experts, qwen3 with QK-norm, qwen2 with q/k/v biases, mistral with a window on
        every layer, else llama; for the gemma family gemma3_text with QK-norm, else gemma2.
      max_position_embeddings: written for transformers' RoPE cache; our model has no limit.
        None = 4096; raised to original_max_position_embeddings x factor
        of a llama3 / yarn scaling.
    Returns:
      A dict for config.json (both the transformers >= 5 and the older RoPE keys).
    """
    if cfg.family in _FAMILY_EXPORT:  # the families with a module of their own here
        return _FAMILY_EXPORT[cfg.family](cfg, arch, max_position_embeddings)
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
    if arch not in _LLAMA_ARCHS:
        raise ValueError(f"arch must be one of {sorted(_LLAMA_ARCHS)} for a llama-family "
                         f"model, got {arch!r}")
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
    rope = hf_variants.rope_scaling_to_hf(cfg.rope_scaling, cfg.rope_theta)
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
              hf_variants.min_max_position_embeddings(cfg.rope_scaling)),
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
    hf.update(hf_variants.window_to_hf(cfg, arch))
    return hf


def _hf_shape(shape: tuple[int, ...], n_in: int) -> tuple[int, ...]:
    """HF shape of one (unstacked) parameter of ours: [out, in] for Linear weights."""
    if n_in == _FLAT:
        return (math.prod(shape),)
    if n_in == _CONV:
        return (shape[-1], *shape[:-1])
    return shape if n_in == 0 else (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def _from_hf(x: np.ndarray, shape: tuple[int, ...], n_in: int) -> np.ndarray:
    """One HF tensor in our layout ``shape``: [out, in] -> [in, out] -> head-split."""
    if n_in == 0:
        return x
    if n_in == _CONV:
        return np.moveaxis(x, 0, -1)
    return x.reshape(shape) if n_in == _FLAT else x.T.reshape(shape)


def _to_hf(x: np.ndarray, n_in: int) -> np.ndarray:
    """One (unstacked) parameter of ours in HF layout; the inverse of ``_from_hf``."""
    if n_in == 0:
        return x
    if n_in == _CONV:
        return np.moveaxis(x, -1, 0)
    return x.reshape(-1) if n_in == _FLAT else x.reshape(math.prod(x.shape[:n_in]), -1).T


def stacked(keys: tuple) -> bool:
    """Whether our parameter at ``keys`` is stacked on a leading layer (or block) axis: the
    decoder layers, and a vision tower's blocks."""
    return keys[0] == "layers" or tuple(keys[:2]) == ("visual", "blocks")


def _hf_names(keys: tuple, cfg: ModelConfig) -> tuple[list, int]:
    """HF tensor names of our parameter path and their n_in: one name per stacked layer (in
    stack order), or for expert weights one list of E names per layer."""
    if keys[0] == "visual":
        return hf_qwen2_5_vl.vision_names(keys, cfg)
    if keys[0] != "layers":
        name, n_in = _GLOBAL[keys]
        return [name], n_in
    layers, inner = stacked_layer_indices(cfg, keys)
    if inner in _EXPERTS:
        return [[f"model.layers.{i}.{_EXPERTS[inner].format(e=e)}"
                 for e in range(cfg.num_experts)] for i in layers], 1
    name, n_in = _LAYER_TABLES.get(cfg.family, _LAYER)[inner]
    return [f"model.layers.{i}.{name}" for i in layers], n_in


def _flat(names: list) -> list[str]:
    return [n for x in names for n in (x if isinstance(x, list) else [x])]


def _tensor_index(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="np") as f:
        return {k: single for k in f.keys()}


def read_config(path: str) -> dict:
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        raise ValueError(f"{path} has no config.json")
    with open(config) as f:
        return json.load(f)


def load_params(path: str, mesh: Mesh, param_sharding: str = "replicated", *,
                dtype: Any = "float32", max_seq_len: int | None = None, **overrides):
    """Reads a Hugging Face checkpoint into float32 parameters sharded on ``mesh``.

    Args:
      path: local directory with config.json and safetensors weights.
      mesh: the ("data", "seq") mesh the parameters are placed on.
      param_sharding: "replicated" or "zero3", as ``models.param_layout.param_spec`` lays them out.
      dtype, max_seq_len, **overrides: as in ``config_from_hf``.
    Returns:
      (ModelConfig, params): params is the Decoder's pure dict (``nnx.to_pure_dict`` layout).
    Raises:
      ValueError: unsupported config, missing, unexpected or wrongly shaped tensors.
    """

    if param_sharding not in PARAM_SHARDING:
        raise ValueError(f"param_sharding must be one of {PARAM_SHARDING}, got {param_sharding!r}")
    cfg = config_from_hf(read_config(path), dtype=dtype, max_seq_len=max_seq_len, **overrides)
    abstract = nnx.to_pure_dict(nnx.state(
        nnx.eval_shape(lambda: Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0)))))
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)]
    wanted = {n for keys in paths for n in _flat(_hf_names(keys, cfg)[0])}
    files = _tensor_index(path)
    # our name -> the name in the files (a family with several key layouts reads any)
    canonical = _KEY_LAYOUTS.get(cfg.family, lambda name: name)
    stored = {canonical(k): k for k in files}
    files = {canonical(k): f for k, f in files.items()}
    # Checked before reading anything: a tensor we would drop changes the model's function.
    unused = sorted(k for k in set(files) - wanted if not k.endswith(_IGNORED_SUFFIXES)
                    and not k.startswith(_IGNORED_PREFIXES)
                    and not (cfg.tie_embeddings and k == "lm_head.weight"))
    if unused:
        raise ValueError(f"checkpoint {path} has tensors the Decoder has no place for "
                         f"(biases or another architecture?): {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}")
    missing = sorted(wanted - set(files))
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    with contextlib.ExitStack() as stack:
        handles = {}

        def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="np"))
            x = handles[file].get_tensor(stored[name])
            if tuple(x.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, expected {shape}")
            return x.astype(np.float32)

        def one(name, shape: tuple[int, ...], n_in: int) -> np.ndarray:
            if isinstance(name, list):  # an expert weight: one tensor per expert
                return np.stack([one(n, shape[1:], n_in) for n in name])
            return _from_hf(read(name, _hf_shape(shape, n_in)), shape, n_in)

        def load(keys: tuple[str, ...], leaf) -> jax.Array:
            names, n_in = _hf_names(keys, cfg)
            shape = leaf.shape[1:] if stacked(keys) else leaf.shape
            # One layer at a time into our layout, then stack.
            arrays = [one(n, shape, n_in) for n in names]
            host = np.stack(arrays) if stacked(keys) else arrays[0]
            spec = leaf_spec(keys, leaf.shape, mesh, param_sharding)
            return jax.device_put(host, NamedSharding(mesh, spec))

        params = jax.tree_util.tree_map_with_path(
            lambda p, leaf: load(tuple(k.key for k in p), leaf), abstract)
    return cfg, params


def from_pretrained(path: str, mesh: Mesh | None = None, dtype: Any = jnp.float32, *,
                    param_sharding: str = "replicated", max_seq_len: int | None = None,
                    **overrides) -> Decoder:
    """Builds a Decoder from a local Hugging Face checkpoint, weights already on the mesh.

    Args:
      path: directory with config.json and model.safetensors (or a sharded index).
      mesh: the mesh to run on; default a one-device mesh.
      dtype: compute dtype (float32 or bfloat16); parameters stay float32.
      param_sharding: "replicated" or "zero3".
      max_seq_len, **overrides: as in ``config_from_hf``.
    Returns:
      The Decoder; ``model(tokens [B, S] int32)`` -> float32 logits [B, S, V].
    """
    mesh = make_mesh(seq=1, data=1, devices=jax.devices()[:1]) if mesh is None else mesh
    cfg, params = load_params(path, mesh, param_sharding, dtype=dtype, max_seq_len=max_seq_len,
                              **overrides)
    # Built abstractly, so no random initialisation is ever allocated; then filled in place.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def to_hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our pure-dict parameters as transformers' float32 state dict (the inverse of import).

    Args:
      cfg: the Decoder's config.
      params: ``nnx.to_pure_dict`` of its state (any sharding; gathered to host here).
    Returns:
      HF tensor name -> contiguous float32 numpy array.
    """
    out = {}

    def put(keys: tuple[str, ...], x):
        names, n_in = _hf_names(keys, cfg)
        x = np.asarray(jax.device_get(x), np.float32)
        for name, layer in zip(names, x if stacked(keys) else [x], strict=True):
            pairs = zip(name, layer, strict=True) if isinstance(name, list) else [(name, layer)]
            for n, w in pairs:
                out[n] = np.ascontiguousarray(_to_hf(w, n_in))

    jax.tree_util.tree_map_with_path(lambda p, x: put(tuple(k.key for k in p), x), params)
    return out


def save_pretrained(model: Decoder, out_dir: str, arch: str | None = None) -> None:
    """Writes config.json and model.safetensors (float32) that transformers can load.

    Args:
      model: a Decoder (parameters on any mesh, single process).
      out_dir: created if missing; only these two files are written.
      arch: as in ``config_to_hf`` (None: the arch that fits the model).
    """
    hf = config_to_hf(model.cfg, arch)
    tensors = to_hf_tensors(model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    # transformers checks this metadata key to know the file holds a torch-style state dict.
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
