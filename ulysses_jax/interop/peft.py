"""LoRA adapters (models/lora.py) as peft writes and reads them, and merged into the base.

peft names the adapter of a decoder projection
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ([R, in], torch Linear
layout) and ``...lora_B.weight`` ([out, R]); its scaling is lora_alpha / r (lora_alpha /
sqrt(r) with ``use_rslora``), as ours. Ours are A [in..., R] and B [R, out...] per layer,
stacked over layers, so a peft A is our A flattened over its input dims and transposed, and
likewise B.

Routed experts (target "experts") are adapted as peft's ``target_parameters`` adapts
transformers' stacked expert weights (``mlp.experts.gate_up_proj`` [E, 2F, D] and
``mlp.experts.down_proj`` [E, D, F]): one ``ParamWrapper`` per parameter, the down
projection's wrapping the gate_up's, so peft saves the gate_up adapter as
``mlp.experts.base_layer.lora_A.weight`` and the down adapter as
``mlp.experts.lora_A.weight``. Its lora_A is [R x E, in] (expert-major rows: row e R + r)
and its lora_B [out, R x E] (expert-minor columns: column r E + e); delta W_e =
s B[:, :, e] A[e]. Ours are A [E, in, R] and B [E, R, out] per layer, with B's gate_up
columns [gate | up] as transformers' ``chunk(2)`` splits them.

The shared expert of an MoE layer (Qwen3-Next, targets gate / up / down) is named by
``target_parameters`` too, ``mlp.shared_expert.gate_proj.weight`` ...: peft (0.21, on
transformers 5) rewrites any ``target_modules`` entry ending in gate_proj, up_proj or
down_proj of a qwen2_moe-like model (qwen3_next among them) into the routed experts' fused
weights, with the rank doubled on gate_up_proj, whatever the entry's prefix (a regular
expression too). On a Linear's 2-D weight peft's ``ParamWrapper`` is a plain LoRA: it saves
``mlp.shared_expert.gate_proj.lora_A.weight`` [R, in] and ``lora_B.weight`` [out, R], the
names and layout of a target_modules adapter, with delta W = s B A.
"""
from __future__ import annotations

import math
import re

import jax
import numpy as np

from ..config import LORA_TARGETS, ModelConfig
from ..families import traits
from ..models import lora
from ..models.decoder import stacked_layer_indices
from ..models.moe import is_moe_layer

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


# Our expert adapter -> peft's module path under a decoder layer (see the module docstring).
EXPERT_MODULES = {"expert_gate_up": "mlp.experts.base_layer", "expert_down": "mlp.experts"}
# ... and the transformers parameter each one adapts (adapter_config's target_parameters, in
# the order peft wraps them, the order Qwen3MoeExperts defines them: the first is innermost,
# whatever order a config lists them in).
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# The shared expert's projections as peft's target_parameters (see the module docstring).
SHARED_PARAMETERS = {t: f"mlp.shared_expert.{lora.HF_MODULES[t].split('.')[-1]}.weight"
                     for t in lora.SHARED}


def layers_path(cfg: ModelConfig) -> str:
    """Where transformers keeps the decoder layers: ``model.layers``, or in a multimodal model
    (Qwen2.5-VL, transformers 5) ``model.language_model.layers``."""
    return "model.language_model.layers" if traits(cfg.family).vision else "model.layers"


def peft_name(layer: int, target: str, which: str, shared: bool = False,
              layers: str = "model.layers") -> str:
    """peft's saved name of one layer's adapter matrix ("A" or "B"); ``shared``: the MoE
    layer's shared expert (``mlp.shared_expert.gate_proj`` ...); ``layers``: ``layers_path``."""
    if target in EXPERT_MODULES:
        module = EXPERT_MODULES[target]
    elif shared:
        module = "mlp.shared_expert." + lora.HF_MODULES[target].split(".")[-1]
    else:
        module = lora.HF_MODULES[target]
    return f"{PEFT_PREFIX}{layers}.{layer}.{module}.lora_{which}.weight"


def _to_peft(w: np.ndarray, target: str, which: str) -> np.ndarray:
    """One layer's A [in..., R] or B [R, out...] (experts: A [E, in, R], B [E, R, out]) in
    peft's layout."""
    if target in EXPERT_MODULES:
        e, r = (w.shape[0], w.shape[-1]) if which == "A" else w.shape[:2]
        if which == "A":                                               # -> [E R, in]
            return w.transpose(0, 2, 1).reshape(e * r, -1)
        return w.transpose(2, 1, 0).reshape(-1, r * e)                 # -> [out, R E]
    return w.reshape(-1, w.shape[-1]).T if which == "A" else w.reshape(w.shape[0], -1).T


def peft_shape(target: str, which: str, shape: tuple) -> tuple[int, int]:
    """peft's shape of one layer's A or B of ``shape`` (``_to_peft``'s result's shape)."""
    if target in EXPERT_MODULES:
        e, r = (shape[0], shape[-1]) if which == "A" else shape[:2]
        return (e * r, shape[1]) if which == "A" else (shape[-1], r * e)
    if which == "A":
        return shape[-1], math.prod(shape[:-1])
    return math.prod(shape[1:]), shape[0]


def _from_peft(t: np.ndarray, target: str, which: str, shape: tuple) -> np.ndarray:
    """``_to_peft``'s inverse: peft's tensor as one layer's matrix of ``shape``."""
    if target in EXPERT_MODULES:
        if which == "A":
            e, n_in, r = shape
            return t.reshape(e, r, n_in).transpose(0, 2, 1)
        e, r, n_out = shape
        return t.reshape(n_out, r, e).transpose(2, 1, 0)
    return t.T.reshape(shape)


def adapter_leaves(cfg: ModelConfig, params: dict):
    """Yields (leaf, target, "A" or "B", peft's names of its layers in stack order) for each
    adapter leaf of a pure-dict tree (arrays or ShapeDtypeStructs, stacked over layers)."""
    for keys, x in _leaves(params):
        found = _adapter(keys)
        if found is None:
            continue
        target, which = found
        layers, _ = stacked_layer_indices(cfg, keys)
        yield x, target, which, [peft_name(i, target, which, shared="moe" in keys,
                                           layers=layers_path(cfg)) for i in layers]


def adapter_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our adapters (any pure-dict tree holding them: the parameters, or their gradients) as
    peft's float32 tensors: name -> [R, in] (lora_A) or [out, R] (lora_B)."""
    out = {}
    for x, target, which, names in adapter_leaves(cfg, params):
        x = np.asarray(jax.device_get(x), np.float32)
        for name, w in zip(names, x, strict=True):  # w: A [in..., R] or B [R, out...]
            out[name] = np.ascontiguousarray(_to_peft(w, target, which))
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
        name = lambda i: peft_name(i, target, which, shared="moe" in keys,  # noqa: E731
                                   layers=layers_path(cfg))
        return np.stack([_from_peft(np.asarray(tensors[name(i)],
                                               np.float32), target, which, shape)
                         for i in layers])

    out = {}
    for keys, x in _leaves(params):
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = load(keys, x)
    return out


def target_layers(cfg: ModelConfig) -> dict[str, list[int]]:
    """target -> the layers that have its projection: attention targets the attention layers,
    linear_* the Gated DeltaNet layers, gate / up / down the dense MLPs and shared experts,
    experts the MoE layers."""
    mixers = cfg.layer_mixers()
    moe = [is_moe_layer(cfg, i) for i in range(cfg.n_layers)]
    out = {}
    for t in LORA_TARGETS:
        out[t] = [i for i in range(cfg.n_layers) if (
            mixers[i] == "A" if t in lora.ATTENTION else mixers[i] == "D" if t in lora.LINEAR
            else moe[i] if t == "experts" else not moe[i] or cfg.moe_shared_ffn_dim)]
    return out


def model_targets(cfg: ModelConfig) -> list[str]:
    """The targets of ``cfg.lora`` that adapt some projection of this model (a target whose
    projection the model lacks, such as linear_qkvz on Llama, adapts nothing)."""
    layers = target_layers(cfg)
    return [t for t in cfg.lora.targets if layers[t]]


def peft_targets(cfg: ModelConfig) -> dict:
    """peft's ``target_modules`` and ``target_parameters`` for the adapters of ``cfg.lora``.

    On an MoE model gate / up / down can only mean the shared expert's projections, named as
    parameters (module docstring); dense MLP layers of an MoE model cannot be named at all
    (export.py refuses such runs).
    """
    targets = model_targets(cfg)
    shared = [t for t in targets if t in lora.MLP] if cfg.num_experts else []
    modules = sorted(lora.HF_MODULES[t].split(".")[-1] for t in targets
                     if t in lora.HF_MODULES and t not in shared)
    parameters = list(EXPERT_PARAMETERS) if "experts" in targets else []
    parameters += [SHARED_PARAMETERS[t] for t in shared]
    if traits(cfg.family).vision:
        # The vision tower has gate_proj / up_proj / down_proj too: name the decoder's only,
        # as a regular expression over the whole module name (peft's full match).
        modules = (rf"{re.escape(layers_path(cfg))}\.\d+\.("
                   + "|".join(re.escape(lora.HF_MODULES[t]) for t in targets
                              if t in lora.HF_MODULES and t not in shared) + ")")
    return {"target_modules": modules, "target_parameters": parameters or None}


def adapter_config(cfg: ModelConfig, base_model: str | None) -> dict:
    """peft's adapter_config.json for the run's ``model.lora``."""
    lo = cfg.lora
    targets = peft_targets(cfg)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM",
              "base_model_name_or_path": base_model,
              "r": lo.rank, "lora_alpha": lo.alpha, "lora_dropout": lo.dropout,
              "use_rslora": lo.rslora, "bias": "none", "fan_in_fan_out": False,
              "target_modules": targets["target_modules"],
              "modules_to_save": None, "inference_mode": True, "init_lora_weights": True}
    if targets["target_parameters"]:
        config["target_parameters"] = targets["target_parameters"]
    return config


def merge_expert_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                        part: int, parts: int) -> np.ndarray:
    """W + s A B for stacked experts: w [L, E, in, out], a [L, E, in, R], b [L, E, R,
    parts x out], of which B's ``part``-th block of columns (gate_up: 0 gate, 1 up) adapts w."""
    n = w.shape[-1]
    assert b.shape[-1] == parts * n, (b.shape, w.shape, parts)
    ab = np.einsum("leir,lero->leio", a, b[..., part * n:(part + 1) * n])
    return np.asarray(w, np.float32) + scale * ab


def merge_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """W + s A B for stacked layers: w [L, in..., out...], a [L, in..., R], b [L, R, out...]
    (float32 host arrays) -> the merged weight, shaped like w."""
    ab = np.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                   b.reshape(b.shape[0], b.shape[1], -1))                      # [L, in, out]
    return np.asarray(w, np.float32) + scale * ab.reshape(w.shape)
