"""LoRA adapters (models/lora.py) as peft writes and reads them, and merged into the base.

peft names the adapter of a decoder projection
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ([R, in], torch Linear
layout) and ``...lora_B.weight`` ([out, R]); its scaling is lora_alpha / r (lora_alpha /
sqrt(r) with ``use_rslora``), as ours. Ours are A [in..., R] and B [R, out...] per layer,
stacked over layers, so a peft A is our A flattened over its input dims and transposed, and
likewise B.
"""
from __future__ import annotations

import jax
import numpy as np

from ..config import ModelConfig
from ..models import lora
from ..models.decoder import stacked_layer_indices

PEFT_PREFIX = "base_model.model."


def _leaves(params: dict, path: tuple = ()):
    for k, v in params.items():
        if isinstance(v, dict):
            yield from _leaves(v, path + (k,))
        else:
            yield path + (k,), v


def _adapter(keys: tuple) -> tuple[str, str] | None:
    """(target, "A" or "B") of an adapter leaf's path, else None."""
    leaf = str(keys[-1])
    if not leaf.startswith(lora.PREFIX):
        return None
    target, which = leaf[len(lora.PREFIX):].rsplit("_", 1)
    return target, which.upper()


def peft_name(layer: int, target: str, which: str) -> str:
    """peft's saved name of one layer's adapter matrix ("A" or "B")."""
    return f"{PEFT_PREFIX}model.layers.{layer}.{lora.HF_MODULES[target]}.lora_{which}.weight"


def adapter_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our adapters (any pure-dict tree holding them: the parameters, or their gradients) as
    peft's float32 tensors: name -> [R, in] (lora_A) or [out, R] (lora_B)."""
    out = {}
    for keys, x in _leaves(params):
        found = _adapter(keys)
        if found is None:
            continue
        target, which = found
        layers, _ = stacked_layer_indices(cfg, keys)
        x = np.asarray(jax.device_get(x), np.float32)
        for i, w in zip(layers, x, strict=True):  # w: A [in..., R] or B [R, out...]
            w = w.reshape(-1, w.shape[-1]).T if which == "A" else w.reshape(w.shape[0], -1).T
            out[peft_name(i, target, which)] = np.ascontiguousarray(w)
    return out


def with_adapters(cfg: ModelConfig, params: dict, tensors: dict[str, np.ndarray]) -> dict:
    """``params`` with every adapter leaf replaced by peft's tensors (``adapter_tensors``'
    inverse), as host float32 arrays in our layout.

    Raises:
      KeyError: a tensor the adapters need is missing.
    """
    def load(keys, x):
        found = _adapter(keys)
        if found is None:
            return x
        target, which = found
        layers, _ = stacked_layer_indices(cfg, keys)
        shape = x.shape[1:]
        rows = [np.asarray(tensors[peft_name(i, target, which)], np.float32).T
                for i in layers]                                  # [in, R] or [R, out]
        return np.stack([r.reshape(shape) for r in rows])

    out = {}
    for keys, x in _leaves(params):
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = load(keys, x)
    return out


def adapter_config(cfg: ModelConfig, base_model: str | None) -> dict:
    """peft's adapter_config.json for the run's ``model.lora``."""
    lo = cfg.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lo.rank, "lora_alpha": lo.alpha, "lora_dropout": lo.dropout,
            "use_rslora": lo.rslora, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted(lora.HF_MODULES[t].split(".")[-1] for t in lo.targets),
            "modules_to_save": None, "inference_mode": True, "init_lora_weights": True}


def merge_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """W + s A B for stacked layers: w [L, in..., out...], a [L, in..., R], b [L, R, out...]
    (float32 host arrays) -> the merged weight, shaped like w."""
    ab = np.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                   b.reshape(b.shape[0], b.shape[1], -1))                      # [L, in, out]
    return np.asarray(w, np.float32) + scale * ab.reshape(w.shape)
