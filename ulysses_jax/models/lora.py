"""Low-rank adapters (LoRA) on the dense projections, and which parameters a LoRA run trains.

A projection W of ours is an einsum over an [in..., out...] weight (``wq`` [D, N, H], ``wo``
[N, H, D], ``w_gate`` [D, F] ...; layers.py). Its adapter is A [in..., R] and B [R, out...]
(R = ``model.lora.rank``), and the projection becomes

    y = x W + s (x A) B,   s = alpha / R   (alpha / sqrt(R) with rsLoRA),

as peft's ``LoraLayer`` computes it (``lora_B(lora_A(x)) * scaling``). B starts at zero, so an
adapted model starts as its base; A starts as peft's does (kaiming-uniform with a = sqrt(5):
U(-1/sqrt(in), 1/sqrt(in))). The adapters are plain ``nnx.Param`` leaves named
``lora_{target}_a`` / ``lora_{target}_b`` beside the weight they adapt, stacked over layers
like it, and gathered at their point of use like it (``layers.gathered``: under ZeRO-3 they are
split as any parameter, ``param_layout.param_spec``).

Why not flax's ``nnx.LoRA``: it wraps a module that owns a 2-D kernel ([in, out]) and
computes ``x @ a @ b + base(x)`` with no scaling. Our projections are not modules: the weights
are multi-dimensional einsum operands of Attention and MLP, cast and gathered at their point
of use inside the layer scan (ZeRO-3), and the MLP's token-chunk loop (``model.mlp_chunk``)
passes them as arrays through a ``shard_map``. The train state is a pure dict, so what is
trained is chosen by path (``is_trainable``), not by an nnx variable type.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import LoraConfig

# target -> (weight attribute, number of leading input dims of that weight)
ATTENTION = {"q": ("wq", 1), "k": ("wk", 1), "v": ("wv", 1), "o": ("wo", 2)}
MLP = {"gate": ("w_gate", 1), "up": ("w_up", 1), "down": ("w_down", 1)}
# Qwen3-Next's Gated DeltaNet projections, in transformers' fused layouts (models/qwen3_next.py):
# in_proj_qkvz [D, Hk, 2Q + 2rV], in_proj_ba [D, Hk, 2r], out_proj [Hv, V, D].
LINEAR = {"linear_qkvz": ("in_proj_qkvz", 1), "linear_ba": ("in_proj_ba", 1),
          "linear_out": ("out_proj", 2)}
# The shared expert of an MoE layer (Qwen3-Next) takes the MLP targets. peft names its
# projections by target_parameters (interop/peft.py: on a transformers-5 MoE model, peft
# turns target_modules gate_proj / up_proj / down_proj into the routed experts' weights).
SHARED = {"gate": ("shared_gate", 1), "up": ("shared_up", 1), "down": ("shared_down", 1)}
# Target "experts": each routed expert gets one adapter on its fused [gate | up] projection
# and one on its down projection, as peft's ``target_parameters`` adapts transformers'
# stacked expert weights (Qwen3MoeExperts.gate_up_proj [E, 2F, D], .down_proj [E, D, F]).
# name -> (expert weights the adapter changes, in its B's column order)
EXPERTS = {"expert_gate_up": ("w_gate", "w_up"), "expert_down": ("w_down",)}
# target -> the Hugging Face module (peft's target_modules names) under a decoder layer
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj", "linear_qkvz": "linear_attn.in_proj_qkvz",
              "linear_ba": "linear_attn.in_proj_ba", "linear_out": "linear_attn.out_proj"}
PREFIX = "lora_"
# Per-layer vectors a bfloat16 base keeps in float32 (besides the norm scales).
_FP32_VECTORS = ("bq", "bk", "bv", "a_log", "dt_bias")


def names(target: str) -> tuple[str, str]:
    """The attribute names of a target's A and B."""
    return f"{PREFIX}{target}_a", f"{PREFIX}{target}_b"


def scaling(lora: LoraConfig) -> float:
    """s = alpha / rank, or alpha / sqrt(rank) with rsLoRA (peft's ``use_rslora``)."""
    return lora.alpha / (math.sqrt(lora.rank) if lora.rslora else lora.rank)


def attach(module: nnx.Module, weights: dict, lora: LoraConfig, rngs: nnx.Rngs) -> None:
    """Adds A and B for each of ``lora.targets`` that ``weights`` (ATTENTION, MLP, LINEAR or
    SHARED) holds.

    Called after the module's own weights are drawn, so adapters never change the base
    weights a seed gives. No-op with rank 0.
    """
    for target in lora.targets if lora.rank else ():
        if target not in weights or getattr(module, weights[target][0], None) is None:
            continue
        attr, n_in = weights[target]
        shape = getattr(module, attr).shape
        _add(module, target, rngs, shape[:n_in], (lora.rank,), shape[n_in:])


def _add(module: nnx.Module, target: str, rngs: nnx.Rngs, ins: tuple, rank: tuple,
         outs: tuple, lead: tuple = ()) -> None:
    """Sets A [lead..., ins..., R] (peft's init: U(-1/sqrt(in), 1/sqrt(in))) and B
    [lead..., R, outs...] = 0 on ``module``."""
    bound = 1.0 / math.sqrt(math.prod(ins))
    a = jax.random.uniform(rngs.params(), (*lead, *ins, *rank), jnp.float32, -bound, bound)
    b = jnp.zeros((*lead, *rank, *outs), jnp.float32)
    name_a, name_b = names(target)
    setattr(module, name_a, nnx.Param(a))
    setattr(module, name_b, nnx.Param(b))


def attach_moe(moe: nnx.Module, lora: LoraConfig, rngs: nnx.Rngs) -> None:
    """Adapters of an MoE layer (models/moe.py): the shared expert's (targets gate, up,
    down, when it has one) and, with target "experts", every routed expert's: A [E, D, R]
    and B [E, R, 2F] on [gate | up], A [E, F, R] and B [E, R, D] on down."""
    attach(moe, SHARED, lora, rngs)
    if not lora.rank or "experts" not in lora.targets:
        return
    e, d, f = moe.w_gate.shape
    _add(moe, "expert_gate_up", rngs, (d,), (lora.rank,), (2 * f,), lead=(e,))
    _add(moe, "expert_down", rngs, (f,), (lora.rank,), (d,), lead=(e,))


def expert_adapters(moe: nnx.Module) -> list:
    """[A, B of gate_up, A, B of down] stored values of an MoE layer's routed experts, or []."""
    if not hasattr(moe, names("expert_gate_up")[0]):
        return []
    return [getattr(moe, n)[...] for t in EXPERTS for n in names(t)]


def expert_swiglu(h, w_gate, w_up, w_down, adapters=(), scale: float = 0.0):
    """The experts' SwiGLU on their slots, h [E, C, D] -> [E, C, D], with ``adapters``
    (``expert_adapters``, in h's dtype) added to each expert's gate_up and down projections.
    """
    gate = jnp.einsum("ECD,EDF->ECF", h, w_gate)
    up = jnp.einsum("ECD,EDF->ECF", h, w_up)
    if adapters:
        a_gu, b_gu, a_d, b_d = adapters
        s = jnp.asarray(scale, h.dtype)
        gu = jnp.einsum("ECR,ERG->ECG", jnp.einsum("ECD,EDR->ECR", h, a_gu), b_gu) * s
        f = w_gate.shape[-1]
        gate, up = gate + gu[..., :f], up + gu[..., f:]
    act = jax.nn.silu(gate) * up                                               # [E, C, F]
    y = jnp.einsum("ECF,EFD->ECD", act, w_down)
    if adapters:
        y = y + jnp.einsum("ECR,ERD->ECD", jnp.einsum("ECF,EFR->ECR", act, a_d), b_d) * s
    return y


def delta(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """s (x A) B for a projection whose own einsum is ``spec`` (e.g. "BSD,DNH->BSNH").

    Args:
      spec: the base projection's einsum; its contracted letters are A's input dims. Any
        letter but R (the rank).
      x: the projection's input; a: [in..., R]; b: [R, out...], in x's dtype.
    Returns:
      An array shaped like the base projection's output.
    """
    if "R" in spec:  # it would be contracted with the rank
        raise ValueError(f"lora.delta: the spec {spec!r} uses R, the rank's letter")
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    contracted = "".join(c for c in ws if c in xs)
    kept = "".join(c for c in xs if c not in contracted)
    mid = jnp.einsum(f"{xs},{contracted}R->{kept}R", x, a)                      # [..., R]
    y = jnp.einsum(f"{kept}R,R{ws[len(contracted):]}->{out}", mid, b)
    return y * jnp.asarray(scale, y.dtype)


def adapters(module: nnx.Module, weights: dict) -> dict:
    """target -> (A, B) stored values, for the targets ``module`` has adapters on."""
    out = {}
    for target in weights:
        name_a, name_b = names(target)
        if hasattr(module, name_a):
            out[target] = (getattr(module, name_a)[...], getattr(module, name_b)[...])
    return out


def is_adapter(keys: tuple) -> bool:
    """Whether the parameter at path ``keys`` is a LoRA matrix."""
    return any(str(k).startswith(PREFIX) for k in keys)


def without_adapters(params: dict, _path: tuple = ()) -> dict:
    """``params`` with every LoRA matrix zeroed: the base model's function (every adapter's
    delta is 0)."""
    return {k: (without_adapters(v, _path + (k,)) if isinstance(v, dict) else
                jnp.zeros_like(v) if is_adapter(_path + (k,)) else v)
            for k, v in params.items()}


def is_trainable(keys: tuple, lora: LoraConfig) -> bool:
    """Whether a LoRA run trains the parameter at ``keys``: the adapters, and the groups
    ``lora.trainable`` names (embed; norms: every norm scale of the decoder; head: the untied
    lm_head; vision: all of a multimodal model's vision tower)."""
    if is_adapter(keys):
        return True
    groups = lora.trainable
    if keys[0] == "visual":
        return "vision" in groups
    return (("embed" in groups and keys[0] == "embed")
            or ("head" in groups and keys[0] == "lm_head")
            or ("norms" in groups and any("norm" in str(k) for k in keys)))


def trainable_params(params: dict, lora: LoraConfig, _path: tuple = ()) -> dict:
    """The trained part of a pure-dict parameter tree: a nested dict of only the leaves
    ``is_trainable`` picks (sub-dicts left empty are dropped). With rank 0: all of it."""
    if not lora.rank:
        return params
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            sub = trainable_params(v, lora, _path + (k,))
            if sub:
                out[k] = sub
        elif is_trainable(_path + (k,), lora):
            out[k] = v
    return out


def overlay(params: dict, leaves: dict) -> dict:
    """``params`` with the leaves of ``leaves`` (a sub-tree such as ``trainable_params``
    gives) put in their places."""
    if leaves is params:
        return params
    out = dict(params)
    for k, v in leaves.items():
        out[k] = overlay(params[k], v) if isinstance(v, dict) else v
    return out


def frozen_dtype_mask(params: dict, lora: LoraConfig, _path: tuple = ()) -> dict:
    """True for the leaves stored in ``lora.base_dtype``: the frozen layer matrices (norm
    scales, biases, DeltaNet's per-head decay a_log and dt_bias, embedding and head stay
    float32, as the offloaded step keeps them)."""
    out = {}
    for k, v in params.items():
        keys = _path + (k,)
        if isinstance(v, dict):
            out[k] = frozen_dtype_mask(v, lora, keys)
        else:
            out[k] = (bool(lora.rank) and keys[0] == "layers" and not is_trainable(keys, lora)
                      and not any("norm" in str(n) or n in _FP32_VECTORS for n in keys))
    return out


def store_base(params: dict, lora: LoraConfig) -> dict:
    """``params`` with the frozen layer matrices cast to ``lora.base_dtype``."""
    if not lora.rank or lora.base_dtype == "float32":
        return params
    dtype = jnp.dtype(lora.base_dtype)
    return jax.tree.map(lambda p, m: p.astype(dtype) if m else p, params,
                        frozen_dtype_mask(params, lora))
