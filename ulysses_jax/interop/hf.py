"""Hugging Face checkpoint import and export.

A checkpoint is a local directory with ``config.json`` and ``model.safetensors`` (or a
``model.safetensors.index.json`` with shards), as ``transformers`` writes it. Import reads the
tensors with safetensors' numpy API (torch is never imported), maps each Linear weight
[out, in] to our [in, ..., out] layout (a bias [N*H] to [N, H]; the codes in
``hf_family.py``), stacks the layers on a leading L axis and places every array straight onto
its sharding on the mesh, one parameter at a time, so host memory holds at most one stacked
parameter beyond what the devices hold.

Each family's model types, block tensor names and config translation are its record
(``hf_family.HFFamily``) in a module of its own, which its entry in ``families.py`` names:
``hf_llama.py`` (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE), ``hf_gemma.py`` (Gemma 2 / 3
text), ``hf_qwen3_next.py``, ``hf_qwen2_5_vl.py``; the RoPE scalings, layer kinds and windows
they share are ``hf_variants.py``'s. Nothing here names a family. What our Decoder cannot
express is refused with a ValueError, never silently dropped.
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

from .hf_family import CONV, FLAT, HFFamily
from ..config import PARAM_SHARDING, ModelConfig
from ..families import FAMILIES, load
from ..mesh import make_mesh
from ..models.decoder import Decoder, stacked_layer_indices
from ..models.param_layout import leaf_spec

# Each family's Hugging Face record (families.Family.hf), and the family of each model type.
_FAMILY_HF: dict[str, HFFamily] = {name: load(f.hf) for name, f in FAMILIES.items()}
_FAMILY_OF = {mt: name for name, rec in _FAMILY_HF.items() for mt in rec.archs}
ARCHS = {mt: arch for rec in _FAMILY_HF.values() for mt, arch in rec.archs.items()}

# Expert weights [E, D, F] / [E, F, D]: one HF Linear [out, in] per expert e (n_in 1 each).
_EXPERTS = {("moe", "w_gate"): "mlp.experts.{e}.gate_proj.weight",
            ("moe", "w_up"): "mlp.experts.{e}.up_proj.weight",
            ("moe", "w_down"): "mlp.experts.{e}.down_proj.weight"}
_GLOBAL = {("embed",): ("model.embed_tokens.weight", 0),
           ("final_norm", "scale"): ("model.norm.weight", 0),
           ("lm_head",): ("lm_head.weight", 1)}
# Non-persistent RoPE buffers that old transformers versions saved; recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Tensors transformers itself skips on load: Qwen3-Next's multi-token-prediction head.
_IGNORED_PREFIXES = ("mtp.",)


def config_from_hf(hf: dict, *, dtype: Any = "float32", max_seq_len: int | None = None,
                   **overrides) -> ModelConfig:
    """Translates a transformers ``config.json`` dict to a ModelConfig.

    Args:
      hf: the parsed config.json (its model_type one of ``ARCHS``).
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
    return _FAMILY_HF[_FAMILY_OF[mt]].config_from_hf(hf, dtype=dtype, **overrides)


def _family_hf(name: str) -> HFFamily:
    """The Hugging Face record of the registered family ``name``."""
    try:
        return _FAMILY_HF[name]
    except KeyError:
        raise ValueError(f"model.family {name!r} is not one of {', '.join(_FAMILY_HF)}") from None


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
    return _family_hf(cfg.family).config_to_hf(cfg, arch, max_position_embeddings)


def _hf_shape(shape: tuple[int, ...], n_in: int) -> tuple[int, ...]:
    """HF shape of one (unstacked) parameter of ours: [out, in] for Linear weights."""
    if n_in == FLAT:
        return (math.prod(shape),)
    if n_in == CONV:
        return (shape[-1], *shape[:-1])
    return shape if n_in == 0 else (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def _from_hf(x: np.ndarray, shape: tuple[int, ...], n_in: int) -> np.ndarray:
    """One HF tensor in our layout ``shape``: [out, in] -> [in, out] -> head-split."""
    if n_in == 0:
        return x
    if n_in == CONV:
        return np.moveaxis(x, 0, -1)
    return x.reshape(shape) if n_in == FLAT else x.T.reshape(shape)


def _to_hf(x: np.ndarray, n_in: int) -> np.ndarray:
    """One (unstacked) parameter of ours in HF layout; the inverse of ``_from_hf``."""
    if n_in == 0:
        return x
    if n_in == CONV:
        return np.moveaxis(x, -1, 0)
    return x.reshape(-1) if n_in == FLAT else x.reshape(math.prod(x.shape[:n_in]), -1).T


def stacked(keys: tuple) -> bool:
    """Whether our parameter at ``keys`` is stacked on a leading layer (or block) axis: the
    decoder layers, and a vision tower's blocks."""
    return keys[0] == "layers" or tuple(keys[:2]) == ("visual", "blocks")


def _hf_names(keys: tuple, cfg: ModelConfig) -> tuple[list, int]:
    """HF tensor names of our parameter path and their n_in: one name per stacked layer (in
    stack order), or for expert weights one list of E names per layer."""
    rec = _family_hf(cfg.family)
    if keys[0] in rec.names:
        return rec.names[keys[0]](keys, cfg)
    if keys[0] != "layers":
        name, n_in = _GLOBAL[keys]
        return [name], n_in
    layers, inner = stacked_layer_indices(cfg, keys)
    if inner in _EXPERTS:
        return [[f"model.layers.{i}.{_EXPERTS[inner].format(e=e)}"
                 for e in range(cfg.num_experts)] for i in layers], 1
    name, n_in = rec.layer[inner]
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
    canonical = _family_hf(cfg.family).canonical_name or (lambda name: name)
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
